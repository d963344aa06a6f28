"""Turning target logits into tokens: greedy, or temperature + top-p sampling."""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, N, V]; temperature, top_p: [B] (temperature > 0) -> probabilities [B, N, V].

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (the token
    that crosses the threshold included), then renormalises.
    """
    probs = torch.softmax(logits.double() / temperature[:, None, None].double(), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p[:, None, None].double(), 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def target_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """The target's token at every node: [B, N, V] -> [B, N].

    Rows with temperature 0 take the argmax; the others draw one token per node from their
    own generator (a per-request seed makes a request's output independent of its batch).
    """
    out = logits.argmax(dim=-1)
    sampled = (temperature > 0).nonzero().flatten().tolist()
    if sampled:
        probs = sampling_probs(logits[sampled], temperature[sampled], top_p[sampled])
        for row, b in enumerate(sampled):
            out[b] = torch.multinomial(probs[row], 1, generator=generators[b]).squeeze(-1)
    return out
