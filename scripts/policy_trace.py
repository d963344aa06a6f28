"""The adaptive policy run again and again on one study cell: what it chose each time, and
the state of its round prices after each run.

One engine, as in `branchspec bench --policies fixed,auto`: a few calibrated fixed runs
first (the study's sweep teaches the measured acceptance the same way), then --repeats
times in turn plain decoding and `SpecConfig.auto()`, printing both throughputs, the
rounds the policy gave each configuration, the noise of one round's measured price, the
candidates measured at this batch (rounds each) and the policy's top three estimates
(speed over plain decoding) at its last decision.

    python scripts/policy_trace.py --workload sharegpt --batch-size 1 [--temperature 0]
        [--seed 0] [--repeats 8] [--max-tokens 64] [--num-prompts 16] [--mbpp-path FILE]
"""

from __future__ import annotations

import argparse

from study_cell import add_cell_arguments, cell

from branchspec import SpecConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cell_arguments(ap, workload="sharegpt", temperature=0.0)
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    B = args.batch_size
    llm, batch, params = cell(args)
    auto = SpecConfig.auto(max_draft_tokens=8)
    policy = llm.engine.policy(auto, progress=True)
    for D in (5, 6, 7, 8):
        for steps in (3, D - 1):
            llm.generate(batch, params, spec=SpecConfig(steps, 2, D, selection="calibrated"))
    costs = policy.costs
    bucket = costs.bucket(B)
    for repeat in range(args.repeats):
        llm.generate(batch, params)
        plain = llm.last_stats.decode_throughput
        llm.generate(batch, params, spec=auto)
        st = llm.last_stats
        rounds = ", ".join(f"{k} {v}" for k, v in sorted(st.spec_choices.items(), key=lambda kv: -kv[1])[:3])
        print(f"run {repeat}: plain {plain:.1f} tok/s, auto {st.decode_throughput:.1f} "
              f"({st.decode_throughput / plain:.2f}x; {rounds})")
        labels = [label for label, bucket_ in costs.corrections if bucket_ == bucket]
        measured = ", ".join(f"{label} {len(costs.corrections[(label, bucket)])}" for label in labels[:4])
        top = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(policy.last_estimate.items(), key=lambda kv: -kv[1])[:3])
        print(f"    round noise {costs.round_noise(B):.3f} (log); candidates measured: {len(labels)} "
              f"({measured}{', ...' if len(labels) > 4 else ''}); estimates over plain decoding: {top}")


if __name__ == "__main__":
    main()
