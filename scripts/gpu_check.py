"""The engine on a CUDA device: equivalence first, then step times with and without CUDA graphs.

Checks, each printed as PASS or FAIL:
1. greedy tokens on cuda equal those on the CPU, in float64 (plain decoding, a 4x2 D=8
   tree, a D=8 chain; batch 1 and 4);
2. on cuda in float32, speculative decoding gives plain decoding's greedy tokens
   (eager, then compiled with CUDA graphs);
3. the compiled steps give eager's greedy tokens on cuda.

Then times, on the embedded v4-mini-v2 (float32), a plain decode step and a 4x2 D=8 tree
round at batch 1, 4, 16 and 64 on three paths: eager, compiled without CUDA graphs
(BRANCHSPEC_CUDA_GRAPHS=0) and compiled with them; prints one table, then one line of JSON.
Never needed to build or test the project: it exits with status 1 and a note where CUDA is
not available, and with status 2 when a check fails.

    python scripts/gpu_check.py [--device cuda:0] [--skip-timing]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from branchspec import LLM, SamplingParams, SpecConfig

PROMPTS = ["Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
           "clips in May. How many clips did Natalia sell altogether?\nAnswer:",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Write a short poem about the sea.",
           "The capital of France is"]
SPECS = (("plain", None), ("tree 4x2 D=8", SpecConfig(4, 2, 8)), ("chain D=8", SpecConfig.chain(8)))


def tokens(llm: LLM, batch: int, spec, max_tokens: int = 32) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS[:batch], params, spec=spec)]


def check(name: str, ok: bool, failures: list[str]) -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}", flush=True)
    if not ok:
        failures.append(name)


def equivalence(device: str) -> list[str]:
    failures: list[str] = []
    cpu64, gpu64 = LLM(dtype="float64", seed=0, max_batch_size=4), LLM(dtype="float64", seed=0, max_batch_size=4,
                                                                       device=device)
    for name, spec in SPECS:
        for batch in (1, 4):
            check(f"float64 {name} batch {batch}: cuda tokens == cpu tokens",
                  tokens(gpu64, batch, spec) == tokens(cpu64, batch, spec), failures)
    del cpu64, gpu64
    eager = LLM(seed=0, max_batch_size=4, device=device)
    fast = LLM(seed=0, max_batch_size=4, device=device, compile=True)
    for spec in (None, SPECS[1][1], SPECS[2][1]):
        fast.warmup(spec, batch_sizes=(1, 2))
    for batch in (1, 4):
        plain = tokens(eager, batch, None)
        for name, spec in SPECS:
            ref = tokens(eager, batch, spec)
            if spec is not None:
                check(f"float32 eager {name} batch {batch}: == plain decoding", ref == plain, failures)
            check(f"float32 compiled {name} batch {batch}: == eager", tokens(fast, batch, spec) == ref, failures)
    return failures


def round_ms(llm: LLM, batch: int, spec, repeats: int = 3) -> float:
    """Best decode time per step (plain) or per round (speculative), ms, over a few runs."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    llm.generate(prompts, params, spec=spec)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        llm.generate(prompts, params, spec=spec)
        st = llm.last_stats
        best = min(best, st.decode_seconds * 1e3 / st.num_steps)
    return best


def timing(device: str) -> list[dict]:
    rows = []
    paths = (("eager", False, None), ("compiled", True, "0"), ("compiled + CUDA graphs", True, "1"))
    for path, compiled, graphs in paths:
        if graphs is not None:
            os.environ["BRANCHSPEC_CUDA_GRAPHS"] = graphs
        llm = LLM(seed=0, max_batch_size=64, device=device, compile=compiled)
        t0 = time.perf_counter()
        for _, spec in SPECS[:2]:
            llm.warmup(spec, batch_sizes=(1, 2))
        warm = time.perf_counter() - t0
        for batch in (1, 4, 16, 64):
            for name, spec in SPECS[:2]:
                rows.append({"path": path, "config": name, "batch": batch, "ms": round_ms(llm, batch, spec),
                             "warmup_s": warm})
                print(f"{path:24} {name:14} batch {batch:3d}: {rows[-1]['ms']:8.2f} ms", flush=True)
        del llm
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here; nothing to check", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False     # float32 means float32
    print(f"device: {torch.cuda.get_device_name(torch.device(args.device))}, torch {torch.__version__}")
    failures = equivalence(args.device)
    rows = [] if args.skip_timing else timing(args.device)
    if rows:
        print(f"\n{'path':24} {'config':14} " + " ".join(f"{'b' + str(b):>9}" for b in (1, 4, 16, 64)))
        for path in dict.fromkeys(r["path"] for r in rows):
            for name in dict.fromkeys(r["config"] for r in rows):
                cells = [r["ms"] for r in rows if r["path"] == path and r["config"] == name]
                print(f"{path:24} {name:14} " + " ".join(f"{ms:7.2f}ms" for ms in cells))
    print(json.dumps({"device": torch.cuda.get_device_name(torch.device(args.device)), "failures": failures,
                      "rows": rows}))
    return 2 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
