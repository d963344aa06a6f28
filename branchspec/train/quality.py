"""How a trained model's text looks: loops in its greedy continuations.

A model that has not learned enough repeats itself under greedy decoding ("the total
number of the total number of ..."). The distinct 4-gram ratio of a continuation (unique
4-grams of token ids / all 4-grams) is 1.0 for text that never repeats a 4-gram and falls
towards 0 in a loop.
"""

from __future__ import annotations

from statistics import fmean


def distinct_ngram_ratio(ids: list[int], n: int = 4) -> float | None:
    """Unique n-grams / n-grams of a token sequence; None when it has no n-gram."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return None
    return len(set(grams)) / len(grams)


def loop_report(llm, prompts: list[str], max_tokens: int = 128, n: int = 4) -> dict:
    """Greedy continuations of `prompts` (stopping at the model's end of turn or text) and
    their mean distinct n-gram ratio; continuations shorter than n tokens are left out."""
    from branchspec.config import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    ratios = [r for r in (distinct_ngram_ratio(o.token_ids, n) for o in outs) if r is not None]
    return {"prompts": len(prompts), "scored": len(ratios),
            "mean_tokens": fmean(len(o.token_ids) for o in outs) if outs else 0.0,
            f"distinct_{n}gram_ratio": fmean(ratios) if ratios else None}
