"""From measured call costs at two reduced depths to the full model's round costs, and from
those and accept lengths to projected throughput: the arithmetic of the regime benchmark
(`bench.regime`), kept apart so that it can be checked by hand.

Depth: a target call at depth p (layer pairs) costs base + p * pair, so two depths give
both, and V4-Flash's 43 layers ([0, 0, (4, 128) x 20, 4]) cost base + 20 * pair. The
drafter's calls do not depend on the target's depth.

Experts: the slice has 6 routed experts, all of which every token runs, so its calls read
6 experts' weights whatever their token count. V4-Flash's tokens each choose 6 of 256,
so a call of more tokens reads more experts (8 verify nodes at batch 1: about 44). The
costs are projected both as measured and with that difference added
(`with_routed_experts`, from one expert timed over each token count, routing taken as
uniform: real routing is correlated, so this bounds the effect from above).

A round of budget D costs draft(D) + verify(D) + extend(D): drafting the tree, the verify
pass over its D nodes (the greedy commit inside it), and the draft extend over the
accepted path. Speculation's throughput against plain decoding is accept_length * plain /
round; a tree against the chain at the same D is (tree accept / tree round) / (chain
accept / chain round).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from branchspec.config.model import V4_FLASH_LAYERS, V4_FLASH_PAIRS

# The paper's Table 1 at D = 8 (accepted length, bonus included), its published ends: the
# lowest (ShareGPT, the least predictable workload) and the highest.
PAPER_ACCEPT_D8 = {"paper low (ShareGPT)": {"chain": 2.39, "tree": 2.84},
                   "paper high": {"chain": 2.84, "tree": 3.41}}
# V4-Flash's routed experts, of which each token takes 6; every one of its 43 layers is MoE.
V4_FLASH_EXPERTS = 256
MEASURED = "6 experts (as measured)"
ROUTED = "256 experts (uniform routing)"


def per_pair(t0: float, t1: float, p0: int, p1: int) -> tuple[float, float]:
    """(base, pair) seconds from a call's time at p0 and p1 pairs: the time at p pairs is
    base + p * pair."""
    pair = (t1 - t0) / (p1 - p0)
    return t0 - p0 * pair, pair


def at_depth(base: float, pair: float, pairs: int = V4_FLASH_PAIRS) -> float:
    """A call's seconds at `pairs` layer pairs; a pair measured as costing less than
    nothing (noise on a tiny difference) counts as free."""
    return base + pairs * max(pair, 0.0)


def experts_touched(tokens: float, per_token: int = 6, experts: int = V4_FLASH_EXPERTS) -> float:
    """Distinct experts a call of `tokens` tokens reads when each takes `per_token` of
    `experts` uniformly at random: experts * (1 - (1 - k/E)^tokens)."""
    return experts * (1.0 - (1.0 - per_token / experts) ** tokens)


def _expert_at(expert_seconds: dict[int, float], tokens: float) -> float:
    """One expert over `tokens` tokens, linear between the measured counts (in
    proportion beyond the last, the first's below it)."""
    counts = sorted(expert_seconds)
    if tokens <= counts[0]:
        return expert_seconds[counts[0]]
    if tokens >= counts[-1]:
        return expert_seconds[counts[-1]] * tokens / counts[-1]
    hi = next(c for c in counts if c >= tokens)
    lo = max(c for c in counts if c < tokens)
    t = (tokens - lo) / (hi - lo)
    return expert_seconds[lo] + t * (expert_seconds[hi] - expert_seconds[lo])


def expert_correction(tokens: int, expert_seconds: dict[int, float], per_token: int = 6,
                      layers: int = V4_FLASH_LAYERS) -> float:
    """Seconds V4-Flash's 256 experts add to a call of `tokens` tokens over the slice's 6:
    per MoE layer, the distinct experts its tokens touch, each over its share of them,
    against 6 experts each over all of them. At batch 1 a plain step touches 6 either way;
    8 verify nodes touch about 44, each read from memory for a token or two."""
    touched = experts_touched(tokens, per_token)
    return layers * (touched * _expert_at(expert_seconds, tokens * per_token / touched)
                     - per_token * _expert_at(expert_seconds, tokens))


def with_routed_experts(costs: dict, expert_seconds: dict[int, float]) -> dict:
    """The full-depth costs with `expert_correction` added to the target's calls (the
    plain step: B tokens; a verify pass: B x D). The drafter's single MoE layer is left as
    measured (one or two tokens a request per step)."""
    from branchspec.bench.regime import TARGET_CALLS

    out = {call: by_B for call, by_B in costs.items()}
    for call in TARGET_CALLS:
        out[call] = {B: {ctx: {D: t + expert_correction(B * D, expert_seconds) for D, t in by_D.items()}
                         for ctx, by_D in by_ctx.items()} for B, by_ctx in costs[call].items()}
    return out


def _num(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


def full_depth_costs(depths, pairs: int = V4_FLASH_PAIRS) -> dict:
    """costs[call][batch][context][D] at `pairs` layer pairs: the target's calls projected
    from the two measured depths, the drafter's as measured (at every context)."""
    from branchspec.bench.regime import DRAFTER_CALLS, TARGET_CALLS

    d0, d1 = depths
    out: dict = {}
    for call in TARGET_CALLS:
        for B, by_ctx in _num(d0.costs[call]).items():
            for ctx, by_D in _num(by_ctx).items():
                for D, t0 in _num(by_D).items():
                    t1 = _num(_num(_num(d1.costs[call])[B])[ctx])[D]
                    base, pair = per_pair(t0, t1, d0.pairs, d1.pairs)
                    out.setdefault(call, {}).setdefault(B, {}).setdefault(ctx, {})[D] = at_depth(base, pair, pairs)
    contexts = sorted({ctx for B in out["plain"].values() for ctx in B})
    for call in DRAFTER_CALLS:
        for B, by_ctx in _num(d0.costs.get(call, {})).items():
            first = _num(next(iter(by_ctx.values())))
            for ctx in contexts:
                out.setdefault(call, {}).setdefault(B, {})[ctx] = dict(first)
    return out


def round_seconds(costs: dict, kind: str, B: int, ctx: int, D: int) -> float:
    """One round of a chain or a tree of budget D (a tree below D = 3 is the chain)."""
    if kind == "tree" and D < 3:
        kind = "chain"
    return costs[f"draft_{kind}"][B][ctx][D] + costs[f"verify_{kind}"][B][ctx][D] + costs["extend"][B][ctx][D]


def speedup(accept: float, plain: float, round_: float) -> float:
    """Throughput of speculation over plain decoding: accept tokens per round of `round_`
    seconds against one token per `plain` seconds."""
    return accept * plain / round_


def tree_gain(accept_tree: float, round_tree: float, accept_chain: float, round_chain: float) -> float:
    """The tree's throughput over the chain's at the same budget, minus one."""
    return (accept_tree / round_tree) / (accept_chain / round_chain) - 1.0


def study_accept_lengths(results_jsonl: str | Path) -> dict:
    """Accept lengths from a study's results.jsonl: {workload and "mean": {D: {"chain",
    "tree"}}}, each the mean over the study's batch sizes, the tree the shape with the
    longest such mean (eagle2 and calibrated alike)."""
    rows = [json.loads(line) for line in Path(results_jsonl).read_text().splitlines() if line.strip()]
    by: dict = {}
    for r in rows:
        if r.get("kind") not in ("chain", "tree") or r.get("D") is None:
            continue
        key = (r["workload"], int(r["D"]), r["kind"], r["shape"])
        by.setdefault(key, []).append(float(r["accept_length"]))
    out: dict = {}
    for (workload, D, kind, _), values in by.items():
        mean = statistics.fmean(values)
        slot = out.setdefault(workload, {}).setdefault(D, {})
        slot[kind] = max(slot.get(kind, 0.0), mean)
    workloads = sorted(out)
    if workloads:
        Ds = sorted(set.intersection(*(set(out[w]) for w in workloads)))
        out["mean"] = {D: {k: statistics.fmean(out[w][D][k] for w in workloads) for k in ("chain", "tree")}
                       for D in Ds if all({"chain", "tree"} <= set(out[w][D]) for w in workloads)}
    return out


def default_studies() -> dict[str, Path]:
    """The study's own results, where this runs from a checkout that has them: greedy (the
    embedded drafter, distilled on greedy text, makes the chain accept slightly more) and
    sampled at temperature 0.7 (the tree accepts more, as in the paper)."""
    root = Path(__file__).resolve().parents[2] / "docs" / "results"
    found = {f"study {mode}": root / mode / "results.jsonl" for mode in ("greedy", "sampled")}
    return {name: path for name, path in found.items() if path.is_file()}


def project(measured, studies: dict[str, dict] | None = None) -> dict:
    """Everything regime.md shows, as numbers, for the costs as measured (6 experts) and
    with V4-Flash's 256 (`with_routed_experts`): the full-depth costs, verify over plain,
    and the projected gains under the paper's accept lengths and each of `studies` ({name:
    `study_accept_lengths`}), with the regularities judged on them."""
    costs = full_depth_costs(measured.depths)
    variants = {MEASURED: costs}
    if measured.expert_seconds:
        variants[ROUTED] = with_routed_experts(costs, measured.expert_seconds)
    return {"layers": V4_FLASH_LAYERS,
            "variants": {name: project_costs(c, studies) for name, c in variants.items()}}


def project_costs(costs: dict, studies: dict[str, dict] | None) -> dict:
    """`project` for one set of full-depth costs."""
    batches = sorted(costs["plain"])
    contexts = sorted(costs["plain"][batches[0]])
    budgets = sorted(D for D in costs["verify_chain"][batches[0]][contexts[0]] if D > 1)
    baseline = plain_baseline(costs)
    verify_ratio = {B: {ctx: {D: costs["verify_chain"][B][ctx][D] / baseline[B][ctx] for D in budgets}
                        for ctx in contexts} for B in batches}
    sources = {name: {8: acc} for name, acc in PAPER_ACCEPT_D8.items() if 8 in budgets}
    for name, study in (studies or {}).items():
        sources[name] = {D: acc for D, acc in study.get("mean", {}).items() if D in budgets}
    gains: dict = {}
    for name, by_D in sources.items():
        for D, acc in by_D.items():
            for B in batches:
                for ctx in contexts:
                    chain, tree = (round_seconds(costs, k, B, ctx, D) for k in ("chain", "tree"))
                    plain = baseline[B][ctx]
                    gains.setdefault(name, {}).setdefault(B, {}).setdefault(ctx, {})[D] = {
                        "tree_vs_chain": tree_gain(acc["tree"], tree, acc["chain"], chain),
                        "chain_vs_plain": speedup(acc["chain"], plain, chain),
                        "tree_vs_plain": speedup(acc["tree"], plain, tree),
                        "accept": acc}
    return {"costs": costs, "plain_baseline": baseline, "verify_over_plain": verify_ratio, "gains": gains,
            "regularities": regularities(gains, batches, contexts), "noise": verify_noise(costs)}


def plain_baseline(costs: dict) -> dict:
    """Plain decoding's step at each (batch, context): the faster of the runner's decode
    step and the verify pass over the root alone (the same one-token step by another
    route), so that speculation is judged against the fastest plain step measured."""
    return {B: {ctx: min(by_D[1], costs["verify_chain"][B][ctx].get(1, math.inf)) for ctx, by_D in by_ctx.items()}
            for B, by_ctx in costs["plain"].items()}


def verify_noise(costs: dict) -> dict:
    """How far the chain's and the tree's verify passes of the same D differ, projected:
    they run as many nodes over the same state (only their plans differ), so this
    measures how much a projected cost moves by chance. {"median", "max"}: of |tree /
    chain - 1| over every (batch, context, D >= 3)."""
    gaps = sorted(abs(costs["verify_tree"][B][ctx][D] / costs["verify_chain"][B][ctx][D] - 1.0)
                  for B in costs["verify_chain"] for ctx in costs["verify_chain"][B]
                  for D in costs["verify_chain"][B][ctx] if D >= 3)
    return {"median": statistics.median(gaps), "max": gaps[-1]} if gaps else {}


def regularities(gains: dict, batches: list[int], contexts: list[int]) -> dict:
    """R2 (the tree's gain grows with D), R4 (largest at small-to-medium batch), R5 (past
    about D = 6 throughput stops following the accept length), judged at the middle
    context under each source of accept lengths that allows it: R2 and R5 need them at
    several D (a study's), R4 at one (the paper's D = 8 too)."""
    ctx = contexts[len(contexts) // 2]           # the middle context (8k in the presets)
    out: dict = {"context": ctx, "R2": {}, "R4": {}, "R5": {}}
    for source, by_B in gains.items():
        Ds = sorted(by_B[batches[0]][ctx])
        if len(Ds) > 1:
            r2 = {B: [by_B[B][ctx][D]["tree_vs_chain"] for D in Ds] for B in batches}
            out["R2"][source] = {"D": Ds, "tree_vs_chain": r2, "grows": {B: g[-1] > g[0] for B, g in r2.items()}}
            lo, hi = (6, Ds[-1]) if 6 in Ds and Ds[-1] > 6 else (Ds[0], Ds[-1])
            r5 = {}
            for B in batches:
                rows = by_B[B][ctx]
                accept_rise = rows[hi]["accept"]["tree"] / rows[lo]["accept"]["tree"] - 1
                speed_rise = rows[hi]["tree_vs_plain"] / rows[lo]["tree_vs_plain"] - 1
                r5[B] = {"accept_rise": accept_rise, "throughput_rise": speed_rise,
                         "decoupled": speed_rise < 0.5 * accept_rise}
            out["R5"][source] = {"from": lo, "to": hi, "by_batch": r5}
        D = 6 if 6 in Ds else Ds[-1]
        by_batch = {B: by_B[B][ctx][D]["tree_vs_chain"] for B in batches}
        best = max(by_batch, key=by_batch.get)
        out["R4"][source] = {"D": D, "tree_vs_chain": by_batch, "best_batch": best,
                             "interior": best not in (batches[0], batches[-1])}
    return out
