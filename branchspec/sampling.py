"""Turning target logits into tokens (greedy, or temperature, min-p, top-k and top-p
sampling) and into vLLM's logprob dicts. Every token the engine emits is drawn here: the
first one from the prefill's logits, the rest from a decode step's or a verify pass's.
What a request's own rules (logit bias, min_tokens, penalties) do to the logits before
that is `logits_process`.

**Seeded draws depend on nothing but (seed, position).** The uniform that picks the token
at sequence position p of a request is Philox4x32-10 (Salmon et al., SC 2011: a
counter-based generator) keyed by the request's seed, at counter p: a pure function, not
the next value of a consumed stream. A verify pass draws at every node of a tree, a plain
step at one position, yet the token emitted at position p is always the inverse CDF of
the target's distribution at its accepted prefix at the same u_p. Since the prefix itself
is a function of u_<p, plain decoding, any chain, any tree and the adaptive policy emit
the same tokens for a seed (exactly, when their logits agree bit for bit, as in float64),
and the output still follows the target's distribution: u_p is independent of u_<p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingBatch:
    """How each request of a batch turns logits into tokens."""

    temperature: torch.Tensor                 # [B] float64, 0 = greedy
    top_p: torch.Tensor                       # [B] float64
    seeds: list[int]                          # [B] each request's seed, in [0, 2**64)
    num_logprobs: list[int | None]            # [B] top-k logprobs asked for (None: none)
    top_k: torch.Tensor | None = None         # [B] long, 0 = all tokens (None: 0 for every row)
    min_p: torch.Tensor | None = None         # [B] float64 (None: 0 for every row)
    # What each request's rules do to the logits first (`logits_process.LogitsRules`);
    # None when no request of the batch has any.
    rules: object | None = None

    def untouched(self) -> torch.Tensor:
        """[B] bool: rows whose token is the argmax or a draw at their temperature alone
        (no top-p, top-k or min-p cut, no logits rules), which a verify pass can take
        inside its own call (`node_draws`, `draw_tokens`). Rules belong to the batch, so
        where any row has some, no row is."""
        if self.rules is not None:
            return torch.zeros_like(self.temperature, dtype=torch.bool)
        uncut = self.top_p >= 1.0
        if self.top_k is not None:
            uncut &= self.top_k == 0
        if self.min_p is not None:
            uncut &= self.min_p == 0
        return (self.temperature == 0) | uncut

    def rows(self, index: list[int]) -> "SamplingBatch":
        """The same for the requests at `index`."""
        pick = (lambda t: None if t is None else t[index])
        return SamplingBatch(self.temperature[index], self.top_p[index], [self.seeds[i] for i in index],
                             [self.num_logprobs[i] for i in index], pick(self.top_k), pick(self.min_p),
                             None if self.rules is None else self.rules.rows(index))


# -- the counter-based draw ---------------------------------------------------------------
# Philox4x32's multipliers and key increments (Random123's PHILOX_M4x32_*, PHILOX_W32_*).
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_MASK32 = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox4x32(counter: tuple[np.ndarray, ...], key: tuple[np.ndarray, np.ndarray], rounds: int = 10
               ) -> tuple[np.ndarray, ...]:
    """Philox4x32-R of four 32-bit counter words and two key words (uint64 arrays holding
    32-bit values, broadcast together) -> four 32-bit output words. In numpy's unsigned
    arithmetic a 32 x 32-bit product is exact in 64 bits, so the result is the same on every
    machine; the tests check Random123's known answers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2
        c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> _32) ^ c3 ^ k1, p0 & _MASK32
    return c0, c1, c2, c3


