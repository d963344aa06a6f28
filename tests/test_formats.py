"""Other checkpoint formats (Hugging Face deepseek_v4, DeepSeek's original) mapped onto
branchspec's: configs, tensor names, FP8 dequantisation, folder reading, the foreign
tokenizer and `branchspec convert`.

The mapping is tested on plain dicts against branchspec's state_dict schema
(`expected_shapes`, itself checked against the Transformer), and on folders written by
transformers' own `save_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from branchspec.checkpoint import (
    CheckpointError,
    checkpoint_stop_ids,
    convert_checkpoint,
    detect_format,
    load_checkpoint,
    open_checkpoint,
    save_checkpoint,
)
from branchspec.checkpoint.deepseek_config import deepseek_config_to_branchspec
from branchspec.checkpoint.folder import FORMAT_BRANCHSPEC, FORMAT_DEEPSEEK, FORMAT_HF
from branchspec.checkpoint.fp8 import dequantize_fp8_blocks
from branchspec.checkpoint.hf_config import hf_config_extras, hf_config_to_branchspec
from branchspec.checkpoint.load import to_branchspec_tensors
from branchspec.checkpoint.names import canonical_name, plan_names
from branchspec.checkpoint.schema import expected_shapes, is_integer_tensor
from branchspec.cli import main as cli_main
from branchspec.config import ConfigError, ModelConfig, tiny_config, tiny_v4_config
from branchspec.model.init import random_model

HAS_FP8 = hasattr(torch, "float8_e4m3fn")
HAS_E8M0 = hasattr(torch, "float8_e8m0fnu")
HAS_FP4 = hasattr(torch, "float4_e2m1fn_x2")


# -- helpers --------------------------------------------------------------------------------


def random_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A branchspec state_dict for cfg from the schema: random floats, a valid hash table."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if is_integer_tensor(name):
            out[name] = torch.randint(0, cfg.num_experts, shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g)
    return out


def fp8_quantize(w: torch.Tensor, seed: int = 0, block: int = 128, e8m0: bool = False):
    """(fp8 weight, per-block scale, the dequantised weight the loader must produce)."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = w.shape
    nb = (math.ceil(rows / block), math.ceil(cols / block))
    scale = 2.0 ** torch.randint(-3, 3, nb, generator=g).float()   # exact in e8m0 and float32
    full = scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    q = (w / full).to(torch.float8_e4m3fn)
    stored = scale.to(torch.float8_e8m0fnu) if e8m0 else scale
    return q, stored, q.float() * full


