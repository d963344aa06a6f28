"""What a training run keeps to resume, how it is written, and how it is read back.

No file a run folder holds can run code when read: tensors are safetensors, everything
else JSON. (The pickled ``state.pt`` of older versions is refused, never unpickled: run
folders move between machines, and unpickling a crafted file runs its code.)

Two ways to resume, both in the run folder:

* **exact**: ``state.json`` (step, sampler, history, the optimizer's settings) naming its
  tensors file ``state-<step>.safetensors`` (the model's weights and Adam's moments);
* **compact pack**, what a repository keeps: ``resume.safetensors`` (the weights) and
  ``resume.json`` (step, sampler, history); Adam's moments are rebuilt on resume.

Every write is atomic: a file is written under a temporary name and renamed into place.
``state.json`` is written after the tensors it names, so an interrupted save leaves the
previous state whole (and an orphan tensors file, which the next save removes). The pack's
two files carry the same step, so a pack torn by an interruption is recognised. Reading
checks every field, and every error names the file and the field.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from branchspec.atomic import is_temporary, save_safetensors, write_atomically

STATE_FILE = "state.json"
STATE_FORMAT = "branchspec-train-state"
PACK_WEIGHTS, PACK_STATE = "resume.safetensors", "resume.json"
LEGACY_STATE = "state.pt"
_TENSORS_RE = re.compile(r"state-\d{6,}\.safetensors")


class ResumeError(ValueError):
    """A run folder whose saved state cannot be resumed; the message names the file."""


# -- writing ------------------------------------------------------------------------------------

def write_json(path: Path, obj) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(obj) + "\n", encoding="utf-8"))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    write_atomically(path, lambda tmp: save_safetensors(tensors, tmp, metadata))


def remove_leftovers(out: Path) -> list[Path]:
    """Delete what interrupted saves left in a run folder: temporary files, and tensors
    files that state.json does not name. Returns what was removed."""
    named = None
    try:
        named = json.loads((out / STATE_FILE).read_text(encoding="utf-8")).get("tensors")
    except (OSError, ValueError, AttributeError):
        pass
    # Tensors files are orphans only beside a state.json that names another: with none,
    # or an unreadable one, they may be all that is left of the run, and stay.
    named_ok = isinstance(named, str) and _TENSORS_RE.fullmatch(named) and (out / named).is_file()
    removed = []
    for p in out.iterdir() if out.is_dir() else ():
        stale_tmp = is_temporary(p.name) and p.is_file()
        orphan = named_ok and _TENSORS_RE.fullmatch(p.name) and p.name != named and p.is_file()
        if stale_tmp or orphan:
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


# -- reading, with checks ---------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ResumeError(f"{path} is missing")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ResumeError(f"{path} is not UTF-8 text: the file is corrupt") from None
    if not text.strip():
        raise ResumeError(f"{path} is empty (an interrupted write?)")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ResumeError(f"{path} is not valid JSON ({e}): the file is corrupt") from None
    if not isinstance(obj, dict):
        raise ResumeError(f"{path} must hold a JSON object, got {type(obj).__name__}")
    return obj


def _field(path: Path, record: dict, name: str, kind, what: str):
    if name not in record:
        raise ResumeError(f"{path}: field {name!r} is missing")
    value = record[name]
    ok = isinstance(value, kind) and not isinstance(value, bool) if kind is not bool else isinstance(value, bool)
    if not ok:
        raise ResumeError(f"{path}: field {name!r} must be {what}, got {type(value).__name__} {str(value)[:40]}")
    return value


def _progress(path: Path, record: dict, max_steps: int) -> dict:
    """The fields both formats share: step, sampler, history, evals, elapsed, sittings."""
    step = _field(path, record, "step", int, "an integer")
    if not 0 <= step <= max_steps:
        raise ResumeError(f"{path}: field 'step' is {step}, outside this run's 0..{max_steps} steps")
    _field(path, record, "sampler", dict, "an object (the batch sampler's state)")
    history = _field(path, record, "history", list, "a list")
    if not all(isinstance(h, dict) for h in history):
        raise ResumeError(f"{path}: field 'history' must hold objects, one per step")
    _field(path, record, "evals", list, "a list")
    elapsed = _field(path, record, "elapsed", (int, float), "a number of seconds")
    if not (math.isfinite(elapsed) and elapsed >= 0):
        raise ResumeError(f"{path}: field 'elapsed' must be a finite number >= 0, got {elapsed}")
    if not isinstance(record.get("sittings", []), list):
        raise ResumeError(f"{path}: field 'sittings' must be a list")
    return record


def _open_tensors(path: Path):
    """(safetensors handle, its metadata); ResumeError naming the file if it is absent,
    empty or unreadable."""
    from safetensors import safe_open

    if not path.is_file():
        raise ResumeError(f"{path} is missing")
    if path.stat().st_size == 0:
        raise ResumeError(f"{path} is empty (0 bytes; an interrupted write?)")
    try:
        handle = safe_open(str(path), "pt")
        return handle, handle.metadata() or {}
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError alike
        raise ResumeError(f"{path} is not a readable safetensors file: {e}") from None


def _load_tensors(path: Path, handle, shapes: dict[str, tuple[int, ...]],
                  dtypes: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """The tensors named in `shapes`, of those shapes (cast to `dtypes` where given), read
    from `handle`: ResumeError naming the file and the tensor for one missing or of another
    shape (state saved by a run with other settings), or unreadable."""
    keys = set(handle.keys())
    missing = sorted(set(shapes) - keys)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ResumeError(f"{path} lacks tensor {missing[0]!r}{more}: it was saved by a run of another model or "
                          "settings")
    out = {}
    for name, shape in shapes.items():
        try:
            t = handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise ResumeError(f"{path}: tensor {name!r} cannot be read: {e}") from None
        if tuple(t.shape) != tuple(shape):
            raise ResumeError(f"{path}: tensor {name!r} has shape {list(t.shape)}, this run's model expects "
                              f"{list(shape)}: it was saved by a run of another model or settings")
        out[name] = t.to(dtypes[name]) if dtypes and name in dtypes else t
    return out


def _expect(state: dict[str, torch.Tensor], prefix: str = "") -> tuple[dict, dict]:
    return ({prefix + k: tuple(v.shape) for k, v in state.items()},
            {prefix + k: v.dtype for k, v in state.items()})


# -- the exact state --------------------------------------------------------------------------

def save_state(out: Path, model_state: dict[str, torch.Tensor], optimizer_state: dict, record: dict) -> None:
    """Write the exact state (a model's and an optimizer's state dicts, and the JSON
    record): the tensors file first, then state.json naming it (the commit), then remove
    older tensors files."""
    step = record["step"]
    name = f"state-{step:06d}.safetensors"
    sd = optimizer_state
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in model_state.items()}
    scalars: dict[str, dict] = {}
    for index, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{key}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[key] = value
    write_tensors(out / name, tensors, {"format": STATE_FORMAT, "step": str(step)})
    write_json(out / STATE_FILE, {"format": STATE_FORMAT, "version": 1, "tensors": name, **record,
                                  "optimizer": {"param_groups": sd["param_groups"], "scalars": scalars}})
    remove_leftovers(out)


def _state_files(out: Path, max_steps: int) -> tuple[dict, Path, object]:
    """state.json's record, checked, and its tensors file (path, open handle)."""
    path = out / STATE_FILE
    record = _read_json(path)
    if record.get("format") != STATE_FORMAT:
        raise ResumeError(f"{path}: field 'format' must be {STATE_FORMAT!r}, got {record.get('format')!r}")
    name = _field(path, record, "tensors", str, "a file name")
    if not _TENSORS_RE.fullmatch(name):      # a name, never a path out of the folder
        raise ResumeError(f"{path}: field 'tensors' must name a state-NNNNNN.safetensors file here, got {name!r}")
    _progress(path, record, max_steps)
    _field(path, record, "optimizer", dict, "an object")
    tensors_path = out / name
    handle, meta = _open_tensors(tensors_path)
    if meta.get("step") != str(record["step"]):
        raise ResumeError(f"{tensors_path} holds step {meta.get('step')}, but {path} is at step {record['step']}")
    return record, tensors_path, handle


