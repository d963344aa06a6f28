"""The adaptive policy against plain decoding, side by side, on the fast path: the
embedded checkpoint compiled, held-out GSM8K prompts (one per request, cycling), greedy.

At each batch size, plain decoding and `SpecConfig.auto(candidates)` run in turn
--repeats times (after one untimed call of each); the table gives their median tok/s,
the ratio, and the rounds the policy ran. Every auto run's tokens must equal plain
decoding's. A compiled engine compiles every candidate's graphs before it can choose
among them, so by default the policy chooses among a compact set (--candidates small:
`fast_path_candidates(6)`, the D <= 6 part of what `--compile` gives the CLI's auto
policy; fast: all of `fast_path_candidates()`; default: every default candidate, on 2
CPU cores about 90 graphs per batch class, most of an hour cold). Prints a table, then
one line of JSON.

    python scripts/bench_auto.py [--batches 16,64] [--repeats 3] [--max-tokens 48] [--eager]
        [--candidates small|fast|default]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.config import fast_path_candidates
from branchspec.data.workloads import load_workload
from branchspec.execution.compiled_step import compilations

# What the policy chooses among (--candidates). small: plain decoding, two chains (D = 4
# and 6) and two calibrated trees at D = 6, a shallow and a deep one, as measured in
# docs/fast-path.md.
CANDIDATES = {"small": fast_path_candidates(6), "fast": fast_path_candidates(), "default": None}


def run(llm: LLM, prompts: list[str], params: SamplingParams, spec) -> tuple[float, list, dict]:
    outs = llm.generate(prompts, params, spec=spec)
    st = llm.last_stats
    return st.decode_throughput, [o.token_ids for o in outs], dict(st.spec_choices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--candidates", choices=tuple(CANDIDATES), default="small")
    ap.add_argument("--eager", action="store_true", help="the eager path instead of compiled steps")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    policy = SpecConfig.auto(CANDIDATES[args.candidates])
    llm = LLM(seed=0, max_batch_size=max(batches), compile=not args.eager)
    t0, graphs = time.perf_counter(), compilations()
    sizes = tuple(sorted({min(b, 2) for b in batches}))
    llm.warmup(None, batch_sizes=sizes)
    llm.warmup(policy, batch_sizes=sizes, sampling=("greedy",))
    warm = {"seconds": round(time.perf_counter() - t0, 1), "graphs": compilations() - graphs}
    print(f"warm-up: {warm['graphs']} graphs in {warm['seconds']} s", flush=True)
    pool = [e.prompt for e in load_workload("gsm8k", "eval")]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = [pool[i % len(pool)] for i in range(batch)]
        run(llm, prompts, params, None)
        run(llm, prompts, params, policy)
        plain, auto, same, choices = [], [], True, {}
        for _ in range(args.repeats):
            tok_s, reference, _ = run(llm, prompts, params, None)
            plain.append(tok_s)
            tok_s, tokens, picked = run(llm, prompts, params, policy)
            auto.append(tok_s)
            same &= tokens == reference
            for k, v in picked.items():
                choices[k] = choices.get(k, 0) + v
        row = {"batch": batch, "plain_tok_s": statistics.median(plain), "auto_tok_s": statistics.median(auto),
               "same_tokens": same, "rounds": choices}
        row["auto_over_plain"] = row["auto_tok_s"] / row["plain_tok_s"]
        rows.append(row)
        total = sum(choices.values())
        mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(choices.items(), key=lambda kv: -kv[1])[:3])
        print(f"batch {batch}: plain {row['plain_tok_s']:.0f} tok/s, auto {row['auto_tok_s']:.0f} tok/s, "
              f"auto / plain {row['auto_over_plain']:.2f}, same tokens {same}; rounds: {mix}", flush=True)
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "compiled": not args.eager, "candidates": args.candidates, "warmup": warm, "rows": rows}))


if __name__ == "__main__":
    main()
