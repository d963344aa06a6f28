"""What the adaptive policy's bookkeeping costs a round over one study cell, and where it goes.

Runs `SpecConfig.auto()` over one batch of a workload's held-out prompts (one untimed run,
then --repeats timed ones) and prints one JSON line: the policy's own seconds (deciding and
observing, `LLM.last_stats.policy_seconds`) per round, the decode throughput and the rounds
run per configuration. With --parts it also times the policy's parts (a wrapper around
each method, so those numbers carry the wrapper's own cost) and prints them per call and
per round.

To compare two versions of the code, run it from each checkout in turn on one machine:

    PYTHONPATH=OLD python scripts/policy_bookkeeping.py --batch-size 16 --workload mbpp --tag old
    python scripts/policy_bookkeeping.py --batch-size 16 --workload mbpp --tag new [--parts]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter, defaultdict

from branchspec import LLM, SpecConfig
from branchspec.bench.study import StudyConfig, batch_prompts, load_prompts, request_params

PARTS = ("choose", "observe", "_decide", "_values", "expected_accept", "_worth_exploring", "_flush")


def time_parts(policy) -> tuple[dict[str, float], Counter]:
    """Wrap the policy's methods (those it has of PARTS) to add up their seconds and calls."""
    spent, calls = defaultdict(float), Counter()
    targets = [(policy, name, name) for name in PARTS if hasattr(policy, name)]
    targets.append((policy.acceptance, "acceptance", "acceptance.acceptance"))
    for obj, name, key in targets:
        method = getattr(obj, name)

        def timed(*args, _method=method, _key=key, **kwargs):
            t0 = time.perf_counter()
            out = _method(*args, **kwargs)
            spent[_key] += time.perf_counter() - t0
            calls[_key] += 1
            return out
        setattr(obj, name, timed)
    return spent, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--workload", default="gsm8k")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mbpp-path", default=None)
    ap.add_argument("--tag", default="", help="a name for this checkout in the output")
    ap.add_argument("--parts", action="store_true", help="also time the policy's parts")
    args = ap.parse_args()
    B = args.batch_size
    llm = LLM(max_batch_size=B, seed=0)
    auto = SpecConfig.auto()
    policy = llm.engine.policy(auto, progress=True)
    cfg = StudyConfig(workloads=(args.workload,), num_prompts=16, max_tokens=args.max_tokens,
                      temperature=args.temperature, seed=0, batch_sizes=(B,), progress=False,
                      mbpp_path=args.mbpp_path)
    prompts = batch_prompts(load_prompts(cfg, llm)[args.workload], B)
    params = request_params(cfg, B)
    llm.generate(prompts, params, spec=auto, use_tqdm=False)          # untimed: the policy's first look
    spent, calls = time_parts(policy) if args.parts else ({}, Counter())
    ms, tok_s, rounds, choices = [], [], 0, Counter()
    for _ in range(args.repeats):
        llm.generate(prompts, params, spec=auto, use_tqdm=False)
        stats = llm.last_stats
        n = sum(stats.spec_choices.values())
        rounds += n
        choices.update(stats.spec_choices)
        ms.append(1e3 * stats.policy_seconds / n)
        tok_s.append(stats.decode_throughput)
    print(json.dumps({"tag": args.tag, "batch": B, "workload": args.workload, "temperature": args.temperature,
                      "bookkeeping_ms": statistics.median(ms), "runs_ms": [round(x, 3) for x in ms],
                      "tok_s": statistics.median(tok_s), "rounds": dict(choices.most_common(4))}))
    for key in sorted(spent, key=lambda k: -spent[k]):
        print(f"  {key:24s} {calls[key]:5d} calls {1e3 * spent[key] / calls[key]:7.3f} ms a call "
              f"{1e3 * spent[key] / rounds:7.3f} ms a round")


if __name__ == "__main__":
    main()