def _pack_files(out: Path, max_steps: int) -> tuple[dict, Path, object]:
    path = out / PACK_STATE
    record = _progress(path, _read_json(path), max_steps)
    weights_path = out / PACK_WEIGHTS
    handle, meta = _open_tensors(weights_path)
    if "step" in meta and meta["step"] != str(record["step"]):   # packs before this check carry no step
        raise ResumeError(f"{weights_path} holds step {meta['step']}, but {path} is at step {record['step']}: a "
                          "save was interrupted between the two; resume from state.json, or from an intact pack")
    return record, weights_path, handle


def check_resumable(out: Path, source: str, max_steps: int) -> None:
    """Before any work: the files `source` ("state" or "pack") resumes from are there,
    readable, and their records well formed (the tensors' shapes need the model: they are
    checked when loading). ResumeError naming the file and the field."""
    (_state_files if source == "state" else _pack_files)(out, max_steps)


def load_state(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, max_steps: int) -> dict:
    """Read the exact state into `model` and `opt`; returns the JSON record. ResumeError
    naming the file and the field for anything missing, corrupt or mismatched."""
    record, tensors_path, handle = _state_files(out, max_steps)
    path = out / STATE_FILE
    weights = _load_tensors(tensors_path, handle, *_expect(model.state_dict(), "model."))
    model.load_state_dict({k[len("model."):]: v for k, v in weights.items()})
    state = _optimizer_state(path, tensors_path, handle, record, opt)
    try:
        opt.load_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError) as e:
        raise ResumeError(f"{path}: field 'optimizer' does not fit this run's optimizer ({type(e).__name__}: "
                          f"{e})") from None
    return record


