"""Measuring what a round's calls cost on this machine, through the engine's own execution
path (eager, compiled, or captured graphs: the very steps the rounds run).

`RoundCalls` makes the calls of one round one at a time, so that each can be timed;
`median_seconds` times several side by side. `calibrate` times them on the grid the
adaptive policy's cost model (`policy.costs.CostModel`) composes round times from, and
`load_or_calibrate` keeps that on disk per machine, model and code; the regime benchmark
(`bench.regime`) times them at V4-Flash's layer shapes. Kept out of `policy/`, which
decides from the numbers and runs no execution code.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from branchspec.config import SpecConfig
from branchspec.disk_cache import cache_dir, source_digest
from branchspec.execution.threads import one_row_products
from branchspec.machine import cpu_model_name
from branchspec.speculative.policy.costs import BY_GROWTH, CONTEXTS, CostModel, grid_tokens


def median_seconds(runs: list, repeats: int, device: torch.device | str = "cpu") -> list[float]:
    """Median wall time of each of `runs` over `repeats` calls, after one untimed warm-up
    call each, the calls taken in turn (one of each run per pass): on a shared machine a
    slow spell then falls on every run alike, so the ratios between them, which are what
    the policy compares, hold even when the absolute times move. On a GPU each call is
    timed until its kernels finish, not until they are queued."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = [[] for _ in runs]
    for i in range(repeats + 1):
        for run, ts in zip(runs, times):
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            if i:
                ts.append(time.perf_counter() - t0)
    return [float(np.median(ts)) for ts in times]


class RoundCalls:
    """The calls a round makes, as it makes them, over B requests with L [B] committed
    tokens whose last target hidden state is hidden [B, 1, d]: each returns a function
    that makes one call."""

    def __init__(self, ex, drafter, hidden: torch.Tensor, ids: list[int], L: torch.Tensor, gen: torch.Generator):
        self.ex, self.drafter, self.hidden, self.ids, self.L, self.gen = ex, drafter, hidden, ids, L, gen
        self.vocab = ex.model.cfg.vocab_size

    def _tokens(self, n: int) -> torch.Tensor:
        return torch.randint(3, self.vocab, (len(self.ids), n), generator=self.gen).to(self.L.device)

    def of(self, name: str, n: int):
        """The plain decode step (n = 1) or a verify pass over a chain of n nodes
        (`verify`); a draft extend of n nodes (a path of n - 1 and the next root); a
        catch-up chunk of n positions."""
        from branchspec.model.metadata import chain_meta

        ex, ids, L = self.ex, self.ids, self.L
        new = self._tokens(n)
        B = len(ids)
        if name == "target":
            if n == 1:     # as the runner runs it (`engine.runner.ModelRunner.decode`)
                def plain():
                    with one_row_products(B, L.device):
                        return ex.decode(new, ids, L)
                return plain
            return self.verify(torch.arange(-1, n - 1).tolist())
        if name == "extend":
            return self._extend(n - 1)
        prev = self.hidden.expand(B, n, self.hidden.shape[-1])
        return lambda: ex.drafter_prefill(new, prev, chain_meta(L, n, ()), ex.cache.gather_mtp(ids, L))

    def verify(self, parents: list[int], tokens: torch.Tensor | None = None):
        """The verify pass over a tree of these parents (-1 for the root; a parent before
        its children), the same tree for every request, of `tokens` [B, D] (default:
        random ones), as a round's verify runs, its greedy commit included (written to the
        sink here: the private state stays as it is)."""
        from branchspec.speculative.verify import verify_pass

        B, n = len(self.ids), len(parents)
        new = self._tokens(n) if tokens is None else tokens
        tree = torch.tensor(parents, device=new.device).expand(B, n)
        in_call = torch.zeros(B, dtype=torch.bool, device=new.device)
        most = torch.full((B,), n, device=new.device)
        return lambda: verify_pass(self.ex, new, tree, self.ids, self.L, in_call, most)

    def _extend(self, D: int):
        """A draft extend after a round that accepted D nodes ending at L - 1: its next
        root lands at L, where a round's drafting starts."""
        B = len(self.ids)
        start = (self.L - D).clamp(min=0)
        path_tokens = self._tokens(D)
        hidden = self.hidden.expand(B, D, self.hidden.shape[-1])
        path = torch.arange(D, device=self.L.device).expand(B, D)
        path_len = torch.full((B,), D, dtype=torch.long, device=self.L.device)
        bonus = self._tokens(1)[:, 0]
        return lambda: self.drafter.extend(self.ids, start, path_tokens, hidden, path, path_len, bonus, D)

    def draft(self, spec: SpecConfig):
        """A round's drafting (`propose`) of `spec`, from a root the last extend computed
        (an extend of the width the candidate's rounds run, so no other graph is needed)."""
        self._extend(spec.num_draft_tokens)()
        roots = self._tokens(1)[:, 0]
        greedy = [0.0] * len(self.ids)
        return lambda: self.drafter.propose(self.ids, self.L, roots, spec, greedy)


