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
