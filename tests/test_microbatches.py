"""Micro-batches: every forward of a block runs a few windows at a time, and GPTQ's one forward keeps them in step so
that each Linear is still solved at its first call over every window. The artifact is the one-forward run's, byte
for byte; the memory is less."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli, write_recipe
from test_resume import safetensors_bytes
from test_streaming import FORMATS, STAGES, sharded_checkpoint
from tiny_models import tiny_config, tiny_tokenizer

from quantkit.errors import QuantkitError
from quantkit.quantize import microbatches
from quantkit.quantize.microbatches import InStep


def test_a_barrier_runs_its_action_once_every_micro_batch_has_arrived():
    log = []
    step = InStep(3)

    def forward(c: int) -> int:
        log.append(("before", c))
        step.barrier("q_proj", lambda: log.append(("solve q_proj in", step.index)))
        log.append(("after", c))
        step.barrier("down_proj", lambda: log.append(("solve down_proj in", step.index)))
        return 10 * c

    assert step.run(forward) == [0, 10, 20]
    assert log == [("before", 0), ("before", 1), ("before", 2), ("solve q_proj in", 2),
                   ("after", 0), ("after", 1), ("after", 2), ("solve down_proj in", 2)]
    alone = InStep(1)  # one micro-batch: no coroutines, the action runs at once
    assert alone.run(lambda c: alone.barrier("x", lambda: log.append("alone")) or c) == [0] and log[-1] == "alone"


def test_each_micro_batch_keeps_its_own_grad_mode_across_barriers():
    """torch's grad mode is per thread and the micro-batches share one: a no_grad block left open at a barrier
    must not switch gradients on or off for another micro-batch, or for the caller afterwards."""
    import torch

    step = InStep(3)

    def forward(c: int) -> list[bool]:
        seen = []
        with torch.no_grad():
            step.barrier("q_proj", lambda: None)
            seen.append(torch.is_grad_enabled())
            step.barrier("down_proj", lambda: None)
            seen.append(torch.is_grad_enabled())
        seen.append(torch.is_grad_enabled())
        return seen

    assert torch.is_grad_enabled()
    assert step.run(forward) == [[False, False, True]] * 3
    assert torch.is_grad_enabled()
    with torch.no_grad():
        assert step.run(forward) == [[False, False, False]] * 3
        assert not torch.is_grad_enabled()


def test_micro_batches_that_part_ways_are_named_and_a_failure_unwinds_the_others():
    step = InStep(3)
    with pytest.raises(QuantkitError, match="micro-batch 1 reached k_proj where micro-batch 0 reached q_proj"):
        step.run(lambda c: step.barrier("k_proj" if c == 1 else "q_proj", lambda: None))
    with pytest.raises(QuantkitError, match="micro-batch 2 reached the end of its forward where micro-batch 0 "
                                            "reached q_proj"):
        step.run(lambda c: None if c == 2 else step.barrier("q_proj", lambda: None))
    unwound = []

    def failing(c: int) -> None:
        try:
            step.barrier("a", lambda: None)
            if c == 1:
                raise ValueError("boom in micro-batch 1")
            step.barrier("b", lambda: None)
        finally:
            unwound.append(c)

    with pytest.raises(ValueError, match="boom in micro-batch 1"):
        step.run(failing)
    assert sorted(unwound) == [0, 1, 2]  # the others' finally blocks ran


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return sharded_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama", tied=False, layers=3)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", len(tok), layers=2), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("ckpt") / "moe"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


RECIPES = {name: (STAGES[name], FORMATS[name]) for name in ("gptq", "sq-w8a8", "awq+gptq", "sq-rtn")} | {
    "gptq-w8a8": ("gptq: {bits: 8, group_size: -1, activations: {bits: 8}}", ("compressed-tensors",)),
    "awq": ("awq: {bits: 4, group_size: 32, zero_point: true, grid: 4}", ("awq",)),
}


def quantized(monkeypatch, tmp_path: Path, name: str, model: Path, stage: str, tokens: int) -> dict:
    """The artifact's bytes and the summary of a run with `tokens` tokens per micro-batch (8 windows of 64)."""
    monkeypatch.setattr(microbatches, "TOKENS", tokens)
    stages, formats = RECIPES[stage]
    recipe = write_recipe(tmp_path / f"{name}.yaml", model, tmp_path / name, stages, formats)
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet", "--json", tmp_path / f"{name}.json") == 0
    return {"bytes": {fmt: safetensors_bytes(tmp_path / name / fmt) for fmt in formats},
            "summary": json.loads((tmp_path / f"{name}.json").read_text())}