def to_deepseek(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek's original naming: experts one by one, tid2eid as int32."""
    out = {}
    for k, v in state.items():
        if ".experts.w" in k:
            prefix, w = k.rsplit(".", 1)
            for i in range(v.shape[0]):
                out[f"{prefix}.{i}.{w}.weight"] = v[i].clone()
        elif k.endswith("tid2eid"):
            out[k] = v.to(torch.int32)
        else:
            out[k] = v
    return out


# branchspec -> transformers' in-memory module names (the table the brief gives), written
# out independently of checkpoint/names.py's rules.
_HF_BLOCK = [
    ("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("attn.wq_a.weight", "self_attn.q_a_proj.weight"), ("attn.q_norm.weight", "self_attn.q_a_norm.weight"),
    ("attn.wq_b.weight", "self_attn.q_b_proj.weight"), ("attn.wkv.weight", "self_attn.kv_proj.weight"),
    ("attn.kv_norm.weight", "self_attn.kv_norm.weight"), ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wo_a.weight", "self_attn.o_a_proj.weight"), ("attn.wo_b.weight", "self_attn.o_b_proj.weight"),
    ("attn.compressor.wkv.weight", "self_attn.compressor.kv_proj.weight"),
    ("attn.compressor.wgate.weight", "self_attn.compressor.gate_proj.weight"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.norm.weight", "self_attn.compressor.kv_norm.weight"),
    ("attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    ("attn.indexer.weights_proj.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    ("attn.indexer.compressor.wkv.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    ("attn.indexer.compressor.wgate.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.norm.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.weight", "mlp.gate.weight"), ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"), ("ffn.experts.w2", "mlp.experts.down_proj"),
    ("ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"),
    ("ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"),
    ("ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"),
]
_HF_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "head.weight": "lm_head.weight", "hc_head_fn": "model.hc_head.hc_fn",
           "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}


def to_hf_native(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' module names; experts packed as gate_up_proj [E, 2I, d] (gate first)."""
    out = {}
    for k, v in state.items():
        if k in _HF_TOP:
            out[_HF_TOP[k]] = v
            continue
        if k.startswith("mtp."):
            continue   # transformers has no MTP module
        layer, rest = k.split(".", 2)[1], k.split(".", 2)[2]
        if rest == "ffn.experts.w1":
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat(
                [v, state[f"layers.{layer}.ffn.experts.w3"]], dim=1)
            continue
        if rest == "ffn.experts.w3":
            continue
        out[f"model.layers.{layer}.{dict(_HF_BLOCK)[rest]}"] = v
    return out


def hf_dict_for(cfg: ModelConfig, **overrides) -> dict:
    """A transformers DeepseekV4Config.to_dict() for a branchspec config."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    types = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, head_dim=cfg.head_dim, partial_rotary_factor=cfg.rope_dim / cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, sliding_window=cfg.window, index_n_heads=cfg.index_num_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, moe_intermediate_size=cfg.moe_hidden,
        max_position_embeddings=cfg.max_position, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        scoring_func=cfg.scoring_func, routed_scaling_factor=cfg.routed_scaling_factor,
        swiglu_limit=cfg.swiglu_limit, rms_norm_eps=cfg.norm_eps, num_nextn_predict_layers=cfg.num_mtp_layers,
        layer_types=[types[r] for r in cfg.compress_ratios],
        mlp_layer_types=["hash_moe" if i < cfg.num_hash_layers else "moe" for i in range(cfg.num_layers)],
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id)
    if cfg.yarn_factor > 1:
        kwargs["rope_parameters"] = {"rope_type": "yarn", "factor": cfg.yarn_factor,
                                     "original_max_position_embeddings": cfg.yarn_original_max_position,
                                     "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow}
    kwargs.update(overrides)
    return transformers.DeepseekV4Config(**kwargs).to_dict()


def deepseek_dict_for(cfg: ModelConfig, **overrides) -> dict:
    """DeepSeek's ModelArgs config.json for a branchspec config (MTP ratio appended)."""
    d = dict(vocab_size=cfg.vocab_size, dim=cfg.d_model, n_layers=cfg.num_layers, n_heads=cfg.num_heads,
             moe_inter_dim=cfg.moe_hidden, n_routed_experts=cfg.num_experts,
             n_activated_experts=cfg.num_experts_per_tok, n_shared_experts=cfg.num_shared_experts,
             n_hash_layers=cfg.num_hash_layers, n_mtp_layers=cfg.num_mtp_layers, score_func=cfg.scoring_func,
             route_scale=cfg.routed_scaling_factor, swiglu_limit=cfg.swiglu_limit, q_lora_rank=cfg.q_lora_rank,
             head_dim=cfg.head_dim, rope_head_dim=cfg.rope_dim, norm_eps=cfg.norm_eps, o_groups=cfg.o_groups,
             o_lora_rank=cfg.o_lora_rank, window_size=cfg.window,
             compress_ratios=[*cfg.compress_ratios] + [0] * cfg.num_mtp_layers,
             compress_rope_theta=cfg.compress_rope_theta, original_seq_len=cfg.yarn_original_max_position,
             rope_theta=cfg.rope_theta, rope_factor=cfg.yarn_factor, beta_fast=cfg.yarn_beta_fast,
             beta_slow=cfg.yarn_beta_slow, index_n_heads=cfg.index_num_heads, index_head_dim=cfg.index_head_dim,
             index_topk=cfg.index_topk, hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
             hc_eps=cfg.hc_eps, max_seq_len=cfg.max_position, dtype="fp8", scale_fmt="ue8m0")
    d.update(overrides)
    return d


# tiny_v4_config as HF and DeepSeek can express it: one FFN width (moe_hidden), pad = eos.
V4 = tiny_v4_config(ffn_hidden=24, pad_token_id=1)


# -- FP8 ---------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_FP8, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("scale_dtype", ["float32", "float8_e8m0fnu"])
def test_dequantize_fp8_blocks_elementwise(scale_dtype):
    if scale_dtype == "float8_e8m0fnu" and not HAS_E8M0:
        pytest.skip("this torch has no float8_e8m0fnu")
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 200, generator=g) * 3).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=g) * 4 + 0.1           # ceil(300/128) x ceil(200/128)
    if scale_dtype == "float8_e8m0fnu":
        scale = scale.to(torch.float8_e8m0fnu)                 # powers of two
    out = dequantize_fp8_blocks(weight, scale)
    assert out.dtype == torch.float32 and out.shape == (300, 200)
    w, s = weight.float(), scale.float()
    for i in list(range(0, 300, 7)) + [127, 128, 255, 256, 299]:
        for j in list(range(0, 200, 11)) + [127, 128, 199]:
            assert out[i, j].item() == (w[i, j] * s[i // 128, j // 128]).item(), (i, j)   # float32
    rows = torch.arange(300) // 128
    cols = torch.arange(200) // 128
    assert torch.equal(out, w * s[rows][:, cols])


@pytest.mark.skipif(not HAS_FP8, reason="this torch has no float8_e4m3fn")
def test_dequantize_fp8_blocks_stacked_and_bad_scale():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(3, 130, 64, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, 1, generator=g) + 0.5
    out = dequantize_fp8_blocks(weight, scale)
    for e in range(3):
        assert torch.equal(out[e], dequantize_fp8_blocks(weight[e], scale[e]))
    assert torch.equal(dequantize_fp8_blocks(weight[0], torch.ones(3, 2), block=(64, 32)), weight[0].float())
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequantize_fp8_blocks(weight[0], torch.ones(1, 1))


# -- configs ------------------------------------------------------------------------------------


def test_hf_default_config_maps():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    d = transformers.DeepseekV4Config().to_dict()
    cfg = ModelConfig(**hf_config_to_branchspec(d))
    assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.rope_dim) == (4096, 43, 64, 512, 64)
    assert cfg.compress_ratios[:4] == (128, 128, 128, 4) and len(cfg.compress_ratios) == 43
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_hidden, cfg.num_hash_layers) == (256, 6, 2048, 3)
    assert (cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult, cfg.window, cfg.index_topk) == (8, 1024, 4, 128, 512)
    assert cfg.compress_rope_theta == 160000.0 and cfg.yarn_factor == 1.0
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 1)   # pad None -> eos
    assert cfg.num_mtp_layers == 1
    assert hf_config_extras(d).extra_stop_ids == ()


def test_hf_small_config_maps_to_tiny_v4():
    d = hf_dict_for(V4)
    assert d["rope_parameters"]["compress"]["attention_factor"] == 1.0   # what transformers writes
    assert ModelConfig(**hf_config_to_branchspec(d)) == V4
    assert json.dumps(hf_config_to_branchspec(d))   # plain JSON values


def test_hf_legacy_keys_map_like_modern_ones():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    modern = hf_config_to_branchspec(hf_dict_for(V4))
    legacy = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, head_dim=16,
                  qk_rope_head_dim=8, q_lora_rank=16, sliding_window=8, index_n_heads=2, index_head_dim=8,
                  index_topk=3, moe_intermediate_size=24, max_position_embeddings=1024, o_groups=2,
                  o_lora_rank=8, hc_mult=2, n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5,
                  compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1, swiglu_limit=10.0,
                  rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                                "beta_fast": 32, "beta_slow": 1})
    # as the hub ships it (legacy keys, no transformers involved) ...
    raw = {"model_type": "deepseek_v4", **legacy}
    assert hf_config_to_branchspec(raw) == modern
    # ... and after transformers has folded the legacy keys in
    assert hf_config_to_branchspec(transformers.DeepseekV4Config(**legacy).to_dict()) == modern


