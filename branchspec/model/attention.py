"""V4-style attention: sliding window + compressed entries (C4 with indexer, C128) + sink.

One forward handles N new nodes per sequence on top of a `LayerState` (the committed
state of this layer, already gathered from the paged pools) and returns a `LayerScratch`
with everything the new nodes produced. Nothing here writes persistent state: committing
scratch is the caller's decision (all nodes for prefill, the accepted path for verify).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from branchspec.config import Compression, ModelConfig
from branchspec.model.layers import Linear, RMSNorm, StackedLinear, rope_cos_sin, rope_pair_tables, rotate_pairs, unit_rms
from branchspec.model.metadata import ForwardMeta, PoolPlan


Tables = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # `layers.rope_pair_tables`


@dataclass(frozen=True)
class RopeTables:
    """The RoPE pair tables (`layers.rope_pair_tables`) one forward rotates with, computed
    once before its first layer and shared by every layer: each table the layers use
    ("main" for sliding-only layers and the drafter, "compress" for CSA/HCA layers) at the
    new nodes' positions, and the compressed table at each ratio's entry positions (an
    entry is rotated at its block-start position)."""

    nodes: dict[str, Tables]      # table name -> tables at meta.positions [B, N]
    entries: dict[int, Tables]    # ratio -> "compress" tables at meta.pools[ratio].entry_pos [B, K]

    @staticmethod
    def build(meta: ForwardMeta, inv_freq: dict[str, torch.Tensor], names: tuple[str, ...],
              dtype: torch.dtype) -> "RopeTables":
        """names: the tables the forward's layers rotate with; entries are built for every
        pooling plan in `meta` (none for the drafter's window-only block)."""
        nodes = {n: rope_pair_tables(*rope_cos_sin(meta.positions, inv_freq[n], dtype)) for n in names}
        entries = {r: rope_pair_tables(*rope_cos_sin(plan.entry_pos, inv_freq["compress"], dtype))
                   for r, plan in meta.pools.items()}
        return RopeTables(nodes=nodes, entries=entries)


def rope_table_of(compression: Compression) -> str:
    """The RoPE table a layer rotates with: V4 gives compressing layers their own base and YaRN."""
    return "compress" if compression.ratio > 0 else "main"


def in_dtype(tables: Tables, dtype: torch.dtype) -> Tables:
    """The tables in the dtype of what they rotate: the same tensors at inference, where
    everything is in the model's dtype; a cast under autocast (training in bfloat16)."""
    return tables if tables[0].dtype == dtype else tuple(t.to(dtype) for t in tables)


@dataclass
class LayerState:
    """Committed state of one layer for a batch, in dense form.

    Absent parts are None (window-only layers have no buffer or entries).
    """

    raw_k: torch.Tensor                      # [B, Wc, d_h] keys at positions L-Wc .. L-1
    raw_valid: torch.Tensor                  # [B, Q, Wc] bool, which of them query n may see (Q = 1 or N)
    raw_pos: torch.Tensor                    # [B, Wc]
    buf: torch.Tensor | None = None          # [B, S, 2*c*d_h] compressor rows (a | g), positions L-S .. L-1
    entries: torch.Tensor | None = None      # [B, E, d_h]
    entries_valid: torch.Tensor | None = None  # [B, E] bool, e < L // r
    index_buf: torch.Tensor | None = None    # [B, S, 4*d_I] indexer compressor rows
    index_keys: torch.Tensor | None = None   # [B, E, d_I]


@dataclass
class LayerScratch:
    """What a forward's new nodes produced in one layer (the per-round scratch area)."""

    k: torch.Tensor                          # [B, N, d_h]
    rows: torch.Tensor | None = None         # [B, N, 2*c*d_h]
    entries: torch.Tensor | None = None      # [B, K, d_h], one per completing node
    index_rows: torch.Tensor | None = None   # [B, N, 4*d_I]
    index_keys: torch.Tensor | None = None   # [B, K, d_I]


def empty_layer_state(cfg: ModelConfig, compression: Compression, batch: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> LayerState:
    """The state of a layer before any token (training and the first prefill chunk)."""
    z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    st = LayerState(raw_k=z(batch, 0, cfg.head_dim), raw_valid=torch.zeros(batch, 1, 0, dtype=torch.bool, device=device),
                    raw_pos=torch.zeros(batch, 0, dtype=torch.long, device=device))
    if compression.ratio > 0:
        S, c = compression.buffer_rows, compression.row_groups
        st.buf = z(batch, S, 2 * c * cfg.head_dim)
        st.entries = z(batch, 0, cfg.head_dim)
        st.entries_valid = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        if compression.indexer:     # the indexer's own compressor pools like the layer's
            st.index_buf = z(batch, S, 2 * c * cfg.index_head_dim)
            st.index_keys = z(batch, 0, cfg.index_head_dim)
    return st


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one entry: per-channel softmax over gate rows.

    Overlapping (C4): entry i pools 2r rows, channels [:dim] of the previous block and
    channels [dim:] of the current block; the missing block before entry 0 is padding.
    Entries are rotated with the compressed layers' RoPE at their block-start position.
    """

    def __init__(self, d_model: int, compression: Compression, dim: int, cfg: ModelConfig):
        super().__init__()
        self.ratio, self.dim, self.overlap = compression.ratio, dim, compression.overlap
        width = compression.row_groups * dim
        self.wkv = Linear(d_model, width)
        self.wgate = Linear(d_model, width)
        self.ape = nn.Parameter(torch.zeros(self.ratio, width))
        self.norm = RMSNorm(dim, cfg.norm_eps)

    def rows(self, a: torch.Tensor, g: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """a, g: [B, N, width] the input's wkv and wgate projections; positions: [B, N]
        -> [B, N, 2*width] rows (a | g + ape)."""
        return torch.cat([a, g + self.ape[positions % self.ratio]], dim=-1)

    def pool(self, rows_all: torch.Tensor, plan: PoolPlan, rope: RopeTables) -> torch.Tensor:
        """rows_all: [B, S + N, 2*width] (committed buffer then new rows) -> entries [B, K, dim]."""
        B, K, span = plan.row_src.shape
        w = rows_all.shape[-1]
        picked = torch.gather(rows_all, 1, plan.row_src.reshape(B, K * span, 1).expand(B, K * span, w))
        picked = picked.view(B, K, span, w)
        a, g = picked.split(w // 2, dim=-1)                       # [B, K, span, width] each
        if self.overlap:
            r, d = self.ratio, self.dim
            a = torch.cat([a[:, :, :r, :d], a[:, :, r:, d:]], dim=2)  # [B, K, 2r, dim]
            g = torch.cat([g[:, :, :r, :d], g[:, :, r:, d:]], dim=2)
        pad = plan.row_pad[..., None]
        a = a.masked_fill(pad, 0.0)
        g = g.masked_fill(pad, float("-inf"))
        pooled = (torch.softmax(g, dim=2) * a).sum(dim=2)         # [B, K, dim]
        entries = self.norm(pooled)
        return rotate_pairs(entries, in_dtype(rope.entries[self.ratio], entries.dtype))


class Indexer(nn.Module):
    """Lightning indexer: ranks visible C4 entries with ReLU-weighted multi-head scores."""

    def __init__(self, cfg: ModelConfig, compression: Compression):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = cfg.index_num_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(cfg.d_model, self.num_heads)
        self.compressor = Compressor(cfg.d_model, compression, self.head_dim, cfg)
        self.scale = (self.num_heads * self.head_dim) ** -0.5

    def select(self, head_weights: torch.Tensor, c_q: torch.Tensor, rope: RopeTables,
               index_keys: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """head_weights: [B, N, H_I] the input's weights_proj projection; c_q: [B, N, q_lora];
        index_keys: [B, T, d_I]; visible: [B, N, T] bool.

        Returns the selected subset of `visible`: its top-k entries by index score.
        """
        B, N, _ = c_q.shape
        T = index_keys.shape[1]
        if T == 0:
            return visible
        q = self.wq_b(c_q).view(B, N, self.num_heads, self.head_dim)
        q = rotate_pairs(q, in_dtype(rope.nodes["compress"], q.dtype))
        w = head_weights * self.scale                              # [B, N, H_I]
        dots = torch.einsum("bnhd,btd->bnht", q, index_keys).relu()
        score = torch.einsum("bnh,bnht->bnt", w, dots)             # [B, N, T]
        score = score.masked_fill(~visible, float("-inf"))
        # ReLU makes exact ties common (all heads zero). A stable sort breaks them by entry
        # number, which every execution path lays out in the same order; topk would not.
        k = min(self.topk, T)
        top = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
        chosen = torch.zeros_like(visible).scatter_(-1, top, True)
        return chosen & visible


class Attention(nn.Module):
    """One V4 attention layer. It rotates with the main RoPE table when sliding-only, the
    compressed one (`layers.rope_tables`) when it compresses."""

    def __init__(self, cfg: ModelConfig, compression: Compression):
        super().__init__()
        self.cfg, self.ratio = cfg, compression.ratio
        H, dh = cfg.num_heads, cfg.head_dim
        self.rope_name = rope_table_of(compression)
        self.wq_a = Linear(cfg.d_model, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * dh)
        self.wkv = Linear(cfg.d_model, dh)
        self.kv_norm = RMSNorm(dh, cfg.norm_eps)
        if cfg.o_groups:
            # Grouped low-rank output: each group of heads to o_lora_rank, then all to d_model.
            self.wo_a = Linear(H * dh // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
            self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.d_model)
        else:
            self.wo = Linear(H * dh, cfg.d_model)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor = Compressor(cfg.d_model, compression, dh, cfg) if compression.ratio > 0 else None
        self.indexer = Indexer(cfg, compression) if compression.indexer else None
        self.input_proj = StackedLinear(self._input_weights)

    def _input_weights(self) -> list[torch.Tensor]:
        """Every projection of the layer's normed input, in the order `forward` unpacks them:
        wq_a, wkv, then the compressor's wkv and wgate, then the indexer's compressor wkv
        and wgate and its weights_proj."""
        ws = [self.wq_a.weight, self.wkv.weight]
        if self.compressor is not None:
            ws += [self.compressor.wkv.weight, self.compressor.wgate.weight]
        if self.indexer is not None:
            ic = self.indexer.compressor
            ws += [ic.wkv.weight, ic.wgate.weight, self.indexer.weights_proj.weight]
        return ws

    def forward(self, x: torch.Tensor, meta: ForwardMeta, state: LayerState, rope: RopeTables
                ) -> tuple[torch.Tensor, LayerScratch]:
        """x: [B, N, d_model] (normed) -> ([B, N, d_model], scratch)."""
        cfg = self.cfg
        B, N, _ = x.shape
        H, dh, W = cfg.num_heads, cfg.head_dim, cfg.window
        pos = meta.positions                                       # [B, N]

        q_a, kv, *rest = self.input_proj(x)                        # one matmul for all of x's projections
        c_q = self.q_norm(q_a)                                     # [B, N, q_lora]
        q = unit_rms(self.wq_b(c_q).view(B, N, H, dh), cfg.norm_eps)
        cs = in_dtype(rope.nodes[self.rope_name], x.dtype)
        q = rotate_pairs(q, cs)                                     # [B, N, H, d_h]
        k = rotate_pairs(self.kv_norm(kv), cs)                      # [B, N, d_h]
        scratch = LayerScratch(k=k)

        # Window: committed keys in range, plus ancestor-or-self new keys in range.
        lo = (pos - W + 1)[..., None]                              # [B, N, 1]
        win_committed = state.raw_valid & (state.raw_pos[:, None, :] >= lo)
        win_new = meta.ancestor & (pos[:, None, :] >= lo)
        keys = [state.raw_k, k]
        masks = [win_committed, win_new]

        if self.compressor is not None:
            plan = meta.pools[self.ratio]
            rows = self.compressor.rows(rest[0], rest[1], pos)
            new_entries = self.compressor.pool(torch.cat([state.buf, rows], dim=1), plan, rope)  # [B, K, d_h]
            scratch.rows, scratch.entries = rows, new_entries
            visible = torch.cat([state.entries_valid[:, None, :].expand(B, N, -1), plan.visible], dim=-1)
            if self.indexer is not None:
                idx = self.indexer
                index_rows = idx.compressor.rows(rest[2], rest[3], pos)
                new_index_keys = idx.compressor.pool(torch.cat([state.index_buf, index_rows], dim=1), plan, rope)
                scratch.index_rows, scratch.index_keys = index_rows, new_index_keys
                all_index_keys = torch.cat([state.index_keys, new_index_keys], dim=1)
                visible = idx.select(rest[4], c_q, rope, all_index_keys, visible)
            keys += [state.entries, new_entries]
            masks.append(visible)

        keys_all = torch.cat(keys, dim=1)                          # [B, T, d_h]; K = V
        mask = torch.cat(masks, dim=-1)                            # [B, N, T]
        scores = torch.einsum("bnhd,btd->bhnt", q, keys_all) * dh ** -0.5
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        sink = self.attn_sink.to(scores.dtype).view(1, H, 1, 1).expand(B, H, N, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        out = torch.einsum("bhnt,btd->bnhd", probs, keys_all)      # [B, N, H, d_h]
        out = rotate_pairs(out, cs, inverse=True)
        return self.output(out), scratch

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output per head [B, N, H, d_h] -> [B, N, d_model]."""
        B, N = out.shape[:2]
        if not self.cfg.o_groups:
            return self.wo(out.reshape(B, N, -1))
        g = self.cfg.o_groups
        grouped = out.reshape(B, N, g, -1)                         # [B, N, g, H*d_h/g]
        w = self.wo_a.weight.view(g, self.cfg.o_lora_rank, -1)     # [g, r, H*d_h/g]
        return self.wo_b(torch.einsum("bngi,gri->bngr", grouped, w).flatten(2))
