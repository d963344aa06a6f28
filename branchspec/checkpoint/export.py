"""Write a branchspec model as a Hugging Face ``deepseek_v4`` folder.

The opposite of the HF loader (``hf_config``, ``names``): ``transformers.DeepseekV4ForCausalLM
.from_pretrained(folder)`` loads what ``export_hf`` writes, and so does branchspec's
``LLM(folder)``, MTP drafter included.

Tensor names are not spelled out here. They are the ``state_dict`` names of transformers'
own model for the exported config (built on the meta device: no memory, no init), mapped
to branchspec's names by ``names.plan_names``, the very rules the loader uses, and that
mapping is inverted. So every rename, the packed ``experts.gate_up_proj`` (gate half, then
up half, along dim 1) and any per-expert spelling are written exactly as they are read.

transformers has no MTP module (``num_nextn_predict_layers`` is recorded, the tensors are
skipped at load by its ``mtp.*`` ignore rule). The block is written under ``mtp.0.`` with
the names of a transformers decoder layer (sliding attention, scored MoE), its final norm
and hc head, beside DeepSeek's ``e_proj``/``h_proj``/``enorm``/``hnorm``: the loader maps
them back by the same renames as the layers'.

Some branchspec configs have no transformers equivalent (a dense FFN, no hyper-connections,
one output projection, ...); ``check_hf_expressible`` refuses them, naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from branchspec.atomic import save_safetensors
from branchspec.checkpoint.folder import (CARRIED_FILES, HF_MODEL_TYPE, WEIGHTS_FILE, check_new_folder,
                                          copy_tokenizer_files, new_folder)
from branchspec.checkpoint.hf_config import HF_LAYER_TYPES
from branchspec.checkpoint.names import plan_names
from branchspec.checkpoint.schema import expected_shapes
from branchspec.config import ModelConfig
from branchspec.model.dtypes import resolve_dtype
from branchspec.model.model import Transformer

HF_ARCHITECTURE = "DeepseekV4ForCausalLM"
# transformers' layer type for each compress ratio (hf_config's table, inverted; its sliding
# layers have no ratio, branchspec's 0).
_LAYER_TYPE_OF_RATIO = {ratio or 0: name for name, ratio in HF_LAYER_TYPES.items()}
_MTP_PREFIX = "mtp.0."
# MTP tensors with no counterpart in transformers' model keep DeepSeek's (branchspec's) names.
_MTP_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight")


class ExportError(ValueError):
    """A model transformers' DeepseekV4 cannot express; the message names the field."""


# -- config -----------------------------------------------------------------------------------


def _refusals(cfg: ModelConfig) -> list[str]:
    """Why transformers 5.23.0's DeepseekV4 would build a different model than ``cfg``."""
    out = []
    if cfg.num_experts == 0:
        out.append("num_experts = 0 (a dense FFN): transformers builds every layer as MoE")
    else:
        if cfg.num_shared_experts != 1:
            out.append(f"num_shared_experts = {cfg.num_shared_experts}: transformers builds exactly one "
                       "shared expert per layer")
        if cfg.scoring_func not in ("sqrtsoftplus", "sigmoid"):
            out.append(f"scoring_func = {cfg.scoring_func!r}: transformers' router activation table has "
                       "only 'sqrtsoftplus' and 'sigmoid'")
        if not cfg.norm_topk_prob:
            out.append("norm_topk_prob = false: transformers always renormalises the top-k weights")
        if cfg.swiglu_limit <= 0:
            out.append(f"swiglu_limit = {cfg.swiglu_limit:g} (no clamp): transformers always clamps "
                       "the SwiGLU at swiglu_limit")
    if cfg.hc_mult == 0:
        out.append("hc_mult = 0 (one plain residual): transformers always uses hyper-connections")
    if cfg.o_groups == 0:
        out.append("o_groups = 0 (one output projection): transformers always uses the grouped one")
    bad = sorted({r for r in cfg.compress_ratios if r not in _LAYER_TYPE_OF_RATIO})
    if bad:
        out.append(f"compress_ratios holds {bad}: transformers' layer types have ratios "
                   f"{sorted(_LAYER_TYPE_OF_RATIO)} only")
    if int(cfg.head_dim * (cfg.rope_dim / cfg.head_dim)) != cfg.rope_dim:
        out.append(f"rope_dim = {cfg.rope_dim}: head_dim * partial_rotary_factor does not give it back "
                   "exactly in floating point")
    return out


