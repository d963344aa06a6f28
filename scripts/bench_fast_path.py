"""Eager against compiled, side by side in one run: the embedded checkpoint,
plain decoding, a D=8 chain and a 4x2 D=8 tree, at batch 1, 4, 16 and 64, with each
speculative configuration's speedup over plain decoding on the same path.

Warms the compiled LLM first (and reports how long that took and how many graphs it
compiled), then times each configuration on both paths (best of two calls, after one
untimed call) and checks that they produce the same tokens. Prints a table, then one line
of JSON.

    python scripts/bench_fast_path.py [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.execution.compiled import compilations

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
          "clips in May. How many clips did Natalia sell altogether?\nAnswer:")
SPECS = (("plain", None), ("chain D=8", SpecConfig.chain(8)), ("tree 4x2 D=8", SpecConfig(4, 2, 8)))


def timed(llm: LLM, prompts: list[str], params: SamplingParams, spec) -> tuple[float, float, list]:
    llm.generate(prompts, params, spec=spec)
    best = None
    for _ in range(2):
        outs = llm.generate(prompts, params, spec=spec)
        st = llm.last_stats
        ms = st.decode_seconds * 1e3 / st.num_steps
        if best is None or ms < best[0]:
            best = (ms, st.decode_throughput, [o.token_ids for o in outs])
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fast = LLM(seed=0, max_batch_size=64, compile=True)
    t0, graphs = time.perf_counter(), compilations()
    for _, spec in SPECS:
        fast.warmup(spec, batch_sizes=(1,))
    warmup = {"seconds": time.perf_counter() - t0, "graphs": compilations() - graphs}
    eager = LLM(seed=0, max_batch_size=64)
    rows, graphs = [], compilations()
    for batch in (1, 4, 16, 64):
        params = SamplingParams(max_tokens=48 if batch <= 4 else 32, ignore_eos=True)
        plain = None
        for name, spec in SPECS:
            e, c = timed(eager, [PROMPT] * batch, params, spec), timed(fast, [PROMPT] * batch, params, spec)
            plain = plain or (e[1], c[1])
            rows.append({"config": name, "batch": batch, "eager_ms": e[0], "eager_tok_s": e[1],
                         "compiled_ms": c[0], "compiled_tok_s": c[1], "same_tokens": e[2] == c[2],
                         "eager_speedup": e[1] / plain[0], "compiled_speedup": c[1] / plain[1]})
    print(f"warm-up: {warmup['graphs']} graphs in {warmup['seconds']:.1f} s")
    print(f"{'config':14} {'batch':>5} {'eager ms':>9} {'tok/s':>7} {'vs plain':>8} {'compiled ms':>12} "
          f"{'tok/s':>7} {'vs plain':>8}  same tokens")
    for r in rows:
        print(f"{r['config']:14} {r['batch']:5d} {r['eager_ms']:9.2f} {r['eager_tok_s']:7.0f} "
              f"{r['eager_speedup']:7.2f}x {r['compiled_ms']:12.2f} {r['compiled_tok_s']:7.0f} "
              f"{r['compiled_speedup']:7.2f}x  {r['same_tokens']}")
    print(json.dumps({"threads": torch.get_num_threads(), "warmup": warmup,
                      "graphs_after_warmup": compilations() - graphs, "rows": rows}))


if __name__ == "__main__":
    main()