@pytest.mark.parametrize("stage", list(RECIPES))
def test_micro_batches_write_the_one_forward_bytes(llama, tmp_path, monkeypatch, stage):
    """8 windows in micro-batches of 3 (3 + 3 + 2) against all 8 at once: GPTQ in step (W8A8 too; after SmoothQuant,
    which folds inside its forward, all at once), the transforms' statistics passes and the plain forwards a
    micro-batch at a time."""
    one = quantized(monkeypatch, tmp_path, "one", llama, stage, 1 << 30)
    micro = quantized(monkeypatch, tmp_path, "micro", llama, stage, 3 * 64)
    assert micro["bytes"] == one["bytes"]
    assert micro["summary"]["loss_total"] == one["summary"]["loss_total"]
    # the plan counts one micro-batch's temporaries, not every window's, except where they all run at once
    acts = [r["summary"]["memory"]["plan"]["host"]["activations"] for r in (one, micro)]
    assert acts[1] == acts[0] if stage == "sq-w8a8" else acts[1] < acts[0]


def test_moe_blocks_keep_one_gptq_forward_and_the_same_bytes(moe, tmp_path, monkeypatch):
    """Experts run on the tokens routed to them, so micro-batches need not call the same Linears: GPTQ runs an MoE
    block's forward over every window at once."""
    one = quantized(monkeypatch, tmp_path, "one", moe, "gptq", 1 << 30)
    micro = quantized(monkeypatch, tmp_path, "micro", moe, "gptq", 3 * 64)
    assert micro["bytes"] == one["bytes"]


WIDE_MLP = """
    import sys
    from quantkit.quantize import microbatches
    microbatches.TOKENS = {tokens}
    from quantkit.cli import main
    sys.argv = ["quantkit", "quantize", {recipe!r}, "--quiet", "--json", {out!r}]
    main()
"""


def test_micro_batches_bound_the_peak_memory(tmp_path):
    """A block with a 2048-wide MLP over 64 x 256 calibration tokens: every window's MLP temporaries at once take
    ~400 MB; micro-batches of 4 windows hold down_proj's input (~130 MB) and one micro-batch's temporaries. Peak
    resident memory above the run's start, each run in its own process."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    cfg = tiny_config("llama", len(tok), layers=2)
    cfg.hidden_size, cfg.intermediate_size = 256, 2048
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "wide")
    tok.save_pretrained(tmp_path / "wide")
    growth, loss = {}, {}
    for name, tokens in (("one", 1 << 30), ("micro", 4 * 256)):
        recipe = write_recipe(tmp_path / f"{name}.yaml", tmp_path / "wide", tmp_path / name, STAGES["gptq"],
                              ("compressed-tensors",), samples=64, seq_len=256)
        code = textwrap.dedent(WIDE_MLP.format(tokens=tokens, recipe=str(recipe), out=str(tmp_path / f"{name}.json")))
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        summary = json.loads((tmp_path / f"{name}.json").read_text())
        mem, loss[name] = summary["memory"], summary["loss_total"]
        growth[name] = mem["rss_peak"] - mem["rss_start"]
        assert growth[name] <= mem["plan"]["host_total"], (name, growth, mem["plan"])
    assert growth["micro"] < 0.6 * growth["one"], growth
    # down_proj's 2048-deep matmul sums in another order over 16384 rows than over 1024 here (MKL's blocking):
    # last-bit differences, not the same bytes
    assert loss["micro"] == pytest.approx(loss["one"], rel=1e-3)
