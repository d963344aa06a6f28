"""Decode step time of the target model at batch 1 and 64 (random weights: timing only).

Each sequence holds a committed context of --context tokens (so C4 and C128 entries exist);
one step feeds one token per sequence through gather -> forward -> commit. Prints a table,
then one line of JSON.

    python scripts/bench_decode_step.py [--context 512] [--steps 20] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from branchspec.cache.paged import PagedState
from branchspec.config import tiny_config, v4_mini_config
from branchspec.model.metadata import chain_meta
from branchspec.model.weights import random_model


@torch.no_grad()
def step_times(cfg, batch: int, context: int, steps: int) -> list[float]:
    model = random_model(cfg, seed=0)
    cache = PagedState(cfg, max_seqs=batch, max_len=context + steps + 1, page_size=16)
    ids = list(range(batch))
    for sid in ids:
        cache.add(sid)
        cache.reserve(sid, context)
    # Fill the context with one batched prefill chunk.
    L = torch.zeros(batch, dtype=torch.long)
    meta = chain_meta(L, context, cfg.compressed_ratios)
    tokens = torch.randint(3, cfg.vocab_size, (batch, context))
    out = model(tokens, meta, cache.gather(ids, L))
    cache.commit(ids, meta, out.scratch, meta.valid)
    L = L + context
    times = []
    for _ in range(steps):
        for sid in ids:
            cache.reserve(sid, int(L[0]) + 1)
        t0 = time.perf_counter()
        meta = chain_meta(L, 1, cfg.compressed_ratios)
        out = model(torch.randint(3, cfg.vocab_size, (batch, 1)), meta, cache.gather(ids, L))
        cache.commit(ids, meta, out.scratch, meta.valid)
        times.append(time.perf_counter() - t0)
        L = L + 1
    return times[2:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name, cfg in (("tiny", tiny_config()), ("v4-mini", v4_mini_config())):
        for batch in (1, 64):
            t = step_times(cfg, batch, args.context, args.steps)
            rows.append({"model": name, "batch": batch, "context": args.context,
                         "median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t),
                         "tok_per_s": batch / statistics.median(t)})
    print(f"{'model':8} {'batch':>5} {'median ms':>10} {'min ms':>8} {'tok/s':>8}")
    for r in rows:
        print(f"{r['model']:8} {r['batch']:5d} {r['median_ms']:10.2f} {r['min_ms']:8.2f} {r['tok_per_s']:8.0f}")
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
