"""Per-token building blocks: norms, rotary embedding (with YaRN), SwiGLU, MoE and the
manifold-constrained hyper-connections. None of them keeps state across tokens, so none of
them touches the isolation problem; they are what real V4 checkpoints need."""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from branchspec.config import ModelConfig
from branchspec.model.matmul import PACK_MIN_ELEMENTS, linear, packed_products_available, weight_version


class Linear(nn.Linear):
    """nn.Linear without a bias, whose product may run on a packed copy of its weight
    (`packed`, set by `pack_products`; see `matmul.linear`)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.packed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector (last dim) to unit RMS, no learned gain (V4's query normalisation)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _WeightCopy:
    """Several weights joined into one matrix for one matmul at inference (`StackedLinear`,
    `JoinedLinear`), while the separate weights stay the model's parameters, so checkpoints,
    export and training see nothing new. The copy is built on first use and rebuilt
    whenever one of them moved (`.to()`) or changed in place (loading, an optimiser step).
    A copy frozen for inference (`build_stacked`, before compiling: compiled code cannot
    check the weights' versions) is used as it is; with autograd on (training, compiled or
    not) the separate matmuls run, so gradients reach the weights."""

    dim = 0   # the matrices' dimension the copy joins them along

    def __init__(self, weights: Callable[[], list[torch.Tensor]]):
        self.weights = weights                  # the current weights, in order
        self.stacked: torch.Tensor | None = None  # the joined [out, in] matrix
        self.sizes: list[int] = []              # each weight's share of `dim`
        self.key: tuple = ()
        self.frozen = False                     # built for compiled inference (`build_stacked`)
        self.packed = False                     # multiply by a packed copy (`pack_products`)

    @staticmethod
    def matrix(w: torch.Tensor) -> torch.Tensor:
        """A weight as the [out, in] matrix it multiplies by."""
        raise NotImplementedError

    def build(self) -> None:
        """(Re)build the joined copy if any weight moved or changed since the last build."""
        ws = self.weights()
        key = tuple((w.data_ptr(), weight_version(w), w.dtype) for w in ws)
        if key != self.key:
            with torch.no_grad():
                matrices = [self.matrix(w) for w in ws]
                self.stacked = torch.cat(matrices, dim=self.dim)
            self.sizes = [m.shape[self.dim] for m in matrices]
            self.key = key

    def joined(self) -> torch.Tensor:
        if not self.frozen:
            self.build()
        return self.stacked


class StackedLinear(_WeightCopy):
    """Linear maps that read the same input, run as one matmul when autograd is off. At
    decode every matmul is mostly call overhead, and a compressed layer's input feeds seven
    of them. Weights: [out_i, in] (or [..., in], flattened to rows)."""

    dim = 0

    @staticmethod
    def matrix(w: torch.Tensor) -> torch.Tensor:
        return w.reshape(-1, w.shape[-1])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x: [..., in] -> one output [..., out_i] per weight."""
        if torch.is_grad_enabled():
            return [F.linear(x, self.matrix(w)) for w in self.weights()]
        return list(linear(x, self.joined(), self.packed).split(self.sizes, dim=-1))


