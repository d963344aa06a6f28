"""Record a checkpoint's greedy outputs as a golden file for tests/test_default_model.py.

Run once, when a checkpoint is shipped; later changes to the model code (layouts, fast
paths, kernels) must then reproduce every token. Plain and tree-speculative outputs are
recorded separately, although greedy speculation is lossless, so a failure says which
path moved.

    python scripts/record_golden.py [--model DIR] --out tests/data/NAME.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from branchspec import LLM, SamplingParams, SpecConfig

PROMPTS = [
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
    "clips in May. How many clips did Natalia sell altogether in April and May?\nAnswer:",
    '"""\nWrite a function to find the minimum cost path.\n"""\n',
    "The history of the city begins",
]
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the embedded one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    llm = LLM(args.model)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate(PROMPTS, params)]
    tree = [o.token_ids for o in llm.generate(PROMPTS, params, spec=SpecConfig(3, 2, 6))]
    if tree != plain:
        raise SystemExit("tree speculation changed a greedy output; not recording a golden file")
    golden = {"prompts": PROMPTS, "chat": CHAT, "max_tokens": args.max_tokens, "plain": plain, "tree": tree,
              "chat_plain": llm.chat(CHAT, params)[0].token_ids}
    Path(args.out).write_text(json.dumps(golden) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
