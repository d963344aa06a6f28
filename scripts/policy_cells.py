"""The adaptive policy's goals, cell by cell: `SpecConfig.auto()` against plain decoding and
the best fixed configuration, side by side, on held-out prompts.

For each (temperature, batch size, workload) cell, a run serves --requests of the workload's
eval prompts (at least one batch; the study's cell: `scripts/study_cell.py`), each request
--max-tokens long, through an engine of that batch size: at batch 1, sixteen requests one
after another, so that no cell rests on one prompt. The policy runs on the LLM's engine,
every fixed configuration on an engine of its own over the same model and compiled steps
(`twin`):

1. a sweep: every fixed configuration of FIXED once, alone (plain decoding among them;
   with --compile, `fast_path_candidates()`, which are then the policy's candidates too),
   and the policy once, untimed: each engine's first look at the cell;
2. side by side: plain decoding, the sweep's --top fastest speculative configurations and
   the policy, --repeats turns, the engines taking steps in turn, paced by the tokens
   each has emitted (`SideBySide`).

The table gives each cell's auto / best fixed (the fastest of step 2's fixed arms by
median, plain decoding included) and auto / plain, each the median of the turns' own
ratios (`ratios`), the rounds the policy ran on other
configurations than the one it settled on (per request, the one it ran most after that
request's first --settle-after rounds), its bookkeeping per round, and the run-to-run spread
(per arm (max - min) / median of its runs, the median over the arms): a shared machine's
noise, against which a miss of the goal is to be read. Every output must equal
plain decoding's (greedy, or sampled with the study's per-request seeds). One engine per
batch size serves every cell of that size, as a server would: the policy's learnt state
carries from cell to cell (and each twin's, for its configuration). Writes cells.jsonl,
cells.md and cells.png (auto / best fixed per cell, beside an earlier run's cells.jsonl
given as --before) into --out;
`--plot-only` summarises --out's cells.jsonl again from its runs (`ratios`; give the flags
it was measured with, for the table's heading) and redraws table and plot.

    python scripts/policy_cells.py --out DIR [--workloads gsm8k,mbpp,sharegpt]
        [--batches 1,4,16] [--temperatures 0,0.7] [--max-tokens 96] [--requests 16]
        [--repeats 3] [--compile]
        [--before OLD/cells.jsonl] [--plot-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from branchspec import LLM, SpecConfig
from branchspec.bench.study import StudyConfig, batch_prompts, load_prompts, request_params
from branchspec.config import fast_path_candidates, spec_label
from branchspec.engine.engine import Engine
from branchspec.machine import cpu_model_name

# The fixed arms: plain decoding, chains and calibrated trees near where the study's sweeps
# found each cell's best (docs/policy.md).
FIXED = (None, SpecConfig.chain(4), SpecConfig.chain(5), SpecConfig.chain(6),
         SpecConfig(3, 2, 6, selection="calibrated"), SpecConfig(2, 3, 6, selection="calibrated"),
         SpecConfig(3, 2, 8, selection="calibrated"), SpecConfig(2, 3, 8, selection="calibrated"),
         SpecConfig(4, 2, 7, selection="calibrated"))


class ChoiceLog:
    """Every configuration the policy chose, in order, over one turn, and which requests
    each round served with how many rounds each had had before it."""

    def __init__(self, policy):
        self.policy = policy
        self.choices: list[str] = []
        self.served: list[list[tuple[int, int]]] = []     # per round: (request id, its rounds before)
        self.seen: Counter[int] = Counter()

    def __enter__(self) -> "ChoiceLog":
        choose = self.policy.choose

        def logged(batch):
            spec = choose(batch)
            self.choices.append(spec_label(spec))
            self.served.append([(sid, self.seen[sid]) for sid in batch.seq_ids])
            self.seen.update(batch.seq_ids)
            return spec
        self.policy.choose = logged
        return self

    def __exit__(self, *exc) -> None:
        del self.policy.choose                      # back to the class's method

    def off_settled(self, after: int) -> tuple[str | None, float | None]:
        """Per request, the configuration run most in its rounds after its first `after`,
        and the share of those rounds spent on others, over every request: (the
        configuration most requests settled on, the share off; None where no request had
        that many rounds). Requests differ, so each settles on its own."""
        late: dict[int, Counter[str]] = {}
        for choice, served in zip(self.choices, self.served):
            for sid, age in served:
                if age >= after:
                    late.setdefault(sid, Counter())[choice] += 1
        if not late:
            return None, None
        settled = Counter(c.most_common(1)[0][0] for c in late.values())
        off = sum(c.total() - c.most_common(1)[0][1] for c in late.values())
        return settled.most_common(1)[0][0], off / sum(c.total() for c in late.values())


def twin(llm: LLM) -> Engine:
    """Another engine over `llm`'s model and compiled steps, with a paged state, drafter and
    measured acceptance of its own: one fixed arm's, so that the arms can step in turn
    without sharing a batch, each learning only from its own rounds as a user's engine
    running that configuration would."""
    e = llm.engine
    return Engine(llm.model, e.config, seed=0, stop_token_ids=tuple(e.stop_token_ids),
                  draft_vocab=e.drafter.vocab if e.drafter is not None else None,
                  executor=lambda model, cache: e.executor.over(cache))


class SideBySide:
    """Arms serving the same requests side by side, each on its own engine, the engines
    taking steps in turn: always the one that has emitted the fewest tokens steps next.
    The requests ignore EOS, so every arm emits the same total, and the arms move through
    the workload at the same pace: a slow spell of the machine, which lasts seconds, falls
    on all of them at the same point of it, at every batch size (a batch of 64 takes
    seconds, so taking turns a batch at a time left one arm to each spell). An arm's speed
    is its tokens over its steps' seconds less their prefill, as
    `GenerateStats.decode_throughput` counts it."""

    def __init__(self, arms: dict[str, tuple[Engine, object]], prompts: list[list[int]], params: list):
        self.arms = arms
        self.seqs = {label: [engine.add_request(ids, p) for ids, p in zip(prompts, params)]
                     for label, (engine, _) in arms.items()}
        self.seconds = dict.fromkeys(arms, 0.0)

    def emitted(self, label: str) -> int:
        return sum(len(s.output_ids) for s in self.seqs[label])

    def run(self) -> "SideBySide":
        try:
            while active := [label for label, (engine, _) in self.arms.items() if engine.scheduler.has_work()]:
                label = min(active, key=self.emitted)
                engine, spec = self.arms[label]
                prefill = engine.phase_seconds["prefill"]
                t0 = time.perf_counter()
                engine.step(spec)
                self.seconds[label] += time.perf_counter() - t0 - (engine.phase_seconds["prefill"] - prefill)
        finally:       # a failure must not leave requests holding pages
            for label, (engine, _) in self.arms.items():
                for s in self.seqs[label]:
                    engine.abort(s)
        return self

    def tok_s(self, label: str) -> float:
        return self.emitted(label) / self.seconds[label]

    def outputs(self, label: str) -> list[list[int]]:
        return [list(s.output_ids) for s in self.seqs[label]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default="gsm8k,mbpp,sharegpt")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--requests", type=int, default=16,
                    help="requests a run serves (at least one batch), cycling through the prompts")
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
        rows = [{**r, **ratios(r["runs"])} for r in read_rows(out / "cells.jsonl")]
        (out / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        write_table(rows, out / "cells.md", args)
        plot(rows, out / "cells.png", read_rows(args.before) if args.before else None)
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
            # The policy runs on the LLM's engine, whose learnt state carries from cell to
            # cell as a server's would; each fixed configuration on a twin of its own.
            engines = {spec_label(s): twin(llm) for s in fixed}
            engines["auto"] = llm.engine
        cfg = StudyConfig(workloads=(workload,), num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                          temperature=T, seed=0, batch_sizes=(B,), progress=False, mbpp_path=args.mbpp_path)
        n = max(args.requests, B)
        prompts = batch_prompts(load_prompts(cfg, llm)[workload], n)
        params = request_params(cfg, n)

        def side_by_side(specs: list) -> SideBySide:
            return SideBySide({spec_label(s): (engines[spec_label(s)], s) for s in specs}, prompts, params).run()

        # The sweep (each arm alone, once) picks the arms and is each engine's first look at
        # the cell, as the policy's untimed run is.
        sweep = {spec_label(s): side_by_side([s]).tok_s(spec_label(s)) for s in fixed}
        fastest = sorted((s for s in fixed if s is not None), key=lambda s: -sweep[spec_label(s)])[:args.top]
        arms = [None, *fastest, auto]
        reference = side_by_side([auto]).outputs("auto")
        tok_s = {spec_label(s): [] for s in arms}
        same, off, settled, bookkeeping, rounds = True, [], Counter(), [], Counter()
        for turn in range(args.repeats):
            log = ChoiceLog(policy)
            before = policy.decide_seconds
            with log:
                t = side_by_side(arms)
            for spec in arms:
                tok_s[spec_label(spec)].append(t.tok_s(spec_label(spec)))
                same &= t.outputs(spec_label(spec)) == reference
            label, share = log.off_settled(args.settle_after)
            if share is not None:
                off.append(share)
                settled[label] += 1
            rounds.update(log.choices)
            bookkeeping.append(1e3 * (policy.decide_seconds - before) / max(len(log.choices), 1))
        row = {"workload": workload, "batch": B, "temperature": T, "requests": n, **ratios(tok_s),
               "off_settled": statistics.median(off) if off else None,
               "settled": settled.most_common(1)[0][0] if settled else None,
               "bookkeeping_ms": statistics.median(bookkeeping), "same_tokens": same,
               "runs": tok_s,
               "rounds": dict(rounds.most_common()), "sweep": sweep}
        rows.append(row)
        with open(out / "cells.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.update(1)
        tqdm.write(f"{workload} b{B} T={T}: auto/best {row['auto_over_best']:.2f} ({row['best_fixed']}), auto/plain "
                   f"{row['auto_over_plain']:.2f}, off-settled {row['off_settled']}, "
                   f"{row['bookkeeping_ms']:.2f} ms/round, same {same}; {dict(rounds.most_common(3))}")
    bar.close()
    write_table(rows, out / "cells.md", args)
    plot(rows, out / "cells.png", read_rows(args.before) if args.before else None)


def ratios(tok_s: dict[str, list[float]]) -> dict:
    """A cell's summary from each arm's tok/s, turn by turn: the best fixed arm (highest
    median), auto over it and over plain decoding as the median of the turns' own ratios
    (the arms of a turn ran side by side, so a turn's ratio is free of the machine's
    slower and faster spells that move whole turns; the ratio of the medians beside it),
    and the run-to-run spread, (max - min) / median of an arm's runs, the median over the
    arms: a miss smaller than this says nothing about the policy."""
    median = {k: statistics.median(v) for k, v in tok_s.items()}
    best = max((k for k in median if k != "auto"), key=median.get)

    def paired(arm: str) -> float:
        return statistics.median(a / b for a, b in zip(tok_s["auto"], tok_s[arm]))
    return {"tok_s": median, "best_fixed": best, "auto_over_best": paired(best), "auto_over_plain": paired("none"),
            "medians_auto_over_best": median["auto"] / median[best],
            "medians_auto_over_plain": median["auto"] / median["none"],
            "spread": statistics.median((max(v) - min(v)) / statistics.median(v) for v in tok_s.values())}


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
    turns = " or ".join(str(n) for n in sorted({len(r["runs"]["auto"]) for r in rows}))
    lines = [f"CPU: {cpu_model_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
             f"{'compiled' if args.compile else 'eager'}; {args.max_tokens} tokens a request, "
             f"{args.requests} requests a run (at least a batch); ratios are medians of {turns} turns' "
             "own ratios.", "",
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
