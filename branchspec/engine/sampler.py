"""Turning target logits into tokens: greedy, or temperature + top-p sampling."""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, N, V]; temperature, top_p: [B] (temperature > 0) -> probabilities [B, N, V].

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (the token
    that crosses the threshold included), then renormalises.
    """
    probs = torch.softmax(logits.double() / temperature[:, None, None].double(), dim=-1)
    if bool((top_p >= 1.0).all()):
        return probs            # nothing to cut: skip the sort over the vocabulary
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
    temperature, top_p = temperature.to(logits.device), top_p.to(logits.device)
    sampled = (temperature > 0).nonzero().flatten().tolist()
    if sampled:
        probs = sampling_probs(logits[sampled], temperature[sampled], top_p[sampled])   # [S, N, V]
        # Inverse-CDF draws: one uniform per node from the request's own generator, then
        # one batched search (torch.multinomial per request costs ~1.5 ms a call here).
        # The first token whose cumulative mass exceeds u: never a zero-probability one.
        cdf = probs.cumsum(-1)                                                          # [S, N, V]
        # (Generators live on the CPU, so a seed gives the same draws on every device.)
        u = torch.stack([torch.rand(probs.shape[1], generator=generators[b], dtype=cdf.dtype)
                         for b in sampled]).to(cdf.device) * cdf[..., -1]                 # [S, N]
        draws = torch.searchsorted(cdf, u[..., None], right=True)[..., 0]
        out[sampled] = draws.clamp_(max=probs.shape[-1] - 1)
    return out


def logprob_dicts(logits: torch.Tensor, chosen: list[int], num_top: list[int]) -> list[dict[int, float]]:
    """vLLM's raw logprobs of M rows: logits [M, V] (the target's, at the node that produced
    each token), chosen [M] the token taken at each row, num_top [M] the k asked for.

    Returns one {token_id: logprob} per row: the chosen token first, then the row's top k in
    rank order (k or k + 1 entries). log_softmax in float64, before temperature and top-p.
    One log_softmax and one topk over all rows; Python only builds the dicts.
    """
    if not chosen:
        return []
    lp = torch.log_softmax(logits.double(), dim=-1)                               # [M, V]
    idx = torch.tensor(chosen, dtype=torch.long, device=lp.device)
    chosen_lp = lp.gather(-1, idx[:, None])[:, 0].tolist()
    k_max = max(num_top)
    if k_max:
        top_lp, top_ids = (x.tolist() for x in lp.topk(k_max, dim=-1))          # [M, k_max]
    else:
        top_lp = top_ids = [[]] * len(chosen)
    out = []
    for r, (t, k) in enumerate(zip(chosen, num_top)):
        d = {t: chosen_lp[r]}
        d.update(zip(top_ids[r][:k], top_lp[r][:k]))
        out.append(d)
    return out
