"""Per configuration the policy ran in one study cell: the tokens a round and the round's
price (in plain decode steps) it predicted, against what its rounds did.

The cell as `scripts/policy_cells.py` runs it (one batch of held-out prompts, a sweep of
its fixed configurations first, which teaches the measured acceptance), then --repeats
times in turn plain decoding and `SpecConfig.auto()`. For each auto run, per
configuration: rounds, predicted and observed tokens a round (all requests), predicted
and observed price (the round's seconds over the plain run's seconds a step, so run-to-run
speed enters it), and their ratio, the speed over plain decoding; and the accept
calibration's sums (observed, predicted drafted tokens, per kind) before and after.

    python scripts/policy_rounds.py --workload sharegpt --batch-size 1 --temperature 0.7
        [--repeats 4] [--max-tokens 96] [--mbpp-path FILE]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np
from policy_cells import FIXED

from branchspec import LLM, SpecConfig
from branchspec.bench.study import StudyConfig, batch_prompts, load_prompts, request_params
from branchspec.config import spec_label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--mbpp-path", default=None)
    args = ap.parse_args()
    B, workload = args.batch_size, args.workload
    llm = LLM(max_batch_size=B, seed=0)
    auto = SpecConfig.auto()
    policy = llm.engine.policy(auto, progress=True)
    cfg = StudyConfig(workloads=(workload,), num_prompts=16, max_tokens=args.max_tokens,
                      temperature=args.temperature, seed=0, batch_sizes=(B,), progress=False,
                      mbpp_path=args.mbpp_path)
    prompts = batch_prompts(load_prompts(cfg, llm)[workload], B)
    params = request_params(cfg, B)
    sweep = {}
    for spec in FIXED:
        llm.generate(prompts, params, spec=spec, use_tqdm=False)
        sweep[spec_label(spec)] = llm.last_stats.decode_throughput
    print("sweep (tok/s):", {k: round(v, 1) for k, v in sorted(sweep.items(), key=lambda kv: -kv[1])[:4]})

    estimate: dict = {}                      # option -> (tokens a round, price) at the last decision
    values = policy._values

    def hooked_values(seq_ids, *rest):
        out = values(seq_ids, *rest)
        options, value = out[0], out[1]
        price = policy._tokens / len(seq_ids) / np.exp(value)     # what the decision priced, catch-up included
        estimate.update({o: (policy._tokens[i], price[i]) for i, o in enumerate(options)})
        return out
    policy._values = hooked_values
    rounds: list[tuple] = []
    observe = policy.observe

    def hooked_observe(batch, result):
        tokens, price = estimate.get(result.spec, (np.nan, np.nan))
        rounds.append((spec_label(result.spec), tokens, price, sum(result.path_len), result.seconds))
        observe(batch, result)
    policy.observe = hooked_observe

    def sums() -> dict:
        return {f"{'sampled' if k[0] else 'greedy'} {k[1]}": (round(a, 1), round(b, 1))
                for k, (a, b) in policy.accept_sums.items() if k[1] in ("chain", "tree")}
    for repeat in range(args.repeats):
        llm.generate(prompts, params, use_tqdm=False)
        plain = llm.last_stats.decode_throughput
        before = sums()
        rounds.clear()
        llm.generate(prompts, params, spec=auto, use_tqdm=False)
        speed = llm.last_stats.decode_throughput
        print(f"run {repeat}: plain {plain:.1f} tok/s, auto {speed:.1f} ({speed / plain:.2f}x); "
              f"calibration sums before {before}, after {sums()}")
        step = B / plain                     # seconds of a plain step in the plain run
        per = defaultdict(list)
        for row in rounds:
            per[row[0]].append(row)
        for label, rows in sorted(per.items(), key=lambda kv: -len(kv[1])):
            t_pred, p_pred = np.nanmean([r[1] for r in rows]), np.nanmean([r[2] for r in rows])
            t_obs, p_obs = np.mean([r[3] for r in rows]), np.mean([r[4] for r in rows]) / step
            print(f"    {label:28s} {len(rows):3d} rounds | tokens {t_pred:5.2f} predicted, {t_obs:5.2f} seen | "
                  f"price {p_pred:5.2f}, {p_obs:5.2f} | speed {t_pred / B / p_pred:5.2f}, {t_obs / B / p_obs:5.2f}")


if __name__ == "__main__":
    main()
