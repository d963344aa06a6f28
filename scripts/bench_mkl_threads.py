"""MKL on one thread against all threads for plain decode steps, side by side in one process
(`execution/threads.py`): one compiled LLM on the embedded model, its plain decoding at each
batch size run with MKL's products on one thread and on every thread in turn (call by call),
and the speculative configurations at batch 1 beside them, so that their speedups can be
read against the faster plain step. Greedy, one GSM8K prompt repeated to the batch, 96
tokens. Prints medians and ranges, whether the tokens agree, then one line of JSON.

    python scripts/bench_mkl_threads.py [--batches 1,2,4] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.execution import threads

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
          "clips in May. How many clips did Natalia sell altogether?\nAnswer:")
TREES = {"tree 3x2 D=6": SpecConfig(3, 2, 6), "tree 4x2 D=8": SpecConfig(4, 2, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not threads.mkl_local_threads_available():
        raise SystemExit("this torch has no MKL thread-local setting: nothing to compare")
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(seed=0, compile=True, max_batch_size=max(batches + [4]))
    for b in sorted({min(b, 2) for b in batches}):
        llm.warmup(None, batch_sizes=(b,))
    for spec in TREES.values():
        llm.warmup(spec, batch_sizes=(1,), sampling=("greedy",))
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    # (label, batch, MKL's one-thread bound: 0 never, the batch size: this step)
    cells = [(f"plain, MKL {'one thread' if one else 'all threads'}", b, b if one else 0)
             for b in batches for one in (True, False)]
    cells += [(name, 1, threads.ONE_THREAD_MAX_ROWS) for name in TREES]
    runs = {c: [] for c in cells}
    tokens = {}
    bound = threads.ONE_THREAD_MAX_ROWS
    try:
        for r in range(args.repeats + 1):     # the first call of each is untimed
            for cell in cells:
                label, b, threads.ONE_THREAD_MAX_ROWS = cell
                outs = llm.generate([PROMPT] * b, params, spec=TREES.get(label))
                st = llm.last_stats
                if r:
                    runs[cell].append((st.decode_seconds * 1e3 / st.num_steps, st.decode_throughput))
                tokens[cell] = [o.token_ids for o in outs]
    finally:
        threads.ONE_THREAD_MAX_ROWS = bound
    rows = []
    print(f"medians of {args.repeats} calls, in turn")
    print(f"{'configuration':28} {'batch':>5} {'ms/step':>8} {'(range)':>13} {'tok/s':>7}")
    for cell in cells:
        label, b, _ = cell
        ms = [x[0] for x in runs[cell]]
        row = {"config": label, "batch": b, "ms": statistics.median(ms), "ms_range": [min(ms), max(ms)],
               "tok_s": statistics.median(x[1] for x in runs[cell])}
        rows.append(row)
        print(f"{label:28} {b:5} {row['ms']:8.2f} {min(ms):6.2f}-{max(ms):<6.2f} {row['tok_s']:7.0f}")
    by = {(r["config"], r["batch"]): r for r in rows}
    for b in batches:
        one, every = by[("plain, MKL one thread", b)], by[("plain, MKL all threads", b)]
        print(f"batch {b}: one thread / all threads, step time {one['ms'] / every['ms']:.3f}")
    for name in TREES:
        t = by[(name, 1)]["tok_s"]
        print(f"{name}: {t / by[('plain, MKL one thread', 1)]['tok_s']:.2f}x plain with MKL on one thread, "
              f"{t / by[('plain, MKL all threads', 1)]['tok_s']:.2f}x with all threads")
    reference = {b: tokens[("plain, MKL all threads", b, 0)] for b in batches}
    same = all(tokens[c] == reference[c[1]] for c in cells if c[0].startswith("plain"))
    if 1 in batches:     # the trees run at batch 1: greedy, so the same tokens as plain decoding
        same &= all(tokens[c] == reference[1] for c in cells if c[0] in TREES)
    print("same tokens everywhere:", same)
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "rows": rows, "same_tokens": same}))


if __name__ == "__main__":
    main()
