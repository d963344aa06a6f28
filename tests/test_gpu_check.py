"""scripts/gpu_check.py, the prepared GPU check, runs on a CPU too: each phase under its
share of the time budget, its JSON written as it ends, a phase that runs out of time
marked so without losing the ones after it. (Its checks themselves run on a GPU; on a CPU
the CUDA-graph path runs with `graphs.StaticCalls`, which tests/test_graphs.py covers.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def test_a_phase_out_of_time_keeps_the_others(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path), "--quick",
                          "--phases", "steps,throughput", "--budget-s", "8"],
                         capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    phases = report["phases"]
    assert phases["steps"]["status"] == "timed out", phases["steps"]
    assert phases["throughput"]["status"] == "done"
    assert run.returncode == 3, run.stderr[-2000:]
    assert report["device"] == "cpu" and "seconds" in report


def test_unknown_phases_are_refused(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path),
                          "--phases", "equivalence,speed"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown phases ['speed']" in run.stderr


def test_the_regime_phase_keeps_its_rows_and_writes_its_table(tmp_path, monkeypatch):
    """The regime phase, at a tiny size on a CPU: rows in the JSON, the projection, regime.md."""
    import importlib.util

    from branchspec.bench import regime as regime_module
    from test_regime import TINY_SLICE

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    tiny = regime_module.RegimePlan(batch_sizes=(1,), contexts=(40,), nodes=(1, 2, 6), repeats=1, progress=False,
                                    dtype="float32", config_overrides=TINY_SLICE)
    monkeypatch.setattr(regime_module, "default_plan", lambda device, quick, **given: tiny)
    report = gpu_check.Report(tmp_path, "cpu")
    phase = report.phase("regime")
    gpu_check.regime("cpu", phase, report, True, tmp_path)
    written = json.loads((tmp_path / "gpu_check.json").read_text())["phases"]["regime"]
    assert [d["num_layers"] for d in written["rows"]] == [3, 7]
    assert phase["regime"]["projection"]["layers"] == 43
    assert "Verify cost of D nodes" in (tmp_path / "regime.md").read_text()
