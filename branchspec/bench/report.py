"""The study's tables: report.md (paper-shaped tables) and the console table.

Table headers are module constants so tests can check that every column is present.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median

from branchspec.bench.analysis import (
    BREAKDOWN_PHASES,
    POLICY_GOAL_VS_BASELINE,
    POLICY_GOAL_VS_BEST,
    Comparison,
    accept_table,
    breakdown_table,
    gain,
    policy_table,
    selection_table,
    throughput_ratio_grid,
)
from branchspec.bench.metrics import CellResult

ACCEPT_HEADERS = ("D", "workload", "chain accept", "best tree", "tree accept", "accept gain")
THROUGHPUT_HEADERS_LEAD = ("workload", "batch size")          # then one column per D
COMPARISON_HEADERS = ("workload", "batch size", "D", "chain accept", "tree (best tok/s)", "tree accept",
                      "accept gain", "chain tok/s", "tree tok/s", "throughput gain", "conversion",
                      "best-accept tree", "its accept")
BREAKDOWN_HEADERS = ("kind", "batch size", "D", *(f"{p} ms" for p in BREAKDOWN_PHASES), "total ms",
                     "not verify")
CELL_HEADERS = ("workload", "batch size", "kind", "shape", "D", "accept length", "accept rate per depth",
                "tok/s", "speedup", "ms/round", "rounds", "tokens", "wall s", "matches baseline")


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:+.1f}%"


def num(v: float | None, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def markdown_table(headers: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(headers: tuple[str, ...] | list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest entry, for the terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(s.rjust(w) for s, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(list(headers)), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


# -- table rows ----------------------------------------------------------------------------

def accept_rows(cells: list[CellResult]) -> list[list[str]]:
    rows = []
    table = accept_table(cells)
    for r in table:
        rows.append([str(r.D), r.workload, num(r.chain), r.tree_shape, num(r.tree), pct(r.gain)])
    # A mean row per D, across workloads.
    for d in sorted({r.D for r in table}):
        at_d = [r for r in table if r.D == d]
        if len(at_d) > 1:
            chain = sum(r.chain for r in at_d) / len(at_d)
            tree = sum(r.tree for r in at_d) / len(at_d)
            rows.append([str(d), "mean", num(chain), "-", num(tree), pct(gain(tree, chain))])
    return rows


def throughput_rows(comparisons: list[Comparison]) -> tuple[list[str], list[list[str]]]:
    grid = throughput_ratio_grid(comparisons)
    budgets = sorted({d for (_, _, d) in grid})
    workloads = list(dict.fromkeys(w for (w, _, _) in grid if w != "mean")) + ["mean"]
    batches = sorted({b for (_, b, _) in grid})
    headers = [*THROUGHPUT_HEADERS_LEAD, *(f"D={d}" for d in budgets)]
    rows = []
    for w in workloads:
        for b in batches:
            if not any((w, b, d) in grid for d in budgets):
                continue
            ratios = [grid.get((w, b, d)) for d in budgets]
            rows.append([w, str(b), *(pct(None if r is None else r - 1) for r in ratios)])
    return headers, rows


def comparison_rows(comparisons: list[Comparison]) -> list[list[str]]:
    rows = []
    for c in comparisons:
        t, a = c.best_tree, c.best_accept_tree
        rows.append([c.workload, str(c.batch_size), str(c.D), num(c.chain.accept_length), t.shape,
                     num(t.accept_length), pct(None if c.accept_ratio is None else c.accept_ratio - 1),
                     num(c.chain.throughput_tok_s, 1), num(t.throughput_tok_s, 1),
                     pct(None if c.throughput_ratio is None else c.throughput_ratio - 1),
                     num(c.conversion), a.shape, num(a.accept_length)])
    return rows


def breakdown_rows(cells: list[CellResult], comparisons: list[Comparison]) -> list[list[str]]:
    return [[r.kind, str(r.batch_size), "-" if r.D is None else str(r.D),
             *(num(r.ms[p], 3) for p in BREAKDOWN_PHASES), num(r.ms["total"], 3),
             f"{100 * (1 - r.ms['verify'] / r.ms['total']):.0f}%" if r.ms["total"] > 0 else "-"]
            for r in breakdown_table(cells, comparisons)]


POLICY_HEADERS = ("workload", "batch size", "best fixed", "sweep: auto tok/s", "best fixed tok/s",
                  "auto / best fixed", "auto / no spec", "side by side: auto tok/s", "best fixed tok/s",
                  "no spec tok/s", "auto / best fixed", "auto / no spec", "rounds run (most used first)",
                  "decide ms/round")


def fixed_label(cell: CellResult) -> str:
    """A fixed configuration's name in the tables: "no spec", "chain D=5", "3x2 D=6",
    "3x2 D=6 calibrated"."""
    if cell.kind == "baseline":
        return "no spec"
    if cell.kind == "chain":
        return f"chain D={cell.D}"
    return f"{cell.shape} D={cell.D}" + (" calibrated" if cell.kind == "calibrated" else "")


def policy_rows(cells: list[CellResult]) -> list[list[str]]:
    rows = []
    for r in policy_table(cells):
        fixed = r.best_fixed
        label = "-" if fixed is None else fixed_label(fixed)
        total = sum(r.choices.values()) or 1
        runs = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in list(r.choices.items())[:3])
        side = [num(r.side_median(role), 1) for role in ("auto", "best_fixed", "baseline")]
        rows.append([r.workload, str(r.batch_size), label, num(r.auto.throughput_tok_s, 1),
                     "-" if fixed is None else num(fixed.throughput_tok_s, 1), num(r.sweep_vs_best_fixed),
                     num(r.sweep_vs_baseline), *side,
                     num(r.vs_best_fixed) if r.side_by_side else "-", num(r.vs_baseline) if r.side_by_side else "-",
                     runs, num(r.auto.extra.get("policy_ms_per_round"), 3)])
    return rows


SELECTION_HEADERS = ("workload", "batch", "D", "chain accept", "EAGLE-2 accept (shape)", "calibrated accept (shape)",
                     "vs chain", "vs EAGLE-2", "sweep: calibrated tok/s / best other",
                     "side by side: faster calibrated / faster other", "calibrated tok/s / best other")


def side_pair(row) -> str:
    """Each side's faster finalist side by side, with its shape and median tok/s."""
    winners = [row.side_winner(side) for side in ("calibrated", "other")]
    if None in winners:
        return "-"
    return " / ".join(f"{row.side_shapes[r]} {num(median(row.side_by_side[r]), 1)}" for r in winners)


