"""The study's figures (matplotlib, Agg backend: files only, no display needed).

accept_length.png     accept length vs D per workload, chain vs best tree
throughput_ratio.png  tree/chain decode-throughput ratio vs batch size, one line per D
round_breakdown.png   stacked ms per round by phase, chain vs tree at each D, for the
                      smallest and the largest batch size
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: a headless backend, whatever the environment says
import matplotlib.pyplot as plt  # noqa: E402

from branchspec.bench.analysis import (  # noqa: E402
    BREAKDOWN_PHASES,
    Comparison,
    accept_table,
    breakdown_table,
    throughput_ratio_grid,
)
from branchspec.bench.metrics import CellResult  # noqa: E402


def write_plots(out_dir: Path, cells: list[CellResult], comparisons: list[Comparison]) -> dict[str, Path]:
    """Write the three figures into ``out_dir``; returns name -> path."""
    out = {
        "accept_length": plot_accept_length(out_dir / "accept_length.png", cells),
        "throughput_ratio": plot_throughput_ratio(out_dir / "throughput_ratio.png", comparisons),
        "round_breakdown": plot_round_breakdown(out_dir / "round_breakdown.png", cells, comparisons),
    }
    return out


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_accept_length(path: Path, cells: list[CellResult]) -> Path:
    rows = accept_table(cells)
    workloads = list(dict.fromkeys(r.workload for r in rows)) or ["(no data)"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 3.4), squeeze=False, sharey=True)
    for ax, w in zip(axes[0], workloads):
        rs = sorted((r for r in rows if r.workload == w), key=lambda r: r.D)
        ds = [r.D for r in rs]
        ax.plot(ds, [r.chain for r in rs], "o-", label="chain")
        ax.plot(ds, [r.tree for r in rs], "s-", label="best tree")
        for r in rs:
            ax.annotate(r.tree_shape, (r.D, r.tree), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)
        ax.margins(y=0.2)  # room for the shape labels above the points
        ax.set_title(w)
        ax.set_xlabel("budget D")
        ax.set_xticks(ds)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("accept length (tokens / round)")
    axes[0][0].legend()
    return _save(fig, path)


def plot_throughput_ratio(path: Path, comparisons: list[Comparison]) -> Path:
    grid = throughput_ratio_grid(comparisons)
    workloads = list(dict.fromkeys(w for (w, _, _) in grid if w != "mean"))
    panels = workloads + (["mean"] if len(workloads) > 1 else []) or ["(no data)"]
    budgets = sorted({d for (_, _, d) in grid})
    batches = sorted({b for (_, b, _) in grid})
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False, sharey=True)
    for ax, w in zip(axes[0], panels):
        for d in budgets:
            pts = [(b, grid[(w, b, d)]) for b in batches if grid.get((w, b, d)) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"D={d}")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        if batches and max(batches) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_title("mean over workloads" if w == "mean" else w)
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("tree / chain decode throughput")
    if budgets:
        axes[0][0].legend(fontsize=8)
    return _save(fig, path)


def plot_round_breakdown(path: Path, cells: list[CellResult], comparisons: list[Comparison]) -> Path:
    rows = breakdown_table(cells, comparisons)
    batches = sorted({r.batch_size for r in rows})
    shown = sorted({batches[0], batches[-1]}) if batches else []
    fig, axes = plt.subplots(1, max(len(shown), 1), figsize=(6 * max(len(shown), 1), 3.8), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, b in zip(axes[0], shown):
        # Bars: baseline, then chain and tree side by side at each D.
        bars = [r for r in rows if r.batch_size == b]
        labels = ["base" if r.kind == "baseline" else f"D{r.D}\n{r.kind}" for r in bars]
        x = range(len(bars))
        bottom = [0.0] * len(bars)
        for i, phase in enumerate(BREAKDOWN_PHASES):
            heights = [r.ms[phase] for r in bars]
            ax.bar(x, heights, bottom=bottom, color=colors[i % len(colors)], label=phase)
            bottom = [s + h for s, h in zip(bottom, heights)]
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"batch size {b}")
        ax.set_ylabel("ms per round")
        ax.grid(alpha=0.3, axis="y")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)
