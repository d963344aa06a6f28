"""Packed products against plain ones, side by side in one process: two compiled LLMs on the
embedded model, one running its large weights' products through oneDNN on packed copies
(`layers.pack_products`, what an LLM does by default), the other through `F.linear` (MKL),
called in turn (configuration by configuration, repeat by repeat) so that both see the
same machine. Greedy, one GSM8K prompt repeated to the batch, 96 tokens. Prints medians,
their ranges and the phases, whether both gave the same tokens, then one line of JSON.

With --alone it instead times each distinct product of the fast path's model by itself,
eagerly: every weight shape it multiplies by (joined copies included), over 1, 8 and 32 rows,
`F.linear` against the packed operator, medians of many calls in turn.

    python scripts/bench_packed_products.py [--batch 1] [--repeats 5] [--min-elements N]
    python scripts/bench_packed_products.py --alone
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.model.layers import Linear, _WeightCopy, pack_products, packed_products
from branchspec.model.matmul import PACK_MIN_ELEMENTS, linear

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
          "clips in May. How many clips did Natalia sell altogether?\nAnswer:")
SPECS = {"plain": None, "tree 3x2 D=6": SpecConfig(3, 2, 6), "tree 4x2 D=8": SpecConfig(4, 2, 8)}


def product_shapes(model: torch.nn.Module) -> dict[tuple[int, int], list[str]]:
    """Every [out, in] matrix the model multiplies by at inference -> the products using it."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, m in model.named_modules():
        if isinstance(m, Linear):
            shapes.setdefault(tuple(m.weight.shape), []).append(name)
        for attr, value in vars(m).items():
            if isinstance(value, _WeightCopy):
                shapes.setdefault(tuple(value.joined().shape), []).append(f"{name}.{attr}")
    return shapes


def time_alone(calls: int = 200) -> None:
    """Each distinct product by itself, F.linear (MKL) against packed (oneDNN), eagerly."""
    model = LLM(seed=0, compile=True).model    # the fast path's model: the dense expert dispatch
    print(f"torch threads {torch.get_num_threads()}; µs per product, medians of {calls} calls in turn")
    print(f"{'[out, in]':>13} {'rows':>4} {'F.linear':>9} {'packed':>8} {'ratio':>6}  e.g.")
    results = []
    with torch.inference_mode():
        for (out, inp), names in sorted(product_shapes(model).items(), key=lambda kv: -kv[0][0] * kv[0][1]):
            w = torch.randn(out, inp)
            for rows in (1, 8, 32):
                x = torch.randn(rows, inp)
                ways = {"F.linear": lambda: F.linear(x, w), "packed": lambda: linear(x, w, True)}
                times = {k: [] for k in ways}
                for f in ways.values():
                    f()
                for _ in range(calls):
                    for k, f in ways.items():
                        t0 = time.perf_counter()
                        f()
                        times[k].append(1e6 * (time.perf_counter() - t0))
                med = {k: statistics.median(v) for k, v in times.items()}
                results.append({"shape": [out, inp], "rows": rows, "us": med, "products": names})
                print(f"{str([out, inp]):>13} {rows:4} {med['F.linear']:9.1f} {med['packed']:8.1f} "
                      f"{med['F.linear'] / med['packed']:6.2f}  {names[0]} ({len(names)})", flush=True)
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "alone": results}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-elements", type=int, default=PACK_MIN_ELEMENTS,
                    help="pack weights with at least this many elements (0: every one)")
    ap.add_argument("--alone", action="store_true", help="time each distinct product by itself instead")
    args = ap.parse_args()
    if args.alone:
        time_alone()
        return
    llms = {"packed": LLM(seed=0, compile=True, max_batch_size=max(args.batch, 4)),
            "plain products": LLM(seed=0, compile=True, max_batch_size=max(args.batch, 4))}
    pack_products(llms["packed"].model, min_elements=args.min_elements)
    pack_products(llms["plain products"].model, on=False)
    print(f"{len(packed_products(llms['packed'].model))} products packed:",
          ", ".join(packed_products(llms["packed"].model)), flush=True)
    for llm in llms.values():
        for spec in SPECS.values():
            llm.warmup(spec, batch_sizes=(min(args.batch, 2),), sampling=("greedy",))
    params = SamplingParams(max_tokens=96, ignore_eos=True)
    runs = {(name, s): [] for name in llms for s in SPECS}
    tokens = {}
    for _ in range(args.repeats):
        for s, spec in SPECS.items():
            for name, llm in llms.items():
                outs = llm.generate([PROMPT] * args.batch, params, spec=spec)
                st = llm.last_stats
                runs[(name, s)].append({"ms": st.decode_seconds * 1e3 / st.num_steps, "tok_s": st.decode_throughput,
                                        "phases": {k: 1e3 * v / st.num_steps for k, v in st.phase_seconds.items()
                                                   if k != "prefill"}})
                tokens[(name, s)] = [o.token_ids for o in outs]
    rows = []
    print(f"batch {args.batch}: medians of {args.repeats} calls, the two LLMs in turn")
    print(f"{'configuration':14} {'products':15} {'ms':>7} {'(range)':>13} {'tok/s':>7} {'vs plain':>8}  phases (ms)")
    for s in SPECS:
        for name in llms:
            r = runs[(name, s)]
            row = {"config": s, "products": name, "ms": statistics.median(x["ms"] for x in r),
                   "ms_range": [min(x["ms"] for x in r), max(x["ms"] for x in r)],
                   "tok_s": statistics.median(x["tok_s"] for x in r),
                   "phases": {k: statistics.median(x["phases"].get(k, 0.0) for x in r) for k in r[0]["phases"]},
                   "same_tokens": tokens[(name, s)] == tokens[("packed", s)]}
            rows.append(row)
        for row in rows[-len(llms):]:
            plain = next(x for x in rows if x["config"] == "plain" and x["products"] == row["products"])
            row["speedup"] = row["tok_s"] / plain["tok_s"]
            phases = " ".join(f"{k} {v:.2f}" for k, v in row["phases"].items() if v >= 0.005)
            print(f"{s:14} {row['products']:15} {row['ms']:7.2f} {row['ms_range'][0]:6.2f}-{row['ms_range'][1]:<6.2f} "
                  f"{row['tok_s']:7.0f} {row['speedup']:7.2f}x  {phases}")
    print("same tokens on both:", all(r["same_tokens"] for r in rows))
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "batch": args.batch,
                      "min_elements": args.min_elements, "rows": rows}))


if __name__ == "__main__":
    main()