def seeded_uniforms(seeds: list[int], positions: np.ndarray) -> np.ndarray:
    """The uniform in [0, 1) of every (request, position): seeds [S] (each < 2**64) key the
    generator, positions [S, N] (>= 0) are its counter. [S, N] float64, 53 random bits."""
    seed = np.array(seeds, dtype=np.uint64)[:, None]                        # [S, 1]
    pos = positions.astype(np.uint64)                                       # [S, N]
    zero = np.zeros_like(pos)
    x0, x1, _, _ = philox4x32((pos & _MASK32, pos >> _32, zero, zero), (seed & _MASK32, seed >> _32))
    bits = ((x0 >> np.uint64(5)) << np.uint64(26)) | (x1 >> np.uint64(6))   # 27 + 26 bits
    return bits.astype(np.float64) * 2.0 ** -53


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                   top_k: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [B, N, V]; temperature, top_p: [B] (temperature > 0); top_k: [B] long
    (0 = all tokens), min_p: [B] -> probabilities [B, N, V].

    vLLM v1's order, after the temperature: min-p drops tokens less likely than min_p
    times the most likely one; top-k keeps the k most likely (ties with the k-th kept);
    top-p then keeps the smallest set of most likely tokens whose mass, renormalised,
    reaches top_p (the token that crosses the threshold included). The kept mass is
    renormalised. A row's cut depends on that row alone.
    """
    probs = torch.softmax(logits.double() / temperature[:, None, None].double(), dim=-1)
    V = probs.shape[-1]
    cut = torch.zeros(probs.shape[0], dtype=torch.bool, device=probs.device)             # [B] a cut made
    if min_p is not None and bool((min_p > 0).any()):
        min_p = min_p.to(probs.device, torch.float64)
        floor = min_p[:, None, None] * probs.amax(-1, keepdim=True)                        # [B, N, 1]
        probs = probs.masked_fill(probs < floor, 0.0)
        cut |= min_p > 0
    use_k = top_k is not None and bool((top_k > 0).any())
    if not use_k and bool((top_p >= 1.0).all()):
        # nothing else to cut: skip the sort over the vocabulary
        return torch.where(cut[:, None, None], probs / probs.sum(-1, keepdim=True), probs)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    if use_k:
        top_k = top_k.to(probs.device)
        k = torch.where(top_k > 0, top_k.clamp(max=V), V)                                   # [B]
        kth = sorted_p.gather(-1, (k - 1)[:, None, None].expand(-1, sorted_p.shape[1], 1))  # [B, N, 1]
        sorted_p = sorted_p.masked_fill(sorted_p < kth, 0.0)
        cut |= top_k > 0
    # Renormalise before top-p only where something was cut (other rows keep their exact sums).
    sorted_p = torch.where(cut[:, None, None], sorted_p / sorted_p.sum(-1, keepdim=True), sorted_p)
    mass_before = sorted_p.cumsum(-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p[:, None, None].to(probs.device).double(), 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at u of each row's distribution: probs [..., V] (any non-negative mass),
    u [...] in [0, 1) -> [...] long, the first token whose cumulative mass exceeds u times
    the row's total, never a zero-probability one. A count rather than a search, so that it
    is one kernel inside a compiled graph; the cumulative sums of non-negative numbers are
    non-decreasing, so the count is the search's answer."""
    cdf = probs.cumsum(-1)                                                               # [..., V]
    drawn = (cdf <= (u * cdf[..., -1])[..., None]).sum(-1)
    return drawn.clamp_(max=probs.shape[-1] - 1)


@dataclass
class NodeDraws:
    """What a verify pass needs to draw the target's token at each node inside its own call,
    for the rows sampled at their temperature alone (`SamplingBatch.untouched`)."""

    rows: torch.Tensor           # [B] bool: drawn here (the other rows take the argmax)
    temperature: torch.Tensor    # [B] float64 (1 where not drawn)
    uniforms: torch.Tensor       # [B, N] float64: the uniform of a node at depth d (position L + d + 1)


def node_draws(sampling: SamplingBatch, untouched: torch.Tensor, lengths: torch.Tensor, depths: int,
               device: torch.device) -> NodeDraws | None:
    """The draws of the untouched [B] rows with a temperature, for nodes at depths
    0 .. depths - 1 on top of lengths [B] committed tokens; None when there are none. The
    uniforms are the seeded ones (`seeded_uniforms`), computed on the host as
    `target_tokens` computes them, so a row draws the same token in the call as after it."""
    rows = untouched & (sampling.temperature > 0)                                        # [B]
    if not bool(rows.any()):
        return None
    positions = lengths.cpu().numpy()[:, None] + 1 + np.arange(depths)[None, :]          # [B, N]
    u = torch.from_numpy(seeded_uniforms(sampling.seeds, positions))
    return NodeDraws(rows=rows.to(device), temperature=torch.where(rows, sampling.temperature, 1.0).to(device),
                     uniforms=u.to(device))