class JoinedLinear(_WeightCopy):
    """Linear maps whose outputs add up, y = sum_i x_i @ w_i.T, run as one matmul over the
    joined inputs when autograd is off: the dense MoE's down projections, every routed
    expert's and the shared expert's, in one product where there were a batched product
    over experts, its sum and another product. Weights: [out, in_i] (or [out, ...],
    flattened to columns)."""

    dim = 1

    @staticmethod
    def matrix(w: torch.Tensor) -> torch.Tensor:
        return w.reshape(w.shape[0], -1)

    def __call__(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """xs: one input [T, in_i] per weight -> [T, out]."""
        if torch.is_grad_enabled():
            return sum(F.linear(x, self.matrix(w)) for x, w in zip(xs, self.weights()))
        return linear(torch.cat(xs, dim=-1), self.joined(), self.packed)


def build_stacked(module: nn.Module) -> None:
    """Build every joined copy (`StackedLinear`, `JoinedLinear`) of `module` and its
    children now and freeze them for compiled inference: call it before compiling a model
    whose weights will not change (the copies are no longer checked against the weights,
    eager calls included)."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, _WeightCopy):
                value.build()
                value.frozen = True


def rebuild_stacked(module: nn.Module) -> None:
    """Rebuild the joined copies already built (after the weights moved: `Transformer._apply`),
    so that a frozen copy follows its weights to their new device or dtype."""
    for m in module.modules():
        for value in vars(m).values():
            if isinstance(value, _WeightCopy) and value.stacked is not None:
                value.build()


def pack_products(module: nn.Module, on: bool = True, min_elements: int = PACK_MIN_ELEMENTS) -> int:
    """Run the products of `module`'s large weights (`Linear` products and joined copies,
    `StackedLinear` and `JoinedLinear`, with at least `min_elements` weights; all of them
    with 0) on packed copies of their weights
    (`matmul.linear`), or none of them (`on=False`). Where packed products are not
    available (torch without oneDNN), nothing changes. Read when a forward runs, so set it
    before compiling. Returns how many products now run packed."""
    on = on and packed_products_available()
    count = 0
    for m in module.modules():
        if isinstance(m, Linear):
            m.packed = on and m.weight.numel() >= min_elements
            count += m.packed
        for value in vars(m).values():
            if isinstance(value, _WeightCopy):
                value.packed = on and sum(w.numel() for w in value.weights()) >= min_elements
                count += value.packed
    return count


def packed_products(module: nn.Module) -> tuple[str, ...]:
    """The names of `module`'s products that run packed (`pack_products`): a compiled
    step's graph depends on them."""
    names = []
    for name, m in module.named_modules():
        if isinstance(m, Linear) and m.packed:
            names.append(name)
        names += [f"{name}.{attr}" for attr, value in vars(m).items()
                  if isinstance(value, _WeightCopy) and value.packed]
    return tuple(names)


# -- rotary embedding ----------------------------------------------------------------------

def rope_inv_freq(rope_dim: int, theta: float, yarn_factor: float = 1.0, original_max_position: int = 0,
                  beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] in float64, with YaRN when yarn_factor > 1.

    YaRN keeps the fast-rotating pairs (more than beta_fast turns over the original context)
    as they are, divides the slow ones (fewer than beta_slow turns) by the factor, and
    ramps linearly in between; V4 applies no attention scaling on top (factor 1).
    """
    half = rope_dim // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2.0 / rope_dim)
    if yarn_factor <= 1.0:
        return inv_freq

    def pair_index(num_turns: float) -> float:   # the pair that turns num_turns times
        return rope_dim * math.log(original_max_position / (num_turns * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(pair_index(beta_fast)), 0)
    high = min(math.ceil(pair_index(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp                                   # 1: extrapolate (as is), 0: interpolate
    return inv_freq / yarn_factor * (1 - keep) + inv_freq * keep


def rope_tables(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The two RoPE settings of a V4 model: "main" for sliding-only layers (and the MTP
    block), "compress" for CSA/HCA layers, whose queries, keys, entries and indexer all
    rotate with compress_rope_theta and YaRN."""
    theta_c = cfg.compress_rope_theta if cfg.compress_rope_theta is not None else cfg.rope_theta
    return {"main": rope_inv_freq(cfg.rope_dim, cfg.rope_theta),
            "compress": rope_inv_freq(cfg.rope_dim, theta_c, cfg.yarn_factor, cfg.yarn_original_max_position,
                                      cfg.yarn_beta_fast, cfg.yarn_beta_slow)}


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions * inv_freq: [..., N] -> two [..., N, rope_dim / 2] in dtype
    (angles in float64, so long positions keep their precision)."""
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(positions.device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rope_pair_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cos, sin [..., half] -> what each interleaved pair (a, b) is rotated with: cos
    [..., half, 1], and the signed sines [..., half, 2] that multiply the swapped pair
    (b, a): (-sin, sin) to rotate by +position, (sin, -sin) by -position. Computed once per
    forward and table (`attention.cached_rope`), so a rotation is a few ops."""
    return cos.unsqueeze(-1), torch.stack([-sin, sin], dim=-1), torch.stack([sin, -sin], dim=-1)


