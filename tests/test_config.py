"""Configuration dataclasses: JSON round trip, and every impossible value refused with a
message that names the field (and, for SpecConfig, suggests values that work)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from branchspec.config import (
    ConfigError,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SpecConfig,
    tiny_config,
    v4_mini_config,
)

# -- ModelConfig: round trip -------------------------------------------------------------


@pytest.mark.parametrize("make", [tiny_config, v4_mini_config, ModelConfig])
def test_model_config_dict_round_trip(make):
    cfg = make()
    d = cfg.to_dict()
    assert d["architecture"] == "branchspec-v4"
    assert isinstance(d["compress_ratios"], list)
    json.dumps(d)  # plain JSON types only
    back = ModelConfig.from_dict(d)
    assert back == cfg
    assert hash(back) == hash(cfg)
    assert isinstance(back.compress_ratios, tuple)


def test_model_config_folder_round_trip(tmp_path):
    cfg = tiny_config(window=5, compress_ratios=(4, 0, 128, 4), index_topk=2, rope_theta=5000.0,
                      norm_eps=1e-5, eos_token_id=7)
    cfg.save(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / "config.json"
    assert path.is_file()
    on_disk = json.loads(path.read_text())
    assert on_disk["window"] == 5 and on_disk["compress_ratios"] == [4, 0, 128, 4]
    back = ModelConfig.load(tmp_path / "ckpt")
    assert back == cfg
    # every field survives, including floats and the ratio tuple
    for f in dataclasses.fields(ModelConfig):
        assert getattr(back, f.name) == getattr(cfg, f.name), f.name


def test_model_config_from_dict_accepts_json_lists():
    d = tiny_config().to_dict()
    d["compress_ratios"] = [0, 4, 128, 4]
    cfg = ModelConfig.from_dict(d)
    assert cfg.compress_ratios == (0, 4, 128, 4)
    assert cfg.has_indexer and tuple(c.ratio for c in cfg.compressed_kinds) == (4, 128)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# -- ModelConfig: errors that name the field ---------------------------------------------


@pytest.mark.parametrize("window", [0, -3])
def test_window_must_be_positive(window):
    with pytest.raises(ConfigError, match="window"):
        tiny_config(window=window)


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "num_heads", "head_dim", "q_lora_rank",
                                   "ffn_hidden", "max_position"])
def test_sizes_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: 0})


@pytest.mark.parametrize("ratio", [1, 2, 3, 8, 16, 64, 127, 256])
def test_unsupported_ratio_rejected(ratio):
    with pytest.raises(ConfigError, match=r"compress_ratios\[1\]") as info:
        tiny_config(compress_ratios=(0, ratio, 128, 4))
    assert str(ratio) in str(info.value)
    assert "allow_any_ratio" in str(info.value)  # says how to get past it


@pytest.mark.parametrize("ratio", [2, 8, 16])
def test_any_ratio_accepted_when_allowed(ratio):
    cfg = tiny_config(compress_ratios=(0, ratio, 128, 4), allow_any_ratio=True)
    assert cfg.compress_ratios == (0, ratio, 128, 4)
    assert ratio in [c.ratio for c in cfg.compressed_kinds]
    # and it round-trips with the flag
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_negative_ratio_rejected_even_when_any_allowed():
    with pytest.raises(ConfigError, match=r"compress_ratios\[0\]"):
        tiny_config(compress_ratios=(-4, 0, 128, 4), allow_any_ratio=True)


@pytest.mark.parametrize("ratios", [(0, 4, 128), (0, 4, 128, 4, 0), ()])
def test_ratio_count_must_match_layers(ratios):
    with pytest.raises(ConfigError, match="compress_ratios has") as info:
        tiny_config(compress_ratios=ratios)
    assert "num_layers" in str(info.value)
    assert str(len(ratios)) in str(info.value)


@pytest.mark.parametrize("rope_dim", [7, 3, 18, 32, 0])
def test_rope_dim_even_and_within_head_dim(rope_dim):
    with pytest.raises(ConfigError, match="rope_dim") as info:
        tiny_config(rope_dim=rope_dim)  # head_dim 16
    assert str(rope_dim) in str(info.value)


def test_rope_dim_equal_head_dim_ok():
    assert tiny_config(rope_dim=16, index_head_dim=16).rope_dim == 16


@pytest.mark.parametrize("index_head_dim", [4, 6, 9])
def test_index_head_dim_at_least_rope_dim(index_head_dim):
    with pytest.raises(ConfigError, match="index_head_dim") as info:
        tiny_config(rope_dim=8, index_head_dim=index_head_dim)
    assert "rope_dim" in str(info.value)


def test_index_head_dim_unchecked_without_c4_layers():
    # No ratio-4 layer: no indexer, so its sizes do not matter.
    cfg = tiny_config(compress_ratios=(0, 128, 0, 128), index_head_dim=2)
    assert not cfg.has_indexer


def test_index_topk_must_be_positive():
    with pytest.raises(ConfigError, match="index_topk"):
        tiny_config(index_topk=0)


@pytest.mark.parametrize("field,value", [("bos_token_id", 64), ("eos_token_id", -1), ("pad_token_id", 100)])
def test_special_token_ids_inside_vocab(field, value):
    with pytest.raises(ConfigError, match=field) as info:
        tiny_config(**{field: value})  # vocab 64
    assert str(value) in str(info.value)


def test_num_mtp_layers_zero_or_one():
    assert tiny_config(num_mtp_layers=0).num_mtp_layers == 0
    with pytest.raises(ConfigError, match="num_mtp_layers"):
        tiny_config(num_mtp_layers=2)


def test_unknown_keys_rejected():
    d = tiny_config().to_dict()
    d["hidden_sizee"] = 12
    d["zz_extra"] = True
    with pytest.raises(ConfigError, match="unknown model config keys") as info:
        ModelConfig.from_dict(d)
    assert "hidden_sizee" in str(info.value) and "zz_extra" in str(info.value)


def test_unknown_keys_in_config_json(tmp_path):
    d = tiny_config().to_dict()
    d["n_routed_experts"] = 8
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="n_routed_experts"):
        ModelConfig.load(tmp_path)


def test_wrong_value_type_is_config_error():
    d = tiny_config().to_dict()
    d["window"] = "eight"
    with pytest.raises(ConfigError):
        ModelConfig.from_dict(d)


def test_invalid_json_file(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 64, ')
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        ModelConfig.load(tmp_path)
    assert "config.json" in str(info.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.load(tmp_path)


def test_invalid_value_in_config_json(tmp_path):
    d = tiny_config().to_dict()
    d["window"] = 0
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="window"):
        ModelConfig.load(tmp_path)


def test_model_config_is_frozen():
    cfg = tiny_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 3  # type: ignore[misc]


# -- SpecConfig ----------------------------------------------------------------------------


@pytest.mark.parametrize("D", range(2, 9))
def test_chain_configs(D):
    s = SpecConfig.chain(D)
    assert (s.num_steps, s.topk, s.num_draft_tokens) == (D - 1, 1, D)
    assert s.is_chain


@pytest.mark.parametrize("steps,topk,D", [(3, 2, 6), (2, 4, 7), (4, 3, 8), (1, 4, 5), (2, 2, 3), (7, 2, 8)])
def test_tree_configs(steps, topk, D):
    s = SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=D)
    assert not s.is_chain
    assert (s.num_steps, s.topk, s.num_draft_tokens) == (steps, topk, D)


def test_default_spec_config_valid():
    s = SpecConfig()
    assert (s.num_steps, s.topk, s.num_draft_tokens) == (3, 2, 6)


def test_budget_too_large_for_steps_suggests_enough_steps():
    # topk 2 drafts 2 + 4 (s - 1) candidates; D - 1 = 7 needs s >= 3
    with pytest.raises(ValueError, match=r"num_steps >= 3") as info:
        SpecConfig(num_steps=1, topk=2, num_draft_tokens=8)
    assert "topk" in str(info.value)
    with pytest.raises(ValueError, match=r"num_steps >= 3"):
        SpecConfig(num_steps=2, topk=2, num_draft_tokens=8)
    assert SpecConfig(num_steps=3, topk=2, num_draft_tokens=8)  # the suggestion works
    # a chain needs one step per draft token
    with pytest.raises(ValueError, match=r"num_steps >= 5"):
        SpecConfig(num_steps=2, topk=1, num_draft_tokens=6)


def test_steps_beyond_budget_suggests_max_steps():
    with pytest.raises(ValueError, match=r"num_steps <= 3"):
        SpecConfig(num_steps=5, topk=2, num_draft_tokens=4)
    assert SpecConfig(num_steps=3, topk=2, num_draft_tokens=4)


def test_every_rejected_spec_suggests_a_value_that_works():
    """Over a grid of knobs: each combination is accepted, or following the errors'
    suggestions (num_steps, or topk; the budget D kept) reaches one that is."""
    num_rejected = 0
    for k in range(1, 5):
        for D in range(2, 11):
            for s in range(1, 12):
                knobs = {"num_steps": s, "topk": k}
                for _ in range(3):
                    try:
                        fixed = SpecConfig(num_draft_tokens=D, **knobs)
                        break
                    except ValueError as e:
                        msg = str(e)
                    num_rejected += knobs == {"num_steps": s, "topk": k}
                    m = re.search(r"use (num_steps|topk) (>=|<=) (\d+)", msg)
                    assert m, f"no suggestion in {msg!r} for ({s}, {k}, {D})"
                    knobs[m.group(1)] = int(m.group(3))
                else:
                    raise AssertionError(f"the suggestions for ({s}, {k}, {D}) lead nowhere: {msg}")
                assert fixed.num_draft_tokens == D
    assert num_rejected > 20


def test_topk_past_the_budget_is_refused():
    """No kept tree of D - 1 nodes holds a child ranked past D - 1, so a larger topk only
    drafts topk^2 candidates per step for nothing (SpecConfig(2, 4096, 8) once asked for
    69 GB)."""
    with pytest.raises(ValueError, match=r"SpecConfig.topk=4096 exceeds num_draft_tokens-1=7.*topk <= 7"):
        SpecConfig(num_steps=2, topk=4096, num_draft_tokens=8)
    assert SpecConfig(num_steps=2, topk=7, num_draft_tokens=8)
    assert SpecConfig(num_steps=5, topk=8, num_draft_tokens=64)     # SGLang's large trees stay


@pytest.mark.parametrize("field", ["num_steps", "topk", "num_draft_tokens"])
@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (True, TypeError),
                                        (2.0, TypeError), ("3", TypeError)])
def test_non_positive_or_non_int_knobs(field, bad, error):
    kw = dict(num_steps=3, topk=2, num_draft_tokens=6)
    kw[field] = bad
    with pytest.raises(error, match=field):
        SpecConfig(**kw)


def test_budget_below_two():
    with pytest.raises(ValueError, match=r"num_draft_tokens=1.*>= 2"):
        SpecConfig(num_steps=1, topk=1, num_draft_tokens=1)


def test_chain_of_one_raises():
    with pytest.raises(ValueError):
        SpecConfig.chain(1)


def test_chain_of_one_names_the_budget():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecConfig.chain(1)


# -- SamplingParams ------------------------------------------------------------------------


def test_sampling_params_valid():
    p = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=1, seed=3, stop="###")
    assert p.stop == ("###",) and not p.greedy
    assert SamplingParams().greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(top_p=1.0).top_p == 1.0


@pytest.mark.parametrize("t", [-0.01, -1.0, float("nan")])
def test_negative_temperature(t):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=t)


@pytest.mark.parametrize("p", [0.0, -0.5, 1.0001, 2.0, float("nan")])
def test_top_p_range(p):
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=p)


@pytest.mark.parametrize("m, error", [(-1, ValueError), (-4, ValueError), (1.5, TypeError), (True, TypeError)])
def test_max_tokens_non_negative_int(m, error):
    with pytest.raises(error, match="max_tokens"):
        SamplingParams(max_tokens=m)
    assert SamplingParams(max_tokens=0).max_tokens == 0     # scores the prompt, generates nothing


@pytest.mark.parametrize("kwargs, error, name", [
    ({"top_k": -2}, ValueError, "top_k"), ({"top_k": 1.0}, TypeError, "top_k"),
    ({"min_p": 1.5}, ValueError, "min_p"), ({"min_p": -0.1}, ValueError, "min_p"),
    ({"min_tokens": -1}, ValueError, "min_tokens"), ({"min_tokens": 9, "max_tokens": 8}, ValueError, "min_tokens"),
    ({"stop_token_ids": [1, -3]}, ValueError, r"stop_token_ids\[1\]"), ({"stop_token_ids": 5}, TypeError, "stop_token_ids"),
    ({"stop_token_ids": [1.0]}, TypeError, r"stop_token_ids\[0\]"),
    ({"n": 0}, ValueError, "n must"), ({"n": True}, TypeError, "n must"),
    ({"presence_penalty": 2.5}, ValueError, "presence_penalty"),
    ({"frequency_penalty": -3}, ValueError, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, ValueError, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, ValueError, r"logit_bias\[5\]"), ({"logit_bias": {-1: 1}}, ValueError, "logit_bias"),
    ({"logit_bias": {"a": 1}}, TypeError, "logit_bias"), ({"logit_bias": 3}, TypeError, "logit_bias"),
])
def test_sampling_extras_refuse_bad_values_naming_them(kwargs, error, name):
    with pytest.raises(error, match=name):
        SamplingParams(**kwargs)


def test_sampling_extras_normalise():
    p = SamplingParams(top_k=0, stop_token_ids=[5, 3, 5], logit_bias={7: 1, 2: -1.5}, n=3, seed=2**64 - 2)
    assert (p.top_k, p.stop_token_ids, p.logit_bias) == (-1, (5, 3), ((2, -1.5), (7, 1.0)))
    hash(p)                                             # hashable, as a frozen value should be
    assert SamplingParams(temperature=1.0, top_k=1).greedy and not SamplingParams(temperature=1.0).greedy
    # n samples: seed + i (mod 2**64), as vLLM; sample 0 is what n = 1 gives
    assert [c.seed for c in p.choices()] == [2**64 - 2, 2**64 - 1, 0] and all(c.n == 1 for c in p.choices())
    assert [c.seed for c in SamplingParams(n=2).choices()] == [None, None]
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)                       # what it does not implement it refuses


@pytest.mark.parametrize("stop", ["", ["ok", ""], ("",)])
def test_empty_stop_string(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)


# -- EngineConfig --------------------------------------------------------------------------


def test_engine_config_valid():
    e = EngineConfig(max_batch_size=1, page_size=1, prefill_chunk_size=1, num_pages={"ent4": 3})
    assert dict(e.num_pages) == {"ent4": 3}
    assert dict(EngineConfig().num_pages) == {}


def test_engine_config_is_a_value():
    """Frozen, comparable and hashable: equal settings are equal configs, whatever order
    the page counts were given in, and a config survives dataclasses.replace."""
    import dataclasses

    a = EngineConfig(num_pages={"raw": 4, "ent4": 3})
    b = EngineConfig(num_pages={"ent4": 3, "raw": 4})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != EngineConfig(num_pages={"raw": 4})
    assert dataclasses.replace(a, page_size=8).num_pages == a.num_pages
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.page_size = 4


def test_every_config_raises_one_family_of_errors():
    """A wrong type is a ConfigTypeError (a TypeError), a bad value a ConfigError (a
    ValueError), in every configuration class; both name the field."""
    from branchspec.config import ConfigTypeError

    for make, field in ((lambda: ModelConfig(d_model="256"), "d_model"),
                        (lambda: SpecConfig(num_steps="3"), "SpecConfig.num_steps"),
                        (lambda: SamplingParams(temperature="hot"), "SamplingParams.temperature"),
                        (lambda: EngineConfig(compile=1), "EngineConfig.compile")):
        with pytest.raises(ConfigTypeError, match=field) as info:
            make()
        assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigError)
    for make, field in ((lambda: ModelConfig(window=0), "window"),
                        (lambda: SpecConfig(num_draft_tokens=1), "SpecConfig.num_draft_tokens"),
                        (lambda: SamplingParams(top_p=0.0), "SamplingParams.top_p"),
                        (lambda: EngineConfig(page_size=0), "EngineConfig.page_size")):
        with pytest.raises(ConfigError, match=field) as info:
            make()
        assert not isinstance(info.value, TypeError)


@pytest.mark.parametrize("field", ["max_batch_size", "page_size", "prefill_chunk_size"])
@pytest.mark.parametrize("bad", [0, -2])
def test_engine_config_errors(field, bad):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: bad})


@pytest.mark.parametrize("bad,error,match", [
    ("tpu0", ValueError, "not a device name"),
    ("meta", ValueError, "only 'cpu' and 'cuda'"),
    (0, TypeError, "must be a string"),
])
def test_engine_config_device_errors(bad, error, match):
    with pytest.raises(error, match=match):
        EngineConfig(device=bad)


def test_engine_config_cuda_needs_cuda():
    import torch

    if torch.cuda.is_available():
        assert EngineConfig(device="cuda").device == "cuda"
        with pytest.raises(ValueError, match="CUDA device"):
            EngineConfig(device=f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineConfig(device="cuda")
    assert EngineConfig(device="cpu").device == "cpu"


def test_engine_config_negative_max_model_len():
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=-8)
