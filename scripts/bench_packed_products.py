"""Packed products against plain ones, side by side in one process: two compiled LLMs on the
embedded model, one running its large weights' products through oneDNN on packed copies
(`layers.pack_products`, what an LLM does by default), the other through `F.linear` (MKL),
called in turn (configuration by configuration, repeat by repeat) so that both see the
same machine. Greedy, one GSM8K prompt repeated to the batch, 96 tokens. Prints medians,
their ranges and the phases, whether both gave the same tokens, then one line of JSON.

    python scripts/bench_packed_products.py [--batch 1] [--repeats 5] [--min-elements N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.model.layers import pack_products, packed_products
from branchspec.model.matmul import PACK_MIN_ELEMENTS

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
          "clips in May. How many clips did Natalia sell altogether?\nAnswer:")
SPECS = {"plain": None, "tree 3x2 D=6": SpecConfig(3, 2, 6), "tree 4x2 D=8": SpecConfig(4, 2, 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-elements", type=int, default=PACK_MIN_ELEMENTS,
                    help="pack weights with at least this many elements (0: every one)")
    args = ap.parse_args()
    llms = {"packed": LLM(seed=0, compile=True, max_batch_size=max(args.batch, 4)),
            "plain products": LLM(seed=0, compile=True, max_batch_size=max(args.batch, 4))}
    pack_products(llms["packed"].model, min_elements=args.min_elements)
    pack_products(llms["plain products"].model, on=False)
    print(f"{len(packed_products(llms['packed'].model))} products packed:",
          ", ".join(packed_products(llms["packed"].model)), flush=True)
    for llm in llms.values():
        for spec in SPECS.values():
            llm.warmup(spec, batch_sizes=(min(args.batch, 2),))
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