def calibration_batches(max_batch_size: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 4
    out.append(max_batch_size)
    return tuple(out)


def calibration_contexts(max_position: int, most_tokens: int) -> tuple[int, ...]:
    """The CONTEXTS a model of `max_position` positions can be measured over (each leaves
    room for the largest token count on top)."""
    room = max_position - most_tokens - 1
    return tuple(sorted({max(1, min(c, room)) for c in CONTEXTS}))


@torch.no_grad()
def calibrate(executor, max_batch_size: int, candidates: tuple[SpecConfig | None, ...], repeats: int = 3,
              progress: bool = False, vocab=None) -> CostModel:
    """Time each call a round of these candidates makes (`grid_tokens`), through `executor`
    (the engine's own execution path) over a private paged state and a private drafter
    drafting over `vocab` (the engine's pages and statistics are untouched), at each batch
    of `calibration_batches` and each context of `calibration_contexts`. At each batch
    size the context grows by prefill from one measured length to the next."""
    from branchspec.cache.paged import PagedState
    from branchspec.model.metadata import chain_meta
    from branchspec.speculative.drafter import DrafterState, MTPDrafter

    model = executor.model
    cfg = model.cfg
    p = model.embed.weight
    tokens = grid_tokens(candidates)
    growths = {c.label: c for c in candidates if c is not None}
    batches = calibration_batches(max_batch_size)
    most = max(max(t) for name, t in tokens.items() if name not in BY_GROWTH and t)
    contexts = calibration_contexts(cfg.max_position, most)
    grids = {name: np.zeros((len(batches), len(t), len(contexts))) for name, t in tokens.items()}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(g.size for g in grids.values()), desc=f"calibrating round costs ({executor.name})",
                   unit="shape", leave=False)
    gen = torch.Generator().manual_seed(0)
    for i, B in enumerate(batches):
        cache = PagedState(cfg, max_seqs=B, max_len=contexts[-1] + most + 1, page_size=16, dtype=p.dtype,
                           device=p.device)
        ex = executor.over(cache)
        drafter = MTPDrafter(model, cache, ex, vocab=vocab) if growths else None
        ids = list(range(B))
        for sid in ids:
            cache.add(sid)
            cache.reserve(sid, contexts[-1] + most)
        L = torch.zeros(B, dtype=torch.long, device=p.device)
        for k, context in enumerate(contexts):
            grow = context - int(L[0])
            prompt = torch.randint(3, cfg.vocab_size, (B, grow), generator=gen).to(p.device)
            meta = chain_meta(L, grow, cfg.compressed_kinds)
            out = ex.prefill(prompt, meta, ids, L)
            cache.commit(ids, meta, out.scratch, meta.valid)
            L = L + grow
            if drafter is not None:
                for b, sid in enumerate(ids):
                    drafter.states[sid] = DrafterState(last_hidden=out.hidden[b, -1])
            call = RoundCalls(ex, drafter, out.hidden[:, -1:], ids, L, gen)
            cells = [(name, j, call.draft(growths[key]) if name == "draft" else call.of(name, int(key)))
                     for name, keys in tokens.items() for j, key in enumerate(keys)]
            for (name, j, _), seconds in zip(cells, median_seconds([run for *_, run in cells], repeats, p.device)):
                grids[name][i, j, k] = seconds
            if bar is not None:
                bar.update(len(cells))
    if bar is not None:
        bar.close()
    return CostModel(batches, {name: (tokens[name], g) for name, g in grids.items()}, contexts)


def calibration_key(executor, max_batch_size: int, tokens: dict[str, tuple], vocab_size: int | None = None) -> str:
    """What a calibration depends on: the model's shape and dtype, the execution path, the
    grids, the drafted vocabulary, the machine and its thread count, the torch build, and
    the code whose calls it times (`source_digest`) and this module, which times them."""
    model = executor.model
    cpu = cpu_model_name()
    blob = json.dumps({"model": model.cfg.to_dict(), "dtype": str(model.embed.weight.dtype),
                       "device": str(model.embed.weight.device), "execution": executor.name,
                       "batches": calibration_batches(max_batch_size), "tokens": tokens, "contexts": CONTEXTS,
                       "draft_vocab": vocab_size, "threads": torch.get_num_threads(), "cpu": cpu,
                       "torch": torch.__version__, "source": source_digest(),
                       "timing": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_or_calibrate(executor, max_batch_size: int, candidates: tuple[SpecConfig | None, ...],
                      progress: bool = False, vocab=None) -> CostModel:
    """The cached calibration for this model, execution path, drafted vocabulary (`vocab`,
    a `DraftVocab`, None for the whole) and machine, else a fresh one (then cached; an
    unwritable cache folder only costs the next start another one)."""
    tokens = grid_tokens(candidates)
    key = calibration_key(executor, max_batch_size, tokens, vocab.size if vocab is not None else None)
    path = cache_dir() / f"round-costs-{key}.json"
    try:
        return CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = calibrate(executor, max_batch_size, candidates, progress=progress, vocab=vocab)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(costs.to_dict()))
        tmp.replace(path)
    except OSError:
        pass
    return costs
