"""Which nodes a draft tree keeps: the chain, EAGLE-2 trees and calibrated trees at
matched budgets D, by accept length (tokens per verify round, bonus included).

Held-out GSM8K, MBPP and ShareGPT prompts, greedy and sampled, on the embedded model, in
one process. The calibrated selection learns from verified rounds; before the measured
runs it is warmed on train-split prompts of the same workload (never the measured ones),
as a serving engine would have learnt from its earlier requests. Prints a table per
mode, then one line of JSON.

    python scripts/bench_selection.py [--budgets 5,6,7,8] [--prompts 8] [--max-tokens 64]
        [--temperatures 0,0.7] [--shapes SxK,...] [--mbpp-path FILE]

--shapes runs both selections over the same shapes (each must be valid at every budget)
instead of the study's grid for EAGLE-2 and the grid plus the deep ones for the calibrated
selection, and adds a table of every shape's accept length under both.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.bench.grid import default_tree_shapes
from branchspec.data.workloads import load_workload

WORKLOADS = ("gsm8k", "mbpp", "sharegpt")


def calibrated_shapes(D: int) -> list[SpecConfig]:
    """The EAGLE-2 grid's shapes with the calibrated selection, and deep ones: as deep as
    the budget allows, two and three wide."""
    shapes = [(s.num_steps, s.topk) for s in default_tree_shapes(D)] + [(D - 1, 2), (D - 1, 3)]
    out = []
    for steps, topk in dict.fromkeys(shapes):
        try:
            out.append(SpecConfig(steps, topk, D, selection="calibrated"))
        except ValueError:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="5,6,7,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--shapes", default=None, help="SxK,... for both selections (default: see above)")
    ap.add_argument("--mbpp-path", default=None)
    args = ap.parse_args()
    budgets = [int(d) for d in args.budgets.split(",")]
    shapes = [tuple(int(v) for v in t.lower().split("x")) for t in args.shapes.split(",")] if args.shapes else None
    llm = LLM(max_batch_size=args.prompts, seed=0)

    def prompts(workload: str, split: str) -> list[list[int]]:
        ids = [llm.encode(ex.prompt_text()) for ex in load_workload(workload, split, mbpp_path=args.mbpp_path)]
        return [p for p in ids if len(p) <= 400][:args.prompts]

    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        mode = "greedy" if temperature == 0 else f"T={temperature:g}"
        for workload in WORKLOADS:
            measured, warm = prompts(workload, "eval"), prompts(workload, "train")
            params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
                      for i in range(len(measured))]
            for D in budgets:
                if shapes:
                    eagle = [SpecConfig(steps, topk, D) for steps, topk in shapes]
                    calibrated = [SpecConfig(steps, topk, D, selection="calibrated") for steps, topk in shapes]
                else:
                    eagle = [s.spec(D) for s in default_tree_shapes(D)]
                    calibrated = calibrated_shapes(D)
                for spec in calibrated:     # learn on other prompts first
                    llm.generate(warm, [SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                                       ignore_eos=True, seed=100 + i) for i in range(len(warm))],
                                 spec=spec)
                for kind, specs in (("chain", [SpecConfig.chain(D)]), ("eagle2", eagle), ("calibrated", calibrated)):
                    for spec in specs:
                        outs = llm.generate(measured, params, spec=spec)
                        rounds = sum(o.num_rounds for o in outs)
                        accept = sum(o.accept_length * o.num_rounds for o in outs) / rounds
                        rows.append({"mode": mode, "workload": workload, "D": D, "kind": kind,
                                     "shape": f"{spec.num_steps}x{spec.topk}", "accept_length": accept})
                print(f"{mode} {workload} D={D} done", flush=True)
    # The best shape of each kind per (mode, workload, D), as the paper reports trees.
    best: dict[tuple, dict] = {}
    for r in rows:
        key = (r["mode"], r["workload"], r["D"], r["kind"])
        if key not in best or r["accept_length"] > best[key]["accept_length"]:
            best[key] = r
    for mode in dict.fromkeys(r["mode"] for r in rows):
        print(f"\n{mode}: accept length (best shape) chain / EAGLE-2 / calibrated; calibrated vs chain, vs EAGLE-2")
        gains_chain, gains_eagle = [], []
        for workload in WORKLOADS:
            for D in budgets:
                c, e, k = (best[(mode, workload, D, kind)] for kind in ("chain", "eagle2", "calibrated"))
                gc, ge = k["accept_length"] / c["accept_length"] - 1, k["accept_length"] / e["accept_length"] - 1
                gains_chain.append(gc)
                gains_eagle.append(ge)
                print(f"  {workload:8} D={D}: {c['accept_length']:.3f} / {e['accept_length']:.3f} ({e['shape']}) / "
                      f"{k['accept_length']:.3f} ({k['shape']})   {100 * gc:+.1f}%  {100 * ge:+.1f}%")
        print(f"  mean: calibrated vs chain {100 * statistics.mean(gains_chain):+.1f}%, vs best EAGLE-2 "
              f"{100 * statistics.mean(gains_eagle):+.1f}%; cells below the chain: {sum(g < 0 for g in gains_chain)}")
    if shapes:
        accept = {(r["mode"], r["workload"], r["D"], r["kind"], r["shape"]): r["accept_length"] for r in rows}
        labels = [f"{steps}x{topk}" for steps, topk in shapes]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            print(f"\n{mode}: accept length by shape, EAGLE-2 / calibrated")
            for workload in WORKLOADS:
                for D in budgets:
                    cells = "  ".join(f"{lab} {accept[(mode, workload, D, 'eagle2', lab)]:.2f}/"
                                      f"{accept[(mode, workload, D, 'calibrated', lab)]:.2f}" for lab in labels)
                    print(f"  {workload:8} D={D}: {cells}")
    print(json.dumps({"threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "prompts": args.prompts,
                      "rows": rows}))


if __name__ == "__main__":
    main()
