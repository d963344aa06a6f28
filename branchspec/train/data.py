"""Token streams for training: each workload's documents as BOS + text + EOS, concatenated.

Training batches are random windows over the streams, workloads drawn by mixing weight.
Evaluation uses fixed windows over the held-out streams, so numbers are comparable across
steps and runs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from branchspec.data.tokenizer import Tokenizer
from branchspec.data.workloads import load_workload, training_text
from branchspec.train.corpora import CORPORA, corpus_text


def _stream(tok: Tokenizer, docs, max_chars: int | None) -> np.ndarray:
    texts, total = [], 0
    for d in docs:
        texts.append(d)
        total += len(d)
        if max_chars is not None and total >= max_chars:
            break
    ids = tok.encode_batch(texts)
    flat = list(itertools.chain.from_iterable([tok.bos_id, *x, tok.eos_id] for x in ids))
    return np.asarray(flat, dtype=np.int32)


def documents(name: str, mbpp_path: str | None = None):
    """Training documents of a workload's train split or of an extra corpus (corpora.py)."""
    if name in CORPORA:
        return corpus_text(name)
    return training_text(name, mbpp_path=mbpp_path)


def eval_documents(name: str, mbpp_path: str | None = None):
    return (ex.document() for ex in load_workload(name, "eval", mbpp_path=mbpp_path))


@dataclass
class Streams:
    train: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]

    @classmethod
    def build(cls, tok: Tokenizer, workloads: tuple[str, ...], max_chars: dict[str, int | None],
              mbpp_path: str | None = None, eval_chars: int = 400_000) -> "Streams":
        train = {w: _stream(tok, documents(w, mbpp_path), max_chars.get(w)) for w in workloads}
        # Extra corpora are training text only; held-out numbers are the workloads'.
        evals = {w: _stream(tok, eval_documents(w, mbpp_path), eval_chars) for w in workloads
                 if w not in CORPORA}
        return cls(train, evals)


class BatchSampler:
    """Random [B, T] windows; each row's workload drawn by the mixing weights."""

    def __init__(self, streams: dict[str, np.ndarray], weights: dict[str, float], batch: int,
                 seq_len: int, seed: int):
        self.names = list(weights)
        w = np.asarray([weights[n] for n in self.names], dtype=np.float64)
        self.p = w / w.sum()
        self.streams, self.batch, self.T = streams, batch, seq_len
        self.rng = np.random.default_rng(seed)
        for n in self.names:
            if len(streams[n]) <= seq_len:
                raise ValueError(f"workload {n} has only {len(streams[n])} training tokens, "
                                 f"fewer than seq_len {seq_len}")

    def __next__(self) -> torch.Tensor:
        rows = []
        for name in self.rng.choice(self.names, size=self.batch, p=self.p):
            s = self.streams[name]
            start = int(self.rng.integers(0, len(s) - self.T))
            rows.append(s[start:start + self.T])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def __iter__(self):
        return self

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


def eval_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows from the start of a held-out stream: [n, seq_len]."""
    n = min(max_windows, len(stream) // seq_len)
    if n == 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than seq_len {seq_len}")
    return torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len).astype(np.int64))
