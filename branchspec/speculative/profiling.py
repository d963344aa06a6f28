"""Measuring what rounds cost on this machine, through the engine's own execution path
(eager, compiled, or captured graphs: the very steps the rounds run).

`LiveRounds` runs whole rounds as the engine's runner runs them (a plain step through
`ModelRunner.decode`, a speculative round through `SpeculativeRound.run`) over private
requests; `calibrate` prices every candidate's round against the plain steps run beside
it, for the adaptive policy's round prices (`policy.costs.CostModel`), and
`load_or_calibrate` keeps that on disk per machine, model and code. `RoundCalls` makes the
calls of one round one at a time and `median_seconds` times several side by side: the
regime benchmark (`bench.regime`) times them at V4-Flash's layer shapes. Kept out of
`policy/`, which decides from the numbers and runs no execution code.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from branchspec.atomic import write_text
from branchspec.config import SpecConfig, spec_label
from branchspec.disk_cache import cache_dir, source_digest
from branchspec.execution.threads import one_row_products
from branchspec.machine import cpu_model_name
from branchspec.speculative.policy.costs import CATCH_UP_TOKENS, CONTEXTS, DRAW_ROWS, PLAIN, CostModel, grid_keys


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


def calibration_contexts(max_position: int, room: int) -> tuple[int, ...]:
    """The CONTEXTS a model of `max_position` positions can be measured from (each leaves
    `room` positions for the rounds on top)."""
    top = max_position - room - 1
    return tuple(sorted({max(1, min(c, top)) for c in CONTEXTS}))


class LiveRounds:
    """B requests of random prompts over a private paged state and drafter, stepped round
    after round as the engine's runner steps them: `step(None)` a plain decode step
    (`ModelRunner.decode`, the drafter following by reference, as under an adaptive
    policy), `step(spec)` a speculative round (`SpeculativeRound.run`, which first feeds
    the drafter what the plain steps before it committed, learning as an adaptive policy's
    rounds do). Each step commits what it accepted, so the context grows as it would."""

    def __init__(self, executor, batch: int, context: int, room: int, gen: torch.Generator, vocab=None):
        from branchspec.cache.paged import PagedState
        from branchspec.engine.runner import ModelRunner
        from branchspec.model.metadata import chain_meta
        from branchspec.sampling import SamplingBatch
        from branchspec.speculative.drafter import DrafterState, MTPDrafter

        model = executor.model
        cfg, p = model.cfg, model.embed.weight
        self.cache = PagedState(cfg, max_seqs=batch, max_len=context + room + 1, page_size=16, dtype=p.dtype,
                                device=p.device)
        ex = executor.over(self.cache)
        drafter = MTPDrafter(model, self.cache, ex, vocab=vocab)
        self.runner = ModelRunner(model, self.cache, ex, drafter)
        self.ids = list(range(batch))
        for sid in self.ids:
            self.cache.add(sid)
            self.cache.reserve(sid, context + room)
        prompt = torch.randint(3, cfg.vocab_size, (batch, context), generator=gen).to(p.device)
        L = torch.zeros(batch, dtype=torch.long, device=p.device)
        meta = chain_meta(L, context, cfg.compressed_kinds)
        out = ex.prefill(prompt, meta, self.ids, L)
        self.cache.commit(self.ids, meta, out.scratch, meta.valid)
        for b, sid in enumerate(self.ids):
            drafter.states[sid] = DrafterState(last_hidden=out.hidden[b, -1])
        self.lengths = L + context
        self.roots = torch.randint(3, cfg.vocab_size, (batch,), generator=gen).to(p.device)
        self.sampling = SamplingBatch(temperature=torch.zeros(batch, dtype=torch.float64),
                                      top_p=torch.ones(batch, dtype=torch.float64), seeds=[0] * batch,
                                      num_logprobs=[None] * batch)
        self.budget = torch.full((batch,), room, device=p.device)

    def step(self, spec: SpecConfig | None):
        """One round of `spec` (None: a plain step); its `RoundResult`."""
        from branchspec.speculative.round import RoundBatch

        batch = RoundBatch(self.ids, self.lengths, self.roots, self.budget, self.sampling)
        if spec is None:
            result = self.runner.decode(batch, follow=True)
        else:
            result = self.runner.speculative.run(batch, spec, learn=True)
        self.lengths = self.lengths + torch.tensor(result.path_len, device=self.lengths.device)
        self.roots = torch.tensor([e[-1] for e in result.emitted], device=self.roots.device)
        return result


def _timed(rounds: LiveRounds, spec: SpecConfig | None, sync) -> tuple[float, float, float]:
    """(seconds, its verify phase's seconds, its catch-up's seconds) of one round."""
    sync()
    t0 = time.perf_counter()
    result = rounds.step(spec)
    sync()
    seconds = time.perf_counter() - t0 - result.catch_up_seconds
    return seconds, result.phase_seconds.get("verify", seconds), result.catch_up_seconds


def draw_seconds(vocab_size: int, device: torch.device, repeats: int = 5) -> np.ndarray:
    """Seconds of drawing the target's token by its seeded inverse CDF at a temperature
    (`sampling.draw_tokens`, what a verify pass over sampled requests runs at each node)
    over each of DRAW_ROWS nodes of a `vocab_size` vocabulary: [len(DRAW_ROWS)]. Timed
    eagerly: inside a compiled graph the draw may cost less, which the policy's measured
    rounds then correct."""
    from branchspec.sampling import NodeDraws, draw_tokens

    gen = torch.Generator().manual_seed(0)
    runs = []
    for rows in DRAW_ROWS:
        logits = torch.randn(rows, 1, vocab_size, generator=gen).to(device)
        draws = NodeDraws(rows=torch.ones(rows, dtype=torch.bool, device=device),
                          temperature=torch.full((rows,), 0.7, dtype=torch.float64, device=device),
                          uniforms=torch.rand(rows, 1, dtype=torch.float64, generator=gen).to(device))
        depth = torch.zeros(rows, 1, dtype=torch.long, device=device)
        argmax = logits.argmax(-1)
        runs.append(lambda logits=logits, draws=draws, depth=depth, argmax=argmax:
                    draw_tokens(logits, draws, depth, argmax))
    return np.array(median_seconds(runs, repeats, device))


@torch.no_grad()
def calibrate(executor, max_batch_size: int, candidates: tuple[SpecConfig | None, ...], repeats: int = 3,
              progress: bool = False, vocab=None) -> CostModel:
    """Price every candidate's round (and the drafter's catch-up) in plain decode steps,
    through `executor` (the engine's own execution path) over private requests and a
    private drafter drafting over `vocab` (the engine's pages and statistics are
    untouched), at each batch of `calibration_batches` and from each context of
    `calibration_contexts`.

    Each pass runs plain step, candidate, plain step, candidate, ... plain step, and a
    candidate's sample is its round over the mean of the two plain steps around it, so a
    slow spell of a shared machine falls on both sides of a ratio alike; after one untimed
    pass, each price is the median of `repeats` passes, each from a fresh prefill of the
    context, the verify forward's pooled over every candidate of its node count
    (`pooled_verify`). A speculative round after a plain step first catches up one position; longer
    catch-ups are timed after CATCH_UP_TOKENS plain steps in a row, against those steps.
    The requests are greedy; what sampling adds, a draw at every node, is timed apart
    (`draw_seconds`)."""
    specs = tuple(c for c in candidates if c is not None)
    keys = grid_keys(candidates)
    index = {key: j for j, key in enumerate(keys)}
    by_key = {spec_label(c): c for c in specs}
    model = executor.model
    device = model.embed.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    most = max((c.num_draft_tokens for c in specs), default=1)
    room = 2 * (len(specs) + 1) * (most + 1) + 2 * CATCH_UP_TOKENS[-1] + 2
    batches = calibration_batches(max_batch_size)
    contexts = calibration_contexts(model.cfg.max_position, room)
    shape = (len(batches), len(keys), len(contexts))
    samples = {name: [[[[] for _ in contexts] for _ in keys] for _ in batches] for name in ("round", "verify")}
    catch_up = np.zeros((len(batches), len(CATCH_UP_TOKENS), len(contexts)))
    plain = np.zeros((len(batches), len(contexts)))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(batches) * len(contexts) * (repeats + 1), unit="pass", leave=False,
                   desc=f"measuring round prices ({executor.name})")
    gen = torch.Generator().manual_seed(0)
    for i, B in enumerate(batches):
        for k, context in enumerate(contexts):
            plain_seen: list[float] = []
            for repeat in range(repeats + 1):
                rounds = LiveRounds(executor, B, context, room, gen, vocab)
                before = _timed(rounds, None, sync)[0]
                for key in keys:
                    if key == PLAIN:
                        continue
                    seconds, verify, _ = _timed(rounds, by_key[key], sync)
                    after = _timed(rounds, None, sync)[0]
                    if repeat:
                        step = 0.5 * (before + after)
                        samples["round"][i][index[key]][k].append(seconds / step)
                        samples["verify"][i][index[key]][k].append(verify / step)
                        plain_seen.append(after)
                    before = after
                if repeat == repeats and specs:
                    # Catch-ups: n plain steps in a row, then a round that feeds them to the drafter.
                    for j, n in enumerate(CATCH_UP_TOKENS):
                        steps = [_timed(rounds, None, sync)[0] for _ in range(n)]
                        catch_up[i, j, k] = _timed(rounds, specs[0], sync)[2] / float(np.median(steps))
                if bar is not None:
                    bar.update(1)
            plain[i, k] = float(np.median(plain_seen)) if plain_seen else _timed(rounds, None, sync)[0]
    if bar is not None:
        bar.close()
    grids = {name: np.ones(shape) for name in ("round", "verify")}
    nodes = [by_key[key].num_draft_tokens if key != PLAIN else 1 for key in keys]
    for i in range(len(batches)):
        for k in range(len(contexts)):
            rounds_ik = [samples["round"][i][j][k] for j in range(len(keys))]
            verify_ik = [samples["verify"][i][j][k] for j in range(len(keys))]
            for j, (r, v) in enumerate(zip(*pooled_verify(rounds_ik, verify_ik, nodes))):
                if r is not None:
                    grids["round"][i, j, k], grids["verify"][i, j, k] = r, v
    grids["catch_up"] = catch_up
    draws = draw_seconds(model.cfg.vocab_size, device)
    return CostModel(batches, keys, grids, plain, contexts, draws=draws)


def pooled_verify(rounds: list[list[float]], verify: list[list[float]], nodes: list[int]
                  ) -> tuple[list[float | None], list[float | None]]:
    """Each candidate's calibrated round and verify forward (in plain steps) from its
    samples, paired pass by pass (rounds[j][n] and verify[j][n] from one pass).

    A verify forward costs what its node count costs, whatever the tree's shape, so each
    candidate's verify price is the median of the samples of every candidate verifying as
    many nodes (`nodes[j]`); its round is that price plus the median of its own rounds'
    remainder (drafting, extending). A shape's own few samples would otherwise set it apart
    by the machine's noise alone (10-15% between trees of one D on a shared machine), and
    since served rounds are read against their verify forward, that error could never be
    corrected. None where a candidate has no samples."""
    by_nodes: dict[int, list[float]] = {}
    for n, v in zip(nodes, verify):
        by_nodes.setdefault(n, []).extend(v)
    round_price, verify_price = [], []
    for n, r, v in zip(nodes, rounds, verify):
        if not r:
            round_price.append(None)
            verify_price.append(None)
            continue
        pooled = float(np.median(by_nodes[n]))
        verify_price.append(pooled)
        round_price.append(pooled + float(np.median([a - b for a, b in zip(r, v)])))
    return round_price, verify_price


def calibration_key(executor, max_batch_size: int, keys: tuple[str, ...], vocab_size: int | None = None) -> str:
    """What a calibration depends on: the model's shape and dtype, the execution path, the
    grids, the drafted vocabulary, the machine and its thread count, the torch build, and
    the code whose calls it times (`source_digest`) and this module, which times them."""
    model = executor.model
    cpu = cpu_model_name()
    blob = json.dumps({"model": model.cfg.to_dict(), "dtype": str(model.embed.weight.dtype),
                       "device": str(model.embed.weight.device), "execution": executor.name,
                       "batches": calibration_batches(max_batch_size), "candidates": keys, "contexts": CONTEXTS,
                       "draft_vocab": vocab_size, "threads": torch.get_num_threads(), "cpu": cpu,
                       "torch": torch.__version__, "source": source_digest(),
                       "timing": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_or_calibrate(executor, max_batch_size: int, candidates: tuple[SpecConfig | None, ...],
                      progress: bool = False, vocab=None) -> CostModel:
    """The cached calibration for this model, execution path, drafted vocabulary (`vocab`,
    a `DraftVocab`, None for the whole) and machine, else a fresh one (then cached; an
    unwritable cache folder only costs the next start another one)."""
    key = calibration_key(executor, max_batch_size, grid_keys(candidates), vocab.size if vocab is not None else None)
    path = cache_dir() / f"round-costs-{key}.json"
    try:
        return CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = calibrate(executor, max_batch_size, candidates, progress=progress, vocab=vocab)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(costs.to_dict()))
    except OSError:
        pass
    return costs
