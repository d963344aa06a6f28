"""Training throughput of a model preset on this machine: float32 and bfloat16 autocast,
eager and torch.compile, side by side in one run (random tokens; timing only).

Each mode builds a fresh model, runs --warmup untimed steps (compilation happens there),
then times --steps AdamW steps of --batch-size x --seq-len tokens. Prints a table and one
line of JSON.

    python scripts/bench_training.py [--model v4-mini-v2] [--steps 6] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from branchspec.model.init import random_model
from branchspec.train.losses import lm_losses
from branchspec.train.trainer import MODEL_PRESETS, bf16_is_fast


def tokens_per_second(preset: str, precision: str, compiled: bool, batch: int, seq_len: int,
                      warmup: int, steps: int) -> float:
    model = random_model(MODEL_PRESETS[preset](), seed=0, expert_dispatch="dense" if compiled else "grouped").train()
    if compiled:
        model.forward = torch.compile(model.forward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(warmup + steps):
        ids = torch.randint(3, model.cfg.vocab_size, (batch, seq_len), generator=g)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            main, nxt = lm_losses(model, ids)
        loss = main + 0.3 * nxt
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return batch * seq_len / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="v4-mini-v2", choices=sorted(MODEL_PRESETS))
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for precision in ("float32", "bfloat16"):
        for compiled in (False, True):
            tps = tokens_per_second(args.model, precision, compiled, args.batch_size, args.seq_len,
                                    args.warmup, args.steps)
            rows.append({"precision": precision, "compile": compiled, "tok_per_s": round(tps)})
            print(f"{precision:9} {'compile' if compiled else 'eager':8} {tps:8.0f} tok/s", flush=True)
    base = rows[0]["tok_per_s"]
    for r in rows:
        r["x_float32_eager"] = round(r["tok_per_s"] / base, 2)
    print(json.dumps({"model": args.model, "threads": torch.get_num_threads(), "cpu": platform.processor(),
                      "bf16_native": bf16_is_fast(), "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
