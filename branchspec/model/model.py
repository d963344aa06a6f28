"""The target model and its MTP drafter block, over one set of weights.

`Transformer.forward(input_ids, meta, states)` is the single reference computation behind
training (a chain from empty state), prefill, decode and tree verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from branchspec.config import Compression, ModelConfig
from branchspec.model.attention import Attention, LayerScratch, LayerState, RopeTables, empty_layer_state, rope_table_of
from branchspec.model.layers import (EXPERT_DISPATCH, Linear, RMSNorm, feed_forward, hc_head, hc_post, hc_pre,
                                     hc_scale_index, rebuild_stacked, rope_tables)
from branchspec.model.matmul import linear
from branchspec.model.metadata import ForwardMeta, chain_meta

WINDOW_ONLY = Compression.of(0)    # the drafter's block: a sliding window, no compression


class Block(nn.Module):
    """Attention then FFN, each pre-normed, around the residual.

    With hyper-connections (hc_mult = n > 0) the residual is n streams [B, N, n, d]: an
    mHC site before each sub-block collapses them into its input and writes its output
    back (`layers.hc_pre` / `hc_post`). Without, it is one stream [B, N, d].
    """

    def __init__(self, cfg: ModelConfig, compression: Compression, hashed: bool = False,
                 expert_dispatch: str = "grouped"):
        super().__init__()
        self.cfg, self.ratio = cfg, compression.ratio
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, compression)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = feed_forward(cfg, hashed, expert_dispatch)
        if cfg.hc_mult:
            n = cfg.hc_mult
            rows = (2 + n) * n                       # pre (n), post (n), comb (n x n)
            for site in ("attn", "ffn"):
                self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(rows, n * cfg.d_model)))
                self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(rows)))
                self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
            self.register_buffer("hc_scale_index", hc_scale_index(n), persistent=False)

    def forward(self, h: torch.Tensor, meta: ForwardMeta, state: LayerState, input_ids: torch.Tensor,
                rope: RopeTables) -> tuple[torch.Tensor, LayerScratch]:
        """h: [B, N, d] or streams [B, N, n, d]; input_ids: [B, N] (hash-routed experts)."""
        if not self.cfg.hc_mult:
            a, scratch = self.attn(self.attn_norm(h), meta, state, rope)
            h = h + a
            return h + self.ffn(self.ffn_norm(h), input_ids), scratch
        x, post, comb = hc_pre(h, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg,
                               self.hc_scale_index)
        a, scratch = self.attn(self.attn_norm(x), meta, state, rope)
        h = hc_post(a, h, post, comb)
        x, post, comb = hc_pre(h, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg,
                               self.hc_scale_index)
        return hc_post(self.ffn(self.ffn_norm(x), input_ids), h, post, comb), scratch


def add_hc_head(module: nn.Module, cfg: ModelConfig) -> None:
    """Give `module` (the target, or the MTP block) its own hc head parameters, which
    collapse the residual streams before the final norm (with hyper-connections only)."""
    if cfg.hc_mult:
        n = cfg.hc_mult
        module.hc_head_fn = nn.Parameter(torch.zeros(n, n * cfg.d_model))
        module.hc_head_base = nn.Parameter(torch.zeros(n))
        module.hc_head_scale = nn.Parameter(torch.ones(1))


def collapse(module: nn.Module, h: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[B, N, d] or streams [B, N, n, d] -> [B, N, d] with `module`'s hc head."""
    if not cfg.hc_mult:
        return h
    return hc_head(h, module.hc_head_fn, module.hc_head_base, module.hc_head_scale, cfg)


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None       # [B, N, V] (None: the MTP block asked not to)
    hidden: torch.Tensor              # [B, N, n*d] last block's residual (all streams), before any head
    scratch: list[LayerScratch]       # one per layer


class MTP(Block):
    """DeepSeek's multi-token-prediction block, used as the drafter.

    At position p it combines the embedding of token x_p with a residual for p - 1 (the
    target's, or its own when chained) and predicts x_{p+1}. A sliding-only block (main
    RoPE) with its own hc head and final norm; embedding and LM head are the target's.
    """

    def __init__(self, cfg: ModelConfig, expert_dispatch: str = "grouped"):
        super().__init__(cfg, WINDOW_ONLY, expert_dispatch=expert_dispatch)
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.e_proj = Linear(cfg.d_model, cfg.d_model)
        self.h_proj = Linear(cfg.d_model, cfg.d_model)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        add_hc_head(self, cfg)