def draw_tokens(logits: torch.Tensor, draws: NodeDraws, depth: torch.Tensor, otherwise: torch.Tensor
                ) -> torch.Tensor:
    """Inside a verify pass: logits [B, N, V] at nodes of depth [B, N]; the drawn rows'
    tokens by inverse CDF at their temperature, `otherwise` [B, N] elsewhere. The same
    arithmetic as `target_tokens` for such a row, as a pure function of tensors."""
    u = draws.uniforms.gather(1, depth.clamp(0, draws.uniforms.shape[1] - 1))          # [B, N]
    probs = torch.softmax(logits.double() / draws.temperature[:, None, None], dim=-1)  # [B, N, V]
    return torch.where(draws.rows[:, None], inverse_cdf(probs, u), otherwise)


def step_tokens(logits: torch.Tensor, draws: NodeDraws) -> torch.Tensor:
    """A plain decode step's tokens, inside its graph: logits [B, 1, V] -> [B, 1], the
    argmax, or for the rows in `draws` (uniforms [B, 1], at position L + 1) the seeded
    draw at their temperature."""
    argmax = logits.argmax(dim=-1)                                                      # [B, 1]
    return draw_tokens(logits, draws, torch.zeros_like(argmax), argmax)


def target_tokens(logits: torch.Tensor, sampling: SamplingBatch, positions: torch.Tensor) -> torch.Tensor:
    """The target's token at every node: logits [B, N, V] -> [B, N].

    positions: [B, N] the sequence position of the token each node draws (a node at
    position q draws the token at q + 1). Rows with temperature 0 take the argmax; the
    others draw by inverse CDF at the uniform of (their seed, that position), see the
    module's docstring: a request's tokens depend on neither its batch nor the tree.
    """
    out = logits.argmax(dim=-1)
    temperature, top_p = sampling.temperature.to(logits.device), sampling.top_p.to(logits.device)
    sampled = (temperature > 0).nonzero().flatten().tolist()
    if sampled:
        probs = sampling_probs(logits[sampled], temperature[sampled], top_p[sampled],   # [S, N, V]
                               *(None if t is None else t[sampled] for t in (sampling.top_k, sampling.min_p)))
        # One batched inverse CDF (torch.multinomial per request costs ~1.5 ms a call here).
        # Drawn on the host in exact integer arithmetic: the same u on every device.
        u = seeded_uniforms([sampling.seeds[b] for b in sampled], positions[sampled].cpu().numpy())
        out[sampled] = inverse_cdf(probs, torch.from_numpy(u).to(probs.device, probs.dtype))
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


def emitted_logprobs(logits: torch.Tensor, nodes: torch.Tensor, emitted: list[list[int]],
                     num_logprobs: list[int | None]) -> list[list[dict[int, float]] | None] | None:
    """Raw logprobs of the emitted tokens of the requests that asked for them.

    logits: [B, N, V] target logits at every node; nodes: [B, >= max emitted] the node whose
    output distribution produced each emitted token (emitted token i of a speculative round
    comes from accepted-path node i: an accepted child from its parent, the bonus token from
    the last path node). None, with no work done, when no request asked.
    """
    want = [b for b, k in enumerate(num_logprobs) if k is not None and emitted[b]]
    if not want:
        return None
    rows_b = torch.tensor([b for b in want for _ in emitted[b]], dtype=torch.long, device=logits.device)
    rows_n = torch.cat([nodes[b, :len(emitted[b])] for b in want]).to(logits.device)
    dicts = logprob_dicts(logits[rows_b, rows_n], [t for b in want for t in emitted[b]],
                          [num_logprobs[b] for b in want for _ in emitted[b]])
    out: list[list[dict[int, float]] | None] = [None] * len(emitted)
    start = 0
    for b in want:
        out[b] = dicts[start:start + len(emitted[b])]
        start += len(emitted[b])
    return out
