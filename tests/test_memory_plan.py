"""The memory plan bounds every method: each quantize run, in a process of its own, peaks no higher above its start
(the plan's baseline: run.py's rss_start) than the host total it printed.

The model is shaped so that the parts that scale with the calibration tokens dominate (16384 tokens, an MLP 2.7x as
wide as the hidden states, as SmolLM2's), and there are more windows than one micro-batch holds: SmoothQuant before
GPTQ folds its scales inside GPTQ's forward, which then runs every window at once (the plan before this test counted
one micro-batch's temporaries there, and measured 220 MiB against a 146 MiB plan)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_recipe
from tiny_models import tiny_config, tiny_tokenizer

from quantkit.quantize import microbatches

SAMPLES, SEQ_LEN = 128, 128
W8A8 = "{bits: 8, group_size: -1, sym: true, activations: {bits: 8, type: int}}"
METHODS = {  # as tests/test_families.py writes them
    "rtn": "rtn: {bits: 4, group_size: 32, sym: true}",
    "gptq": "gptq: {bits: 4, group_size: 32, sym: true, act_order: true}",
    "awq": "awq: {bits: 4, group_size: 32, zero_point: true, grid: 4}",
    "awq+gptq": "awq: {bits: 4, group_size: 32, zero_point: true, grid: 4}\n  - gptq: {bits: 4, group_size: 32, "
                "sym: false}",
    "gptq w8a8": f"gptq: {W8A8}",
    "smoothquant+gptq w8a8": f"smoothquant: {{alpha: 0.8}}\n  - gptq: {W8A8}",
    "smoothquant+rtn w8a8": f"smoothquant: {{alpha: 0.8}}\n  - rtn: {W8A8}",
    "fp8": "rtn: {bits: 8, group_size: -1, sym: true, type: float, activations: {type: float}}",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every method's run, started at once (each its own process: its own peak)."""
    from transformers import AutoModelForCausalLM

    assert SAMPLES > microbatches.size(SAMPLES, SEQ_LEN)  # several micro-batches' worth of windows
    tmp = tmp_path_factory.mktemp("memory_plan")
    tok = tiny_tokenizer()
    cfg = tiny_config("llama", len(tok), hidden=192)
    cfg.intermediate_size = 512
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    started = {}
    for k, (method, stage) in enumerate(METHODS.items()):
        recipe = write_recipe(tmp / f"{k}.yaml", tmp / "model", tmp / f"out{k}", stage, ("compressed-tensors",),
                              samples=SAMPLES, seq_len=SEQ_LEN)
        summary = tmp / f"{k}.json"
        started[method] = (summary, subprocess.Popen(
            [sys.executable, "-m", "quantkit.cli", "quantize", str(recipe), "--quiet", "--json", str(summary)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    yield started
    for _, proc in started.values():
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("method", list(METHODS))
def test_peak_stays_within_the_printed_plan(runs, method):
    summary, proc = runs[method]
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    memory = json.loads(Path(summary).read_text())["memory"]
    rise, plan = memory["rss_peak"] - memory["rss_start"], memory["plan"]
    assert rise <= plan["host_total"], (f"{rise / 2**20:.1f} MiB above the start, plan "
                                        f"{plan['host_total'] / 2**20:.1f} MiB", plan["host"])
