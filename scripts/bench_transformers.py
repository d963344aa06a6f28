"""branchspec against transformers' own `generate` on the same weights: the embedded
checkpoint exported with `branchspec convert --to hf`, loaded as `DeepseekV4ForCausalLM`
(float32, eager attention), greedy, batch 1, one GSM8K prompt; then branchspec's eager and
compiled plain decoding and compiled trees, in the same process. Reports decode tokens per
second (prefill excluded where each tool can say so: transformers' time is for the whole
`generate`, so its figure is slightly pessimistic for it, by one prompt forward) and
whether each path's tokens equal transformers' greedy tokens. Every path runs in turn,
`--repeats` times after one untimed turn, and each is judged by its median (one path
timed after another would read the machine's slow and fast minutes as speed). Prints a
table, then one line of JSON.

    python scripts/bench_transformers.py [--max-tokens 96] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.checkpoint.convert import export_hf_folder
from branchspec.llm import DEFAULT_CHECKPOINT

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
          "clips in May. How many clips did Natalia sell altogether?\nAnswer:")
SPECS = (("plain", None), ("tree 3x2 D=6", SpecConfig(3, 2, 6)), ("tree 4x2 D=8", SpecConfig(4, 2, 8)))


def transformers_generate(folder: str, ids: list[int], max_tokens: int) -> Callable[[], tuple[float, list[int]]]:
    """transformers' model from `folder`, as a call that decodes `ids` greedily and returns
    (tokens per second, the tokens)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    x = torch.tensor([ids])
    # No stop token, as branchspec's ignore_eos: EOS may be generated and decoding goes on
    # (min_new_tokens would instead forbid EOS, and change the tokens).
    model.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(x))

    def run() -> tuple[float, list[int]]:
        with torch.no_grad():
            t0 = time.perf_counter()
            out = model.generate(x, **kw)
            return max_tokens / (time.perf_counter() - t0), out[0, len(ids):].tolist()
    return run


def branchspec_generate(llm: LLM, ids: list[int], max_tokens: int, spec) -> Callable[[], tuple[float, list[int]]]:
    """One branchspec path as a call returning (decode tokens per second, the tokens)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def run() -> tuple[float, list[int]]:
        out = llm.generate([ids], params, spec=spec)[0]
        return llm.last_stats.decode_throughput, out.token_ids
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="timed turns (after one untimed), medians")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.repeats < 1 or args.max_tokens < 1:
        ap.error(f"--repeats and --max-tokens must be at least 1, got {args.repeats} and {args.max_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    eager, fast = LLM(seed=0), LLM(seed=0, compile=True)
    ids = fast.encode(PROMPT)
    for _, spec in SPECS:
        fast.warmup(spec, batch_sizes=(1,), sampling=("greedy",))
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf_folder(DEFAULT_CHECKPOINT, Path(tmp) / "hf")
        paths = {"transformers generate": transformers_generate(str(folder), ids, args.max_tokens)}
        for path, llm in (("branchspec eager", eager), ("branchspec compiled", fast)):
            for name, spec in SPECS:
                if not (path.endswith("eager") and spec is not None):
                    paths[f"{path} {name}"] = branchspec_generate(llm, ids, args.max_tokens, spec)
        # Every path in turn, so that the machine's slow and fast minutes fall on all alike.
        speeds, tokens = defaultdict(list), {}
        for turn in range(args.repeats + 1):
            for path, run in paths.items():
                tok_s, tokens[path] = run()
                if turn:
                    speeds[path].append(tok_s)
    hf_tokens = tokens["transformers generate"]
    hf = statistics.median(speeds["transformers generate"])
    rows = []
    for path in paths:
        tok_s = statistics.median(speeds[path])
        first = next((i for i, (a, b) in enumerate(zip(tokens[path], hf_tokens)) if a != b), None)
        rows.append({"path": path, "tok_s": tok_s, "vs_transformers": tok_s / hf,
                     "same_tokens": tokens[path] == hf_tokens, "first_difference": first})
    print(f"{'path':36} {'tok/s':>8} {'vs transformers':>16}  same tokens as transformers")
    for r in rows:
        print(f"{r['path']:36} {r['tok_s']:8.1f} {r['vs_transformers']:15.2f}x  {r['same_tokens']}")
    print(json.dumps({"threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "rows": rows}))


if __name__ == "__main__":
    main()