def _optimizer_state(path: Path, tensors_path: Path, handle, record: dict, opt: torch.optim.Optimizer) -> dict:
    saved = _field(path, record, "optimizer", dict, "an object")
    groups = saved.get("param_groups")
    scalars = saved.get("scalars", {})
    current = opt.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(current) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) and g["params"] == c["params"]
            for g, c in zip(groups, current)):
        raise ResumeError(f"{path}: field 'optimizer.param_groups' does not match this run's parameters: it was "
                          "saved by a run of another model or settings")
    if not isinstance(scalars, dict):
        raise ResumeError(f"{path}: field 'optimizer.scalars' must be an object")
    params = [p for group in opt.param_groups for p in group["params"]]
    prefix = re.compile(r"optimizer\.(\d+)\.(\w+)")
    state: dict[int, dict] = {}
    shapes = {}
    for key in handle.keys():
        m = prefix.fullmatch(key)
        if m is None:
            continue
        index = int(m.group(1))
        if index >= len(params):
            raise ResumeError(f"{tensors_path}: tensor {key!r} is for parameter {index}; this run has {len(params)}")
        shapes[key] = () if m.group(2) == "step" else tuple(params[index].shape)   # Adam's step count, moments
    loaded = _load_tensors(tensors_path, handle, shapes)
    for key, t in loaded.items():
        m = prefix.fullmatch(key)
        state.setdefault(int(m.group(1)), {})[m.group(2)] = t
    for index, entry in scalars.items():
        if not (isinstance(index, str) and index.isdigit() and isinstance(entry, dict)):
            raise ResumeError(f"{path}: field 'optimizer.scalars' must map parameter indices to objects")
        state.setdefault(int(index), {}).update(entry)
    return {"state": state, "param_groups": groups}


# -- the compact pack -------------------------------------------------------------------------

def save_pack(out: Path, model: torch.nn.Module, record: dict) -> None:
    """Write the pack: the weights (their step in the header), then resume.json."""
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    write_tensors(out / PACK_WEIGHTS, tensors, {"step": str(record["step"])})
    write_json(out / PACK_STATE, record)


def load_pack(out: Path, model: torch.nn.Module, max_steps: int) -> dict:
    """Read the pack's weights into `model`; returns resume.json's record (checked)."""
    record, weights_path, handle = _pack_files(out, max_steps)
    model.load_state_dict(_load_tensors(weights_path, handle, *_expect(model.state_dict())))
    return record


# -- which -------------------------------------------------------------------------------------

def resume_source(out: Path) -> str:
    """"state" (exact) or "pack", whichever the run folder holds (the exact one first);
    ResumeError when it holds neither, or only the pickled state of older versions."""
    if (out / STATE_FILE).is_file():
        return "state"
    if (out / PACK_STATE).is_file() or (out / PACK_WEIGHTS).is_file():
        return "pack"
    if (out / LEGACY_STATE).is_file():
        raise ResumeError(
            f"{out / LEGACY_STATE} is a pickle, the training state of an older branchspec, and is not loaded: "
            f"unpickling a file can run any code it holds. Resume from a pack ({PACK_WEIGHTS} + {PACK_STATE}) "
            "if the folder has one, or start a new run; to keep the exact state of a run you made yourself, "
            "convert it once with `python scripts/migrate_train_state.py "
            f"{out}` (it reads the file with torch.load(weights_only=True), which runs no code)")
    raise ResumeError(f"nothing to resume in {out}: it holds neither {STATE_FILE} nor {PACK_STATE} + "
                      f"{PACK_WEIGHTS}; drop --resume to start a new run there")
