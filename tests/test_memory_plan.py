"""The memory plan bounds every method: each quantize run, in a process of its own, peaks no higher above its start
(the plan's baseline: run.py's rss_start) than the host total it printed.

SmoothQuant before GPTQ folds its scales inside GPTQ's forward, which then runs every window at once; its run has
512 windows of 128 tokens (16 micro-batches' worth), so that what every window holds at once dominates the peak (the
plan that counted one micro-batch's temporaries there printed 136 MiB for a 244 MiB peak). The other methods take
64 windows (two micro-batches: GPTQ keeps them in step)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import write_recipe
from tiny_models import make_tiny_model

from quantkit.quantize import microbatches

SEQ_LEN = 128
W8A8 = "{bits: 8, group_size: -1, sym: true, activations: {bits: 8, type: int}}"
METHODS = {  # method -> (stages as tests/test_families.py writes them, calibration windows)
    "rtn": ("rtn: {bits: 4, group_size: 32, sym: true}", 64),
    "gptq": ("gptq: {bits: 4, group_size: 32, sym: true, act_order: true}", 64),
    "awq": ("awq: {bits: 4, group_size: 32, zero_point: true, grid: 4}", 64),
    "awq+gptq": ("awq: {bits: 4, group_size: 32, zero_point: true, grid: 4}\n  - gptq: {bits: 4, group_size: 32, "
                 "sym: false}", 64),
    "gptq w8a8": (f"gptq: {W8A8}", 64),
    "smoothquant+gptq w8a8": (f"smoothquant: {{alpha: 0.8}}\n  - gptq: {W8A8}", 512),
    "smoothquant+rtn w8a8": (f"smoothquant: {{alpha: 0.8}}\n  - rtn: {W8A8}", 64),
    "fp8": ("rtn: {bits: 8, group_size: -1, sym: true, type: float, activations: {type: float}}", 64),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("memory_plan") / "llama")  # hidden 64, MLP 128, 2 blocks


@pytest.mark.parametrize("method", list(METHODS))
def test_peak_stays_within_the_printed_plan(model, tmp_path, method):
    stage, windows = METHODS[method]
    assert windows > microbatches.size(windows, SEQ_LEN)  # several micro-batches' worth of windows
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", stage, ("compressed-tensors",),
                          samples=windows, seq_len=SEQ_LEN)
    run = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe), "--quiet", "--json",
                          str(tmp_path / "run.json")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    memory = json.loads((tmp_path / "run.json").read_text())["memory"]
    rise, plan = memory["rss_peak"] - memory["rss_start"], memory["plan"]
    assert rise <= plan["host_total"], (f"{rise / 2**20:.1f} MiB above the start, plan "
                                        f"{plan['host_total'] / 2**20:.1f} MiB", plan["host"])
