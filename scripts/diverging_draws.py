"""Where a speculative configuration's tokens differ from plain decoding's in a study cell,
and whether rounding explains it.

Reruns one cell of `branchspec bench` (the same prompts, batch and per-request seeds), plain
decoding and the configuration, and for each request whose tokens differ takes the first
differing token and recomputes its draw in float64 from the shared prefix: sampled, the
request's uniform u and its distance to the nearest boundary between two tokens'
cumulative probabilities; greedy, the gap between the two largest logits. It also shows
the token plain decoding draws there for that request alone (batch 1) and in float64. A
distance of the order of float32 rounding (about 1e-7 of the cumulative mass, 1e-5 of a
logit) with the paths disagreeing among themselves is rounding; a draw far from every
boundary that the paths disagree on is a bug.

    python scripts/diverging_draws.py --workload gsm8k --batch-size 16 --spec chain:5
        [--temperature 0.7] [--seed 0] [--max-tokens 64] [--num-prompts 16] [--mbpp-path FILE]

--spec is chain:D, SxK:D (an EAGLE-2 tree) or SxK:D:calibrated.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np
import torch

from study_cell import add_cell_arguments, cell

from branchspec import LLM, SpecConfig
from branchspec.sampling import inverse_cdf, seeded_uniforms


def parse_spec(text: str) -> SpecConfig:
    parts = text.split(":")
    if parts[0] == "chain" and len(parts) == 2:
        return SpecConfig.chain(int(parts[1]))
    steps, topk = (int(v) for v in parts[0].lower().split("x"))
    selection = parts[2] if len(parts) == 3 else "eagle2"
    return SpecConfig(steps, topk, int(parts[1]), selection=selection)


@dataclass
class Draw:
    """One draw recomputed in float64 after a prefix."""

    token: int                  # what float64 draws (sampled) or its argmax (greedy)
    margin: float               # sampled: u's distance to the nearest CDF boundary; greedy: the top-2 logit gap
    u: float | None             # the request's uniform there (None: greedy)
    probs: torch.Tensor         # [V] the float64 distribution at the temperature (greedy: at 1)


def float64_draw(ref: LLM, prefix: list[int], seed: int | None, temperature: float) -> Draw:
    """The draw of the token after `prefix` by a float64 model, with the request's seeded
    uniform at that position (the prefix's length)."""
    with torch.no_grad():
        out, _ = ref.model.full_forward(torch.tensor([prefix]))
    logits = out.logits[0, -1].double()                                   # [V]
    if temperature == 0:
        top = logits.topk(2)
        return Draw(int(top.indices[0]), float(top.values[0] - top.values[1]), None, torch.softmax(logits, -1))
    probs = torch.softmax(logits / temperature, dim=-1)
    u = float(seeded_uniforms([seed], np.array([[len(prefix)]]))[0, 0])
    token = int(inverse_cdf(probs, torch.tensor(u, dtype=probs.dtype)))   # the engine's own arithmetic
    edges = (probs.cumsum(-1) / probs.sum()).numpy()                      # token t's interval ends at edges[t]
    below = edges[token - 1] if token > 0 else 0.0
    return Draw(token, float(min(u - below, edges[token] - u)), u, probs)


def explain(draw: Draw, tokens: dict[str, int]) -> str:
    """The float64 draw against the tokens each path drew there."""
    drawn = ", ".join(f"{name} {tok}" for name, tok in tokens.items())
    if draw.u is None:
        return f"{drawn}; float64 argmax {draw.token}, gap to the runner-up {draw.margin:.2e}"
    shown = sorted(set(tokens.values()) | {draw.token})
    masses = ", ".join(f"p({tok}) = {float(draw.probs[tok]):.1e}" for tok in shown)
    return f"{drawn}; float64 {draw.token}; u = {draw.u:.9f}, {draw.margin:.1e} from the nearest boundary; {masses}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cell_arguments(ap, workload="gsm8k", temperature=0.7)
    ap.add_argument("--spec", type=parse_spec, required=True, help="chain:D, SxK:D or SxK:D:calibrated")
    args = ap.parse_args()
    B = args.batch_size
    llm, batch, params = cell(args)
    plain = [o.token_ids for o in llm.generate(batch, params)]
    spec = [o.token_ids for o in llm.generate(batch, params, spec=args.spec)]
    differing = [i for i in range(B) if plain[i] != spec[i]]
    print(f"{len(differing)} of {B} requests differ from plain decoding")
    ref = LLM(max_batch_size=1, seed=0, dtype="float64") if differing else None
    for i in differing:
        j = next(k for k in range(len(plain[i])) if plain[i][k] != spec[i][k])
        alone = llm.generate([batch[i]], [params[i]])[0].token_ids
        tokens = {f"plain (batch {B})": plain[i][j], "speculative": spec[i][j], "plain alone": alone[j]}
        draw = float64_draw(ref, batch[i] + plain[i][:j], params[i].seed, args.temperature)
        print(f"request {i}, token {j}: " + explain(draw, tokens))


if __name__ == "__main__":
    main()
