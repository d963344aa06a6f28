"""Checkpoint folders: exact round trips per dtype, deterministic random init, and errors
that name the offending file or tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from branchspec.checkpoint import (
    CheckpointError,
    checkpoint_metadata,
    load_checkpoint,
    resolve_dtype,
    save_checkpoint,
)
from branchspec.config import ConfigError, tiny_config
from branchspec.model.init import random_model

SUPPORTED = ("bfloat16", "float32", "float64")


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


@pytest.fixture(scope="module")
def model32(cfg):
    return random_model(cfg, seed=0)


@pytest.fixture
def ckpt(tmp_path, model32):
    return save_checkpoint(model32, tmp_path / "ckpt")


def _assert_state_equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def _rewrite(folder, tensors: dict) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SUPPORTED)
def test_round_trip_per_dtype(tmp_path, cfg, dtype):
    model = random_model(cfg, seed=3, dtype=dtype)
    folder = save_checkpoint(model, tmp_path / dtype)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    loaded = load_checkpoint(folder, dtype)
    assert loaded.cfg == cfg
    assert not loaded.training
    _assert_state_equal(loaded.state_dict(), model.state_dict())
    for v in loaded.state_dict().values():
        if v.is_floating_point():
            assert v.dtype == resolve_dtype(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_save_with_dtype_cast_keeps_integer_buffers(tmp_path, dtype):
    """A hash-routed MoE's token -> expert table is an integer buffer: a cast to a float
    dtype must leave it integer, or the checkpoint would not load."""
    from branchspec.config import tiny_v4_config

    model = random_model(tiny_v4_config(), seed=0)
    ints = {k for k, v in model.state_dict().items() if not v.is_floating_point()}
    assert ints, "tiny_v4 has no integer buffer to check"
    folder = save_checkpoint(model, tmp_path / "c", dtype=dtype)
    stored = load_file(str(folder / "model.safetensors"))
    for k in ints:
        assert stored[k].dtype == model.state_dict()[k].dtype and torch.equal(stored[k], model.state_dict()[k]), k
    load_checkpoint(folder, dtype)


@pytest.mark.parametrize("dtype", SUPPORTED)
def test_save_with_dtype_cast(tmp_path, model32, dtype):
    folder = save_checkpoint(model32, tmp_path / "c", dtype=dtype)
    stored = load_file(str(folder / "model.safetensors"))
    target = resolve_dtype(dtype)
    assert all(v.dtype == target for v in stored.values() if v.is_floating_point())
    loaded = load_checkpoint(folder, dtype)
    expected = {k: v.to(target) for k, v in model32.state_dict().items()}
    _assert_state_equal(loaded.state_dict(), expected)


def test_float64_round_trip_is_bit_exact(tmp_path, cfg):
    model = random_model(cfg, seed=11, dtype="float64")
    folder = save_checkpoint(model, tmp_path / "f64")
    loaded = load_checkpoint(folder, "float64")
    for k, v in model.state_dict().items():
        w = loaded.state_dict()[k]
        assert w.dtype == torch.float64
        # compare the bytes, not just values (-0.0 vs 0.0, NaN payloads)
        assert torch.equal(v.view(torch.int64), w.view(torch.int64)), k


def test_torch_dtype_accepted(ckpt, model32):
    loaded = load_checkpoint(ckpt, torch.float64)
    assert loaded.embed.weight.dtype == torch.float64
    assert torch.equal(loaded.embed.weight, model32.embed.weight.double())


def test_metadata_round_trip(tmp_path, model32):
    folder = save_checkpoint(model32, tmp_path / "m", metadata={"step": 17, "note": "hi", "loss": [1.5, 2.0]})
    assert checkpoint_metadata(folder) == {"step": 17, "note": "hi", "loss": [1.5, 2.0]}
    _assert_state_equal(load_checkpoint(folder).state_dict(), model32.state_dict())


# -- random init -----------------------------------------------------------------------------


def test_random_model_deterministic(cfg):
    a = random_model(cfg, seed=5).state_dict()
    b = random_model(cfg, seed=5).state_dict()
    _assert_state_equal(a, b)


def test_random_model_differs_across_seeds(cfg):
    a = random_model(cfg, seed=5).state_dict()
    b = random_model(cfg, seed=6).state_dict()
    differing = [k for k in a if not torch.equal(a[k], b[k])]
    # every randomly initialised matrix differs; norms (ones), ape and sinks (zeros) do not
    random_keys = [k for k in a if a[k].dim() >= 2 and a[k].std() > 0]
    assert random_keys
    assert set(random_keys) <= set(differing)


def test_random_model_float64_matches_float32_init(cfg):
    a = random_model(cfg, seed=2, dtype="float64").state_dict()
    b = random_model(cfg, seed=2, dtype="float32").state_dict()
    for k in a:
        assert torch.equal(a[k].float(), b[k]), k


# -- errors ----------------------------------------------------------------------------------


def test_missing_tensor_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    victim = sorted(tensors)[len(tensors) // 2]
    del tensors[victim]
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match="missing") as info:
        load_checkpoint(ckpt)
    assert victim in str(info.value)


def test_extra_tensor_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["layers.0.attn.not_a_param"] = torch.zeros(3)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match="unexpected") as info:
        load_checkpoint(ckpt)
    assert "layers.0.attn.not_a_param" in str(info.value)


def test_misshaped_tensor_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    victim = "embed.weight"
    assert victim in tensors
    old = tuple(tensors[victim].shape)
    tensors[victim] = torch.zeros(old[0] + 1, old[1])
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match="mis-shaped") as info:
        load_checkpoint(ckpt)
    msg = str(info.value)
    assert victim in msg and str(old) in msg and str((old[0] + 1, old[1])) in msg


def test_all_problems_reported_together(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    gone, reshaped = names[0], names[-1]
    del tensors[gone]
    tensors[reshaped] = torch.zeros(tensors[reshaped].numel() + 1)
    tensors["bogus"] = torch.zeros(1)
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt)
    msg = str(info.value)
    assert gone in msg and reshaped in msg and "bogus" in msg


def test_config_shape_mismatch_is_named(tmp_path, cfg):
    """Weights saved for one config, config.json replaced by a wider model's."""
    folder = save_checkpoint(random_model(cfg, seed=0), tmp_path / "c")
    tiny_config(d_model=48).save(folder)
    with pytest.raises(CheckpointError, match="embed.weight"):
        load_checkpoint(folder)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensor_rejected(ckpt, bad):
    tensors = load_file(str(ckpt / "model.safetensors"))
    victim = "embed.weight"
    tensors[victim] = tensors[victim].clone()
    tensors[victim][3, 1] = bad
    _rewrite(ckpt, tensors)
    with pytest.raises(CheckpointError, match="NaN or Inf") as info:
        load_checkpoint(ckpt)
    assert victim in str(info.value)