def rotate_pairs(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope dims of x [..., N, (H,) dim] by `rope_pair_tables`:
    (a, b) -> (a cos - b sin, b cos + a sin), the same products and sums as the textbook
    form, so the result is bit-identical to it."""
    cos, sin_fwd, sin_inv = tables
    sin = sin_inv if inverse else sin_fwd
    for _ in range(x.dim() + 1 - cos.dim()):   # head dims between N and features
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    rot = 2 * cos.shape[-2]
    pairs = x[..., x.shape[-1] - rot:].unflatten(-1, (rot // 2, 2))
    rotated = (pairs * cos + pairs.flip(-1) * sin).flatten(-2)
    return rotated if rot == x.shape[-1] else torch.cat([x[..., : x.shape[-1] - rot], rotated], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] dims of x in interleaved pairs (2i, 2i+1), as V4
    does. x: [..., N, (H,) dim]; cos, sin: [..., N, half] (broadcast over head dims).
    `inverse` rotates by -position: V4 un-rotates the attention output, whose values carry
    their keys' rotations, back to the query's frame."""
    return rotate_pairs(x, rope_pair_tables(cos, sin), inverse)


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` at positions [..., N] with inverse frequencies inv_freq [rope_dim / 2]."""
    return apply_rope(x, *rope_cos_sin(positions, inv_freq, x.dtype), inverse=inverse)


# -- feed-forward --------------------------------------------------------------------------

def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    """w2 (silu(w1 x) * w3 x); limit > 0 clamps the gate from above and the up projection
    to [-limit, limit] (V4's swiglu_limit)."""
    return F.linear(swiglu_hidden(F.linear(x, w1), F.linear(x, w3), limit), w2)


def swiglu_hidden(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate) * up, both clamped first when limit > 0."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, limit: float = 0.0):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(dim, hidden)
        self.w2 = Linear(hidden, dim)
        self.w3 = Linear(dim, hidden)
        self.input_proj = StackedLinear(self._input_weights)

    def _input_weights(self) -> list[torch.Tensor]:
        return [self.w1.weight, self.w3.weight]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.down(*self.input_proj(x))

    def hidden(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The activations w2 reads, from the input's w1 (gate) and w3 (up) projections."""
        return swiglu_hidden(gate, up, self.limit)

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The rest of the block, from the input's w1 (gate) and w3 (up) projections."""
        return F.linear(self.hidden(gate, up), self.w2.weight)


_SCORE_FUNCS = {
    "sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(),
    "softmax": lambda logits: logits.softmax(dim=-1),
    "sigmoid": torch.sigmoid,
}


class Gate(nn.Module):
    """MoE routing: per-expert scores, top-k experts per token, and their weights.

    Scored layers pick the top-k of score + bias (the bias, DeepSeek's load-balancing
    correction, moves the choice but not the weights); hash layers take the experts from a
    fixed token-id table. Weights are the chosen scores, renormalised when norm_topk_prob,
    times routed_scaling_factor.
    """

    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.d_model))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, d]; input_ids: [T] -> (weights [T, k], expert indices [T, k])."""
        return self.route(F.linear(x, self.weight), input_ids)

    def route(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] the gate's projection of the tokens; input_ids: [T]."""
        cfg = self.cfg
        scores = _SCORE_FUNCS[cfg.scoring_func](logits)                      # [T, E]
        if self.hashed:
            indices = self.tid2eid[input_ids]
        else:
            indices = (scores + self.bias).topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, indices)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, indices


EXPERT_DISPATCH = ("grouped", "dense")


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked: w1, w3 [E, I, d], w2 [E, d, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, d = cfg.num_experts, cfg.moe_hidden, cfg.d_model
        self.limit = cfg.swiglu_limit
        self.w1 = nn.Parameter(torch.zeros(E, I, d))
        self.w2 = nn.Parameter(torch.zeros(E, d, I))
        self.w3 = nn.Parameter(torch.zeros(E, I, d))

    def grouped(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [T, d]; indices, weights: [T, k] -> sum of each token's k weighted experts [T, d].

        The T*k (token, expert) pairs are sorted by expert, so each chosen expert runs once
        over a contiguous slice of its tokens; experts no token chose are skipped.
        """
        T, k = indices.shape
        if T * k <= 4:
            return self._few_tokens(x, indices, weights)
        order = indices.flatten().argsort(stable=True)                  # [T*k] pairs grouped by expert
        counts = torch.bincount(indices.flatten(), minlength=self.w1.shape[0]).tolist()
        tok = order // k
        xs = x[tok]                                                      # [T*k, d]
        ys, start = [], 0
        for e, count in enumerate(counts):
            if count:
                ys.append(swiglu(xs[start:start + count], self.w1[e], self.w2[e], self.w3[e], self.limit))
                start += count
        y = torch.cat(ys) if len(ys) > 1 else ys[0]
        y = y * weights.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))

    def dense_hidden(self, gate: torch.Tensor, up: torch.Tensor, indices: torch.Tensor,
                     weights: torch.Tensor) -> torch.Tensor:
        """Every expert's activations on every token [T, E, I], each scaled by the token's
        routing weight (0 for experts it did not choose), from gate, up: [T, E*I] all
        experts' w1 and w3 projections. Multiplied by every expert's w2 and summed (one
        product with the shared expert's, `MoE.down_proj`), that is the routed experts'
        output. No shape depends on the routing, so a step compiles into one graph; it does
        E/k times the routed matmul work, which costs less than the grouped path's
        per-expert calls while experts are few (the embedded models have 4)."""
        E, I, d = self.w1.shape
        T = gate.shape[0]
        route = torch.zeros(T, E, dtype=gate.dtype, device=gate.device).scatter_add(
            1, indices, weights.to(gate.dtype))                           # [T, E]
        return swiglu_hidden(gate.view(T, E, I), up.view(T, E, I), self.limit) * route[..., None]

    def _few_tokens(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Decode at batch 1: each token's experts one by one, without sorting or scattering
        (half the tensor ops of the grouped path, which is what a one-token step costs)."""
        rows = []
        for t, experts in enumerate(indices.tolist()):
            row, acc = x[t:t + 1], None
            for slot, e in enumerate(experts):
                y = swiglu(row, self.w1[e], self.w2[e], self.w3[e], self.limit)
                y = y * weights[t:t + 1, slot:slot + 1].to(y.dtype)
                acc = y if acc is None else acc + y
            rows.append(acc.to(x.dtype))
        return rows[0] if len(rows) == 1 else torch.cat(rows)


class MoE(nn.Module):
    """Routed experts plus a shared one. `dispatch` ("grouped" or "dense", see
    `Experts.grouped` and `Experts.dense_hidden`) is fixed when the module is built."""

    def __init__(self, cfg: ModelConfig, hashed: bool, dispatch: str = "grouped"):
        super().__init__()
        self.dispatch = dispatch
        self.gate = Gate(cfg, hashed)
        self.experts = Experts(cfg)
        self.shared_experts = SwiGLU(cfg.d_model, cfg.moe_hidden, cfg.swiglu_limit) if cfg.num_shared_experts else None
        # Everything that reads the FFN input: the gate and the shared expert's w1 and w3;
        # dense, also every routed expert's w1 and w3. (Bound methods, not lambdas, so that
        # a deep copy of the model reads its own weights.)
        self.input_proj = StackedLinear(self._dense_input_weights if dispatch == "dense" else self._input_weights)
        # Dense: every down projection, the routed experts' and the shared expert's, in one product.
        self.down_proj = JoinedLinear(self._down_weights) if dispatch == "dense" else None

    def _input_weights(self) -> list[torch.Tensor]:
        sh = self.shared_experts
        return [self.gate.weight] + ([sh.w1.weight, sh.w3.weight] if sh is not None else [])

    def _dense_input_weights(self) -> list[torch.Tensor]:
        return self._input_weights() + [self.experts.w1, self.experts.w3]

    def _down_weights(self) -> list[torch.Tensor]:
        sh = self.shared_experts
        return [self.experts.w2.transpose(0, 1)] + ([sh.w2.weight] if sh is not None else [])   # [d, E, I], [d, I]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [..., d]; input_ids: [...] (the hash layers route by them)."""
        flat = x.reshape(-1, x.shape[-1])
        ids = input_ids.reshape(-1)
        sh = self.shared_experts
        if self.dispatch == "dense":
            logits, *shared, gate, up = self.input_proj(flat)
            weights, indices = self.gate.route(logits, ids)
            hidden = [self.experts.dense_hidden(gate, up, indices, weights).flatten(1)]   # [T, E*I]
            if sh is not None:
                hidden.append(sh.hidden(*shared))                                       # [T, I]
            return self.down_proj(hidden).view(x.shape)
        logits, *shared = self.input_proj(flat)
        weights, indices = self.gate.route(logits, ids)
        y = self.experts.grouped(flat, indices, weights)
        if sh is not None:
            y = y + sh.down(*shared)
        return y.view(x.shape)


def feed_forward(cfg: ModelConfig, hashed: bool = False, expert_dispatch: str = "grouped") -> nn.Module:
    """The block's FFN: a dense SwiGLU, or MoE when the config has experts."""
    if cfg.num_experts:
        return MoE(cfg, hashed, expert_dispatch)
    return SwiGLU(cfg.d_model, cfg.ffn_hidden, cfg.swiglu_limit)


# -- hyper-connections ---------------------------------------------------------------------

def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams: [..., n, d] -> fn applied to the RMS-normalised flattened streams [..., rows]."""
    flat = streams.flatten(-2)
    return F.linear(F.rms_norm(flat, (flat.shape[-1],), eps=eps), fn)     # unit_rms in one op


def hc_scale_index(n: int) -> torch.Tensor:
    """Which of the three scales each mix row takes: pre (n rows), post (n), comb (n x n).
    A block keeps it as a buffer, so that it lives on the model's device (indexing with a
    tensor on another device would copy it over at every call)."""
    return torch.tensor([0] * n + [1] * n + [2] * (n * n))


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           cfg: ModelConfig, scale_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site before a sub-block: streams [..., n, d] -> (sub-block input [..., d],
    post [..., n], comb [..., n, n]); scale_index: `hc_scale_index(n)` on the streams' device.

    pre and post are sigmoid gates; comb is projected towards a doubly-stochastic matrix by
    Sinkhorn-Knopp (columns first, then rows and columns), so mixing keeps the streams' scale.
    Written in few tensor ops: at decode every op is dispatch overhead, and a model has
    two sites per layer.
    """
    n, eps = cfg.hc_mult, cfg.hc_eps
    mixes = hc_mixes(streams, fn, cfg.norm_eps) * scale[scale_index] + base   # [..., (2+n) n]
    gates = torch.sigmoid(mixes[..., :2 * n])
    pre, post = gates[..., :n] + eps, 2 * gates[..., n:]
    comb = torch.softmax(mixes[..., 2 * n:].unflatten(-1, (n, n)), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return (pre.unsqueeze(-2) @ streams).squeeze(-2), post, comb


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Sub-block output [..., d] back into the streams: stream k gets post[k] * out plus
    sum_j comb[j, k] * streams[j]."""
    return torch.addcmul(comb.transpose(-1, -2) @ streams, post.unsqueeze(-1), out.unsqueeze(-2))


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            cfg: ModelConfig) -> torch.Tensor:
    """Collapse the streams [..., n, d] into one vector [..., d] before the final norm."""
    pre = torch.sigmoid(hc_mixes(streams, fn, cfg.norm_eps) * scale + base) + cfg.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=-2)
