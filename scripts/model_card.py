"""Model card numbers for a checkpoint: held-out perplexity and MTP top-1 agreement per
workload, the distinct 4-gram ratio of greedy 128-token continuations of held-out prompts
(1.0: no repeated 4-gram; a loop drives it towards 0), and greedy sample generations.
Writes Markdown.

    python scripts/model_card.py [--model DIR] [--out docs/model_card.md] [--windows 16] [--loop-prompts 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.data.workloads import load_workload
from branchspec.train.data import _stream, eval_documents, eval_windows
from branchspec.train.quality import loop_report
from branchspec.train.trainer import evaluate

WORKLOADS = ("gsm8k", "mbpp", "sharegpt")


def fitting_prompts(llm, workload: str, args) -> list[str]:
    """The first --loop-prompts held-out prompts of at most --max-prompt-tokens tokens (as
    the study takes them), so every continuation fits the context."""
    out = []
    for e in load_workload(workload, "eval", mbpp_path=args.mbpp_path):
        if len(llm.encode(e.prompt_text())) <= args.max_prompt_tokens:
            out.append(e.prompt_text())
            if len(out) == args.loop_prompts:
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="docs/model_card.md")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 512 tokens per workload")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--mbpp-path", default=None,
                    help="local mbpp.jsonl (default: $BRANCHSPEC_MBPP, else the Hugging Face hub)")
    ap.add_argument("--loop-prompts", type=int, default=32, help="held-out prompts per workload for the loop check")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts in the loop check")
    args = ap.parse_args()

    llm = LLM(args.model)
    tok = llm.tokenizer
    windows = {w: eval_windows(_stream(tok, eval_documents(w, args.mbpp_path), 2_000_000), 512, args.windows)
               for w in WORKLOADS}
    with torch.no_grad():
        report = evaluate(llm.model, windows)
    loops = {w: loop_report(llm, fitting_prompts(llm, w, args)) for w in WORKLOADS}
    lines = ["| workload | held-out tokens | perplexity | MTP loss | MTP top-1 = target greedy | "
             "distinct 4-grams (greedy 128) |",
             "|---|---:|---:|---:|---:|---:|"]
    for w in WORKLOADS:
        r = report[w]
        ratio = loops[w]["distinct_4gram_ratio"]
        lines.append(f"| {w} | {windows[w].numel()} | {r['ppl']:.1f} | {r['mtp_loss']:.3f} | "
                     f"{100 * r['mtp_top1_agreement']:.1f}% | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} ({loops[w]['scored']} prompts, "
                     f"{loops[w]['mean_tokens']:.0f} tokens on average) |")
    samples = ["", "## Greedy samples on held-out prompts", ""]
    params = SamplingParams(max_tokens=args.max_tokens)
    for w in WORKLOADS:
        examples = load_workload(w, "eval", mbpp_path=args.mbpp_path)[: args.samples]
        outs = llm.generate([e.prompt_text() for e in examples], params, spec=SpecConfig(3, 2, 6))
        for e, o in zip(examples, outs):
            prompt = e.prompt_text().strip()
            samples += [f"**{w}** (`{e.uid}`, accept length {o.accept_length:.2f})", "", "```text",
                        prompt[-400:], "--- model ---", o.text.strip(), "```", ""]
    text = "\n".join(lines + samples) + "\n"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    print(json.dumps({"held_out": report, "loops": loops}))


if __name__ == "__main__":
    main()
