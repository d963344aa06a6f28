"""Building a reduced draft vocabulary: count the target's own greedy predictions on
training text and keep the most frequent tokens (`speculative/draft_vocab.py`).

The target's predictions, not the text's tokens, are what a drafter must match: a token
the target rarely emits is rarely worth drafting, whatever its frequency in the corpus.
Only train splits are read, never the prompts the study measures acceptance on.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from tqdm import tqdm

from branchspec.data.tokenizer import Tokenizer
from branchspec.model.metadata import chain_meta
from branchspec.model.model import Transformer
from branchspec.speculative.draft_vocab import DraftVocab
from branchspec.train.data import _stream, documents

# Text each workload contributes, by default (characters): enough for about 400k tokens.
DEFAULT_CHARS = {"gsm8k": 400_000, "mbpp": 300_000, "sharegpt": 900_000}


@torch.no_grad()
def count_predictions(model: Transformer, stream: np.ndarray, seq_len: int = 512, batch_size: int = 8,
                      progress: bool = False) -> torch.Tensor:
    """How often the target's argmax is each token [V], over non-overlapping windows of a
    token stream [T] (each window from an empty state, as in training)."""
    cfg = model.cfg
    n = len(stream) // seq_len
    windows = torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len).astype(np.int64))
    counts = torch.zeros(cfg.vocab_size, dtype=torch.int64)
    starts = range(0, n, batch_size)
    for i in tqdm(starts, desc="counting the target's predictions", unit="batch", disable=not progress):
        ids = windows[i:i + batch_size].to(model.embed.weight.device)
        meta = chain_meta(torch.zeros(len(ids), dtype=torch.long, device=ids.device), seq_len, cfg.compressed_kinds)
        counts += torch.bincount(model(ids, meta).logits.argmax(-1).flatten().cpu(), minlength=cfg.vocab_size)
    return counts


def build_draft_vocab(model: Transformer, tokenizer: Tokenizer, size: int, *,
                      chars: dict[str, int] | None = None, mbpp_path: str | None = None,
                      workloads: Iterable[str] | None = None, progress: bool = False) -> tuple[DraftVocab, dict]:
    """The `size` tokens the target predicts most often on the workloads' training text,
    and a summary {tokens read, share of predictions the map covers}."""
    chars = dict(DEFAULT_CHARS if chars is None else chars)
    names = list(workloads) if workloads is not None else list(chars)
    counts = torch.zeros(model.cfg.vocab_size, dtype=torch.int64)
    read = 0
    for name in names:
        stream = _stream(tokenizer, documents(name, mbpp_path), chars.get(name))
        read += len(stream)
        counts += count_predictions(model, stream, progress=progress)
    vocab = DraftVocab.most_frequent(counts.to(torch.float64), size)
    covered = float(counts[vocab.token_ids].sum()) / max(1, int(counts.sum()))
    return vocab, {"tokens_read": read, "predictions": int(counts.sum()), "coverage": covered,
                   "workloads": ",".join(names)}