def selection_rows(cells: list[CellResult]) -> list[list[str]]:
    rows = []
    for r in selection_table(cells):
        e, c = r.best("eagle2", "accept_length"), r.best("calibrated", "accept_length")
        rows.append([r.workload, str(r.batch_size), str(r.D), num(r.chain.accept_length),
                     f"{num(e.accept_length)} ({e.shape})", f"{num(c.accept_length)} ({c.shape})",
                     pct(r.accept_gain("chain")), pct(r.accept_gain("eagle2")), num(r.sweep_throughput_ratio()),
                     side_pair(r), num(r.throughput_ratio())])
    return rows


def cell_rows(cells: list[CellResult]) -> list[list[str]]:
    rows = []
    for c in cells:
        rates = " ".join(f"{r:.2f}" for r in c.accept_rate_per_depth) or "-"
        match = "-" if c.matches_baseline is None else ("yes" if c.matches_baseline else "NO")
        kind = c.kind if c.kind != "recheck" else f"{c.extra['role']} (side by side, run {c.extra['repeat'] + 1})"
        rows.append([c.workload, str(c.batch_size), kind, c.shape, "-" if c.D is None else str(c.D),
                     num(c.accept_length), rates, num(c.throughput_tok_s, 1), num(c.speedup),
                     num(c.ms_per_round["total"], 3), str(c.num_rounds), str(c.tokens),
                     num(c.wall_seconds), match])
    return rows


# -- outputs -------------------------------------------------------------------------------

def _draws(cfg: dict) -> str:
    """How sampled requests drew: seeded, the same tokens in every configuration of a cell,
    or from the engine's stream (other text each run; also reports from before seeds)."""
    if not cfg.get("temperature"):
        return ""
    if cfg.get("seed") is None:
        return " (unseeded: each run samples other text)"
    return (f" (request i seeded {cfg['seed']} + i: every configuration of a cell emits the same tokens, "
            "checked against plain decoding's)")


def _mismatches(summary: dict) -> str:
    """A line for a report whose speculative outputs were not all plain decoding's."""
    n = summary.get("output_mismatches") or 0
    if not n:
        return ""
    return (f"**{n} speculative cells emitted other tokens than plain decoding** (column \"matches baseline\" "
            "of every cell). Speculation is lossless, so each points at a bug or at rounding: a forward of another "
            "shape rounds the logits otherwise, which decides a draw whose uniform lies within rounding of a "
            "boundary between two tokens' cumulative probabilities, or an argmax between two near-equal logits; "
            "plain decoding at another batch size can differ there too. `scripts/diverging_draws.py` tells which.")


