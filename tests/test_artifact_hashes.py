"""The artifact-hash baseline stays honest: one cheap tiny cell, quantized again, hashes as recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "benchmarks"
CELL = "tiny/llama/rtn"  # no calibration to build: the cheapest


def _installed(pkg: str) -> str:
    if pkg == "python":
        return sys.version.split()[0]
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def test_a_tiny_cell_hashes_as_recorded():
    baseline = FOLDER / "artifact_hashes.json"
    recorded = json.loads(baseline.read_text())
    differ = {pkg: (v, _installed(pkg)) for pkg, v in recorded["versions"].items() if _installed(pkg) != v}
    if differ:
        pytest.skip(f"recorded with other package versions (recorded, installed): {differ}")
    import torch

    if torch.backends.cpu.get_cpu_capability() != recorded["cpu"]["torch_capability"]:
        pytest.skip(f"recorded on a {recorded['cpu']['torch_capability']} CPU, this one runs "
                    f"{torch.backends.cpu.get_cpu_capability()} kernels")
    run = subprocess.run([sys.executable, str(FOLDER / "artifact_hashes.py"), "check", str(baseline), "--only", CELL,
                          "--quiet"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checked 1 cells" in run.stdout and "all equal" in run.stdout
