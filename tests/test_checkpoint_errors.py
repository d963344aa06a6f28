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

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
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

    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", full_disk)
    with pytest.raises(OSError, match=r"cannot write .*model.safetensors: No space left"):
        save_checkpoint(model, ckpt)
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    load_checkpoint(ckpt)


# -- sizes config.json claims, checked against the weights before allocating -----------------

@pytest.mark.parametrize("loader", LOADERS)
def test_a_vocabulary_the_weights_do_not_hold_is_refused_before_allocating(ckpt, loader, monkeypatch):
    """config.json claims 10**9 tokens over weights of 320 rows: once the model was built
    at the claimed size first (4 TB: an allocator failure); now the headers' shapes are
    compared first, and nothing of the model's size is allocated."""
    from branchspec.model import model as model_module

    _edit_config(ckpt, vocab_size=10**9)
    built = []
    real = model_module.Transformer.__init__

    def recording(self, cfg, *args, **kwargs):
        if not torch.empty(0).is_meta:         # the shapes are read on the meta device: that is free
            built.append(cfg.vocab_size)
        return real(self, cfg, *args, **kwargs)

    monkeypatch.setattr(model_module.Transformer, "__init__", recording)
    with pytest.raises(CheckpointError, match=r"does not match its config.json: mis-shaped tensors "
                                              r".*embed.weight: expected \(1000000000, 32\), found \(320, 32\)"):
        loader(ckpt)
    assert built == []


def test_a_context_the_memory_cannot_hold_names_max_model_len(ckpt):
    """config.json's max_position of 10**9 matches any weights, and sizes the page pools
    of one request beyond any machine: refused naming max_model_len and what fits."""
    _edit_config(ckpt, max_position=10**9)
    with pytest.raises(ConfigError, match=r"max_model_len=1000000000 \(the model's max_position\): the page pools "
                                          r"for 64 requests .* even one request's; use max_model_len <= (\d+)") as e:
        LLM(ckpt)
    fits = int(str(e.value).rsplit("max_model_len <= ", 1)[1].split()[0])
    assert fits > 1000
    assert LLM(ckpt, max_batch_size=1, max_model_len=min(fits, 4096)).engine.max_len == min(fits, 4096)


# -- keys a real checkpoint's config.json must not lose --------------------------------------

@pytest.mark.parametrize("keys", [["yarn_factor"], ["compress_rope_theta", "hc_eps"], ["rope_theta"], ["window"]])
def test_a_config_missing_a_key_the_model_needs_is_refused_naming_it(tmp_path, keys):
    """A V4 config.json missing yarn_factor once loaded without YaRN (another model) in
    silence; every key branchspec writes must be there, the V4 parts' all or none."""
    from branchspec.config import tiny_v4_config

    folder = save_checkpoint(random_model(tiny_v4_config(), seed=0), tmp_path / "v4")
    d = json.loads((folder / "config.json").read_text())
    for k in keys:
        del d[k]
    (folder / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=rf"config.json: {', '.join(keys)} (is|are) missing; branchspec writes "
                                          r"every key"):
        load_checkpoint(folder)


def test_a_plain_model_config_from_before_the_v4_parts_still_loads(ckpt):
    """A config.json naming none of the V4 parts' keys is a plain model's (they were added
    together, later): their defaults are that model, so it loads as before."""
    d = json.loads((ckpt / "config.json").read_text())
    for k in ModelConfig._V4_KEYS:
        del d[k]
    (ckpt / "config.json").write_text(json.dumps(d))
    assert load_checkpoint(ckpt).cfg == tiny_config(vocab_size=VOCAB)
    assert ModelConfig.load(DEFAULT_CHECKPOINT).hc_mult == 2      # the embedded checkpoint names them all


def test_a_foreign_config_missing_a_setting_is_warned_about_naming_it():
    """Hugging Face's and DeepSeek's configs take their libraries' defaults, as
    transformers and DeepSeek's reference do; the defaults taken are named in a warning."""
    from branchspec.checkpoint.hf_config import hf_config_to_branchspec
    from branchspec.checkpoint.export import hf_config_from_branchspec
    from branchspec.config import tiny_v4_config

    d = hf_config_from_branchspec(tiny_v4_config(), dtype=torch.float32)
    with warnings_as_list() as caught:
        hf_config_to_branchspec(d)
    assert caught == []
    del d["compress_rope_theta"], d["hc_eps"]
    with pytest.warns(UserWarning, match=r"config.json: not given, so transformers' DeepseekV4Config's defaults "
                                         r"are taken: compress_rope_theta=160000.0, hc_eps=1e-06"):
        kw = hf_config_to_branchspec(d)
    assert kw["compress_rope_theta"] == 160000.0


def warnings_as_list():
    import warnings

    return warnings.catch_warnings(record=True)


# -- what convert carries, and a disk that fills -------------------------------------------------

def test_convert_refuses_a_tokenizer_json_that_is_not_json(ckpt, tmp_path, capsys):
    """Once copied as is (exit 0, and the converted folder then failed to load); now a
    named error before any work, and nothing written."""
    from branchspec import cli

    (ckpt / "tokenizer.json").write_text("not json {")
    assert cli.main(["convert", str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{ckpt / 'tokenizer.json'} is not valid JSON" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("to", ["branchspec", "hf"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_convert_keeps_the_draft_vocabulary(tmp_path, tok, to, dtype):
    """Once left out (the converted model drafted over its whole vocabulary); its ids are
    the same in any dtype, so it is carried over, checked against the model first."""
    from branchspec import cli
    from branchspec.config import tiny_v4_config
    from branchspec.speculative.draft_vocab import DRAFT_VOCAB_FILE, DraftVocab

    ckpt = save_checkpoint(random_model(tiny_v4_config(vocab_size=VOCAB), seed=0), tmp_path / "v4")
    tok.save(ckpt)
    DraftVocab(torch.tensor([5, 9, 3, 200])).save(ckpt)
    out = tmp_path / "out"
    assert cli.main(["convert", str(ckpt), str(out), "--dtype", dtype, "--to", to]) == 0
    assert DraftVocab.load(out / DRAFT_VOCAB_FILE, VOCAB).token_ids.tolist() == [5, 9, 3, 200]
    assert LLM(out).draft_vocab.token_ids.tolist() == [5, 9, 3, 200]


def test_convert_refuses_a_draft_vocabulary_the_model_cannot_use(ckpt, tmp_path, capsys):
    from branchspec import cli
    from branchspec.speculative.draft_vocab import DraftVocab

    DraftVocab(torch.tensor([5, VOCAB + 7])).save(ckpt)
    assert cli.main(["convert", str(ckpt), str(tmp_path / "out")]) == 2
    assert "draft_vocab.safetensors: token ids outside the model's vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_convert_onto_a_full_disk_names_the_file(ckpt, tmp_path):
    """A real write failure, a file-size limit standing in for a full disk (once a raw
    SafetensorError traceback): exit 2, the error and the file it struck named, nothing
    left behind."""
    import subprocess
    import sys

    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
              "from branchspec import cli; sys.exit(cli.main(['convert', sys.argv[1], sys.argv[2]]))")
    out = tmp_path / "converted"
    run = subprocess.run([sys.executable, "-c", script, str(ckpt), str(out)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2, run.stderr
    assert f"cannot write {out}: File too large ({out / 'model.safetensors'}); nothing was left there" in run.stderr
    assert "Traceback" not in run.stderr and "SafetensorError" not in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