def test_hf_eos_list_and_tied_embeddings():
    d = hf_dict_for(V4, eos_token_id=[5, 1, 7], pad_token_id=None, tie_word_embeddings=True)
    kw = hf_config_to_branchspec(d)
    assert (kw["eos_token_id"], kw["pad_token_id"]) == (5, 5)
    extras = hf_config_extras(d)
    assert extras.extra_stop_ids == (1, 7) and extras.tie_word_embeddings


def test_hf_mtp_follows_the_weights():
    d = hf_dict_for(V4)
    assert hf_config_to_branchspec(d)["num_mtp_layers"] == 1
    assert hf_config_to_branchspec(d, tensor_names=["model.embed_tokens.weight"])["num_mtp_layers"] == 0
    assert hf_config_to_branchspec(d, tensor_names=["mtp.0.e_proj.weight"])["num_mtp_layers"] == 1


def _refused(d: dict, *patterns: str, fn=hf_config_to_branchspec) -> str:
    with pytest.raises(ConfigError) as info:
        fn(d, source="ckpt/config.json")
    msg = str(info.value)
    assert msg.startswith("ckpt/config.json: ")
    for p in patterns:
        assert p in msg, msg
    return msg


def test_hf_yarn_attention_factor_must_be_one():
    d = hf_dict_for(V4)
    d["rope_parameters"]["compress"]["attention_factor"] = 1.2
    _refused(d, "attention_factor", "1.2")
    del d["rope_parameters"]["compress"]["attention_factor"]     # nested, no factor: HF would derive one
    _refused(d, "attention_factor", "missing")
    d["rope_parameters"]["compress"]["attention_factor"] = 1.0
    assert hf_config_to_branchspec(d)["yarn_factor"] == 16.0
    flat = dict(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    assert hf_config_to_branchspec(flat)["yarn_factor"] == 4.0    # flat: transformers sets 1
    flat["rope_parameters"]["attention_factor"] = 0.9
    _refused(flat, "attention_factor")


@pytest.mark.parametrize("change,patterns", [
    (lambda d: d.pop("hidden_size"), ["hidden_size", "missing"]),
    (lambda d: d.pop("layer_types"), ["layer_types", "missing"]),
    (lambda d: (d.pop("partial_rotary_factor"), d.pop("qk_rope_head_dim")), ["partial_rotary_factor"]),
    (lambda d: d.update(hidden_size=32.5), ["hidden_size must be an integer"]),
    (lambda d: d.update(hidden_size="32"), ["hidden_size must be an integer"]),
    (lambda d: d.update(rms_norm_eps="x"), ["rms_norm_eps must be a number"]),
    (lambda d: d.update(num_key_value_heads=2), ["num_key_value_heads"]),
    (lambda d: d.update(hidden_act="gelu"), ["hidden_act"]),
    (lambda d: d.update(mlp_layer_types=["moe", "hash_moe", "moe", "moe"]), ["mlp_layer_types", "hash_moe"]),
    (lambda d: d.update(mlp_layer_types=["hash_moe", "dense", "moe", "moe"]), ["mlp_layer_types[1]"]),
    (lambda d: d.update(layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                     "sliding_attention"]), ["layer_types[1]"]),
    (lambda d: d["compress_rates"].update(compressed_sparse_attention=8), ["compress_rates"]),
    (lambda d: d.update(layer_types=["sliding_attention"] * 3), ["layer_types has 3 entries"]),
    (lambda d: d.update(n_shared_experts=2), ["n_shared_experts"]),
    (lambda d: d.update(num_nextn_predict_layers=2), ["num_nextn_predict_layers"]),
    (lambda d: d.update(partial_rotary_factor=0.3), ["partial_rotary_factor"]),
    (lambda d: d.update(scoring_func="relu"), ["scoring_func"]),
    (lambda d: d.update(num_experts_per_tok=9), ["num_experts_per_tok"]),
    (lambda d: d.update(quantization_config={"quant_method": "gptq"}), ["quant_method"]),
    (lambda d: d["rope_parameters"]["main"].update(rope_type="yarn"), ["main.rope_type"]),
])
def test_hf_config_problems_name_file_and_field(change, patterns):
    d = hf_dict_for(V4)
    change(d)
    _refused(d, *patterns)


