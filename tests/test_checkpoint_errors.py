"""Bad checkpoints, kind by kind: each is refused at load time, before any request runs,
with an error that names the file and the field or tensor at fault.

Errors: ConfigError (config.json), CheckpointError (model.safetensors), ValueError
(tokenizer files, a tokenizer too big for the model), FileNotFoundError (a missing file),
TypeError (a caller's argument of the wrong Python type). Every checkpoint is loaded through
both `load_checkpoint` and `LLM` where both read the file at fault.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from branchspec import LLM
from branchspec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from branchspec.config import ConfigError, ModelConfig, tiny_config
from branchspec.data.tokenizer import Tokenizer, train_tokenizer
from branchspec.llm import DEFAULT_CHECKPOINT
from branchspec.model.init import random_model

# Larger than the tokenizer below (the smallest byte-level vocabulary is 263 tokens).
VOCAB = 320

LOADERS = [pytest.param(load_checkpoint, id="load_checkpoint"), pytest.param(LLM, id="LLM")]
TOKENIZER_LOADERS = [pytest.param(Tokenizer.from_dir, id="Tokenizer.from_dir"), pytest.param(LLM, id="LLM")]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(["Question: what is 12 + 7?\nAnswer: 19. The quick brown fox.\n"] * 20,
                           vocab_size=300)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(vocab_size=VOCAB), seed=0)


@pytest.fixture
def ckpt(tmp_path, model, tok):
    folder = save_checkpoint(model, tmp_path / "ckpt")
    tok.save(folder)
    return folder


def _edit_config(folder, **changes) -> None:
    d = json.loads((folder / "config.json").read_text())
    d.update(changes)
    (folder / "config.json").write_text(json.dumps(d))   # NaN and inf become NaN / Infinity


def test_good_checkpoint_loads(ckpt, tok):
    assert load_checkpoint(ckpt).cfg == tiny_config(vocab_size=VOCAB)
    llm = LLM(ckpt)
    assert llm.tokenizer.vocab_size == tok.vocab_size < VOCAB


def test_shipped_and_tiny_configs_still_load():
    assert ModelConfig.load(DEFAULT_CHECKPOINT).vocab_size == 8192
    assert tiny_config().compress_ratios == (0, 4, 128, 4)
    # numpy integers and integer-valued rope_theta stay accepted, as plain Python numbers
    cfg = tiny_config(d_model=np.int64(32), compress_ratios=[np.int32(r) for r in (0, 4, 128, 4)],
                      rope_theta=10000)
    assert cfg == tiny_config() and type(cfg.d_model) is int and type(cfg.rope_theta) is float
    json.dumps(cfg.to_dict())


# -- config.json --------------------------------------------------------------------------


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("content", ["[]", "[1, 2]", "3", '"vocab_size"', "null", "true"])
def test_config_json_not_an_object(ckpt, loader, content):
    (ckpt / "config.json").write_text(content)
    with pytest.raises(ConfigError, match="config.json must hold a JSON object"):
        loader(ckpt)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("content", [b'{"vocab_size": 320, ', b"", b"\xff\xfe\x00garbage"])
def test_config_json_not_json(ckpt, loader, content):
    (ckpt / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        loader(ckpt)


# (field, JSON value, what the message says is allowed)
WRONG_TYPES = [
    ("d_model", 256.5, "must be an integer"),
    ("d_model", 32.0, r"must be an integer, got float 32.0; write 32"),
    ("d_model", "32", "must be an integer"),
    ("num_layers", True, "must be an integer"),
    ("vocab_size", None, "must be an integer"),
    ("window", [8], "must be an integer"),
    ("bos_token_id", 0.5, "must be an integer"),
    ("compress_ratios", [0, 4.5, 128, 4], r"compress_ratios\[1\] must be an integer"),
    ("compress_ratios", [0, 4, 128.0, 4], r"compress_ratios\[2\] must be an integer"),
    ("compress_ratios", [0, "4", 128, 4], r"compress_ratios\[1\] must be an integer"),
    ("compress_ratios", "0,4,128,4", "compress_ratios must be a list"),
    ("compress_ratios", 4, "compress_ratios must be a list"),
    ("compress_ratios", {"0": 4}, "compress_ratios must be a list"),
    ("rope_theta", float("nan"), "rope_theta must be a finite number"),
    ("rope_theta", float("inf"), "rope_theta must be a finite number"),
    ("rope_theta", "10000", "rope_theta must be a number"),
    ("norm_eps", float("-inf"), "norm_eps must be a finite number"),
    ("norm_eps", None, "norm_eps must be a number"),
    ("norm_eps", False, "norm_eps must be a number"),
    ("allow_any_ratio", "false", "allow_any_ratio must be true or false"),
]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("field,value,allowed", WRONG_TYPES)
def test_config_field_of_wrong_type(ckpt, loader, field, value, allowed):
    _edit_config(ckpt, **{field: value})
    with pytest.raises(ConfigError, match=allowed) as info:
        loader(ckpt)
    assert "config.json" in str(info.value) and field in str(info.value)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("field,value", [("d_model", 0), ("d_model", -32), ("num_layers", 0),
                                         ("vocab_size", -1), ("window", 0), ("max_position", -5),
                                         ("rope_theta", 0.0), ("norm_eps", -1e-6)])
def test_config_size_not_positive(ckpt, loader, field, value):
    _edit_config(ckpt, **{field: value})
    with pytest.raises(ConfigError, match=f"{field} must be positive, got {value}") as info:
        loader(ckpt)
    assert "config.json" in str(info.value)


@pytest.mark.parametrize("loader", LOADERS)
def test_config_of_another_architecture(ckpt, loader):
    _edit_config(ckpt, architecture="llama")
    with pytest.raises(ConfigError, match="config.json: architecture is 'llama'"):
        loader(ckpt)


@pytest.mark.parametrize("field,value", [("d_model", "256"), ("d_model", 256.0), ("num_layers", True),
                                         ("compress_ratios", (0, 4.0, 128, 4)), ("rope_theta", float("nan")),
                                         ("norm_eps", "1e-6"), ("allow_any_ratio", 1)])
def test_model_config_direct_construction_checks_types(field, value):
    """Not only config.json: the dataclass itself refuses, with ConfigError (a ValueError)."""
    with pytest.raises(ConfigError, match=field):
        tiny_config(**{field: value})


@pytest.mark.parametrize("d", [[("d_model", 32)], "d_model", None])
def test_model_config_from_dict_needs_a_dict(d):
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ModelConfig.from_dict(d)


# -- model.safetensors ----------------------------------------------------------------------


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_non_float_weight(ckpt, loader, dtype):
    tensors = load_file(str(ckpt / "model.safetensors"))
    victim = "layers.1.attn.wq_a.weight"
    tensors[victim] = torch.ones_like(tensors[victim], dtype=dtype)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="must be floating point") as info:
        loader(ckpt)
    msg = str(info.value)
    assert "model.safetensors" in msg and f"{victim} ({dtype})" in msg


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("corrupt", [
    pytest.param(lambda data: b"", id="empty"),
    pytest.param(_truncated, id="truncated"),
    pytest.param(lambda data: data[:7], id="shorter-than-header-length"),
    pytest.param(lambda data: b"not a safetensors file at all" * 4, id="garbage"),
    pytest.param(lambda data: (2**40).to_bytes(8, "little") + b"{}", id="huge-header-length"),
])
def test_unreadable_weights_file(ckpt, loader, corrupt):
    path = ckpt / "model.safetensors"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        loader(ckpt)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_missing_file(ckpt, loader, name):
    (ckpt / name).unlink()
    with pytest.raises(FileNotFoundError, match=name):
        loader(ckpt)


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("dtype", [None, 32, 3.0, ["float32"], b"float32"])
def test_dtype_of_wrong_type(ckpt, loader, dtype):
    with pytest.raises(TypeError, match="dtype"):
        loader(ckpt, dtype=dtype)


def test_dtype_checked_before_anything_is_read(tmp_path):
    with pytest.raises(TypeError, match="dtype"):
        load_checkpoint(tmp_path / "nowhere", dtype=None)


def test_folder_of_wrong_type():
    with pytest.raises(TypeError, match="folder"):
        load_checkpoint(42)


# -- tokenizer files --------------------------------------------------------------------------


def _no_special_tokens() -> str:
    return HFTokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str()


@pytest.mark.parametrize("loader", TOKENIZER_LOADERS)
@pytest.mark.parametrize("corrupt,problem", [
    pytest.param(lambda text: "not json", "is not valid JSON", id="not-json"),
    pytest.param(lambda text: text[: len(text) // 2], "is not valid JSON", id="truncated"),
    pytest.param(lambda text: "", "is not valid JSON", id="empty"),
    pytest.param(lambda text: "[1, 2, 3]", "must hold a JSON object", id="array"),
    pytest.param(lambda text: "null", "must hold a JSON object", id="null"),
    pytest.param(lambda text: "{}", "is not a tokenizers file", id="empty-object"),
    pytest.param(lambda text: '{"model": 1}', "is not a tokenizers file", id="wrong-model"),
    pytest.param(lambda text: _no_special_tokens(), "lacks the special token", id="no-special-tokens"),
])
def test_corrupt_tokenizer_json(ckpt, loader, corrupt, problem):
    path = ckpt / "tokenizer.json"
    path.write_text(corrupt(path.read_text(encoding="utf-8")), encoding="utf-8")
    with pytest.raises(ValueError, match=problem) as info:
        loader(ckpt)
    assert "tokenizer.json" in str(info.value)


@pytest.mark.parametrize("loader", TOKENIZER_LOADERS)
def test_tokenizer_json_not_utf8(ckpt, loader):
    (ckpt / "tokenizer.json").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match="tokenizer.json is not valid JSON"):
        loader(ckpt)


@pytest.mark.parametrize("loader", TOKENIZER_LOADERS)
@pytest.mark.parametrize("content,problem", [
    pytest.param('{"chat_template": ', "is not valid JSON", id="truncated"),
    pytest.param("", "is not valid JSON", id="empty"),
    pytest.param('["<|bos|>"]', "must hold a JSON object", id="array"),
    pytest.param('"python-str.format"', "must hold a JSON object", id="string"),
    pytest.param('{"chat_template": 5, "chat_template_format": "python-str.format"}',
                 "chat_template must be a string", id="template-not-a-string"),
    pytest.param('{"chat_template": "{role}: {text}", "chat_template_format": "python-str.format"}',
                 "exactly the fields", id="template-wrong-fields"),
    pytest.param('{"chat_template": "{% for m in messages %}", "chat_template_format": "jinja"}',
                 "chat_template_format", id="jinja"),
])
def test_corrupt_tokenizer_config(ckpt, loader, content, problem):
    (ckpt / "tokenizer_config.json").write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=problem) as info:
        loader(ckpt)
    assert "tokenizer_config.json" in str(info.value)


def test_tokenizer_json_missing(ckpt):
    (ckpt / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(ckpt)
    assert LLM(ckpt).tokenizer is None   # a checkpoint without a tokenizer takes token ids


def test_tokenizer_larger_than_model_vocab(tmp_path, tok):
    folder = save_checkpoint(random_model(tiny_config(vocab_size=64)), tmp_path / "small")
    tok.save(folder)
    with pytest.raises(ValueError, match=f"tokenizer.json has {tok.vocab_size} tokens but "
                                         "config.json's vocab_size is 64"):
        LLM(folder)


# -- writing: interrupted and failed writes ---------------------------------------------------

def test_a_conversion_that_runs_out_of_disk_leaves_nothing(ckpt, tmp_path, monkeypatch, capsys):
    """The disk fills while the weights are written: an error naming the output (no
    traceback from the CLI), and neither the output nor a temporary sibling is left."""
    import errno

    from branchspec import cli
    from branchspec.checkpoint import convert as convert_module

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", filename)

    monkeypatch.setattr(convert_module, "save_file", full_disk)
    out = tmp_path / "converted"
    with pytest.raises(OSError, match=r"cannot write .*converted: No space left on device.*nothing was left"):
        convert_module.convert_checkpoint(ckpt, out)
    assert cli.main(["convert", str(ckpt), str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(out) in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_killed_conversion_is_cleaned_up_by_the_next(ckpt, tmp_path):
    """A writer killed mid-conversion leaves its temporary folder, marked with its pid;
    the next conversion to the same output removes it (a live writer's is left alone)."""
    import subprocess
    import sys

    from branchspec.atomic import PARTIAL_MARK
    from branchspec.checkpoint import convert_checkpoint

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / ".converted.abc123"
    abandoned.mkdir()
    (abandoned / PARTIAL_MARK).write_text(dead.stdout.strip())
    (abandoned / "model.safetensors").write_bytes(b"half")
    live = tmp_path / ".converted.live42"
    live.mkdir()
    (live / PARTIAL_MARK).write_text(str(__import__("os").getpid()))
    convert_checkpoint(ckpt, tmp_path / "converted")
    assert not abandoned.exists() and live.exists()
    assert load_checkpoint(tmp_path / "converted").cfg == load_checkpoint(ckpt).cfg
    assert not (tmp_path / "converted" / PARTIAL_MARK).exists()


def test_save_checkpoint_replaces_files_whole(ckpt, model, monkeypatch):
    """A save that fails mid-write leaves the folder's previous files as they were."""
    import errno

    from branchspec.checkpoint import save as save_module

    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(save_module, "save_file", full_disk)
    with pytest.raises(OSError, match=r"cannot write .*model.safetensors: No space left"):
        save_checkpoint(model, ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    load_checkpoint(ckpt)
