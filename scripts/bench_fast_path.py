"""Eager against compiled, side by side in one run: the embedded checkpoint, plain
decoding, a D=8 chain, a 4x2 D=8 tree and a 3x2 D=6 tree, at batch 1, 4, 16 and 64, with
each speculative configuration's speedup over plain decoding on the same path, where a
compiled round's time goes (drafting, verifying, the rest), and the fast path's goals:
a plain step against its matmul floor, a D=8 tree round and its drafting against a plain
step, the best speculative configuration against plain decoding at batch 1 and 4.

Warms the compiled LLM first (and reports how long that took and how many graphs it
compiled), then times each configuration on both paths (best of --repeats calls, after one
untimed call) and checks that they produce the same tokens. Prints a table, the goals,
then one line of JSON; --plot FILE also draws the speedups (PNG).

    python scripts/bench_fast_path.py [--threads N] [--repeats 2] [--batches 1,4,16,64] [--no-eager] [--plot FILE]
                                      [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from bench_decode_step import floor_times

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.execution.compiled import compilations

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
          "clips in May. How many clips did Natalia sell altogether?\nAnswer:")
SPECS = (("plain", None), ("chain D=8", SpecConfig.chain(8)), ("tree 4x2 D=8", SpecConfig(4, 2, 8)),
         ("tree 3x2 D=6", SpecConfig(3, 2, 6)))


def timed(llm: LLM, prompts: list[str], params: SamplingParams, spec, repeats: int) -> dict:
    """The fastest of `repeats` calls (after an untimed one): ms per step, tok/s, accept
    length, ms per step in each phase, and the tokens."""
    llm.generate(prompts, params, spec=spec)
    best = None
    for _ in range(repeats):
        outs = llm.generate(prompts, params, spec=spec)
        st = llm.last_stats
        ms = st.decode_seconds * 1e3 / st.num_steps
        if best is None or ms < best["ms"]:
            best = {"ms": ms, "tok_s": st.decode_throughput, "accept": st.accept_length,
                    "phases": {k: 1e3 * v / st.num_steps for k, v in st.phase_seconds.items() if k != "prefill"},
                    "tokens": [o.token_ids for o in outs]}
    return best


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    names = [n for n, s in SPECS if s is not None]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next(r["compiled_speedup"] for r in rows if r["config"] == name and r["batch"] == b) for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("speedup over compiled plain decoding")
    ax.set_title("Speculative decoding on the compiled fast path (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--no-eager", action="store_true", help="time the compiled path only")
    ap.add_argument("--plot", default=None, help="write the speedups as a PNG here")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the compiled path's dtype; other than float32, compiled float32 plain decoding "
                         "is timed beside it as the plain configuration to beat")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    fast = LLM(seed=0, max_batch_size=max(batches), compile=True, dtype=args.dtype)
    # The fastest plain configuration: float32 plain, compiled, whatever dtype is benchmarked.
    fp32 = None if args.dtype == "float32" else LLM(seed=0, max_batch_size=max(batches), compile=True)
    t0, graphs = time.perf_counter(), compilations()
    sizes = tuple(sorted({min(b, 2) for b in batches}))
    for _, spec in SPECS:
        fast.warmup(spec, batch_sizes=sizes)
    if fp32 is not None:
        fp32.warmup(None, batch_sizes=sizes)
    warmup = {"seconds": time.perf_counter() - t0, "graphs": compilations() - graphs}
    eager = None if args.no_eager else LLM(seed=0, max_batch_size=max(batches))
    rows, graphs = [], compilations()
    for batch in batches:
        params = SamplingParams(max_tokens=96 if batch <= 4 else 32, ignore_eos=True)
        plain = None
        for name, spec in SPECS:
            c = timed(fast, [PROMPT] * batch, params, spec, args.repeats)
            e = timed(eager, [PROMPT] * batch, params, spec, args.repeats) if eager else None
            plain = plain or (e, c)
            row = {"config": name, "batch": batch, "compiled_ms": c["ms"], "compiled_tok_s": c["tok_s"],
                   "accept": c["accept"], "compiled_speedup": c["tok_s"] / plain[1]["tok_s"],
                   "compiled_phases": c["phases"]}
            if e is not None:
                row.update(eager_ms=e["ms"], eager_tok_s=e["tok_s"], eager_speedup=e["tok_s"] / plain[0]["tok_s"],
                           same_tokens=e["tokens"] == c["tokens"])
            rows.append(row)
            print(f"  {name} batch {batch}: compiled {c['ms']:.2f} ms, {c['tok_s']:.0f} tok/s", flush=True)
        if fp32 is not None:
            c = timed(fp32, [PROMPT] * batch, params, None, args.repeats)
            rows.append({"config": "plain float32", "batch": batch, "compiled_ms": c["ms"],
                         "compiled_tok_s": c["tok_s"], "accept": c["accept"],
                         "compiled_speedup": c["tok_s"] / plain[1]["tok_s"], "compiled_phases": c["phases"]})
            print(f"  plain float32 batch {batch}: compiled {c['ms']:.2f} ms, {c['tok_s']:.0f} tok/s", flush=True)

    print(f"warm-up: {warmup['graphs']} graphs in {warmup['seconds']:.1f} s")
    print(f"{'config':14} {'batch':>5} {'accept':>6} {'eager ms':>9} {'tok/s':>7} {'vs plain':>8} "
          f"{'compiled ms':>12} {'tok/s':>7} {'vs plain':>8} {'draft':>6} {'verify':>6}  same tokens")
    for r in rows:
        ph = r["compiled_phases"]
        eager_cols = (f"{r['eager_ms']:9.2f} {r['eager_tok_s']:7.0f} {r['eager_speedup']:7.2f}x" if "eager_ms" in r
                      else f"{'-':>9} {'-':>7} {'-':>8}")
        print(f"{r['config']:14} {r['batch']:5d} {r['accept']:6.2f} {eager_cols} {r['compiled_ms']:12.2f} "
              f"{r['compiled_tok_s']:7.0f} {r['compiled_speedup']:7.2f}x {ph.get('draft', 0):6.2f} "
              f"{ph.get('verify', 0):6.2f}  {r.get('same_tokens', '-')}")

    def row(name: str, batch: int) -> dict | None:
        return next((r for r in rows if r["config"] == name and r["batch"] == batch), None)

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
        if row("plain", b):
            best = max((r for r in rows if r["batch"] == b and r["config"].split()[0] != "plain"),
                       key=lambda r: r["compiled_tok_s"])
            goals[f"best speculative / plain, batch {b}"] = best["compiled_speedup"]
            goals[f"best configuration, batch {b}"] = best["config"]
            if row("plain float32", b):
                fastest_plain = max(row("plain", b)["compiled_tok_s"], row("plain float32", b)["compiled_tok_s"])
                goals[f"best speculative / fastest plain (either dtype), batch {b}"] = best["compiled_tok_s"] / fastest_plain
    for k, v in goals.items():
        print(f"goal: {k}: {v:.2f}x" if isinstance(v, float) else f"goal: {k}: {v}")
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                      "warmup": warmup, "graphs_after_warmup": compilations() - graphs, "goals": goals,
                      "rows": rows}))


if __name__ == "__main__":
    main()