class Transformer(nn.Module):
    """The target model and its drafter block.

    expert_dispatch (MoE models only), chosen once when the modules are built: "grouped"
    runs each chosen expert once over the tokens routed to it (the least work; its shapes
    follow the routing), "dense" runs every expert on every token, weighted by its routing
    (no shape depends on the routing, so a step compiles into one graph). Both compute the
    same function; see `layers.Experts`.
    """

    def __init__(self, cfg: ModelConfig, expert_dispatch: str = "grouped"):
        super().__init__()
        if expert_dispatch not in EXPERT_DISPATCH:
            raise ValueError(f"expert_dispatch must be one of {EXPERT_DISPATCH}, got {expert_dispatch!r}")
        self.cfg, self.expert_dispatch = cfg, expert_dispatch
        self.rope = rope_tables(cfg)                          # {"main", "compress"}: [rope_dim/2] float64
        # The tables the target's layers rotate with (the drafter's block: "main").
        self.rope_names = tuple(sorted({rope_table_of(c) for c in cfg.layer_compression}))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(
            Block(cfg, c, hashed=l < cfg.num_hash_layers, expert_dispatch=expert_dispatch)
            for l, c in enumerate(cfg.layer_compression))
        add_hc_head(self, cfg)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = Linear(cfg.d_model, cfg.vocab_size)
        self.mtp = nn.ModuleList(MTP(cfg, expert_dispatch) for _ in range(cfg.num_mtp_layers))

    def _apply(self, fn, recurse: bool = True):
        """Moving the model moves its RoPE frequency tables too (kept in float64 whatever
        the model's dtype, so not buffers, which a dtype cast would reach), and its joined
        projections' copies: a forward must not copy them to the device at every call."""
        super()._apply(fn, recurse)
        device = self.embed.weight.device
        self.rope = {name: t.to(device) for name, t in self.rope.items()}
        rebuild_stacked(self)     # joined projections built (or frozen) before the move follow it
        return self

    def _streams(self, x: torch.Tensor) -> torch.Tensor:
        """Embedded tokens [B, N, d] -> the residual's starting value (copied into n streams)."""
        n = self.cfg.hc_mult
        return x.unsqueeze(2).expand(*x.shape[:2], n, x.shape[-1]).contiguous() if n else x

    # -- target -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta,
                states: list[LayerState] | None = None, logits_at: torch.Tensor | None = None) -> ForwardOutput:
        """input_ids: [B, N] new nodes; states: committed state per layer (None = empty);
        logits_at: [B] the one position of each row whose logits are wanted (logits [B, 1,
        V]: a prefill needs only its last token's, and the LM head over every prompt
        position was a sixth of it), None for every position's."""
        B, N = input_ids.shape
        if states is None:
            states = self.empty_states(B)
        h = self._streams(self.embed(input_ids))
        rope = RopeTables.build(meta, self.rope, self.rope_names, h.dtype)
        scratch = []
        for layer, state in zip(self.layers, states):
            h, s = layer(h, meta, state, input_ids, rope)
            scratch.append(s)
        at = h if logits_at is None else h[torch.arange(B, device=h.device), logits_at][:, None]
        logits = self.head(self.norm(collapse(self, at, self.cfg)))
        return ForwardOutput(logits=logits, hidden=h.reshape(B, N, -1), scratch=scratch)

    def empty_states(self, batch: int) -> list[LayerState]:
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        return [empty_layer_state(self.cfg, c, batch, dtype, device) for c in self.cfg.layer_compression]

    # -- drafter ----------------------------------------------------------------------
    def mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                    state: LayerState | None = None, logits: bool = True) -> ForwardOutput:
        """input_ids: [B, N] tokens x_p; prev_hidden: [B, N, n*d] residual for p - 1.

        `logits=False` skips the LM head (logits None): drafting needs it at few of the
        nodes it feeds, and at a large batch the head is most of the block's cost; apply
        `mtp_logits` to the hidden states that need it."""
        mtp, cfg = self.mtp[0], self.cfg
        B, N = input_ids.shape
        if state is None:
            state = empty_layer_state(cfg, WINDOW_ONLY, B, self.embed.weight.dtype, self.embed.weight.device)
        e = mtp.e_proj(mtp.enorm(self.embed(input_ids)))                     # [B, N, d]
        if cfg.hc_mult:   # every stream of the residual gets the same embedding term
            prev = prev_hidden.view(B, N, cfg.hc_mult, cfg.d_model)
            h = e.unsqueeze(2) + mtp.h_proj(mtp.hnorm(prev))               # [B, N, n, d]
        else:
            h = e + mtp.h_proj(mtp.hnorm(prev_hidden))
        rope = RopeTables.build(meta, self.rope, ("main",), h.dtype)
        h, s = Block.forward(mtp, h, meta, state, input_ids, rope)
        hidden = h.reshape(B, N, -1)
        return ForwardOutput(logits=self.mtp_logits(hidden) if logits else None, hidden=hidden, scratch=[s])

    def mtp_logits(self, hidden: torch.Tensor, head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The MTP block's hidden states [..., n*d] (all streams) -> its logits [..., V], or
        only at the tokens whose LM-head rows are `head_rows` [N, d] ([..., N])."""
        mtp, cfg = self.mtp[0], self.cfg
        if cfg.hc_mult:
            hidden = hidden.unflatten(-1, (cfg.hc_mult, cfg.d_model))
        x = mtp.norm(collapse(mtp, hidden, cfg))
        return self.head(x) if head_rows is None else linear(x, head_rows, self.head.packed)

    # -- training ---------------------------------------------------------------------
    def full_forward(self, input_ids: torch.Tensor, with_mtp: bool = False
                     ) -> tuple[ForwardOutput, ForwardOutput | None]:
        """Causal forward over whole sequences from position 0 (training, reference).

        With MTP: drafter position p sees x_p and the target hidden at p - 1 (zeros at
        p = 0); its logits at p predict x_{p+1}, the token after the one the target's
        hidden state at p - 1 predicts (DeepSeek's next-next-token objective).
        """
        B, T = input_ids.shape
        meta = chain_meta(torch.zeros(B, dtype=torch.long, device=input_ids.device), T,
                          self.cfg.compressed_kinds)
        out = self(input_ids, meta)
        if not with_mtp or not self.mtp:
            return out, None
        prev = torch.cat([torch.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], dim=1)
        mtp_meta = chain_meta(meta.num_committed, T, ())
        return out, self.mtp_forward(input_ids, prev, mtp_meta)