def check_hf_expressible(cfg: ModelConfig) -> None:
    """ExportError naming every field transformers' DeepseekV4 cannot express."""
    problems = _refusals(cfg)
    if problems:
        raise ExportError("cannot export to transformers' DeepseekV4: " + "; ".join(problems))


def hf_equivalent_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as an exported folder gives it back: the fields that mean nothing for this
    model (the dense FFN width with experts, YaRN's settings without YaRN, the ratio
    escape hatch, a None compress_rope_theta) take the values the HF reader gives them."""
    plain = ModelConfig()
    kw = dict(ffn_hidden=cfg.moe_hidden, allow_any_ratio=False,
              compress_rope_theta=cfg.compress_rope_theta if cfg.compress_rope_theta is not None else cfg.rope_theta)
    if cfg.yarn_factor == 1.0:
        kw.update(yarn_original_max_position=plain.yarn_original_max_position,
                  yarn_beta_fast=plain.yarn_beta_fast, yarn_beta_slow=plain.yarn_beta_slow)
    return replace(cfg, **kw)


def _hf_rope_parameters(cfg: ModelConfig, compress_theta: float) -> dict:
    """transformers' nested form: plain RoPE for sliding layers, YaRN (if any) for the
    compressed ones, with attention_factor 1 (DeepSeek-V4 does not scale cos/sin)."""
    partial = cfg.rope_dim / cfg.head_dim
    main = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": partial}
    compress = {"rope_type": "default", "rope_theta": compress_theta, "partial_rotary_factor": partial}
    if cfg.yarn_factor > 1.0:
        compress.update(rope_type="yarn", factor=cfg.yarn_factor, attention_factor=1.0,
                        original_max_position_embeddings=cfg.yarn_original_max_position,
                        beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow)
    return {"main": main, "compress": compress}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config_from_branchspec(cfg: ModelConfig, *, dtype: torch.dtype | None = None,
                              extra_stop_ids: Sequence[int] = ()) -> dict:
    """The ``config.json`` dict transformers' DeepseekV4 reads for ``cfg``.

    ``hf_config.hf_config_to_branchspec`` reads it back as ``hf_equivalent_config(cfg)``.
    ``dtype`` is recorded as ``dtype`` (transformers 5's key; ``torch_dtype`` is its
    deprecated spelling); ``extra_stop_ids`` follow eos in an ``eos_token_id`` list.
    ExportError naming the field for a config transformers cannot express.
    """
    check_hf_expressible(cfg)
    compress_theta = cfg.compress_rope_theta if cfg.compress_rope_theta is not None else cfg.rope_theta
    eos = [cfg.eos_token_id, *(i for i in dict.fromkeys(extra_stop_ids) if i != cfg.eos_token_id)]
    d = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1,
        "head_dim": cfg.head_dim,
        "partial_rotary_factor": cfg.rope_dim / cfg.head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "sliding_window": cfg.window,
        "layer_types": [_LAYER_TYPE_OF_RATIO[r] for r in cfg.compress_ratios],
        "compress_rates": {name: ratio for name, ratio in HF_LAYER_TYPES.items() if ratio},
        "index_n_heads": cfg.index_num_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "moe_intermediate_size": cfg.moe_hidden,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_shared_experts": cfg.num_shared_experts,
        "scoring_func": cfg.scoring_func,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "mlp_layer_types": ["hash_moe" if i < cfg.num_hash_layers else "moe" for i in range(cfg.num_layers)],
        "swiglu_limit": cfg.swiglu_limit,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": cfg.rope_theta,
        "compress_rope_theta": compress_theta,
        "rope_parameters": _hf_rope_parameters(cfg, compress_theta),
        "max_position_embeddings": cfg.max_position,
        "rms_norm_eps": cfg.norm_eps,
        "num_nextn_predict_layers": cfg.num_mtp_layers,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos if len(eos) > 1 else eos[0],
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": False,
        "use_cache": True,
    }
    if dtype is not None:
        d["dtype"] = _dtype_name(dtype)
    return d


# -- tensor names -----------------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("exporting to Hugging Face needs transformers (pip install 'branchspec[hf]'): "
                          "the tensor names come from its DeepseekV4 model") from e
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        raise ImportError(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM; "
                          "install transformers==5.23.0 (branchspec[hf])")
    return transformers


def hf_state_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Names and shapes of transformers' DeepseekV4ForCausalLM state_dict for a config dict,
    from a model built on the meta device (no weights are allocated or initialised)."""
    transformers = _transformers()
    config = transformers.DeepseekV4Config.from_dict(dict(hf_config))
    with torch.device("meta"):
        model = transformers.DeepseekV4ForCausalLM(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _mtp_shapes(hf_config: dict, main: Mapping[str, tuple[int, ...]], d_model: int) -> dict[str, tuple[int, ...]]:
    """HF-style names (and shapes) for the MTP block, which transformers does not build.

    A one-layer model with a sliding-attention scored-MoE layer, the MTP block's kind,
    gives the layer's names; the final norm and hc head come from the main model.
    """
    one = dict(hf_config, num_hidden_layers=1, layer_types=[_LAYER_TYPE_OF_RATIO[0]], mlp_layer_types=["moe"])
    layer = {k.removeprefix("model.layers.0."): s for k, s in hf_state_shapes(one).items()
             if k.startswith("model.layers.0.")}
    top = {k.removeprefix("model."): s for k, s in main.items() if k.startswith(("model.norm.", "model.hc_head."))}
    own = {n: ((d_model, d_model) if "proj" in n else (d_model,)) for n in _MTP_OWN}
    return {_MTP_PREFIX + n: s for n, s in {**layer, **top, **own}.items()}


@dataclass(frozen=True)
class HFRecipe:
    """How one HF tensor is built from branchspec tensors (``names.Recipe`` inverted).

    op: "copy" (sources[0]), "expert" (expert ``index`` of the stacked sources[0]) or
    "cat" (sources[0] then sources[1] along dim 1: transformers' packed gate_up_proj).
    """

    op: str
    sources: tuple[str, ...]
    index: int = 0


def invert_plan(hf_names: Iterable[str]) -> dict[str, HFRecipe]:
    """For each HF name, the branchspec tensors it is made of, by inverting
    ``plan_names`` (so export and load share one set of rules)."""
    plan = plan_names(hf_names)
    if plan.duplicates or plan.expert_gaps:
        raise ExportError(f"HF names that branchspec's loader cannot read back: "
                          f"{plan.duplicates + plan.expert_gaps}")
    out: dict[str, HFRecipe] = {}
    halves: dict[str, dict[str, str]] = {}
    for target, recipe in plan.recipes.items():
        if recipe.op == "copy":
            out[recipe.sources[0]] = HFRecipe("copy", (target,))
        elif recipe.op == "stack":
            for i, source in enumerate(recipe.sources):
                out[source] = HFRecipe("expert", (target,), i)
        else:
            halves.setdefault(recipe.sources[0], {})[recipe.op] = target
    for source, parts in halves.items():
        out[source] = HFRecipe("cat", (parts["half0"], parts["half1"]))
    return out


def hf_tensor_plan(cfg: ModelConfig) -> tuple[dict[str, HFRecipe], dict[str, tuple[int, ...]]]:
    """(HF name -> recipe, HF name -> shape) for exporting a model of ``cfg``.

    Every branchspec tensor must be used exactly once; a gap is a bug in the name rules
    and is reported with the tensors involved.
    """
    hf_config = hf_config_from_branchspec(cfg)
    shapes = hf_state_shapes(hf_config)
    if cfg.num_mtp_layers:
        shapes.update(_mtp_shapes(hf_config, shapes, cfg.d_model))
    recipes = invert_plan(shapes)
    used = [s for r in recipes.values() for s in r.sources]
    want = set(expected_shapes(cfg))
    missing, extra = sorted(want - set(used)), sorted(set(used) - want)
    if missing or extra:
        raise ExportError(f"transformers' DeepseekV4 names do not cover branchspec's model: "
                          f"branchspec tensors with no HF name {missing}, HF names for unknown tensors {extra}")
    return recipes, shapes


def to_hf_tensors(state: Mapping[str, torch.Tensor], recipes: Mapping[str, HFRecipe],
                  shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF tensors from branchspec's state_dict; floats cast to ``dtype`` (None: as they
    are), integer tables kept integer. ExportError naming any tensor of the wrong shape."""
    out, bad = {}, []
    for name, recipe in recipes.items():
        parts = [state[s] for s in recipe.sources]
        if recipe.op == "expert":
            t = parts[0][recipe.index].clone()         # its own storage: safetensors refuses shared ones
        elif recipe.op == "cat":
            t = torch.cat(parts, dim=1)                 # [E, I, D] x2 -> [E, 2I, D]: gate, then up
        else:
            t = parts[0]
        if tuple(t.shape) != tuple(shapes[name]):
            bad.append(f"{name}: built {tuple(t.shape)}, transformers expects {tuple(shapes[name])}")
            continue
        if t.is_floating_point() and dtype is not None:
            t = t.to(dtype)
        out[name] = t.detach().cpu().contiguous()
    if bad:
        raise ExportError(f"mis-shaped HF tensors: {bad}")
    return out


# -- folders ----------------------------------------------------------------------------------


def _generation_config(hf_config: dict) -> dict:
    """HF generate's defaults: the model's special ids (an eos list included)."""
    return {"_from_model_config": True, **{k: hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}}


def write_hf_folder(model: Transformer, out: Path, dtype: torch.dtype | None, extra_stop_ids: Sequence[int],
                    copy_from: Path | None) -> Path:
    """``export_hf``'s folder, with ``copy_from``'s tokenizer files and draft vocabulary
    beside it (None: none)."""
    target = resolve_dtype(dtype) if dtype is not None else None   # fail before writing anything
    check_new_folder(out)
    hf_config = hf_config_from_branchspec(model.cfg, dtype=target or model.embed.weight.dtype,
                                          extra_stop_ids=extra_stop_ids)
    recipes, shapes = hf_tensor_plan(model.cfg)
    tensors = to_hf_tensors(model.state_dict(), recipes, shapes, target)
    with new_folder(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n", encoding="utf-8")
        (tmp / "generation_config.json").write_text(json.dumps(_generation_config(hf_config), indent=2) + "\n",
                                                    encoding="utf-8")
        save_safetensors(tensors, tmp / WEIGHTS_FILE, {"format": "pt"})
        if copy_from is not None:
            copy_tokenizer_files(copy_from, tmp, [n for n in CARRIED_FILES if n != "generation_config.json"])
    return out


def export_hf(model: Transformer, folder: str | Path, dtype: str | torch.dtype | None = None,
              extra_stop_ids: Sequence[int] = ()) -> Path:
    """Write ``model`` as a Hugging Face ``deepseek_v4`` folder: config.json,
    generation_config.json and model.safetensors (floats in ``dtype``; None keeps the
    model's), MTP block included when the model has one.

    ``folder`` must not exist or be empty; nothing is left there if the export fails.
    ExportError naming the field for a config transformers cannot express; ImportError
    without transformers (the names come from its model).
    """
    return write_hf_folder(model, Path(folder), dtype, extra_stop_ids, None)


__all__ = ["ExportError", "HFRecipe", "check_hf_expressible", "export_hf", "hf_config_from_branchspec",
           "hf_equivalent_config", "hf_state_shapes", "hf_tensor_plan", "invert_plan", "to_hf_tensors",
           "write_hf_folder"]
