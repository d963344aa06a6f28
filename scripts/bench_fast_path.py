"""Eager against compiled, side by side in one run: the embedded checkpoint on held-out
prompts of GSM8K and MBPP, plain decoding, a D=8 chain, 4x2 D=8 and 3x2 D=6 EAGLE-2 trees
and 4x2 and 5x2 D=8 calibrated trees, at batch 1, 4, 16 and 64, with each speculative
configuration's speedup over plain decoding on the same path, where a compiled round's
time goes (drafting, verifying, the rest), and the fast path's goals: a plain step
against its matmul floor, a D=8 tree round and its drafting against a plain step, the
best speculative configuration against plain decoding at batch 1 and 4.

Warms the compiled LLM first (and reports how long that took and how many graphs it
compiled). Then, for each batch size, every configuration runs the same calls in turn
(`--num-prompts` eval prompts of each workload, in batches of that size), `--repeats`
times after one untimed turn, and each is judged by its medians over the turns: one
prompt, or one configuration timed after another, reads the machine's and the prompt's
luck as speed. Checks that eager and compiled produce the same tokens. Prints a table
(per workload, and "all": both pooled), the goals, then one line of JSON; --plot FILE
also draws the speedups (PNG). MBPP comes from --mbpp-path (else $BRANCHSPEC_MBPP, else
the Hugging Face hub); where it is unavailable the run goes on with GSM8K alone.
--temperature T samples instead of decoding greedily, each prompt with a seed of its own
(the same in every turn and on both paths), so turns and paths draw the same tokens.

    python scripts/bench_fast_path.py [--threads N] [--repeats 3] [--batches 1,4,16,64] [--no-eager] [--plot FILE]
                                      [--dtype float32|bfloat16] [--num-prompts 4] [--mbpp-path FILE]
                                      [--temperature 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
import zlib
from collections import defaultdict

import torch
from bench_decode_step import floor_times

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.data.workloads import MbppUnavailable, load_workload
from branchspec.execution.compiled_step import compilations

SPECS = (("plain", None), ("chain D=8", SpecConfig.chain(8)), ("tree 4x2 D=8", SpecConfig(4, 2, 8)),
         ("tree 3x2 D=6", SpecConfig(3, 2, 6)),
         ("calibrated 4x2 D=8", SpecConfig(4, 2, 8, selection="calibrated")),
         ("calibrated 5x2 D=8", SpecConfig(5, 2, 8, selection="calibrated")))
WORKLOADS = ("gsm8k", "mbpp")
ALL = "all"


def eval_prompts(num_prompts: int, mbpp_path: str | None) -> dict[str, list[str]]:
    """The first `num_prompts` held-out prompts of each workload that is available."""
    prompts = {}
    for name in WORKLOADS:
        try:
            prompts[name] = [ex.prompt_text() for ex in load_workload(name, "eval", mbpp_path=mbpp_path)[:num_prompts]]
        except MbppUnavailable as exc:
            print(f"  {name} skipped: {exc}", flush=True)
    return prompts


def calls_of(prompts: list[str], batch: int) -> list[list[str]]:
    """The prompts in calls of `batch` (at least one call; prompts reused where too few)."""
    n = max(1, len(prompts) // batch)
    return [[prompts[(i * batch + j) % len(prompts)] for j in range(batch)] for i in range(n)]


def seed_of(prompt: str) -> int:
    """A prompt's own seed, the same in every process (Python's str hash is not)."""
    return zlib.crc32(prompt.encode())


def in_turn(llm: LLM, calls: dict[str, list[list[str]]], params: SamplingParams, specs,
            repeats: int) -> tuple[dict, dict]:
    """Every configuration of `specs` over the same calls (workload -> calls), one after
    the other, `repeats` turns after an untimed one. Returns, per (configuration, workload,
    or ALL for all pooled), the medians over the turns of ms per step, tok/s, accept length
    and ms per step in each phase; and per (configuration, workload, prompts) the tokens of
    the last turn."""
    turns = defaultdict(list)
    tokens = {}
    for turn in range(repeats + 1):
        for name, spec in specs:
            pooled = defaultdict(float)
            for workload, batches in calls.items():
                tally = defaultdict(float)
                for prompts in batches:
                    # A seed per prompt (sampled: the same draws in every turn and on either path).
                    seeded = [dataclasses.replace(params, seed=seed_of(p)) for p in prompts]
                    outs = llm.generate(prompts, seeded, spec=spec)
                    st = llm.last_stats
                    tally["seconds"] += st.decode_seconds
                    tally["tokens"] += st.num_generated
                    tally["steps"] += st.num_steps
                    tally["accepted"] += st.accept_length * st.num_steps
                    for phase, seconds in st.phase_seconds.items():
                        if phase != "prefill":
                            tally["phase " + phase] += seconds
                    tokens[(name, workload, tuple(prompts))] = [o.token_ids for o in outs]
                for k, v in tally.items():
                    pooled[k] += v
                if turn:
                    turns[(name, workload)].append(dict(tally))
            if turn:
                turns[(name, ALL)].append(dict(pooled))
    out = {}
    for key, runs in turns.items():
        med = lambda f: statistics.median(f(r) for r in runs)   # noqa: E731
        phases = {k.split(" ", 1)[1] for r in runs for k in r if k.startswith("phase ")}
        out[key] = {"ms": med(lambda r: 1e3 * r["seconds"] / r["steps"]),
                    "tok_s": med(lambda r: r["tokens"] / r["seconds"]),
                    "accept": med(lambda r: r["accepted"] / r["steps"]),
                    "phases": {p: med(lambda r, p=p: 1e3 * r.get("phase " + p, 0.0) / r["steps"]) for p in phases}}
    return out, tokens


def plot(rows: list[dict], path: str, temperature: float = 0.0) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    names = [n for n, s in SPECS if s is not None]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next(r["compiled_speedup"] for r in rows
                   if r["config"] == name and r["batch"] == b and r["workload"] == ALL) for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("speedup over compiled plain decoding")
    mode = "greedy" if temperature == 0 else f"temperature {temperature:g}"
    ax.set_title(f"Speculative decoding on the compiled fast path ({mode}, held-out prompts)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="timed turns (after one untimed), medians")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--num-prompts", type=int, default=4, help="held-out prompts of each workload (>= 1)")
    ap.add_argument("--mbpp-path", default=None, help="local mbpp.jsonl (default: $BRANCHSPEC_MBPP, else the hub)")
    ap.add_argument("--no-eager", action="store_true", help="time the compiled path only")
    ap.add_argument("--plot", default=None, help="write the speedups as a PNG here")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the compiled path's dtype; other than float32, compiled float32 plain decoding "
                         "is timed beside it as the plain configuration to beat")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above: sampled")
    args = ap.parse_args()
    if args.num_prompts < 1 or args.repeats < 1:
        ap.error(f"--num-prompts and --repeats must be at least 1, got {args.num_prompts} and {args.repeats}")
    if not args.temperature >= 0.0:
        ap.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if min(batches) < 1:
        ap.error(f"--batches must be positive integers, got {args.batches}")
    prompts = eval_prompts(args.num_prompts, args.mbpp_path)
    fast = LLM(seed=0, max_batch_size=max(batches), compile=True, dtype=args.dtype)
    # The fastest plain configuration: float32 plain, compiled, whatever dtype is benchmarked.
    fp32 = None if args.dtype == "float32" else LLM(seed=0, max_batch_size=max(batches), compile=True)
    t0, graphs = time.perf_counter(), compilations()
    sizes = tuple(sorted({min(b, 2) for b in batches}))
    mode = "sampled" if args.temperature > 0 else "greedy"
    for _, spec in SPECS:
        fast.warmup(spec, batch_sizes=sizes, sampling=(mode,))
    if fp32 is not None:
        fp32.warmup(None, batch_sizes=sizes)
    warmup = {"seconds": time.perf_counter() - t0, "graphs": compilations() - graphs}
    eager = None if args.no_eager else LLM(seed=0, max_batch_size=max(batches))
    rows, graphs = [], compilations()
    for batch in batches:
        params = SamplingParams(max_tokens=96 if batch <= 4 else 32, ignore_eos=True, temperature=args.temperature)
        calls = {w: calls_of(p, batch) for w, p in prompts.items()}
        c, c_tokens = in_turn(fast, calls, params, SPECS, args.repeats)
        e, e_tokens = in_turn(eager, calls, params, SPECS, args.repeats) if eager else (None, None)
        f, _ = in_turn(fp32, calls, params, (("plain float32", None),), args.repeats) if fp32 else (None, None)
        for workload in (*calls, ALL):
            plain = c[("plain", workload)]
            for name, _ in SPECS:
                m = c[(name, workload)]
                row = {"config": name, "batch": batch, "workload": workload, "compiled_ms": m["ms"],
                       "compiled_tok_s": m["tok_s"], "accept": m["accept"],
                       "compiled_speedup": m["tok_s"] / plain["tok_s"], "compiled_phases": m["phases"]}
                if e is not None:
                    em = e[(name, workload)]
                    same = all(e_tokens[k] == v for k, v in c_tokens.items()
                               if k[0] == name and (workload == ALL or k[1] == workload))
                    row.update(eager_ms=em["ms"], eager_tok_s=em["tok_s"],
                               eager_speedup=em["tok_s"] / e[("plain", workload)]["tok_s"], same_tokens=same)
                rows.append(row)
            if f is not None:
                m = f[("plain float32", workload)]
                rows.append({"config": "plain float32", "batch": batch, "workload": workload, "compiled_ms": m["ms"],
                             "compiled_tok_s": m["tok_s"], "accept": m["accept"],
                             "compiled_speedup": m["tok_s"] / plain["tok_s"], "compiled_phases": m["phases"]})
        for r in rows:
            if r["batch"] == batch and r["workload"] == ALL:
                print(f"  {r['config']} batch {batch}: compiled {r['compiled_ms']:.2f} ms, "
                      f"{r['compiled_tok_s']:.0f} tok/s ({r['compiled_speedup']:.2f}x)", flush=True)

    print(f"warm-up: {warmup['graphs']} graphs in {warmup['seconds']:.1f} s")
    print(f"{'config':18} {'batch':>5} {'workload':>8} {'accept':>6} {'eager ms':>9} {'tok/s':>7} {'vs plain':>8} "
          f"{'compiled ms':>12} {'tok/s':>7} {'vs plain':>8} {'draft':>6} {'verify':>6}  same tokens")
    for r in rows:
        ph = r["compiled_phases"]
        eager_cols = (f"{r['eager_ms']:9.2f} {r['eager_tok_s']:7.0f} {r['eager_speedup']:7.2f}x" if "eager_ms" in r
                      else f"{'-':>9} {'-':>7} {'-':>8}")
        print(f"{r['config']:18} {r['batch']:5d} {r['workload']:>8} {r['accept']:6.2f} {eager_cols} "
              f"{r['compiled_ms']:12.2f} {r['compiled_tok_s']:7.0f} {r['compiled_speedup']:7.2f}x "
              f"{ph.get('draft', 0):6.2f} {ph.get('verify', 0):6.2f}  {r.get('same_tokens', '-')}")

    def row(name: str, batch: int, workload: str = ALL) -> dict | None:
        return next((r for r in rows if r["config"] == name and r["batch"] == batch and r["workload"] == workload),
                    None)

    goals = {}
    if row("plain", 1):
        floor_ms = 1e3 * statistics.median(floor_times(fast.engine.model, 1, 50))
        plain1 = row("plain", 1)["compiled_ms"]
        tree = row("tree 4x2 D=8", 1)
        goals = {"plain step / floor, batch 1": plain1 / floor_ms,
                 "4x2 D=8 round / plain step, batch 1": tree["compiled_ms"] / plain1,
                 "drafting 4x2 / plain step, batch 1": tree["compiled_phases"]["draft"] / plain1}
        print(f"matmul floor at batch 1: {floor_ms:.2f} ms; compiled plain step {plain1:.2f} ms")
    for b in (1, 4):
        for workload in (ALL, *prompts):
            if not row("plain", b, workload):
                continue
            best = max((r for r in rows if r["batch"] == b and r["workload"] == workload
                        and r["config"].split()[0] != "plain"), key=lambda r: r["compiled_tok_s"])
            of = "" if workload == ALL else f", {workload}"
            goals[f"best speculative / plain, batch {b}{of}"] = best["compiled_speedup"]
            goals[f"best configuration, batch {b}{of}"] = best["config"]
            if row("plain float32", b, workload):
                fastest = max(row("plain", b, workload)["compiled_tok_s"], row("plain float32", b, workload)["compiled_tok_s"])
                goals[f"best speculative / fastest plain (either dtype), batch {b}{of}"] = best["compiled_tok_s"] / fastest
    for k, v in goals.items():
        print(f"goal: {k}: {v:.2f}x" if isinstance(v, float) else f"goal: {k}: {v}")
    if args.plot:
        plot(rows, args.plot, args.temperature)
    print(json.dumps({"dtype": args.dtype, "temperature": args.temperature, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                      "prompts": {w: len(p) for w, p in prompts.items()}, "repeats": args.repeats,
                      "warmup": warmup, "graphs_after_warmup": compilations() - graphs, "goals": goals,
                      "rows": rows}))


if __name__ == "__main__":
    main()
