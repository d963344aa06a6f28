"""Choosing the reduced draft vocabulary's size: accept length against drafting time.

For each size (a prefix of one frequency ranking, `branchspec draft-vocab --size BIG --out
RANKING`; a map's tokens are most frequent first) and the full vocabulary, runs held-out
GSM8K, MBPP and ShareGPT prompts greedily at batch 1 with a chain and a tree, side by side
in one process on one (compiled or eager) LLM, and reports the mean accept length, the
draft phase's milliseconds per round and decode throughput. Prints a table, then one line
of JSON.

    python scripts/bench_draft_vocab.py --ranking RANKING [--sizes 512,1024,2048] [--compile]
        [--prompts 8] [--max-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.data.workloads import load_workload
from branchspec.speculative.draft_vocab import DraftVocab
from branchspec.speculative.drafter import MTPDrafter

SPECS = (("chain D=6", SpecConfig.chain(6)), ("tree 3x2 D=6", SpecConfig(3, 2, 6)), ("tree 4x2 D=8", SpecConfig(4, 2, 8)))


def use_vocab(llm: LLM, vocab: DraftVocab | None) -> None:
    """Swap the engine's drafter for one drafting over `vocab` (same model, cache, executor)."""
    engine = llm.engine
    old = engine.drafter
    engine.drafter = MTPDrafter(llm.model, engine.cache, engine.executor, old.chunk, vocab)
    engine.runner.drafter = engine.drafter
    engine.runner.speculative.drafter = engine.drafter
    engine._policies.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranking", required=True, help="a draft_vocab.safetensors with at least the largest size")
    ap.add_argument("--sizes", default="512,1024,2048")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the sizes, alternating")
    ap.add_argument("--mbpp-path", default=None)
    args = ap.parse_args()
    llm = LLM(compile=args.compile, max_batch_size=1, speculative_token_map=False)
    ranking = DraftVocab.load(args.ranking, llm.config.vocab_size)
    sizes = [int(s) for s in args.sizes.split(",")]
    vocabs = {n: DraftVocab(ranking.token_ids[:n]) for n in sizes} | {llm.config.vocab_size: None}
    prompts = []
    for w in ("gsm8k", "mbpp", "sharegpt"):
        ids = [llm.encode(ex.prompt_text()) for ex in load_workload(w, "eval", mbpp_path=args.mbpp_path)]
        prompts += [p for p in ids if len(p) <= 400][:args.prompts]     # prompts that fit beside the output
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    if args.compile:
        for _, spec in SPECS:
            llm.warmup(spec, batch_sizes=(1,), sampling=("greedy",))
    results: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.repeats):
        for n, vocab in vocabs.items():
            use_vocab(llm, vocab)
            for label, spec in SPECS:
                rounds = accepted = tokens = 0
                draft = decode = 0.0
                for p in prompts:
                    out = llm.generate([p], params, spec=spec)[0]
                    st = llm.last_stats
                    rounds += st.num_rounds
                    accepted += out.accept_length * st.num_rounds
                    draft += st.phase_seconds.get("draft", 0.0)
                    decode += st.decode_seconds
                    tokens += st.num_generated
                results.setdefault((n, label), []).append(
                    {"accept_length": accepted / rounds, "draft_ms_per_round": 1e3 * draft / rounds,
                     "tok_s": tokens / decode})
    rows = []
    print(f"{'size':>6} {'config':14} {'accept':>7} {'draft ms/round':>15} {'tok/s':>7}")
    for (n, label), runs in results.items():
        row = {"size": n, "config": label, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
        rows.append(row)
        print(f"{n:6d} {label:14} {row['accept_length']:7.3f} {row['draft_ms_per_round']:15.2f} {row['tok_s']:7.1f}")
    print(json.dumps({"compile": args.compile, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