def test_deepseek_config_maps():
    d = deepseek_dict_for(V4)
    assert ModelConfig(**deepseek_config_to_branchspec(d)) == V4
    # no YaRN unless original_seq_len > 0, whatever rope_factor says
    kw = deepseek_config_to_branchspec(dict(d, original_seq_len=0, rope_factor=40))
    assert kw.get("yarn_factor", 1.0) == 1.0
    # DeepSeek renormalises the top-k weights for every score function but softmax
    assert deepseek_config_to_branchspec(dict(d, score_func="softmax"))["norm_topk_prob"] is False
    assert deepseek_config_to_branchspec(dict(d, score_func="sigmoid"))["norm_topk_prob"] is True
    # the MTP entry of compress_ratios is optional
    assert deepseek_config_to_branchspec(dict(d, compress_ratios=[0, 4, 128, 4]))["compress_ratios"] == [0, 4, 128, 4]
    assert deepseek_config_to_branchspec(d, tensor_names=["layers.0.attn.wkv.weight"])["num_mtp_layers"] == 0


@pytest.mark.parametrize("change,patterns", [
    (lambda d: d.pop("dim"), ["dim", "missing"]),
    (lambda d: d.pop("compress_ratios"), ["compress_ratios", "missing"]),
    (lambda d: d.update(compress_ratios=[0, 4, 128, 4, 4]), ["compress_ratios", "must be 0"]),
    (lambda d: d.update(compress_ratios=[0, 4, 128]), ["compress_ratios has 3 entries"]),
    (lambda d: d.update(compress_ratios=[0, 4, 64, 4, 0]), ["compress_ratios[2] = 64"]),
    (lambda d: d.update(n_heads=2.0), ["n_heads must be an integer"]),
    (lambda d: d.update(rope_head_dim=7), ["rope_dim", "rope_head_dim"]),
])
def test_deepseek_config_problems(change, patterns):
    d = deepseek_dict_for(V4)
    change(d)
    _refused(d, *patterns, fn=deepseek_config_to_branchspec)


# -- branchspec's schema ---------------------------------------------------------------------------


SCHEMA_CONFIGS = [
    pytest.param(tiny_config(), id="tiny"),
    pytest.param(tiny_config(num_mtp_layers=0), id="tiny-no-mtp"),
    pytest.param(tiny_v4_config(), id="tiny-v4"),
    pytest.param(tiny_v4_config(hc_mult=0, o_groups=0, num_shared_experts=0, num_hash_layers=0), id="v4-parts-off"),
    pytest.param(tiny_v4_config(num_experts=0, num_hash_layers=0, num_mtp_layers=0), id="v4-dense"),
]


@pytest.mark.parametrize("cfg", SCHEMA_CONFIGS)
def test_expected_shapes_match_the_transformer(cfg):
    """The schema the mapping checks against is the model's own state_dict."""
    from branchspec.model.model import Transformer

    state = Transformer(cfg).state_dict()
    assert expected_shapes(cfg) == {k: tuple(v.shape) for k, v in state.items()}
    assert {k for k, v in state.items() if not v.is_floating_point()} == {k for k in state if is_integer_tensor(k)}


def test_the_schema_leaves_no_meta_tensor_behind():
    """The schema's model is built on the meta device and dropped: afterwards the default
    device is still the CPU, no branchspec module holds a meta tensor, and a real model
    still runs."""
    import sys

    from branchspec.model.metadata import chain_meta

    cfg = tiny_v4_config()
    expected_shapes(cfg)
    assert torch.empty(()).device.type == "cpu"

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from tensors(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v)

    found = [f"{name}.{key}" for name, module in list(sys.modules.items()) if name.startswith("branchspec")
             for key, value in vars(module).items() for t in tensors(value) if t.is_meta]
    assert found == []
    model = random_model(cfg, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids, chain_meta(torch.zeros(1, dtype=torch.long), 3, cfg.compressed_kinds))
    assert out.logits.shape == (1, 3, cfg.vocab_size) and torch.isfinite(out.logits).all()


