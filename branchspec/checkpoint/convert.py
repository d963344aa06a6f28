"""Folder to folder: any supported format to branchspec's (``convert_checkpoint``), and
any folder branchspec reads to Hugging Face's (``export_hf_folder``), tokenizer files and
every stop id carried over."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from branchspec.atomic import save_safetensors
from branchspec.checkpoint.export import write_hf_folder
from branchspec.checkpoint.folder import (WEIGHTS_FILE, check_carried_files, check_new_folder, copy_tokenizer_files,
                                          new_folder)
from branchspec.checkpoint.load import checkpoint_stop_ids, load_checkpoint, open_checkpoint
from branchspec.config import read_config_json
from branchspec.model.dtypes import resolve_dtype


def _record_stop_ids(out: Path, stop_ids: tuple[int, ...]) -> None:
    """Keep an HF eos list, which branchspec's config.json (one eos id) cannot hold, in
    ``generation_config.json``'s ``eos_token_id``, where the foreign tokenizer reads it."""
    path = out / "generation_config.json"
    generation = {}
    if path.is_file():
        try:
            generation = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            generation = {}
        if not isinstance(generation, dict):
            generation = {}
    old = generation.get("eos_token_id")
    old = old if isinstance(old, list) else [old] if isinstance(old, int) else []
    generation["eos_token_id"] = list(dict.fromkeys([*stop_ids, *old]))
    path.write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


def _write_foreign_tokenizer_config(src: Path, out: Path) -> None:
    """A foreign tokenizer.json without tokenizer_config.json is recognised by the HF or
    DeepSeek config.json beside it, which conversion replaces: write the config it needs
    (its bos/eos tokens) so the converted folder still loads it."""
    if not (src / "tokenizer.json").is_file() or (src / "tokenizer_config.json").is_file():
        return
    from branchspec.data.tokenizer import ForeignTokenizer, Tokenizer

    tok = Tokenizer.from_dir(src)     # loads: check_carried_files has read it
    if isinstance(tok, ForeignTokenizer):
        tok.save(out)


def convert_checkpoint(src: str | Path, out: str | Path, dtype: str | torch.dtype = "float32") -> Path:
    """Write ``src`` (any supported format) as a branchspec folder at ``out``.

    ``out`` gets config.json, model.safetensors (floats in ``dtype``) and the tokenizer
    files and draft vocabulary present in ``src`` (each checked to load first). ``out``
    must not exist or be an empty folder. Nothing is left at ``out`` if the conversion
    fails (a full disk is an OSError naming it).
    """
    target = resolve_dtype(dtype)
    src, out = Path(src), Path(out)
    if not src.exists():
        raise FileNotFoundError(f"source checkpoint {src} does not exist")
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint {src} is not a folder")
    check_new_folder(out)
    ckpt = open_checkpoint(src)
    try:
        check_carried_files(src, ckpt.config.vocab_size)
        tensors = ckpt.tensors(dtype=target)
    finally:
        ckpt.close()
    with new_folder(out) as tmp:
        ckpt.config.save(tmp)
        meta = {"format": "pt", "converted_from": json.dumps(ckpt.format)}
        if ckpt.extras.extra_stop_ids:
            meta["extra_stop_ids"] = json.dumps(list(ckpt.extras.extra_stop_ids))
        save_safetensors(tensors, tmp / WEIGHTS_FILE, meta)
        copy_tokenizer_files(src, tmp)
        _write_foreign_tokenizer_config(src, tmp)
        if ckpt.extras.extra_stop_ids:
            _record_stop_ids(tmp, (ckpt.config.eos_token_id, *ckpt.extras.extra_stop_ids))
    return out


def _source_stop_ids(src: Path) -> list[int]:
    """Every stop id of a checkpoint folder: its config.json's, then an eos list in its
    generation_config.json (where ``convert`` keeps an HF eos list)."""
    ids = list(checkpoint_stop_ids(src))
    path = src / "generation_config.json"
    if path.is_file():
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            eos = None
        ids += [e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int) and not isinstance(e, bool)]
    return list(dict.fromkeys(ids))


def export_hf_folder(src: str | Path, out: str | Path, dtype: str | torch.dtype = "float32") -> Path:
    """Load any checkpoint folder branchspec reads and write it as an HF ``deepseek_v4``
    folder at ``out`` (see ``export_hf``), with its tokenizer files and every stop id."""
    src = Path(src)
    read_config_json(src)                    # FileNotFoundError / ConfigError naming the folder
    model = load_checkpoint(src, dtype)
    check_carried_files(src, model.cfg.vocab_size)
    stop_ids = _source_stop_ids(src)
    return write_hf_folder(model, Path(out), dtype, stop_ids[1:], src)
