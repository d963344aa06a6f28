"""The files of a checkpoint folder: which format it is, its safetensors weights read
lazily, and writing a new folder all or nothing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from branchspec import atomic
from branchspec.config import ConfigError, read_config_json
from branchspec.speculative.draft_vocab import DRAFT_VOCAB_FILE, DraftVocab

FORMAT_BRANCHSPEC = "branchspec"
FORMAT_HF = "huggingface"
FORMAT_DEEPSEEK = "deepseek"
FORMATS = (FORMAT_BRANCHSPEC, FORMAT_HF, FORMAT_DEEPSEEK)

HF_MODEL_TYPE = "deepseek_v4"

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files `convert` carries over beside the weights (the tokenizer and HF's generation
# defaults, whose eos list the foreign tokenizer reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")
# ... and the reduced draft vocabulary (token ids, the same in any dtype): without it the
# converted model would draft over its whole vocabulary.
CARRIED_FILES = (*TOKENIZER_FILES, DRAFT_VOCAB_FILE)


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


# -- format -----------------------------------------------------------------------------------


def config_format(d: dict) -> str:
    """Which format a parsed config.json belongs to; ConfigError for a foreign model type."""
    if "architecture" in d:
        return FORMAT_BRANCHSPEC     # ModelConfig refuses a wrong architecture by name
    model_type = d.get("model_type")
    if model_type == HF_MODEL_TYPE or (model_type is None and d.get("architectures") == ["DeepseekV4ForCausalLM"]):
        return FORMAT_HF
    if model_type is not None:
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported; branchspec reads "
                          f"Hugging Face {HF_MODEL_TYPE!r} folders, DeepSeek's original V4 folders and "
                          "its own ('architecture': 'branchspec-v4')")
    if "dim" in d and "n_layers" in d:
        return FORMAT_DEEPSEEK
    return FORMAT_BRANCHSPEC


def detect_format(folder: str | Path) -> str:
    """``"branchspec"``, ``"huggingface"`` or ``"deepseek"``, from ``folder/config.json``."""
    d = read_config_json(folder)
    try:
        return config_format(d)
    except ConfigError as e:
        raise ConfigError(f"{Path(folder) / 'config.json'}{str(e)[len('config.json'):]}") from None


# -- reading safetensors ----------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None), "F4": getattr(torch, "float4_e2m1fn_x2", None),
}


class SafetensorsFolder(Mapping):
    """The tensors of one or more safetensors files as a lazy, read-only mapping.

    Shapes and dtypes come from the headers (``shape``, ``dtype_name``); a tensor is read
    only when indexed. Every unreadable file is a CheckpointError naming it.
    """

    def __init__(self, files: Iterable[str | Path], weight_map: Mapping[str, str] | None = None,
                 where: str | Path | None = None):
        from safetensors import safe_open

        self.files = [Path(p) for p in files]
        self.where = str(where) if where is not None else str(self.files[0] if len(self.files) == 1 else
                                                               self.files[0].parent)
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        for path in self.files:
            if not path.is_file():
                raise FileNotFoundError(f"no {path.name} in {path.parent}")
            if path.stat().st_size == 0:
                raise CheckpointError(f"{path} is empty (0 bytes)")
            try:
                handle = safe_open(str(path), "pt")
                keys = list(handle.keys())
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ValueError alike
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
            self._handles[path] = handle
            for k in keys:
                if k in self._file_of:
                    raise CheckpointError(
                        f"tensor {k} is in both {self._file_of[k].name} and {path.name} (model-parallel "
                        "shards cannot be merged; convert DeepSeek's checkpoint with mp=1)")
                self._file_of[k] = path
        if weight_map is not None:
            absent = sorted(k for k, fname in weight_map.items() if self._file_of.get(k, Path()).name != fname)
            if absent:
                raise CheckpointError(f"{self.where}: tensors listed in the index are not in their shard: "
                                      f"{absent[:20]}{' ...' if len(absent) > 20 else ''}")

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        try:
            return self._handles[path].get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path} is not a readable safetensors file: tensor {name}: {e}") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def _slice(self, name: str):
        path = self._file_of[name]
        try:
            return self._handles[path].get_slice(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path} is not a readable safetensors file: tensor {name}: {e}") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def close(self) -> None:
        self._handles.clear()

    @classmethod
    def open(cls, folder: str | Path) -> "SafetensorsFolder":
        """``model.safetensors``, else the index and its shards, else every ``*.safetensors``."""
        folder = Path(folder)
        single = folder / WEIGHTS_FILE
        if single.is_file():
            return cls([single])
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map must map tensor names to file names")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index: {e!r}") from e
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not (folder / shard).is_file():
                    raise FileNotFoundError(f"{index} names the shard {shard}, which is not in {folder}")
            return cls([folder / s for s in shards], weight_map, where=index)
        found = sorted(p for p in folder.glob("*.safetensors") if p.is_file() and p.name != DRAFT_VOCAB_FILE)
        if not found:
            raise FileNotFoundError(f"no {WEIGHTS_FILE} (nor {INDEX_FILE}, nor any *.safetensors) in {folder}")
        return cls(found)


def tensor_shape(source: Mapping, name: str) -> tuple[int, ...]:
    if isinstance(source, SafetensorsFolder):
        return source.shape(name)
    return tuple(source[name].shape)


def dtype_tag(source: Mapping, name: str) -> str:
    """A dtype's name: safetensors' (``F8_E4M3``) for files, torch's for tensors."""
    if isinstance(source, SafetensorsFolder):
        return source.dtype_name(name)
    return str(source[name].dtype).removeprefix("torch.")


