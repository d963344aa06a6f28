"""Reading a checkpoint folder of any format into branchspec's state_dict and model.

``to_branchspec_tensors`` maps and checks a source's tensors (a dict or a lazily read
``SafetensorsFolder``), ``open_checkpoint`` opens a folder, ``load_checkpoint`` builds
the model from it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from branchspec.checkpoint.deepseek_config import read_deepseek_config
from branchspec.checkpoint.folder import (
    FORMAT_BRANCHSPEC, FORMAT_HF, CheckpointError, SafetensorsFolder, config_format, dtype_kind, dtype_tag,
    tensor_shape, torch_dtype,
)
from branchspec.checkpoint.foreign_config import ConfigExtras
from branchspec.checkpoint.fp8 import FP4_TAGS, FP8_BLOCK, dequantize_fp8_blocks, is_fp8
from branchspec.checkpoint.hf_config import read_hf_config
from branchspec.checkpoint.names import Recipe, plan_names
from branchspec.checkpoint.schema import expected_tensors, is_integer_tensor
from branchspec.config import ConfigError, ModelConfig, read_config_json
from branchspec.model.dtypes import resolve_dtype
from branchspec.model.model import Transformer


def _shown(names: list[str], limit: int = 40) -> str:
    return str(names[:limit]) + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


def to_branchspec_tensors(source: Mapping[str, torch.Tensor], cfg: ModelConfig, *,
                          expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                          dtype: torch.dtype | None = None, tie_word_embeddings: bool = False,
                          fp8_block: int | tuple[int, int] = FP8_BLOCK, fp4_experts: bool = False,
                          rename: bool = True, where: str = "checkpoint", file_label: str | None = None,
                          config_name: str = "its config.json") -> dict[str, torch.Tensor]:
    """Branchspec's state_dict from a source's tensors, in any supported spelling.

    ``source`` is a dict of tensors or a ``SafetensorsFolder`` (read lazily, one target
    tensor at a time). ``expected`` maps each branchspec name to its (shape, dtype), by
    default ``expected_tensors(cfg)``: the model's shapes, int64 for integer tensors and
    ``dtype`` (or float32) for the rest. Block-FP8 weights are dequantised; floating
    tensors are cast to ``dtype`` (kept as read when None), integer ones to the expected
    integer dtype.
    ``rename=False`` reads names as branchspec's own, with no foreign spelling accepted.

    Every problem is checked before a tensor is read, and reported together in one
    CheckpointError: FP4 weights, FP8 weights without a fitting scale, missing, unexpected
    and mis-shaped tensors, then tensors of the wrong kind (float vs integer), then NaN or
    Inf values. Messages name ``where`` (the folder) or ``file_label`` (the weights file;
    default: the source's file for a ``SafetensorsFolder``, else ``where``).
    """
    if file_label is None:
        file_label = source.where if isinstance(source, SafetensorsFolder) else where
    if expected is None:
        expected = expected_tensors(cfg, dtype or torch.float32)
    names = list(source.keys())
    plan = plan_names(names, rename)
    tags = {n: dtype_tag(source, n) for n in names}

    fp4 = sorted(n for n, t in tags.items() if t in FP4_TAGS)
    if fp4 or (fp4_experts and any(".experts." in n for n in names)):
        shown = fp4 or sorted(n for n in names if ".experts." in n)[:5]
        raise CheckpointError(f"{where}: FP4 (float4_e2m1fn_x2) weights are not supported, found {_shown(shown, 10)}; "
                              "use a checkpoint with FP8 or BF16 experts")
    block = (fp8_block, fp8_block) if isinstance(fp8_block, int) else tuple(fp8_block)
    fp8_problems = []
    for n, t in tags.items():
        if is_fp8(t) and n not in plan.scales:
            fp8_problems.append(f"{n} is float8_e4m3fn but has no .scale or _scale_inv companion")
    for w, s in plan.scales.items():
        if not is_fp8(tags[w]):
            fp8_problems.append(f"{s} scales {w}, which is {tags[w]}, not float8_e4m3fn")
            continue
        shape, sshape = tensor_shape(source, w), tensor_shape(source, s)
        want = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])) if len(shape) >= 2 else None
        if sshape != want:
            fp8_problems.append(f"{s}: shape {sshape} does not give one scale per {block[0]}x{block[1]} "
                                f"block of {w} {shape} (expected {want})")
    if fp8_problems:
        raise CheckpointError(f"{where}: block-FP8 weights that cannot be dequantised: {_shown(sorted(fp8_problems))}")

    recipes = dict(plan.recipes)
    if tie_word_embeddings and "head.weight" not in recipes and "embed.weight" in recipes:
        recipes["head.weight"] = recipes["embed.weight"]

    def shape_of(recipe: Recipe) -> tuple[int, ...]:
        first = tensor_shape(source, recipe.sources[0])
        if recipe.op == "stack":
            shapes = {tensor_shape(source, s) for s in recipe.sources}
            return (len(recipe.sources), *first) if len(shapes) == 1 else (len(recipe.sources), -1)
        if recipe.op in ("half0", "half1"):
            if len(first) < 2 or first[1] % 2:
                return first
            return (first[0], first[1] // 2, *first[2:])
        return first

    missing = sorted(set(expected) - set(recipes))
    extra = sorted(set(recipes) - set(expected))
    unexpected_shown = [n if n == k else f"{n} (as {k})" for k in extra for n in recipes[k].sources[:1]]
    bad_shape = sorted(f"{k}: expected {tuple(expected[k][0])}, found {shape_of(recipes[k])}"
                       for k in set(expected) & set(recipes) if shape_of(recipes[k]) != tuple(expected[k][0]))
    problems = []
    if missing or plan.expert_gaps:
        problems.append(f"missing tensors {_shown(missing + sorted(plan.expert_gaps))}")
    if extra:
        problems.append(f"unexpected tensors {_shown(sorted(unexpected_shown))}")
    if plan.duplicates:
        problems.append(f"tensors given twice: {_shown(plan.duplicates)}")
    if bad_shape:
        problems.append(f"mis-shaped tensors {bad_shape}")
    if problems:
        raise CheckpointError(f"checkpoint {where} does not match {config_name}: " + "; ".join(problems))

    # A tensor's kind must be the model's: floating for weights (FP8 dequantises to one),
    # integer for the hash table; load_state_dict would silently cast otherwise.
    def described(k: str) -> str:
        name = recipes[k].sources[0]
        return f"{name} ({torch_dtype(tags[name]) or tags[name]})"

    kinds = {k: dtype_kind(tags[r.sources[0]]) for k, r in recipes.items()}   # FP8 counts as float
    want_float = sorted(described(k) for k in recipes if expected[k][1].is_floating_point and kinds[k] != "float")
    want_int = sorted(described(k) for k in recipes if not expected[k][1].is_floating_point and kinds[k] != "int")
    if want_float:
        raise CheckpointError(f"{file_label}: tensors must be floating point, found {want_float}")
    if want_int:
        raise CheckpointError(f"{file_label}: tensors must be integers, found {want_int}")

    def read(name: str) -> torch.Tensor:
        t = source[name]
        if name in plan.scales:
            t = dequantize_fp8_blocks(t, source[plan.scales[name]], block)
        return t

    out: dict[str, torch.Tensor] = {}
    for k in expected:
        recipe = recipes[k]
        if recipe.op == "stack":
            t = torch.stack([read(s) for s in recipe.sources])
        else:
            t = read(recipe.sources[0])
            if recipe.op in ("half0", "half1"):
                half = t.shape[1] // 2
                t = t[:, :half] if recipe.op == "half0" else t[:, half:]
        if t.is_floating_point():
            if not torch.isfinite(t).all():
                raise CheckpointError(f"checkpoint {where}: tensor {k} contains NaN or Inf")
            target = dtype if dtype is not None else t.dtype
        else:
            target = expected[k][1]
            if is_integer_tensor(k) and t.numel() and (int(t.min()) < 0 or int(t.max()) >= max(cfg.num_experts, 1)):
                raise CheckpointError(f"checkpoint {where}: {k} holds expert ids outside [0, {cfg.num_experts})")
        out[k] = t.to(target).contiguous()
    return out


# -- whole folders ------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """An opened checkpoint folder of any supported format."""

    folder: Path
    format: str
    config: ModelConfig
    extras: ConfigExtras
    source: SafetensorsFolder

    @property
    def where(self) -> str:
        return self.source.where

    def tensors(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Branchspec's state_dict (see ``to_branchspec_tensors``)."""
        return to_branchspec_tensors(
            self.source, self.config, expected=expected, dtype=dtype,
            tie_word_embeddings=self.extras.tie_word_embeddings, fp8_block=self.extras.fp8_block,
            fp4_experts=self.extras.fp4_experts, rename=self.format != FORMAT_BRANCHSPEC,
            where=str(self.folder), file_label=self.where)

    def close(self) -> None:
        self.source.close()


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Detect the folder's format, build its ModelConfig and open its weights lazily.

    FileNotFoundError for a missing folder, config.json or weights; ConfigError naming
    config.json and the field; CheckpointError naming an unreadable weights file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    d = read_config_json(folder)
    config_path = folder / "config.json"
    try:
        fmt = config_format(d)
    except ConfigError as e:
        raise ConfigError(f"{config_path}{str(e)[len('config.json'):]}") from None
    if fmt == FORMAT_BRANCHSPEC:
        cfg = ModelConfig.load(folder)       # its own errors, naming the file
        source = SafetensorsFolder.open(folder)
        return Checkpoint(folder, fmt, cfg, ConfigExtras(), source)
    source = SafetensorsFolder.open(folder)
    convert = read_hf_config if fmt == FORMAT_HF else read_deepseek_config
    kw, extras = convert(d, str(config_path), list(source.keys()))
    return Checkpoint(folder, fmt, ModelConfig(**kw), extras, source)


def checkpoint_stop_ids(folder: str | Path) -> tuple[int, ...]:
    """Every id that ends generation per the folder's config.json: eos, then an HF eos
    list's other entries."""
    ckpt_cfg = read_config_json(folder)
    fmt = config_format(ckpt_cfg)
    if fmt == FORMAT_BRANCHSPEC:
        return (ModelConfig.load(folder).eos_token_id,)
    convert = read_hf_config if fmt == FORMAT_HF else read_deepseek_config
    kw, extras = convert(ckpt_cfg, str(Path(folder) / "config.json"))
    return (kw["eos_token_id"], *extras.extra_stop_ids)


def load_checkpoint(folder: str | Path, dtype: str | torch.dtype = "float32", *,
                    expert_dispatch: str = "grouped") -> Transformer:
    """Load a checkpoint folder: branchspec's own, a Hugging Face ``deepseek_v4`` one or
    DeepSeek's original one (see ``branchspec.checkpoint``; FP8 weights are dequantised).

    Every missing, unexpected, mis-shaped, wrong-kind (float vs integer) or non-finite
    tensor is named in the error (CheckpointError), and a bad config.json field in a
    ConfigError. Everything is checked before a weight is copied into the model; the dtype
    argument before anything is read. Floating tensors are cast to ``dtype``; integer
    buffers (the hash-routing table) stay integer. `expert_dispatch`: how MoE layers run
    (`Transformer`); the compiled path needs "dense".
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a str or path, got {type(folder).__name__} {folder!r}")
    target = resolve_dtype(dtype)
    ckpt = open_checkpoint(Path(folder))
    try:
        # The weights' shapes (from the headers) are checked against config.json's before
        # the model is allocated: a config.json claiming a vocabulary of 10**9 over weights
        # of 8,192 rows is a named mismatch, not an allocator failure.
        tensors = ckpt.tensors(expected_tensors(ckpt.config, target), dtype=target)
    finally:
        ckpt.close()
    model = Transformer(ckpt.config, expert_dispatch=expert_dispatch).to(target)
    model.load_state_dict(tensors)
    return model.eval()
