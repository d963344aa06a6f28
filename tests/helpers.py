"""Shared helpers for the equivalence tests: sequential reference runs over a PagedState."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from branchspec.cache.paged import PagedState
from branchspec.checkpoint import save_checkpoint
from branchspec.config import tiny_config
from branchspec.data.tokenizer import train_tokenizer
from branchspec.model.init import random_model
from branchspec.model.metadata import chain_meta


def new_cache(model, max_seqs: int = 4, page_size: int = 4, max_len: int = 1024) -> PagedState:
    return PagedState(model.cfg, max_seqs=max_seqs, max_len=max_len, page_size=page_size,
                      dtype=model.embed.weight.dtype)


def new_runner(model, cache: PagedState, chunk: int = 64):
    """The engine's runner over `cache` (eager), with an MTP drafter when the model has one."""
    from branchspec.execution.eager import EagerExecutor
    from branchspec.engine.runner import ModelRunner
    from branchspec.speculative.drafter import MTPDrafter

    executor = EagerExecutor(model, cache)
    drafter = MTPDrafter(model, cache, executor, chunk) if model.mtp else None
    return ModelRunner(model, cache, executor, drafter, prefill_chunk_size=chunk)


@torch.no_grad()
def feed(model, cache: PagedState, seq_id: int, ids: list[int], start: int, chunk: int) -> torch.Tensor:
    """Append ids (positions start..) to a sequence in chunks; return their logits [n, V]."""
    L, outs = start, []
    while L < start + len(ids):
        n = min(chunk, start + len(ids) - L)
        cache.reserve(seq_id, L + n)
        Lt = torch.tensor([L])
        meta = chain_meta(Lt, n, model.cfg.compressed_kinds)
        out = model(torch.tensor([ids[L - start:L - start + n]]), meta, cache.gather([seq_id], Lt))
        cache.commit([seq_id], meta, out.scratch, meta.valid)
        outs.append(out.logits[0])
        L += n
    return torch.cat(outs) if outs else torch.zeros(0, model.cfg.vocab_size)


def sequential(model, ids: list[int], chunk: int = 1, page_size: int = 4):
    """A fresh cache holding ids, fed `chunk` tokens at a time -> (cache, logits [T, V])."""
    cache = new_cache(model, max_seqs=1, page_size=page_size)
    cache.add(0)
    return cache, feed(model, cache, 0, ids, 0, chunk)


def assert_same_state(a: dict, b: dict, atol: float = 1e-10) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape, f"{key}: shape {tuple(a[key].shape)} != {tuple(b[key].shape)}"
        diff = (a[key] - b[key]).abs().max().item() if a[key].numel() else 0.0
        assert diff <= atol, f"state part {key} differs by {diff}"


def state_diff(a: dict, b: dict) -> dict[str, float]:
    """Max abs difference per state part (parts with different shapes count as inf)."""
    out = {}
    for key in a:
        if a[key].shape != b[key].shape:
            out[key] = float("inf")
        else:
            out[key] = (a[key] - b[key]).abs().max().item() if a[key].numel() else 0.0
    return out


def checkpoint_with_tokenizer(folder: Path, corpus: list[str], seed: int = 1) -> Path:
    """A tiny random model (weights large enough for peaked outputs) with a small BPE
    tokenizer trained on `corpus`, saved in `folder`, so text prompts and chat work."""
    tok = train_tokenizer(corpus, vocab_size=300)
    cfg = tiny_config(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, bos_token_id=tok.bos_id,
                      pad_token_id=tok.pad_id)
    save_checkpoint(random_model(cfg, seed=seed, std=0.3), folder)
    tok.save(folder)
    return folder


@contextmanager
def lifted_float32_islands(hf_model, tables: dict):
    """Lift transformers' float32 islands to float64 inside the block: `.float()`,
    `.to(torch.float32)` and `softmax(dtype=float32)` keep float64 tensors as they are,
    and the model's RoPE tables are `tables` ({"main", "compress"}, branchspec's float64
    `rope_tables`; transformers builds them in float32 at init, and `from_pretrained`
    leaves them float32 whatever the model's dtype), then the originals are put back."""
    to, as_float, t_softmax, f_softmax = torch.Tensor.to, torch.Tensor.float, torch.Tensor.softmax, F.softmax

    def keep64_to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("dtype")
        if self.dtype == torch.float64 and target is torch.float32:
            return self
        return to(self, *args, **kwargs)

    def keep64(fn):
        def wrapped(x, *args, dtype=None, **kwargs):
            if x.dtype == torch.float64:
                return fn(x, *args, **kwargs)
            return fn(x, *args, dtype=dtype, **kwargs)
        return wrapped

    saved = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "to", keep64_to)
        mp.setattr(torch.Tensor, "float", lambda self: self if self.dtype == torch.float64 else as_float(self))
        mp.setattr(torch.Tensor, "softmax", keep64(t_softmax))
        mp.setattr(F, "softmax", keep64(f_softmax))
        try:
            for module in hf_model.modules():
                if type(module).__name__ == "DeepseekV4RotaryEmbedding":
                    for kind in ("main", "compress"):
                        name = f"{kind}_inv_freq"
                        original = getattr(module, name)
                        saved.append((module, name, original))
                        setattr(module, name, tables[kind].to(original.device).clone())   # a float64 buffer
            yield
        finally:
            for module, name, original in saved:
                setattr(module, name, original)


@torch.no_grad()
def sequential_drafter(model, committed: list[int]) -> tuple[dict, torch.Tensor]:
    """The drafter state a sequential pass builds over `committed` tokens: the MTP block
    fed the target's hidden state before each token (zeros before the first), all at once
    from an empty cache. Returns ({"mtp/0": snapshot}, the target's last hidden state)."""
    from branchspec.model.metadata import chain_meta

    L = len(committed)
    out, _ = model.full_forward(torch.tensor([committed]))
    prev = torch.cat([torch.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], dim=1)
    ref = new_cache(model, max_seqs=1)
    ref.add(0)
    meta = chain_meta(torch.tensor([0]), L, ())
    mtp = model.mtp_forward(torch.tensor([committed]), prev, meta, ref.gather_mtp([0], torch.tensor([0])))
    ref.commit_mtp([0], meta, mtp.scratch[0], meta.valid)
    return {"mtp/0": ref.snapshot(0, 0, mtp_length=L)["mtp/0"]}, out.hidden[0, -1]


def second_and_third_token_counts(model, prompt: list[int], outs) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Observed counts of (x2, x3), the 2nd and 3rd generated tokens of each output, and
    their exact expectation under the target: sum over x1 of P(x1) P(x2 | x1) P(x3 | x1, x2),
    times the number of outputs. Both [V, V] (a tiny vocabulary: V^2 prompts are scored)."""
    import itertools

    V = model.cfg.vocab_size
    counts = torch.zeros(V, V, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1
    seqs = torch.tensor([prompt + list(t) for t in itertools.product(range(V), repeat=2)])
    with torch.no_grad():
        lp = torch.log_softmax(model.full_forward(seqs)[0].logits, -1)   # [V^2, T+2, V]
    P = len(prompt)
    expected = torch.einsum("a,ab,abc->bc", lp[0, P - 1].exp(), lp[:, P, :].exp().view(V, V, V)[:, 0],
                            lp[:, P + 1, :].exp().view(V, V, V)) * len(outs)
    return counts, expected


def chi2_p_value(counts: "torch.Tensor", expected: "torch.Tensor") -> float:
    """Chi-square goodness of fit over the cells expecting at least 5."""
    mask = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[mask]).sum()
    dof = torch.tensor((int(mask.sum()) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, chi2 / 2).item()