# -- names -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("source,target", [
    # transformers' module names
    ("model.embed_tokens.weight", "embed.weight"),
    ("lm_head.weight", "head.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.layers.3.self_attn.q_a_proj.weight", "layers.3.attn.wq_a.weight"),
    ("model.layers.3.self_attn.kv_norm.weight", "layers.3.attn.kv_norm.weight"),
    ("model.layers.3.self_attn.sinks", "layers.3.attn.attn_sink"),
    ("model.layers.1.self_attn.compressor.indexer.position_bias", "layers.1.attn.indexer.compressor.ape"),
    ("model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
     "layers.1.attn.indexer.weights_proj.weight"),
    ("model.layers.1.self_attn.compressor.kv_norm.weight", "layers.1.attn.compressor.norm.weight"),
    ("model.layers.0.attn_hc.scale", "layers.0.hc_attn_scale"),
    ("model.layers.0.mlp.gate.e_score_correction_bias", "layers.0.ffn.gate.bias"),
    ("model.layers.0.mlp.shared_experts.up_proj.weight", "layers.0.ffn.shared_experts.w3.weight"),
    ("model.layers.0.mlp.experts.down_proj", "layers.0.ffn.experts.w2"),
    # save_pretrained's default spelling
    ("head.weight", "head.weight"),
    ("model.layers.2.attn.norm.weight", "layers.2.attn.kv_norm.weight"),
    ("model.layers.2.attn.compressor.norm.weight", "layers.2.attn.compressor.norm.weight"),
    ("model.layers.0.hc_ffn_fn", "layers.0.hc_ffn_fn"),
    # DeepSeek / branchspec names are fixed points
    ("layers.0.attn.kv_norm.weight", "layers.0.attn.kv_norm.weight"),
    ("mtp.0.hc_head_base", "mtp.0.hc_head_base"),
    ("mtp.0.e_proj.weight", "mtp.0.e_proj.weight"),
    ("layers.0.ffn.w2.weight", "layers.0.ffn.w2.weight"),
])
def test_canonical_name(source, target):
    assert canonical_name(source) == target


def test_every_branchspec_name_is_a_fixed_point():
    for name in expected_shapes(tiny_v4_config()) | expected_shapes(tiny_config()):
        assert canonical_name(name) == name


def test_plan_stacks_splits_and_finds_scales():
    plan = plan_names(["layers.0.ffn.experts.1.w1.weight", "layers.0.ffn.experts.0.w1.weight",
                       "layers.0.ffn.experts.0.w1.scale", "model.layers.1.mlp.experts.gate_up_proj",
                       "model.layers.1.self_attn.kv_proj.weight", "model.layers.1.self_attn.kv_proj.weight_scale_inv",
                       "model.layers.1.attn_hc.scale", "mtp.0.embed.weight"])
    assert plan.recipes["layers.0.ffn.experts.w1"].op == "stack"
    assert plan.recipes["layers.0.ffn.experts.w1"].sources == ["layers.0.ffn.experts.0.w1.weight",
                                                               "layers.0.ffn.experts.1.w1.weight"]
    assert plan.recipes["layers.1.ffn.experts.w1"].op == "half0"
    assert plan.recipes["layers.1.ffn.experts.w3"].op == "half1"
    assert plan.scales == {"layers.0.ffn.experts.0.w1.weight": "layers.0.ffn.experts.0.w1.scale",
                           "model.layers.1.self_attn.kv_proj.weight":
                               "model.layers.1.self_attn.kv_proj.weight_scale_inv"}
    assert "layers.1.hc_attn_scale" in plan.recipes          # not mistaken for an FP8 scale
    assert not any(k.startswith("mtp.0.embed") for k in plan.recipes)   # DeepSeek's alias of embed


# -- tensors ---------------------------------------------------------------------------------------


def _assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_branchspec_names_map_to_themselves():
    state = random_state(tiny_v4_config())
    _assert_same(to_branchspec_tensors(state, tiny_v4_config()), state)


