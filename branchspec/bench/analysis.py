"""Tree versus chain at a matched budget: the derived numbers the report tables show.

gain(x) = tree / chain - 1. The *conversion ratio* = throughput gain / accept-length gain
says how much of the extra acceptance a tree turns into speed: 1.0 means every extra
accepted token is free; lower means the tree's per-round overhead (wider draft, bigger
plan, more verify compute, path refresh) eats part of it. It uses one tree for both gains
(the best by throughput), so the ratio describes one configuration.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from statistics import fmean, median

from branchspec.bench.metrics import FIXED_KINDS, CellResult
from branchspec.speculative.outcome import ROUND_PHASES

BREAKDOWN_PHASES = (*ROUND_PHASES, "other")


def gain(tree: float, chain: float) -> float | None:
    """tree / chain - 1, or None when the chain value is 0."""
    return tree / chain - 1.0 if chain > 0 else None


@dataclass
class Comparison:
    """The chain and the trees at one (workload, batch size, D)."""

    workload: str
    batch_size: int
    D: int
    chain: CellResult
    trees: list[CellResult]

    @property
    def best_tree(self) -> CellResult:
        """The tree shape with the highest decode throughput (the paper's choice)."""
        return max(self.trees, key=lambda c: c.throughput_tok_s)

    @property
    def best_accept_tree(self) -> CellResult:
        """The tree shape with the longest accept length."""
        return max(self.trees, key=lambda c: c.accept_length)

    @property
    def accept_ratio(self) -> float | None:
        c = self.chain.accept_length
        return self.best_tree.accept_length / c if c > 0 else None

    @property
    def best_accept_ratio(self) -> float | None:
        c = self.chain.accept_length
        return self.best_accept_tree.accept_length / c if c > 0 else None

    @property
    def throughput_ratio(self) -> float | None:
        c = self.chain.throughput_tok_s
        return self.best_tree.throughput_tok_s / c if c > 0 else None

    @property
    def conversion(self) -> float | None:
        if self.accept_ratio is None or self.throughput_ratio is None:
            return None
        acc_gain = self.accept_ratio - 1.0
        # A vanishing accept gain makes the ratio meaningless (and unbounded).
        return (self.throughput_ratio - 1.0) / acc_gain if abs(acc_gain) > 1e-9 else None

    def to_dict(self) -> dict:
        return {
            "workload": self.workload, "batch_size": self.batch_size, "D": self.D,
            "chain_accept_length": self.chain.accept_length,
            "chain_throughput_tok_s": self.chain.throughput_tok_s,
            "best_tree": self.best_tree.shape,
            "tree_accept_length": self.best_tree.accept_length,
            "tree_throughput_tok_s": self.best_tree.throughput_tok_s,
            "accept_ratio": self.accept_ratio, "throughput_ratio": self.throughput_ratio,
            "conversion": self.conversion,
            "best_accept_tree": self.best_accept_tree.shape,
            "best_accept_tree_accept_length": self.best_accept_tree.accept_length,
            "best_accept_ratio": self.best_accept_ratio,
        }


def compare(cells: list[CellResult]) -> list[Comparison]:
    """One Comparison per (workload, batch size, D) that has a chain and at least one tree,
    in the order the cells ran."""
    groups: dict[tuple[str, int, int], dict[str, list[CellResult]]] = {}
    for c in cells:
        if c.kind not in ("chain", "tree"):
            continue
        g = groups.setdefault((c.workload, c.batch_size, c.D), {"chain": [], "tree": []})
        g[c.kind].append(c)
    return [Comparison(w, b, d, g["chain"][0], g["tree"]) for (w, b, d), g in groups.items()
            if g["chain"] and g["tree"]]


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return fmean(present) if present else None


@dataclass
class AcceptRow:
    """Accept length at one (workload, D), averaged over batch sizes (as the paper does)."""

    workload: str
    D: int
    chain: float
    tree_shape: str       # the shape with the longest mean accept length
    tree: float

    @property
    def gain(self) -> float | None:
        return gain(self.tree, self.chain)


def accept_table(cells: list[CellResult]) -> list[AcceptRow]:
    by_shape: dict[tuple[str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        if c.kind in ("chain", "tree"):
            by_shape[(c.workload, c.D)][c.shape].append(c.accept_length)
    rows = []
    for (w, d), shapes in by_shape.items():
        means = {s: fmean(v) for s, v in shapes.items()}
        trees = {s: m for s, m in means.items() if s != "chain"}
        if "chain" not in means or not trees:
            continue
        best = max(trees, key=trees.get)
        rows.append(AcceptRow(w, d, means["chain"], best, trees[best]))
    return sorted(rows, key=lambda r: (r.D, r.workload))


@dataclass
class SelectionRow:
    """One (workload, batch size, D): the chain, the best EAGLE-2 tree and the best
    calibrated tree, each best by accept length and by throughput; and (`side_by_side`,
    role -> throughputs, with `side_shapes`, role -> shape) the finalists of each side by
    throughput in the sweep, the calibrated trees' and the others' (`SELECTION_ROLES`),
    run again in turn."""

    workload: str
    batch_size: int
    D: int
    chain: CellResult
    eagle2: list[CellResult]
    calibrated: list[CellResult]
    side_by_side: dict[str, list[float]] = field(default_factory=dict)
    side_shapes: dict[str, str] = field(default_factory=dict)

    def best(self, kind: str, by: str) -> CellResult:
        cells = self.eagle2 if kind == "eagle2" else self.calibrated
        return max(cells, key=lambda c: getattr(c, by))

    def accept_gain(self, over: str) -> float | None:
        """The best calibrated tree's accept length over the chain's or the best EAGLE-2 tree's, - 1."""
        base = self.chain if over == "chain" else self.best("eagle2", "accept_length")
        return gain(self.best("calibrated", "accept_length").accept_length, base.accept_length)

    def sweep_throughput_ratio(self) -> float | None:
        """The best calibrated tree's throughput over the best of the chain and the
        EAGLE-2 trees, each best by its one run in the sweep."""
        base = max([self.chain, *self.eagle2], key=lambda c: c.throughput_tok_s).throughput_tok_s
        best = self.best("calibrated", "throughput_tok_s").throughput_tok_s
        return best / base if base > 0 else None

    def side_winner(self, side: str) -> str | None:
        """The role of `side` ("calibrated" or "other") with the highest median throughput
        side by side, or None where that did not run."""
        ran = [r for r in SELECTION_FINALIST_ROLES[side] if self.side_by_side.get(r)]
        return max(ran, key=lambda r: median(self.side_by_side[r]), default=None)

    def throughput_ratio(self) -> float | None:
        """The faster finalist of each side, by median throughput side by side where that
        ran: calibrated over the others; else the sweep's ratio."""
        calibrated, other = self.side_winner("calibrated"), self.side_winner("other")
        if calibrated is None or other is None:
            return self.sweep_throughput_ratio()
        base = median(self.side_by_side[other])
        return median(self.side_by_side[calibrated]) / base if base > 0 else None

    def to_dict(self) -> dict:
        return {"workload": self.workload, "batch_size": self.batch_size, "D": self.D,
                "chain_accept": self.chain.accept_length,
                "eagle2_accept": self.best("eagle2", "accept_length").accept_length,
                "eagle2_shape": self.best("eagle2", "accept_length").shape,
                "calibrated_accept": self.best("calibrated", "accept_length").accept_length,
                "calibrated_shape": self.best("calibrated", "accept_length").shape,
                "gain_vs_chain": _round(self.accept_gain("chain")),
                "gain_vs_eagle2": _round(self.accept_gain("eagle2")),
                "throughput_vs_best_other": _round(self.throughput_ratio()),
                "sweep_throughput_vs_best_other": _round(self.sweep_throughput_ratio())}


# `study.recheck_selection`'s: each side's fastest and second fastest in the sweep.
SELECTION_FINALIST_ROLES = {"other": ("best_other", "other_2"), "calibrated": ("best_calibrated", "calibrated_2")}
SELECTION_ROLES = tuple(r for roles in SELECTION_FINALIST_ROLES.values() for r in roles)
POLICY_ROLES = ("baseline", "best_fixed", "auto")        # `study.recheck_policy`'s


def selection_table(cells: list[CellResult]) -> list[SelectionRow]:
    """Calibrated against EAGLE-2 trees and the chain, per (workload, batch size, D) that
    ran all three (the study's `selections=("eagle2", "calibrated")`)."""
    groups: dict[tuple[str, int, int], dict[str, list[CellResult]]] = defaultdict(lambda: defaultdict(list))
    side: dict[tuple[str, int, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    shapes: dict[tuple[str, int, int], dict[str, str]] = defaultdict(dict)
    for c in cells:
        if c.kind in ("chain", "tree", "calibrated"):
            groups[(c.workload, c.batch_size, c.D)][c.kind].append(c)
        elif c.kind == "recheck" and c.extra.get("role") in SELECTION_ROLES:
            key = (c.workload, c.batch_size, c.extra["D"])
            side[key][c.extra["role"]].append(c.throughput_tok_s)
            shapes[key][c.extra["role"]] = c.shape
    rows = [SelectionRow(w, b, d, g["chain"][0], g["tree"], g["calibrated"], dict(side.get((w, b, d), {})),
                         shapes.get((w, b, d), {}))
            for (w, b, d), g in groups.items() if g["chain"] and g["tree"] and g["calibrated"]]
    return sorted(rows, key=lambda r: (r.D, r.workload, r.batch_size))


def throughput_ratio_grid(comparisons: list[Comparison]) -> dict[tuple[str, int, int], float | None]:
    """(workload, batch, D) -> tree/chain throughput ratio, with workload "mean" averaging
    over workloads."""
    out: dict[tuple[str, int, int], float | None] = {}
    pooled: dict[tuple[int, int], list[float | None]] = defaultdict(list)
    for c in comparisons:
        out[(c.workload, c.batch_size, c.D)] = c.throughput_ratio
        pooled[(c.batch_size, c.D)].append(c.throughput_ratio)
    for (b, d), values in pooled.items():
        out[("mean", b, d)] = _mean(values)
    return out


@dataclass
class BreakdownRow:
    """Mean ms per round per phase over workloads, for one kind at one (batch, D)."""

    kind: str            # baseline | chain | tree (the best tree by throughput per workload)
    batch_size: int
    D: int | None
    ms: dict[str, float]   # BREAKDOWN_PHASES and "total"


def breakdown_table(cells: list[CellResult], comparisons: list[Comparison]) -> list[BreakdownRow]:
    picked: dict[tuple[str, int, int | None], list[CellResult]] = defaultdict(list)
    for c in cells:
        if c.kind == "baseline":
            picked[("baseline", c.batch_size, None)].append(c)
    for cmp in comparisons:
        picked[("chain", cmp.batch_size, cmp.D)].append(cmp.chain)
        picked[("tree", cmp.batch_size, cmp.D)].append(cmp.best_tree)
    rows = []
    for (kind, b, d), group in picked.items():
        ms = {p: fmean(c.ms_per_round.get(p, 0.0) for c in group) for p in (*BREAKDOWN_PHASES, "total")}
        rows.append(BreakdownRow(kind, b, d, ms))
    order = {"baseline": 0, "chain": 1, "tree": 2}
    return sorted(rows, key=lambda r: (r.batch_size, r.D or 0, order[r.kind]))


def summary(cells: list[CellResult], comparisons: list[Comparison], config: dict,
            wall_seconds: float) -> dict:
    """The one-line JSON the benchmark prints last: headline gains by D and the best case."""
    by_d: dict[int, list[Comparison]] = defaultdict(list)
    for c in comparisons:
        by_d[c.D].append(c)
    accept_gain = {d: _mean([None if c.accept_ratio is None else c.accept_ratio - 1 for c in cs])
                   for d, cs in sorted(by_d.items())}
    tp_gain = {d: _mean([None if c.throughput_ratio is None else c.throughput_ratio - 1 for c in cs])
               for d, cs in sorted(by_d.items())}
    best = max((c for c in comparisons if c.throughput_ratio is not None),
               key=lambda c: c.throughput_ratio, default=None)
    spec_cells = [c for c in cells if c.kind in ("chain", "tree", "calibrated", "auto")]
    mismatches = sum(1 for c in spec_cells if c.matches_baseline is False)
    policy = policy_table(cells)
    return {
        "benchmark": "branchspec.bench",
        "num_cells": len(cells),
        "wall_seconds": round(wall_seconds, 2),
        "config": config,
        "mean_accept_gain_by_D": {str(d): _round(v) for d, v in accept_gain.items()},
        "mean_throughput_gain_by_D": {str(d): _round(v) for d, v in tp_gain.items()},
        "mean_conversion_by_D": {str(d): _round(_mean([c.conversion for c in cs])) for d, cs in sorted(by_d.items())},
        "best_throughput_gain": None if best is None else {
            "workload": best.workload, "batch_size": best.batch_size, "D": best.D,
            "shape": best.best_tree.shape, "gain": _round(best.throughput_ratio - 1)},
        "max_speedup_vs_baseline": _round(max((c.speedup or 0.0 for c in spec_cells), default=None)),
        "output_mismatches": mismatches,
        **({"policy": policy_summary(policy)} if policy else {}),
        **({"calibrated": selection_summary(selection)} if (selection := selection_table(cells)) else {}),
    }


@dataclass
class PolicyRow:
    """The adaptive policy in one (workload, batch size) against the best fixed
    configuration there (by throughput, over every D and shape) and plain decoding: once
    in the sweep, and (`side_by_side`, role -> throughputs) run again in turn."""

    workload: str
    batch_size: int
    auto: CellResult
    best_fixed: CellResult | None
    baseline: CellResult | None
    side_by_side: dict[str, list[float]] = field(default_factory=dict)

    @property
    def sweep_vs_best_fixed(self) -> float | None:
        if self.best_fixed is None or self.best_fixed.throughput_tok_s <= 0:
            return None
        return self.auto.throughput_tok_s / self.best_fixed.throughput_tok_s

    @property
    def sweep_vs_baseline(self) -> float | None:
        if self.baseline is None or self.baseline.throughput_tok_s <= 0:
            return None
        return self.auto.throughput_tok_s / self.baseline.throughput_tok_s

    def side_median(self, role: str) -> float | None:
        """Median side-by-side throughput of a role; the best fixed configuration's is
        plain decoding's when that was the best."""
        runs = self.side_by_side.get(role) or (self.side_by_side.get("baseline") if role == "best_fixed" else None)
        return median(runs) if runs else None

    def _ratio(self, role: str) -> float | None:
        auto, other = self.side_median("auto"), self.side_median(role)
        return auto / other if auto is not None and other else None

    @property
    def vs_best_fixed(self) -> float | None:
        """Judged side by side when rerun, else on the sweep's single runs."""
        return self._ratio("best_fixed") if self.side_by_side else self.sweep_vs_best_fixed

    @property
    def vs_baseline(self) -> float | None:
        return self._ratio("baseline") if self.side_by_side else self.sweep_vs_baseline

    @property
    def choices(self) -> dict[str, int]:
        return dict(self.auto.extra.get("choices", {}))


# The policy's goals: at least this share of the best fixed configuration's throughput, and
# never below plain decoding.
POLICY_GOAL_VS_BEST = 0.97
POLICY_GOAL_VS_BASELINE = 1.0


def policy_table(cells: list[CellResult]) -> list[PolicyRow]:
    rows = []
    for a in (c for c in cells if c.kind == "auto"):
        same = [c for c in cells if c.workload == a.workload and c.batch_size == a.batch_size]
        fixed = [c for c in same if c.kind in FIXED_KINDS]
        best = max(fixed, key=lambda c: c.throughput_tok_s, default=None)
        base = next((c for c in same if c.kind == "baseline"), None)
        side: dict[str, list[float]] = defaultdict(list)
        for c in same:
            if c.kind == "recheck" and c.extra.get("role") in POLICY_ROLES:
                side[c.extra["role"]].append(c.throughput_tok_s)
        rows.append(PolicyRow(a.workload, a.batch_size, a, best, base, dict(side)))
    return rows


def policy_summary(rows: list[PolicyRow]) -> dict:
    short = [{"workload": r.workload, "batch_size": r.batch_size,
              "vs_best_fixed": _round(r.vs_best_fixed), "vs_baseline": _round(r.vs_baseline),
              "sweep_vs_best_fixed": _round(r.sweep_vs_best_fixed), "sweep_vs_baseline": _round(r.sweep_vs_baseline)}
             for r in rows
             if (r.vs_best_fixed is not None and r.vs_best_fixed < POLICY_GOAL_VS_BEST)
             or (r.vs_baseline is not None and r.vs_baseline < POLICY_GOAL_VS_BASELINE)]
    vb = [r.vs_best_fixed for r in rows if r.vs_best_fixed is not None]
    vp = [r.vs_baseline for r in rows if r.vs_baseline is not None]
    return {"cells": len(rows), "judged": "side by side" if any(r.side_by_side for r in rows) else "sweep",
            "min_vs_best_fixed": _round(min(vb, default=None)),
            "mean_vs_best_fixed": _round(_mean(vb)), "min_vs_baseline": _round(min(vp, default=None)),
            "cells_short_of_goal": short}


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def selection_summary(rows: list[SelectionRow]) -> dict:
    """The calibrated selection's headline numbers: mean accept gains over the chain and
    the best EAGLE-2 tree, how many cells it loses, and in how many its throughput matches
    the best of the others."""
    vs_chain = [r.accept_gain("chain") for r in rows]
    vs_eagle2 = [r.accept_gain("eagle2") for r in rows]
    tp = [r.throughput_ratio() for r in rows]
    return {"cells": len(rows), "mean_accept_gain_vs_chain": _round(_mean(vs_chain)),
            "mean_accept_gain_vs_eagle2": _round(_mean(vs_eagle2)),
            "cells_below_chain": sum(1 for g in vs_chain if g is not None and g < 0),
            "cells_below_eagle2": sum(1 for g in vs_eagle2 if g is not None and g < 0),
            "throughput_at_least_best_other": sum(1 for t in tp if t is not None and t >= 1.0),
            "throughput_judged": "side by side" if any(r.side_by_side for r in rows) else "sweep"}
