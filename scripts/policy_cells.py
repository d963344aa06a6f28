"""The adaptive policy's goals, cell by cell: `SpecConfig.auto()` against plain decoding and
the best fixed configuration, side by side, on held-out prompts.

For each (temperature, batch size, workload) cell, one batch of the workload's eval prompts
(the study's cell: `scripts/study_cell.py`), each request --max-tokens long:

1. a sweep: every fixed configuration of FIXED once (plain decoding among them; with
   --compile, `fast_path_candidates()`, which are then the policy's candidates too);
2. side by side: plain decoding, the sweep's --top fastest speculative configurations and
   the policy, --repeats times in turn (after one untimed run of the policy).

The table gives each cell's medians as auto / best fixed (the fastest of step 2's fixed
arms, plain decoding included) and auto / plain, the rounds the policy ran on other
configurations than the one it settled on (the one it ran most after the first
--settle-after rounds of a run), its bookkeeping per round, and the run-to-run spread
(per arm (max - min) / median of its runs, the median over the arms): a shared machine's
noise, against which a miss of the goal is to be read. Every output must equal
plain decoding's (greedy, or sampled with the study's per-request seeds). One engine per
batch size serves every cell of that size, as a server would: the policy's learnt state
carries from cell to cell. Writes cells.jsonl, cells.md and cells.png (auto / best fixed
per cell, beside an earlier run's cells.jsonl given as --before) into --out;
`--plot-only` redraws the plot from --out's cells.jsonl.

    python scripts/policy_cells.py --out DIR [--workloads gsm8k,mbpp,sharegpt]
        [--batches 1,4,16] [--temperatures 0,0.7] [--max-tokens 96] [--repeats 3] [--compile]
        [--before OLD/cells.jsonl] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from branchspec import LLM, SpecConfig
from branchspec.bench.study import StudyConfig, batch_prompts, load_prompts, request_params
from branchspec.config import fast_path_candidates, spec_label
from branchspec.machine import cpu_model_name

# The fixed arms: plain decoding, chains and calibrated trees near where the study's sweeps
# found each cell's best (docs/policy.md).
FIXED = (None, SpecConfig.chain(4), SpecConfig.chain(5), SpecConfig.chain(6),
         SpecConfig(3, 2, 6, selection="calibrated"), SpecConfig(2, 3, 6, selection="calibrated"),
         SpecConfig(3, 2, 8, selection="calibrated"), SpecConfig(2, 3, 8, selection="calibrated"),
         SpecConfig(4, 2, 7, selection="calibrated"))


class ChoiceLog:
    """Every configuration the policy chose, in order, for one run."""

    def __init__(self, policy):
        self.choices: list[str] = []
        choose = policy.choose

        def logged(batch):
            spec = choose(batch)
            self.choices.append(spec_label(spec))
            return spec
        policy.choose = logged

    def off_settled(self, after: int) -> tuple[str | None, float | None]:
        """The configuration run most after the first `after` rounds, and the share of those
        rounds spent on others (None where the run had no more rounds)."""
        late = self.choices[after:]
        if not late:
            return None, None
        settled, n = Counter(late).most_common(1)[0]
        return settled, 1.0 - n / len(late)


def run(llm: LLM, prompts, params, spec) -> tuple[float, list, object]:
    outs = llm.generate(prompts, params, spec=spec, use_tqdm=False)
    return llm.last_stats.decode_throughput, [o.token_ids for o in outs], llm.last_stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=2, help="speculative arms kept from the sweep")
    ap.add_argument("--settle-after", type=int, default=20)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--mbpp-path", default=None)
    ap.add_argument("--before", default=None, help="an earlier run's cells.jsonl, drawn beside this one")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        plot(read_rows(out / "cells.jsonl"), out / "cells.png", read_rows(args.before) if args.before else None)
        return
    workloads = args.workloads.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    # Compiled steps compile every configuration they run before the first request (a
    # graph takes half a minute on two cores), so there the arms and the policy's
    # candidates are the compact set `--compile --speculative-policy auto` gives a user.
    fixed = fast_path_candidates() if args.compile else FIXED
    auto = SpecConfig.auto(fast_path_candidates()) if args.compile else SpecConfig.auto()
    rows = []
    cells = [(b, t, w) for b in batches for t in temperatures for w in workloads]
    bar = tqdm(total=len(cells), desc="policy cells", unit="cell")
    llm = None
    for B, T, workload in cells:
        if llm is None or llm.engine.config.max_batch_size != B:
            llm = LLM(max_batch_size=B, seed=0, compile=args.compile)
            if args.compile:
                llm.warmup(auto, batch_sizes=(B,))
            policy = llm.engine.policy(auto, progress=True)
        cfg = StudyConfig(workloads=(workload,), num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          temperature=T, seed=0, batch_sizes=(B,), progress=False, mbpp_path=args.mbpp_path)
        prompts = batch_prompts(load_prompts(cfg, llm)[workload], B)
        params = request_params(cfg, B)
        sweep = {spec_label(s): run(llm, prompts, params, s)[0] for s in fixed}
        fastest = sorted((s for s in fixed if s is not None), key=lambda s: -sweep[spec_label(s)])[:args.top]
        arms = [None, *fastest]
        tok_s = {spec_label(s): [] for s in arms + [auto]}
        reference = run(llm, prompts, params, auto)[1]          # untimed: the policy's first look
        same, off, settled, bookkeeping, rounds = True, [], Counter(), [], Counter()
        for _ in range(args.repeats):
            for spec in arms:
                t, tokens, _ = run(llm, prompts, params, spec)
                tok_s[spec_label(spec)].append(t)
                same &= tokens == reference
            log = ChoiceLog(policy)
            t, tokens, stats = run(llm, prompts, params, auto)
            del policy.choose                                   # back to the class's method
            tok_s["auto"].append(t)
            same &= tokens == reference
            label, share = log.off_settled(args.settle_after)
            if share is not None:
                off.append(share)
                settled[label] += 1
            rounds.update(log.choices)
            bookkeeping.append(1e3 * stats.policy_seconds / max(len(log.choices), 1))
        median = {k: statistics.median(v) for k, v in tok_s.items()}
        # How far one arm's runs lie apart, (max - min) / median, the median over the
        # arms: a miss smaller than this says nothing about the policy.
        spread = statistics.median((max(v) - min(v)) / statistics.median(v) for v in tok_s.values())
        best = max((k for k in median if k != "auto"), key=median.get)
        row = {"workload": workload, "batch": B, "temperature": T, "tok_s": median, "best_fixed": best,
               "auto_over_best": median["auto"] / median[best], "auto_over_plain": median["auto"] / median["none"],
               "off_settled": statistics.median(off) if off else None,
               "settled": settled.most_common(1)[0][0] if settled else None,
               "bookkeeping_ms": statistics.median(bookkeeping), "same_tokens": same, "spread": spread,
               "runs": tok_s,
               "rounds": dict(rounds.most_common()), "sweep": sweep}
        rows.append(row)
        with open(out / "cells.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.update(1)
        tqdm.write(f"{workload} b{B} T={T}: auto/best {row['auto_over_best']:.2f} ({best}), auto/plain "
                   f"{row['auto_over_plain']:.2f}, off-settled {row['off_settled']}, "
                   f"{row['bookkeeping_ms']:.2f} ms/round, same {same}; {dict(rounds.most_common(3))}")
    bar.close()
    write_table(rows, out / "cells.md", args)
    plot(rows, out / "cells.png", read_rows(args.before) if args.before else None)


def read_rows(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(rows: list[dict], path: Path, before: list[dict] | None = None) -> None:
    """Auto / best fixed per cell as bars (an earlier run's beside it), the 0.95 goal drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def key(r):
        return r["workload"], r["batch"], r["temperature"]
    labels = [f"{w} b{b} T={t:g}" for w, b, t in map(key, rows)]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 4.5))
    if before:
        old = {key(r): r["auto_over_best"] for r in before}
        ax.bar([i - 0.2 for i in x], [old.get(key(r), float("nan")) for r in rows], 0.4, label="before", color="0.7")
        ax.bar([i + 0.2 for i in x], [r["auto_over_best"] for r in rows], 0.4, label="now")
        ax.legend()
    else:
        ax.bar(list(x), [r["auto_over_best"] for r in rows], 0.6)
    ax.axhline(0.95, color="k", ls="--", lw=1)
    ax.set_xticks(list(x), labels, rotation=60, ha="right", fontsize=8)
    shown = [r["auto_over_best"] for r in rows + (before or [])]
    ax.set_ylim(min(0.7, min(shown) - 0.05), max(1.15, max(shown) + 0.05))
    ax.set_ylabel("auto / best fixed configuration")
    ax.set_title("SpecConfig.auto() against the best fixed configuration, side by side")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_table(rows: list[dict], path: Path, args) -> None:
    lines = [f"CPU: {cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"{'compiled' if args.compile else 'eager'}; {args.max_tokens} tokens a request, medians of "
             f"{args.repeats} runs in turn.", "",
             "| cell | best fixed | auto / best fixed | auto / plain | off settled (after round "
             f"{args.settle_after}) | settled on | bookkeeping ms/round | same tokens | run-to-run spread |",
             "|---|---|---:|---:|---:|---|---:|---|---:|"]
    for r in rows:
        off = "-" if r["off_settled"] is None else f"{100 * r['off_settled']:.0f}%"
        spread = f"{100 * r['spread']:.0f}%" if r.get("spread") is not None else "-"
        lines.append(f"| {r['workload']}, batch {r['batch']}, T={r['temperature']:g} | {r['best_fixed']} | "
                     f"{r['auto_over_best']:.2f} | {r['auto_over_plain']:.2f} | {off} | {r['settled'] or '-'} | "
                     f"{r['bookkeeping_ms']:.2f} | {r['same_tokens']} | {spread} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