@pytest.mark.skipif(not HAS_FP8, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("e8m0", [False, True])
def test_deepseek_tensors_with_fp8(e8m0):
    if e8m0 and not HAS_E8M0:
        pytest.skip("this torch has no float8_e8m0fnu")
    cfg = tiny_v4_config(d_model=160, vocab_size=300)     # 2-D weights larger than one 128-block
    state = random_state(cfg)
    source = to_deepseek(state)
    expected = dict(state)
    for name in ("layers.1.attn.wq_a.weight", "layers.0.attn.wo_b.weight", "head.weight",
                 "layers.2.ffn.experts.3.w2.weight", "mtp.0.ffn.shared_experts.w1.weight"):
        q, scale, deq = fp8_quantize(source[name], seed=len(name), e8m0=e8m0)
        source[name] = q
        source[name[: -len(".weight")] + ".scale"] = scale
        if ".experts.3." in name:
            expected["layers.2.ffn.experts.w2"] = state["layers.2.ffn.experts.w2"].clone()
            expected["layers.2.ffn.experts.w2"][3] = deq
        else:
            expected[name] = deq
    out = to_branchspec_tensors(source, cfg)
    _assert_same(out, expected)
    assert out["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    # cast policy: floats to the target, integers stay integers
    out64 = to_branchspec_tensors(source, cfg, dtype=torch.float64)
    assert out64["embed.weight"].dtype == torch.float64 and out64["layers.0.ffn.gate.tid2eid"].dtype == torch.int64


def test_hf_native_tensors():
    cfg = dataclasses.replace(V4, num_mtp_layers=0)
    state = random_state(cfg)
    _assert_same(to_branchspec_tensors(to_hf_native(state), cfg), state)


def test_tied_head_comes_from_the_embedding():
    cfg = tiny_v4_config(num_mtp_layers=0)
    state = random_state(cfg)
    source = to_hf_native(state)
    del source["lm_head.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors \['head.weight'\]"):
        to_branchspec_tensors(source, cfg)
    out = to_branchspec_tensors(source, cfg, tie_word_embeddings=True)
    assert torch.equal(out["head.weight"], state["embed.weight"])


def test_missing_unexpected_and_misshaped_are_listed_together():
    cfg = tiny_v4_config()
    source = to_deepseek(random_state(cfg))
    del source["layers.1.attn.indexer.wq_b.weight"]
    del source["layers.2.ffn.experts.1.w3.weight"]          # a gap in the experts
    source["layers.0.attn.wkv.weight"] = torch.zeros(3, 3)
    source["model.layers.0.self_attn.bogus_proj.weight"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as info:
        to_branchspec_tensors(source, cfg, where="ckpt")
    msg = str(info.value)
    assert msg.startswith("checkpoint ckpt does not match its config.json")
    for part in ("missing tensors", "layers.1.attn.indexer.wq_b.weight", "layers.2.ffn.experts.1.w3.weight",
                 "unexpected tensors",
                 "model.layers.0.self_attn.bogus_proj.weight (as layers.0.attn.bogus_proj.weight)",
                 "mis-shaped tensors", "layers.0.attn.wkv.weight: expected (16, 32), found (3, 3)"):
        assert part in msg, part


def test_same_tensor_spelt_twice_is_refused():
    cfg = tiny_v4_config()
    source = to_deepseek(random_state(cfg))
    source["model.layers.0.self_attn.kv_proj.weight"] = source["layers.0.attn.wkv.weight"]
    with pytest.raises(CheckpointError, match="both give layers.0.attn.wkv.weight"):
        to_branchspec_tensors(source, cfg)


def test_wrong_kinds_are_named():
    cfg = tiny_v4_config()
    source = to_deepseek(random_state(cfg))
    source["layers.0.ffn.gate.tid2eid"] = source["layers.0.ffn.gate.tid2eid"].float()
    with pytest.raises(CheckpointError,
                       match=r"must be integers, found \['layers.0.ffn.gate.tid2eid \(torch.float32\)'\]"):
        to_branchspec_tensors(source, cfg)
    source = to_deepseek(random_state(cfg))
    source["layers.0.attn.wkv.weight"] = source["layers.0.attn.wkv.weight"].to(torch.int32)
    with pytest.raises(CheckpointError,
                       match=r"must be floating point, found \['layers.0.attn.wkv.weight \(torch.int32\)'\]"):
        to_branchspec_tensors(source, cfg)
    source = to_deepseek(random_state(cfg))
    source["layers.0.ffn.gate.tid2eid"][0, 0] = cfg.num_experts
    with pytest.raises(CheckpointError, match="expert ids outside"):
        to_branchspec_tensors(source, cfg)


@pytest.mark.skipif(not HAS_FP8, reason="this torch has no float8_e4m3fn")
def test_fp8_problems_are_named():
    cfg = tiny_v4_config()
    source = to_deepseek(random_state(cfg))
    q, scale, _ = fp8_quantize(source["layers.0.attn.wkv.weight"])
    source["layers.0.attn.wkv.weight"] = q
    with pytest.raises(CheckpointError, match="layers.0.attn.wkv.weight is float8_e4m3fn but has no"):
        to_branchspec_tensors(source, cfg)
    source["layers.0.attn.wkv.scale"] = torch.ones(2, 2)
    with pytest.raises(CheckpointError, match=r"layers.0.attn.wkv.scale: shape \(2, 2\)"):
        to_branchspec_tensors(source, cfg)


@pytest.mark.skipif(not HAS_FP4, reason="this torch has no float4_e2m1fn_x2")
def test_fp4_experts_are_refused():
    cfg = tiny_v4_config()
    source = to_deepseek(random_state(cfg))
    name = "layers.1.ffn.experts.0.w1.weight"
    source[name] = torch.zeros(24, 16, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    source[name[: -len(".weight")] + ".scale"] = torch.ones(24, 1)
    with pytest.raises(CheckpointError, match="FP4") as info:
        to_branchspec_tensors(source, cfg)
    assert name in str(info.value) and "not supported" in str(info.value)


# -- folders ---------------------------------------------------------------------------------------


def _deepseek_folder(tmp_path, cfg=V4, fp8=True, files=1):
    """A DeepSeek-original folder: ModelArgs config.json, FP8 weights with e8m0 scales."""
    folder = tmp_path / "deepseek"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(deepseek_dict_for(cfg)))
    state = random_state(cfg, seed=4)
    source = to_deepseek(state)
    expected = dict(state)
    if fp8 and HAS_FP8:
        q, scale, deq = fp8_quantize(source["layers.1.attn.wq_b.weight"], e8m0=HAS_E8M0)
        source["layers.1.attn.wq_b.weight"], source["layers.1.attn.wq_b.scale"] = q, scale
        expected["layers.1.attn.wq_b.weight"] = deq
    names = sorted(source)
    for i in range(files):
        part = {k: source[k].contiguous() for k in names[i::files]}
        save_file(part, str(folder / f"model{i}-mp1.safetensors" if files > 1 else folder / "model0-mp1.safetensors"))
    return folder, expected


def test_deepseek_folder_reads_and_loads(tmp_path):
    folder, expected = _deepseek_folder(tmp_path, files=3)
    assert detect_format(folder) == FORMAT_DEEPSEEK
    ckpt = open_checkpoint(folder)
    assert ckpt.format == FORMAT_DEEPSEEK and ckpt.config == V4
    _assert_same(ckpt.tensors(), expected)
    model = load_checkpoint(folder, "float64")
    assert model.cfg == V4
    loaded = model.state_dict()
    for k, v in expected.items():
        assert torch.equal(loaded[k], v.double() if v.is_floating_point() else v), k


def test_deepseek_folder_without_mtp_tensors(tmp_path):
    folder, _ = _deepseek_folder(tmp_path)
    path = folder / "model0-mp1.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.startswith("mtp.")}
    save_file(tensors, str(path))
    assert open_checkpoint(folder).config.num_mtp_layers == 0


def test_model_parallel_shards_are_refused(tmp_path):
    folder, _ = _deepseek_folder(tmp_path, fp8=False)
    tensors = load_file(str(folder / "model0-mp1.safetensors"))
    save_file({"embed.weight": tensors["embed.weight"]}, str(folder / "model1-mp2.safetensors"))
    with pytest.raises(CheckpointError, match="embed.weight is in both"):
        open_checkpoint(folder)


def test_index_naming_an_absent_shard(tmp_path):
    folder, _ = _deepseek_folder(tmp_path, fp8=False)
    names = list(load_file(str(folder / "model0-mp1.safetensors")))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {**dict.fromkeys(names, "model0-mp1.safetensors"), "x": "model-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002.safetensors"):
        open_checkpoint(folder)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match=r"config.json: model_type 'llama' is not supported"):
        detect_format(tmp_path)
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        load_checkpoint(tmp_path)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    cfg = transformers.DeepseekV4Config(**{k: v for k, v in hf_dict_for(V4).items()
                                           if k not in ("transformers_version", "architectures")})
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval()
    with torch.no_grad():   # give the buffers content worth comparing
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, V4.num_experts, buf.shape))
            elif name.endswith("e_score_correction_bias"):
                buf.normal_()
    return model