def render_report(cells: list[CellResult], comparisons: list[Comparison], summary: dict,
                  plot_files: dict[str, Path] | None = None) -> str:
    cfg = summary.get("config", {})
    shapes = "; ".join(f"D={d}: {', '.join(s) or 'none'}" for d, s in cfg.get("tree_shapes", {}).items())
    tp_headers, tp_rows = throughput_rows(comparisons)
    parts = [
        "# Tree vs chain speculative decoding at matched budget D",
        "",
        f"Model `{cfg.get('model')}` ({cfg.get('dtype')}, {cfg.get('threads')} threads); workloads "
        f"{', '.join(cfg.get('workloads', []))} ({cfg.get('prompts')}, {cfg.get('num_prompts')} prompts of at most "
        f"{cfg.get('max_prompt_tokens')} tokens); batch sizes {cfg.get('batch_sizes')}; "
        f"{cfg.get('max_tokens')} tokens per request, temperature {cfg.get('temperature')}"
        f"{_draws(cfg)}; {summary.get('num_cells')} cells in {summary.get('wall_seconds')} s.",
        "",
        *(line for note in cfg.get("notes", []) for line in (note, "")),   # e.g. MBPP skipped
        *([flag, ""] if (flag := _mismatches(summary)) else []),      # outputs that differ from plain decoding
        f"Tree shapes (num_steps x topk): {shapes}. The best tree at each D is chosen per "
        "(workload, batch size) by decode throughput; the accept-length table picks the shape with "
        "the longest accept length averaged over batch sizes. Gain = tree / chain - 1; conversion = "
        "throughput gain / accept-length gain of the same tree.",
        "",
        "## Accept length (tokens per round, bonus included), mean over batch sizes",
        "",
        markdown_table(ACCEPT_HEADERS, accept_rows(cells)),
        "",
        "## Decode throughput gain, best tree vs chain",
        "",
        markdown_table(tp_headers, tp_rows),
        "",
        "## Tree vs chain per workload, batch size and D",
        "",
        markdown_table(COMPARISON_HEADERS, comparison_rows(comparisons)),
        "",
        "## Round-time breakdown (ms per batch round, mean over workloads; tree = best by throughput)",
        "",
        markdown_table(BREAKDOWN_HEADERS, breakdown_rows(cells, comparisons)),
        "",
        *(["## Adaptive policy (SpecConfig.auto) against the best fixed configuration and no speculation",
            "",
            f"Goals: auto / best fixed >= {POLICY_GOAL_VS_BEST}, auto / no spec >= {POLICY_GOAL_VS_BASELINE} in every cell. "
            "\"Sweep\": the policy's run in the sweep against the best single run of every fixed configuration. "
            "\"Side by side\": after each (workload, batch size), plain decoding, that best fixed configuration and "
            "the policy run again in turn; medians. The goals are judged side by side where that ran: the best "
            "of many single runs is partly the luckiest.",
            "",
            markdown_table(POLICY_HEADERS, policy_rows(cells)), ""] if policy_table(cells) else []),
        *(["## Calibrated trees against EAGLE-2 trees and the chain",
            "",
            "Per (workload, batch size, D): the best tree of each selection by accept length, its gain over the "
            "chain and over the best EAGLE-2 tree, and the best calibrated tree's throughput over the best of the "
            "chain and the EAGLE-2 trees (each best by throughput): in the sweep (one run each), then the two "
            "fastest of each side in the sweep run again in turn, each side judged by its faster one's median "
            "(\"side by side\": one sweep run picks the luckiest as often as the fastest). The last column is "
            "judged side by side where that ran.",
            "",
            markdown_table(SELECTION_HEADERS, selection_rows(cells)), ""] if selection_table(cells) else []),
        "## Every cell",
        "",
        markdown_table(CELL_HEADERS, cell_rows(cells)),
        "",
        *(["## Plots", "", *(f"![{name}]({Path(f).name})" for name, f in plot_files.items()), ""]
          if plot_files else []),
        "## Summary",
        "",
        "```json",
        json.dumps(summary, indent=2),
        "```",
        "",
    ]
    return "\n".join(parts)


def write_report(path: Path, cells: list[CellResult], comparisons: list[Comparison], summary: dict,
                 plot_files: dict[str, Path] | None = None) -> Path:
    path.write_text(render_report(cells, comparisons, summary, plot_files))
    return path


def console_tables(cells: list[CellResult], comparisons: list[Comparison]) -> str:
    """What the benchmark prints before its JSON line: accept lengths and tree vs chain."""
    tp_headers, tp_rows = throughput_rows(comparisons)
    return "\n\n".join([
        "Accept length (mean over batch sizes)\n" + text_table(ACCEPT_HEADERS, accept_rows(cells)),
        "Tree vs chain\n" + text_table(COMPARISON_HEADERS, comparison_rows(comparisons)),
        "Throughput gain, best tree vs chain\n" + text_table(tp_headers, tp_rows),
        *(["Adaptive policy\n" + text_table(POLICY_HEADERS, policy_rows(cells))] if policy_table(cells) else []),
        *(["Calibrated trees\n" + text_table(SELECTION_HEADERS, selection_rows(cells))]
          if selection_table(cells) else []),
    ])