def test_corrupt_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x13\x37 this is not a safetensors file" * 10)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_truncated_safetensors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_empty_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError):
        load_checkpoint(ckpt)


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(ckpt)


def test_bad_config_json_in_checkpoint(ckpt):
    d = json.loads((ckpt / "config.json").read_text())
    d["compress_ratios"] = [0, 4, 128]
    (ckpt / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="compress_ratios"):
        load_checkpoint(ckpt)


@pytest.mark.parametrize("dtype", ["float16", "fp32", "int8", torch.float16, torch.int32])
def test_unknown_dtype(ckpt, dtype):
    with pytest.raises(ValueError, match="not supported") as info:
        load_checkpoint(ckpt, dtype)
    for name in SUPPORTED:
        assert name in str(info.value)


def test_unknown_dtype_in_random_model_and_save(cfg, model32, tmp_path):
    with pytest.raises(ValueError, match="float32"):
        random_model(cfg, dtype="half")
    with pytest.raises(ValueError, match="float32"):
        save_checkpoint(model32, tmp_path / "x", dtype="float8")


def test_large_finite_float64_value_accepted(tmp_path, cfg):
    model = random_model(cfg, seed=0, dtype="float64")
    folder = save_checkpoint(model, tmp_path / "big")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["embed.weight"][0, 0] = 1e39
    _rewrite(folder, tensors)
    loaded = load_checkpoint(folder, "float64")
    assert loaded.embed.weight[0, 0].item() == 1e39


def test_failed_save_leaves_no_half_checkpoint(tmp_path, model32):
    with pytest.raises(ValueError):
        save_checkpoint(model32, tmp_path / "half", dtype="float8")
    assert not (tmp_path / "half" / "config.json").exists()