def _expected_from_hf(model) -> dict[str, torch.Tensor]:
    """branchspec's tensors from transformers' in-memory state_dict, by the brief's table."""
    inverse = {v: k for k, v in _HF_TOP.items()}
    block = {hf: bs for bs, hf in _HF_BLOCK}
    out = {}
    for name, v in model.state_dict().items():
        if name in inverse:
            out[inverse[name]] = v
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            half = v.shape[1] // 2
            out[f"layers.{layer}.ffn.experts.w1"] = v[:, :half]
            out[f"layers.{layer}.ffn.experts.w3"] = v[:, half:]
        else:
            out[f"layers.{layer}.{block[rest]}"] = v
    return out


@pytest.mark.parametrize("original_format", [True, False], ids=["save-default", "module-names"])
def test_transformers_save_pretrained_folder(tmp_path, hf_model, original_format):
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB",
                             save_original_format=original_format)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert detect_format(tmp_path) == FORMAT_HF
    ckpt = open_checkpoint(tmp_path)
    # save_pretrained drops the MTP layer, so the mapped config has none
    assert ckpt.config == dataclasses.replace(V4, num_mtp_layers=0)
    tensors = ckpt.tensors()
    shapes = expected_shapes(ckpt.config)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    _assert_same(tensors, {k: v.float() for k, v in _expected_from_hf(hf_model).items()} |
                 {k: v for k, v in _expected_from_hf(hf_model).items() if not v.is_floating_point()})


def test_transformers_tied_embeddings(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    d = {k: v for k, v in hf_dict_for(V4, tie_word_embeddings=True).items()
         if k not in ("transformers_version", "architectures")}
    model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**d))
    model.save_pretrained(tmp_path, safe_serialization=True)
    tensors = open_checkpoint(tmp_path).tensors()
    assert torch.equal(tensors["head.weight"], model.model.embed_tokens.weight.detach())


# -- tokenizers --------------------------------------------------------------------------------------


def _hf_tokenizer_folder(folder, tokenizer_config: dict | None, model_config: dict | None = None):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>", "<eot>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if model_config is not None:
        (folder / "config.json").write_text(json.dumps(model_config))
    return backend


