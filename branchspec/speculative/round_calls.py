"""The calls one speculative round makes, made one at a time so that each can be timed
(`RoundCalls`), and a side-by-side timer for them (`median_seconds`): what the policy's
cost model (`policy.costs.calibrate`) and the regime benchmark (`bench.regime`) measure."""

from __future__ import annotations

import time

import numpy as np
import torch

from branchspec.config import SpecConfig
from branchspec.execution.threads import one_row_products


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
