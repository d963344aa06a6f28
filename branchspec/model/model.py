"""The target model and its MTP drafter block, over one set of weights.

`Transformer.forward(input_ids, meta, states)` is the single reference computation behind
training (a chain from empty state), prefill, decode and tree verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from branchspec.config import ModelConfig
from branchspec.model.attention import Attention, LayerScratch, LayerState, empty_layer_state
from branchspec.model.layers import RMSNorm, SwiGLU
from branchspec.model.metadata import ForwardMeta, chain_meta


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, ratio)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, h: torch.Tensor, meta: ForwardMeta, state: LayerState
                ) -> tuple[torch.Tensor, LayerScratch]:
        a, scratch = self.attn(self.attn_norm(h), meta, state)
        h = h + a
        return h + self.ffn(self.ffn_norm(h)), scratch


@dataclass
class ForwardOutput:
    logits: torch.Tensor              # [B, N, V]
    hidden: torch.Tensor              # [B, N, d] last block output, before the final norm
    scratch: list[LayerScratch]       # one per layer


class MTP(nn.Module):
    """DeepSeek's multi-token-prediction block, used as the drafter.

    At position p it combines the embedding of token x_p with a hidden state for p - 1 (the
    target's, or its own output when chained) and predicts x_{p+1}. Window attention only.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.e_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.h_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.block = Block(cfg, 0)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, r) for r in cfg.compress_ratios)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTP(cfg) for _ in range(cfg.num_mtp_layers))

    # -- target -----------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta,
                states: list[LayerState] | None = None) -> ForwardOutput:
        """input_ids: [B, N] new nodes; states: committed state per layer (None = empty)."""
        B = input_ids.shape[0]
        if states is None:
            states = self.empty_states(B)
        h = self.embed(input_ids)
        scratch = []
        for layer, state in zip(self.layers, states):
            h, s = layer(h, meta, state)
            scratch.append(s)
        return ForwardOutput(logits=self.head(self.norm(h)), hidden=h, scratch=scratch)

    def empty_states(self, batch: int) -> list[LayerState]:
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        return [empty_layer_state(self.cfg, r, batch, dtype, device) for r in self.cfg.compress_ratios]

    # -- drafter ----------------------------------------------------------------------
    def mtp_forward(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                    state: LayerState | None = None) -> ForwardOutput:
        """input_ids: [B, N] tokens x_p; prev_hidden: [B, N, d] hidden state for p - 1."""
        mtp = self.mtp[0]
        if state is None:
            state = empty_layer_state(self.cfg, 0, input_ids.shape[0], self.embed.weight.dtype,
                                      self.embed.weight.device)
        h = mtp.e_proj(mtp.enorm(self.embed(input_ids))) + mtp.h_proj(mtp.hnorm(prev_hidden))
        h, s = mtp.block(h, meta, state)
        return ForwardOutput(logits=self.head(mtp.norm(h)), hidden=h, scratch=[s])

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
                          self.cfg.compressed_ratios)
        out = self(input_ids, meta)
        if not with_mtp or not self.mtp:
            return out, None
        prev = torch.cat([torch.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], dim=1)
        mtp_meta = chain_meta(meta.num_committed, T, ())
        return out, self.mtp_forward(input_ids, prev, mtp_meta)