def test_foreign_tokenizer(tmp_path):
    from branchspec.data.tokenizer import ForeignTokenizer, Tokenizer

    backend = _hf_tokenizer_folder(tmp_path, {
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"model_type": "deepseek_v4", "eos_token_id": [1, 3]})
    tok = Tokenizer.from_dir(tmp_path)
    assert isinstance(tok, ForeignTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
    assert tok.stop_ids == (1, 3)
    assert tok.vocab_size == backend.get_vocab_size()
    text = "hello fox, the world"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == 0 and ids[1:] == backend.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    assert tok.encode_batch([text], add_bos=True) == [ids]
    with pytest.raises(ValueError, match="no branchspec chat template.*jinja"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no branchspec chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_foreign_tokenizer_ids_from_the_model_config(tmp_path):
    from branchspec.data.tokenizer import ForeignTokenizer, Tokenizer

    _hf_tokenizer_folder(tmp_path, None, {"model_type": "deepseek_v4", "bos_token_id": 0, "eos_token_id": 3,
                                          "pad_token_id": 2})
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert isinstance(tok, ForeignTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.stop_ids) == (0, 3, 2, (3, 1))
    tok.save(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == ("<s>", "<eot>")
    again = Tokenizer.from_dir(tmp_path / "saved")
    assert (again.bos_id, again.eos_id) == (0, 3)


def test_foreign_tokenizer_with_a_branchspec_template(tmp_path):
    from branchspec.data.chat import CHAT_TEMPLATE, CHAT_TEMPLATE_FORMAT
    from branchspec.data.tokenizer import Tokenizer

    _hf_tokenizer_folder(tmp_path, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
                                    "chat_template_format": CHAT_TEMPLATE_FORMAT})
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == tok.bos_id


def test_foreign_tokenizer_problems(tmp_path):
    from branchspec.data.tokenizer import Tokenizer

    _hf_tokenizer_folder(tmp_path, {"bos_token": "<s>", "eos_token": "<|not-there|>"})
    with pytest.raises(ValueError, match=r"tokenizer_config.json: eos_token '<\|not-there\|>' is not in"):
        Tokenizer.from_dir(tmp_path)
    # a branchspec tokenizer_config.json over a tokenizer without branchspec's tokens keeps its error
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>"}))
    with pytest.raises(ValueError, match="lacks the special token"):
        Tokenizer.from_dir(tmp_path)


# -- convert ---------------------------------------------------------------------------------------


def test_convert_deepseek_folder(tmp_path, capsys):
    folder, expected = _deepseek_folder(tmp_path)
    _hf_tokenizer_folder(folder, {"bos_token": "<s>", "eos_token": "</s>"})
    out = tmp_path / "converted"
    assert cli_main(["convert", str(folder), str(out), "--dtype", "bfloat16"]) == 0
    assert "deepseek" in capsys.readouterr().out
    assert detect_format(out) == FORMAT_BRANCHSPEC
    assert ModelConfig.load(out) == V4
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json"}
    stored = load_file(str(out / "model.safetensors"))
    assert stored["embed.weight"].dtype == torch.bfloat16
    assert stored["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    _assert_same(stored, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected.items()})
    assert load_checkpoint(out, "bfloat16").cfg == V4


def test_convert_hf_folder_keeps_stop_ids(tmp_path, hf_model):
    src = tmp_path / "hf"
    hf_model.save_pretrained(src, safe_serialization=True)
    _hf_tokenizer_folder(src, None)
    config = json.loads((src / "config.json").read_text())
    config["eos_token_id"] = [1, 3]
    (src / "config.json").write_text(json.dumps(config))
    assert checkpoint_stop_ids(src) == (1, 3)
    out = convert_checkpoint(src, tmp_path / "out")
    from branchspec.data.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(out)          # recognised via the tokenizer_config.json convert wrote
    assert tok.eos_id == 1 and 3 in tok.stop_ids  # generation_config.json travels along
    assert load_checkpoint(out).cfg.num_mtp_layers == 0


def test_convert_branchspec_folder_recasts(tmp_path):
    model = random_model(tiny_config(), seed=1)
    src = save_checkpoint(model, tmp_path / "src")
    out = convert_checkpoint(src, tmp_path / "out", dtype="float64")
    loaded = load_checkpoint(out, "float64")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v.double()), k


def test_convert_errors(tmp_path, capsys):
    folder, _ = _deepseek_folder(tmp_path, fp8=False)
    assert cli_main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "o1")]) == 2
    assert "does not exist" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    assert cli_main(["convert", str(folder), str(busy)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert cli_main(["convert", str(llama), str(tmp_path / "o2")]) == 2
    assert "model_type 'llama' is not supported" in capsys.readouterr().err
    # a failed conversion leaves nothing behind; an empty OUT folder is fine
    bad = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(bad, dim=48)))
    assert cli_main(["convert", str(folder), str(tmp_path / "o3")]) == 2
    assert "mis-shaped" in capsys.readouterr().err
    assert not (tmp_path / "o3").exists() and not list(tmp_path.glob(".o3.*"))
    (folder / "config.json").write_text(json.dumps(bad))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["convert", str(folder), str(empty)]) == 0
    assert (empty / "model.safetensors").is_file()


def test_branchspec_folders_take_no_foreign_spelling(tmp_path):
    folder = save_checkpoint(random_model(tiny_config(), seed=0), tmp_path / "c")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors.pop("embed.weight")
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    msg = str(info.value)
    assert "missing tensors ['embed.weight']" in msg and "unexpected tensors ['model.embed_tokens.weight']" in msg
