"""A reduced draft vocabulary (FR-Spec; SGLang's `--speculative-token-map`).

The drafter scores only the `size` tokens the target emits most often, so its LM head
reads size rows instead of the whole vocabulary: at the default model's 8,192 tokens the
head is most of a drafter forward. Drafting stays lossless, since the target verifies
every drafted token; a token outside the map is simply never drafted (it can still be the
target's bonus token).

The map is stored beside the checkpoint as `draft_vocab.safetensors` (one int32 tensor,
`token_ids`, most frequent first), built by `branchspec draft-vocab` from the target's own
greedy predictions on training text (`train/draft_vocab.py`). A checkpoint without one
drafts over the full vocabulary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def token_map_arg(value: str | None) -> str | bool | None:
    """A `--speculative-token-map` value as `LLM(speculative_token_map=...)` takes it:
    None (the checkpoint's own map), "none" (False: the full vocabulary), or a file."""
    return None if value is None else False if value.lower() == "none" else value


class DraftVocabError(ValueError):
    """A draft vocabulary file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class DraftVocab:
    token_ids: torch.Tensor          # [N] int64 distinct target token ids, most frequent first

    @property
    def size(self) -> int:
        return int(self.token_ids.numel())

    def save(self, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> Path:
        """Write the map to `path` (a folder gets `draft_vocab.safetensors`); atomic, and a
        failed write (a full disk) is an OSError naming the file."""
        from branchspec.atomic import save_safetensors, write_atomically

        path = Path(path)
        if path.is_dir():
            path = path / DRAFT_VOCAB_FILE
        ids = {"token_ids": self.token_ids.to(torch.int32).contiguous()}
        write_atomically(path, lambda tmp: save_safetensors(ids, tmp, metadata))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, vocab_size: int) -> "DraftVocab":
        """Read a map file (or a folder's `draft_vocab.safetensors`) for a model of
        `vocab_size` tokens. DraftVocabError naming the file when it is unreadable, empty,
        or holds ids the model does not have or holds twice."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        if path.is_dir():
            path = path / DRAFT_VOCAB_FILE
        if not path.is_file():
            raise DraftVocabError(f"{path}: no such draft vocabulary file")
        try:
            tensors = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as e:
            raise DraftVocabError(f"{path} is not a readable safetensors file: {e}") from None
        ids = tensors.get("token_ids")
        if ids is None or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise DraftVocabError(f"{path} must hold one 1-D integer tensor 'token_ids', got {sorted(tensors)}")
        ids = ids.to(torch.int64)
        if ids.numel() == 0:
            raise DraftVocabError(f"{path}: 'token_ids' is empty")
        if bool((ids < 0).any()) or bool((ids >= vocab_size).any()):
            raise DraftVocabError(f"{path}: token ids outside the model's vocabulary [0, {vocab_size})")
        if ids.unique().numel() != ids.numel():
            raise DraftVocabError(f"{path}: 'token_ids' holds a token more than once")
        return cls(ids)

    @classmethod
    def of_folder(cls, folder: str | os.PathLike, vocab_size: int) -> "DraftVocab | None":
        """The checkpoint folder's map, or None when it has none."""
        path = Path(folder) / DRAFT_VOCAB_FILE
        return cls.load(path, vocab_size) if path.is_file() else None

    @classmethod
    def most_frequent(cls, counts: torch.Tensor, size: int) -> "DraftVocab":
        """The `size` tokens with the highest counts [V] (ties: lower id first)."""
        if not 1 <= size <= counts.numel():
            raise ValueError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
        order = torch.sort(counts, descending=True, stable=True).indices[:size]
        return cls(order.to(torch.int64))