def torch_dtype(tag: str) -> torch.dtype | None:
    if tag in _SAFETENSORS_DTYPES:
        return _SAFETENSORS_DTYPES[tag]
    return getattr(torch, tag, None)


def dtype_kind(tag: str) -> str:
    dtype = torch_dtype(tag)
    if dtype is None:
        return "other"
    if dtype.is_floating_point:
        return "float"
    if dtype == torch.bool or dtype.is_complex:
        return "other"
    return "int"


# -- writing a new folder ---------------------------------------------------------------------


def check_new_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {out} already exists and is not an empty folder; choose a new path")


def new_folder(out: Path):
    """Write a checkpoint folder all or nothing (`atomic.new_folder`): the block fills a
    temporary sibling of ``out`` (which must not exist, or be empty), renamed into place
    when the block ends; on any error, a full disk included (an OSError naming ``out``),
    the sibling is removed and ``out`` is left as it was."""
    return atomic.new_folder(out, refuse=check_new_folder)


def check_carried_files(src: Path, vocab_size: int) -> None:
    """What ``convert`` carries over beside the weights must load, checked before any work:
    a tokenizer.json that is not JSON or not a tokenizers file, a tokenizer_config.json
    that is not JSON, or a draft vocabulary with ids the model lacks is a ValueError naming
    the file, not a copy that only the converted folder's first load would report."""
    if (src / "tokenizer.json").is_file():
        from branchspec.data.tokenizer import Tokenizer

        Tokenizer.from_dir(src)
    if (src / DRAFT_VOCAB_FILE).is_file():
        DraftVocab.load(src / DRAFT_VOCAB_FILE, vocab_size)


def copy_tokenizer_files(src: Path, out: Path, names: Iterable[str] = CARRIED_FILES) -> None:
    """Copy the tokenizer files (and the draft vocabulary) of ``src`` into ``out``. A
    branchspec tokenizer is written anew (``Tokenizer.save``), so a folder from before the
    current layout gets the Jinja ``chat_template`` and BOS post-processor that other tools
    read; a foreign one is copied as it is (``check_carried_files`` has loaded both)."""
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    if not (src / "tokenizer.json").is_file() or not (src / "tokenizer_config.json").is_file():
        return
    from branchspec.data.tokenizer import ForeignTokenizer, Tokenizer

    tok = Tokenizer.from_dir(src)
    if not isinstance(tok, ForeignTokenizer):
        tok.save(out)
