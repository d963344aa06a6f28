"""Decode step time of the target model at batch 1 and 64 (random weights: timing only),
against its floor: the same step's matmuls alone, with the same weights, in the same run.

Each sequence holds a committed context of --context tokens (so C4 and C128 entries exist);
one step feeds one token per sequence through gather -> forward -> commit. With --compile
the compiled fast path is timed too (it compiles first: about a minute per model). Prints a
table, then one line of JSON.

    python scripts/bench_decode_step.py [--context 512] [--steps 20] [--threads N] [--compile] [--models tiny,v4-mini,v4-mini-v2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from branchspec.cache.paged import PagedState
from branchspec.config import tiny_config, v4_mini_config, v4_mini_v2_config
from branchspec.execution import expert_dispatch, make_executor
from branchspec.execution.threads import one_row_products
from branchspec.model.init import random_model
from branchspec.model.layers import Experts, pack_products
from branchspec.model.matmul import linear
from branchspec.model.metadata import chain_meta

PRESETS = {"tiny": tiny_config, "v4-mini": v4_mini_config, "v4-mini-v2": v4_mini_v2_config}


@torch.no_grad()
def step_times(model, batch: int, context: int, steps: int, compiled: bool = False) -> list[float]:
    """One plain decode step (read state -> forward -> commit) through the engine's
    executor, eager or compiled, over `context` committed tokens per sequence."""
    cfg = model.cfg
    cache = PagedState(cfg, max_seqs=batch, max_len=context + steps + 4, page_size=16)
    executor = make_executor(model, cache, compiled)
    ids = list(range(batch))
    for sid in ids:
        cache.add(sid)
        cache.reserve(sid, context)
    # Fill the context with one batched prefill chunk (eager).
    L = torch.zeros(batch, dtype=torch.long)
    meta = chain_meta(L, context, cfg.compressed_kinds)
    tokens = torch.randint(3, cfg.vocab_size, (batch, context))
    out = executor.prefill(tokens, meta, ids, L)
    cache.commit(ids, meta, out.scratch, meta.valid)
    L = L + context
    times = []
    for _ in range(steps + 3):
        for sid in ids:
            cache.reserve(sid, int(L[0]) + 1)
        t0 = time.perf_counter()
        executor.decode(torch.randint(3, cfg.vocab_size, (batch, 1)), ids, L)   # fed and committed
        times.append(time.perf_counter() - t0)
        L = L + 1
    return times[3:]


@torch.no_grad()
def floor_times(model, batch: int, steps: int) -> list[float]:
    """The step's matmuls alone: every target Linear (and the LM head) applied once to a
    [batch, in_features] input, back to back, each through the product the model runs it
    with (packed where the model packs it, `layers.pack_products`)."""
    products = [(m.weight, getattr(m, "packed", False)) for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and not name.startswith("mtp")]
    # MoE: each token runs num_experts_per_tok routed experts (counted as the first k).
    for name, m in model.named_modules():
        if isinstance(m, Experts) and not name.startswith("mtp"):
            for e in range(model.cfg.num_experts_per_tok):
                products += [(m.w1[e], False), (m.w3[e], False), (m.w2[e], False)]
    inputs = [torch.randn(batch, w.shape[1], dtype=w.dtype) for w, _ in products]
    times = []
    with one_row_products(batch):     # MKL's threads as a plain step at this batch uses them
        for _ in range(steps + 3):
            t0 = time.perf_counter()
            for x, (w, packed) in zip(inputs, products):
                linear(x, w, packed)
            times.append(time.perf_counter() - t0)
    return times[3:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="also time the compiled fast path")
    ap.add_argument("--models", default="tiny,v4-mini,v4-mini-v2",
                    help="comma-separated presets among " + ", ".join(PRESETS))
    args = ap.parse_args()
    unknown = [m for m in args.models.split(",") if m not in PRESETS]
    if unknown:
        ap.error(f"unknown model preset(s) {unknown}; choose from {list(PRESETS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = ("eager", "compiled") if args.compile else ("eager",)
    rows = []
    for name in args.models.split(","):
        cfg = PRESETS[name]()
        models = {path: random_model(cfg, seed=0, expert_dispatch=expert_dispatch(path == "compiled"))
                  for path in paths}    # the same weights; MoE dispatch as each path runs it
        for m in models.values():
            pack_products(m)            # as an LLM runs them
        for batch in (1, 64):
            floor = statistics.median(floor_times(models["eager"], batch, args.steps))
            for path in paths:
                t = statistics.median(step_times(models[path], batch, args.context, args.steps, path == "compiled"))
                rows.append({"model": name, "path": path, "batch": batch, "context": args.context,
                             "median_ms": 1e3 * t, "floor_ms": 1e3 * floor, "x_floor": t / floor,
                             "tok_per_s": batch / t})
    print(f"{'model':10} {'path':9} {'batch':>5} {'median ms':>10} {'floor ms':>9} {'x floor':>8} {'tok/s':>8}")
    for r in rows:
        print(f"{r['model']:10} {r['path']:9} {r['batch']:5d} {r['median_ms']:10.2f} {r['floor_ms']:9.2f} "
              f"{r['x_floor']:8.1f} {r['tok_per_s']:8.0f}")
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
