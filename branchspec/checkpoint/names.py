"""Tensor names: Hugging Face's and DeepSeek's spellings mapped to branchspec's, and the
plan that builds each branchspec tensor from a checkpoint's tensors (stacking per-expert
weights, splitting transformers' packed ``gate_up_proj``, pairing FP8 scales).

Export inverts the same plan (``export.invert_plan``), so one set of rules serves both ways.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# Foreign spellings -> branchspec's (DeepSeek's), applied in order to the whole name after
# a leading "model." is dropped. Per-expert and packed expert tensors are handled apart.
_RENAMES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),        # save_pretrained's reverse of kv_norm
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.o_proj\.", ".attn.wo."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.(shared_experts|experts\.\d+|ffn)\.gate_proj\.", r".\1.w1."),
    (r"\.(shared_experts|experts\.\d+|ffn)\.up_proj\.", r".\1.w3."),
    (r"\.(shared_experts|experts\.\d+|ffn)\.down_proj\.", r".\1.w2."),
    (r"\.experts\.down_proj$", ".experts.w2"),
))
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")
_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")
# DeepSeek's MTP block holds references to the shared embedding and head.
_MTP_ALIAS = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")


def canonical_name(name: str) -> str:
    """A tensor name in DeepSeek's / branchspec's spelling (experts not yet stacked)."""
    if name.startswith("model."):
        name = name[len("model."):]
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


@dataclass
class Recipe:
    """How one branchspec tensor is built from source tensors.

    op: "copy" (sources[0]), "stack" (sources in expert order, along a new dim 0), or
    "half0" / "half1" (the first / second half of sources[0] along dim 1, for
    transformers' packed gate_up_proj: gate first, then up).
    """

    op: str
    sources: list[str]


@dataclass
class NamePlan:
    recipes: dict[str, Recipe]                  # branchspec name -> recipe
    scales: dict[str, str]                      # FP8 weight (source name) -> its scale tensor
    duplicates: list[str] = field(default_factory=list)     # "a and b both give c"
    expert_gaps: list[str] = field(default_factory=list)    # missing per-expert sources


def _scale_companion(name: str, names: set[str]) -> str | None:
    """The weight a block-FP8 scale tensor belongs to, if ``name`` is one."""
    if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in names:
        return name[: -len("_scale_inv")]
    if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:
        return name[: -len(".scale")] + ".weight"
    return None


def plan_names(names: Iterable[str], rename: bool = True) -> NamePlan:
    """Map source tensor names (any supported spelling) to branchspec names.

    ``rename=False`` takes names as branchspec's own (FP8 scales still recognised): a
    branchspec checkpoint must spell every tensor exactly."""
    names = list(names)
    name_set = set(names)
    scales: dict[str, str] = {}
    for n in names:
        owner = _scale_companion(n, name_set)
        if owner is not None:
            scales[owner] = n
    scale_names = set(scales.values())
    recipes: dict[str, Recipe] = {}
    origin: dict[str, str] = {}
    plan = NamePlan(recipes, scales)
    stacks: dict[str, dict[int, str]] = {}

    def add(target: str, recipe: Recipe, source: str) -> None:
        if target in recipes:
            plan.duplicates.append(f"{origin[target]} and {source} both give {target}")
            return
        recipes[target] = recipe
        origin[target] = source

    for n in sorted(names):
        if n in scale_names:
            continue
        if not rename:
            add(n, Recipe("copy", [n]), n)
            continue
        c = canonical_name(n)
        if _MTP_ALIAS.match(c):
            continue
        m = _PER_EXPERT.match(c)
        if m:
            target = f"{m.group(1)}.{m.group(3)}"
            slot = stacks.setdefault(target, {})
            index = int(m.group(2))
            if index in slot:
                plan.duplicates.append(f"{slot[index]} and {n} both give expert {index} of {target}")
            slot[index] = n
            continue
        m = _GATE_UP.match(c)
        if m:
            add(f"{m.group(1)}.w1", Recipe("half0", [n]), n)
            add(f"{m.group(1)}.w3", Recipe("half1", [n]), n)
            continue
        add(c, Recipe("copy", [n]), n)
    for target, slot in sorted(stacks.items()):
        count = max(slot) + 1
        gaps = [i for i in range(count) if i not in slot]
        if gaps:
            some = slot[min(slot)]
            plan.expert_gaps += [re.sub(r"\.experts\.\d+\.", f".experts.{i}.", some) for i in gaps]
            continue
        add(target, Recipe("stack", [slot[i] for i in range(count)]), f"{slot[0]} ...")
    return plan
