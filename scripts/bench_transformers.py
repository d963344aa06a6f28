"""branchspec against transformers' own `generate` on the same weights: the embedded
checkpoint exported with `branchspec convert --to hf`, loaded as `DeepseekV4ForCausalLM`
(float32, eager attention), greedy, batch 1, one GSM8K prompt; then branchspec's eager and
compiled plain decoding and compiled trees, in the same process. Reports decode tokens per
second (prefill excluded where each tool can say so: transformers' time is for the whole
`generate`, so its figure is slightly pessimistic for it, by one prompt forward) and
whether each path's tokens equal transformers' greedy tokens. Prints a table, then one
line of JSON.

    python scripts/bench_transformers.py [--max-tokens 96] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.checkpoint.convert import export_hf_folder
from branchspec.llm import DEFAULT_CHECKPOINT

PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
          "clips in May. How many clips did Natalia sell altogether?\nAnswer:")
SPECS = (("plain", None), ("tree 3x2 D=6", SpecConfig(3, 2, 6)), ("tree 4x2 D=8", SpecConfig(4, 2, 8)))


def transformers_tok_s(folder: str, ids: list[int], max_tokens: int, repeats: int) -> tuple[float, list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    x = torch.tensor([ids])
    # No stop token, as branchspec's ignore_eos: EOS may be generated and decoding goes on
    # (min_new_tokens would instead forbid EOS, and change the tokens).
    model.generation_config.eos_token_id = None
    kw = dict(max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(x))
    best, tokens = None, []
    with torch.no_grad():
        model.generate(x, **kw)
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model.generate(x, **kw)
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
            tokens = out[0, len(ids):].tolist()
    return max_tokens / best, tokens


def branchspec_tok_s(llm: LLM, ids: list[int], max_tokens: int, repeats: int, spec) -> tuple[float, list[int]]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate([ids], params, spec=spec)
    best, tokens = 0.0, []
    for _ in range(repeats):
        out = llm.generate([ids], params, spec=spec)[0]
        best, tokens = max(best, llm.last_stats.decode_throughput), out.token_ids
    return best, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    eager, fast = LLM(seed=0), LLM(seed=0, compile=True)
    ids = fast.encode(PROMPT)
    for _, spec in SPECS:
        fast.warmup(spec, batch_sizes=(1,))
    with tempfile.TemporaryDirectory() as tmp:
        folder = export_hf_folder(DEFAULT_CHECKPOINT, Path(tmp) / "hf")
        hf, hf_tokens = transformers_tok_s(str(folder), ids, args.max_tokens, args.repeats)
    rows = [{"path": "transformers generate", "tok_s": hf, "vs_transformers": 1.0, "same_tokens": True}]
    for path, llm in (("branchspec eager", eager), ("branchspec compiled", fast)):
        for name, spec in SPECS:
            if path.endswith("eager") and spec is not None:
                continue
            tok_s, tokens = branchspec_tok_s(llm, ids, args.max_tokens, args.repeats, spec)
            first = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), None)
            rows.append({"path": f"{path} {name}", "tok_s": tok_s, "vs_transformers": tok_s / hf,
                         "same_tokens": tokens == hf_tokens, "first_difference": first})
    print(f"{'path':36} {'tok/s':>8} {'vs transformers':>16}  same tokens as transformers")
    for r in rows:
        print(f"{r['path']:36} {r['tok_s']:8.1f} {r['vs_transformers']:15.2f}x  {r['same_tokens']}")
    print(json.dumps({"threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
