"""Resuming a training run from files that may be hostile, corrupt, torn or missing: no
file runs code when read (a planted pickle is refused, never unpickled), every bad file
is refused with a message naming it and the field, an empty folder is not silently a new
run, and an interrupted save leaves the last state whole and its leftovers are removed."""

import errno
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from branchspec import cli
from branchspec.train import state
from branchspec.train.state import ResumeError
from branchspec.train.trainer import train
from conftest import write_mbpp
from test_train import _small


@pytest.fixture(scope="module")
def mbpp_path(tmp_path_factory) -> str:
    return str(write_mbpp(tmp_path_factory.mktemp("mbpp") / "mbpp.jsonl"))


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, mbpp_path):
    """A run of 4 steps stopped after 2: state.json, its tensors and the pack."""
    out = tmp_path_factory.mktemp("stopped")
    assert train(_small(out, 4, mbpp_path), progress=False, stop_after=2) is None
    return out


@pytest.fixture
def run(stopped, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    return out


def resume(out: Path, mbpp_path: str):
    return train(_small(out, 4, mbpp_path), resume=True, progress=False, stop_after=1)


def test_the_stopped_run_holds_no_pickle(stopped):
    names = sorted(p.name for p in stopped.iterdir())
    assert "state.json" in names and "state-000002.safetensors" in names and "state.pt" not in names
    assert {"resume.json", "resume.safetensors"} <= set(names)
    assert not [n for n in names if n.endswith(".tmp")]


class Payload:
    """Unpickling this writes a file: what a crafted state.pt would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('code ran')",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_planted_pickle_is_never_unpickled(tmp_path, mbpp_path):
    out = tmp_path / "run"
    out.mkdir()
    marker = tmp_path / "pwned"
    (out / "state.pt").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ResumeError, match=r"state.pt is a pickle.*not loaded.*migrate_train_state.py"):
        resume(out, mbpp_path)
    assert not marker.exists()
    # the migration script's restricted unpickler refuses it too
    import importlib.util

    spec = importlib.util.spec_from_file_location("migrate", Path(__file__).parents[1] / "scripts" /
                                                  "migrate_train_state.py")
    migrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migrate)
    with pytest.raises(SystemExit):
        migrate.main([str(out)])
    assert not marker.exists()
    # and pickles planted where the new files go are only bad files
    (out / "state.json").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ResumeError, match=r"state.json is not (UTF-8 text|valid JSON)"):
        resume(out, mbpp_path)
    assert not marker.exists()


def test_migrating_an_old_state_resumes_exactly(stopped, tmp_path, mbpp_path):
    """A state.pt written by an older version (tensors, numbers, containers) converts with
    the restricted unpickler and resumes to the same weights as the new format."""
    import importlib.util

    from safetensors.torch import load_file

    out = tmp_path / "old"
    shutil.copytree(stopped, out)
    record = json.loads((out / "state.json").read_text())
    tensors = load_file(str(out / record["tensors"]))
    model = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    opt_state = {}
    for k, v in tensors.items():
        if k.startswith("optimizer."):
            _, i, name = k.split(".")
            opt_state.setdefault(int(i), {})[name] = v
    optimizer = {"state": opt_state, "param_groups": record["optimizer"]["param_groups"]}
    torch.save({"model": model, "optimizer": optimizer, **{k: record[k] for k in
               ("step", "sampler", "history", "evals", "elapsed", "sittings")}}, out / "state.pt")
    for p in [out / "state.json", *out.glob("state-*.safetensors")]:
        p.unlink()
    spec = importlib.util.spec_from_file_location("migrate", Path(__file__).parents[1] / "scripts" /
                                                  "migrate_train_state.py")
    migrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(migrate)
    assert migrate.main([str(out)]) == 0
    (out / "state.pt").unlink()
    ref = tmp_path / "new"
    shutil.copytree(stopped, ref)
    for folder in (out, ref):
        assert resume(folder, mbpp_path) is None
    a, b = (load_file(str(f / "resume.safetensors")) for f in (out, ref))
    assert all(torch.equal(a[k], b[k]) for k in a)


def _rewrite_json(name, **fields):
    def change(out: Path):
        record = json.loads((out / name).read_text())
        record.update(fields)
        (out / name).write_text(json.dumps(record))
    return change


def _tensors_of_another_shape(out: Path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = out / "state-000002.safetensors"
    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["model.embed.weight"] = tensors["model.embed.weight"][:-1].clone()
    save_file(tensors, str(path), metadata=meta)


def _torn_pack(out: Path):
    from safetensors.torch import load_file, save_file

    for p in [out / "state.json", *out.glob("state-*.safetensors")]:
        p.unlink()
    weights = load_file(str(out / "resume.safetensors"))
    save_file(weights, str(out / "resume.safetensors"), metadata={"step": "1"})


def _pack_only(out: Path):
    for p in [out / "state.json", *out.glob("state-*.safetensors")]:
        p.unlink()


BAD_STATES = [
    pytest.param(lambda o: (o / "state.json").write_text(""), r"state.json is empty", id="empty-json"),
    pytest.param(lambda o: (o / "state.json").write_text((o / "state.json").read_text()[:50]),
                 r"state.json is not valid JSON", id="truncated-json"),
    pytest.param(lambda o: (o / "state.json").write_text("[1, 2]"), r"state.json must hold a JSON object",
                 id="json-array"),
    pytest.param(_rewrite_json("state.json", step="2"), r"state.json: field 'step' must be an integer",
                 id="step-string"),
    pytest.param(_rewrite_json("state.json", step=99), r"state.json: field 'step' is 99, outside this run's 0..4",
                 id="step-past-the-run"),
    pytest.param(_rewrite_json("state.json", history={}), r"state.json: field 'history' must be a list",
                 id="history-object"),
    pytest.param(_rewrite_json("state.json", elapsed=-1), r"state.json: field 'elapsed' must be a finite",
                 id="negative-elapsed"),
    pytest.param(_rewrite_json("state.json", sampler={"bit_generator": "nope"}), r"state.json: field 'sampler'",
                 id="bad-sampler"),
    pytest.param(_rewrite_json("state.json", tensors="../../etc/x.safetensors"),
                 r"state.json: field 'tensors' must name a state-NNNNNN.safetensors", id="tensors-path"),
    pytest.param(_rewrite_json("state.json", format="other"), r"state.json: field 'format'", id="format"),
    pytest.param(_rewrite_json("state.json", optimizer={"param_groups": [], "scalars": {}}),
                 r"state.json: field 'optimizer.param_groups' does not match", id="optimizer-groups"),
    pytest.param(lambda o: (o / "state-000002.safetensors").unlink(), r"state-000002.safetensors is missing",
                 id="tensors-missing"),
    pytest.param(lambda o: (o / "state-000002.safetensors").write_bytes(b""), r"state-000002.safetensors is empty",
                 id="tensors-empty"),
    pytest.param(lambda o: (o / "state-000002.safetensors").write_bytes(b"\x80\x04garbage" * 10),
                 r"state-000002.safetensors is not a readable safetensors file", id="tensors-garbage"),
    pytest.param(_tensors_of_another_shape, r"state-000002.safetensors: tensor 'model.embed.weight' has shape",
                 id="tensors-of-another-model"),
    pytest.param(_torn_pack, r"resume.safetensors holds step 1, but .*resume.json is at step 2", id="torn-pack"),
    pytest.param(lambda o: (_pack_only(o), (o / "resume.safetensors").unlink()), r"resume.safetensors is missing",
                 id="pack-weights-missing"),
    pytest.param(lambda o: (_pack_only(o), (o / "resume.json").write_text("{")), r"resume.json is not valid JSON",
                 id="pack-json-corrupt"),
]


@pytest.mark.parametrize("damage, match", BAD_STATES)
def test_bad_saved_state_is_refused_naming_file_and_field(run, mbpp_path, damage, match):
    damage(run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ResumeError, match=match):
        resume(run, mbpp_path)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before, "a refused resume changed the folder"


def test_resume_on_an_empty_folder_is_refused(tmp_path, mbpp_path, capsys):
    with pytest.raises(ResumeError, match=r"nothing to resume in .*empty.*drop --resume"):
        resume(tmp_path / "empty", mbpp_path)
    (tmp_path / "empty").mkdir()
    assert cli.main(["train", "--out", str(tmp_path / "empty"), "--resume", "--model", "tiny"]) == 2
    err = capsys.readouterr().err
    assert "nothing to resume in" in err and "Traceback" not in err
    assert list((tmp_path / "empty").iterdir()) == []


def test_out_that_is_a_file_is_refused_before_any_work(tmp_path, mbpp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("not a folder")
    with pytest.raises(ValueError, match=r"the run folder .*a-file is a file"):
        train(_small(f, 4, mbpp_path), progress=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--out", str(f), "--model", "tiny"])
    assert e.value.code == 2
    assert "--out" in capsys.readouterr().err and f.read_text() == "not a folder"


def test_leftovers_of_an_interrupted_save_are_removed(run, mbpp_path):
    (run / ".state.json.4242.tmp").write_text("{half")
    (run / "state-000001.safetensors").write_bytes(b"an orphan from an interrupted save")
    assert resume(run, mbpp_path) is None
    names = {p.name for p in run.iterdir()}
    assert ".state.json.4242.tmp" not in names and "state-000001.safetensors" not in names
    assert json.loads((run / "state.json").read_text())["step"] == 3 and "state-000003.safetensors" in names
    assert "state-000002.safetensors" not in names


def test_a_save_that_runs_out_of_disk_keeps_the_last_state(run, mbpp_path, monkeypatch):
    """The disk fills while the tensors are written: the error names the file, nothing
    half-written is left, and the previous state still resumes."""
    from safetensors import torch as st_torch

    real = st_torch.save_file

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    before = (run / "state.json").read_text()
    monkeypatch.setattr(st_torch, "save_file", full_disk)
    with pytest.raises(OSError, match=r"cannot write .*state-000003.safetensors: No space left on device"):
        resume(run, mbpp_path)
    monkeypatch.setattr(st_torch, "save_file", real)
    assert (run / "state.json").read_text() == before
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp") or p.name == "state-000003.safetensors"]
    assert resume(run, mbpp_path) is None
    assert json.loads((run / "state.json").read_text())["step"] == 3
