"""calibration.offload / batch_size: the hidden states between blocks on the device, in host memory or in files, and
the block run over batches of windows. Batched GPTQ is still true-sequential, so it writes the one-forward run's
bytes; the memory plan picks the layout that fits, and names the option when none does."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import run_cli, write_recipe
from test_resume import quantize, safetensors_bytes
from test_streaming import FORMATS, STAGES, sharded_checkpoint
from tiny_models import tiny_config, tiny_tokenizer


def recipe(tmp_path: Path, name: str, model: Path, stage: str, offload: str | None = None, batch: int | None = None,
           samples: int = 8, **kw) -> Path:
    path = write_recipe(tmp_path / f"{name}.yaml", model, tmp_path / name, STAGES[stage], FORMATS[stage],
                        samples=samples, **kw)
    extra = (f", offload: {offload}" if offload else "") + (f", batch_size: {batch}" if batch else "")
    path.write_text(path.read_text().replace("seed: 0}", "seed: 0" + extra + "}"))
    return path


def run(monkeypatch, tmp_path: Path, path: Path) -> dict:
    out = tmp_path / (path.stem + ".json")
    assert run_cli(monkeypatch, "quantize", path, "--quiet", "--json", out) == 0
    return json.loads(out.read_text())


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


@pytest.mark.parametrize("offload,batch", [("cpu", 2), ("disk", 3), ("device", 5)])
@pytest.mark.parametrize("stage", ["gptq", "sq-rtn", "sq-w8a8"])
def test_batched_runs_write_the_one_forward_bytes(llama, tmp_path, monkeypatch, offload, batch, stage):
    """GPTQ (and SmoothQuant then RTN) over 2-4 batches, one of them short, gives the one-forward run's codes bit for
    bit: every batch's windows are summed in the same order, and each Linear is solved after the ones it reads."""
    one = run(monkeypatch, tmp_path, recipe(tmp_path, "one", llama, stage))
    assert one["memory"]["plan"]["offload"] == "device" and one["memory"]["plan"]["batch_size"] is None
    got = run(monkeypatch, tmp_path, recipe(tmp_path, "batched", llama, stage, offload, batch))
    assert got["memory"]["plan"]["offload"] == offload and got["memory"]["plan"]["batch_size"] == batch
    if stage != "sq-w8a8":
        for fmt in FORMATS[stage]:
            want, have = safetensors_bytes(tmp_path / "one" / fmt), safetensors_bytes(tmp_path / "batched" / fmt)
            assert want.keys() == have.keys() and all(want[k] == have[k] for k in want), fmt
    else:
        # SmoothQuant before GPTQ: one batch folds its scales inside GPTQ's forward (gate/up's from the quantized
        # attention's output), several batches in a float forward first; the losses stay within a few percent
        assert got["loss_total"] == pytest.approx(one["loss_total"], rel=0.05)
    assert not (tmp_path / "batched" / ".quantkit-activations").exists()  # the spill files go with the run


def test_moe_batched_gptq_is_byte_identical_and_counts_every_token(moe, tmp_path, monkeypatch):
    one = run(monkeypatch, tmp_path, recipe(tmp_path, "one", moe, "gptq"))
    got = run(monkeypatch, tmp_path, recipe(tmp_path, "batched", moe, "gptq", "disk", 3))
    assert got["loss_total"] == one["loss_total"]
    for fmt in FORMATS["gptq"]:
        want, have = safetensors_bytes(tmp_path / "one" / fmt), safetensors_bytes(tmp_path / "batched" / fmt)
        assert want.keys() == have.keys() and all(want[k] == have[k] for k in want), fmt


def test_auto_offloads_to_disk_when_memory_is_short(llama, tmp_path, monkeypatch):
    """Free host memory below what every window's hidden states need, even one window per forward, but above the disk
    plan's: auto spills to files, and the plan it logs and checks is the one the run used."""
    from quantkit.quantize import run as run_module

    plans = {}
    for where in ("device", "disk"):  # the smallest plan of each: one window per forward
        got = run(monkeypatch, tmp_path, recipe(tmp_path, where, llama, "gptq", where, 1, samples=64))
        plans[where] = got["memory"]["plan"]["host_total"]
    assert plans["disk"] < plans["device"]
    free = (plans["disk"] + plans["device"]) // 2
    monkeypatch.setattr(run_module, "host_available", lambda: free)
    got = run(monkeypatch, tmp_path, recipe(tmp_path, "auto", llama, "gptq", samples=64))["memory"]["plan"]
    assert got["offload"] == "disk" and got["disk"]["hidden_states"] > 0 and got["host_total"] <= free
    assert got["batch_size"] > 1  # the most windows per forward that fit
    want, have = safetensors_bytes(tmp_path / "device" / "gptq"), safetensors_bytes(tmp_path / "auto" / "gptq")
    assert want == have


def test_device_offload_that_cannot_fit_names_the_options(llama, tmp_path, monkeypatch, capsys):
    from quantkit.quantize import run as run_module

    # 2048 windows of 512 tokens: 1 GiB of hidden states, far more than the free memory the test grants
    path = recipe(tmp_path, "dev", llama, "gptq", "device", samples=2048, seq_len=512)
    monkeypatch.setattr(run_module, "host_available", lambda: 256 << 20)
    assert run_cli(monkeypatch, "quantize", path) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: memory plan: the run needs ") and "of host memory and 0.25 GiB is free" in err
    assert "the largest part is hidden_states" in err
    assert err.endswith("set calibration.offload: disk, or lower calibration.num_samples or seq_len")
    assert not (tmp_path / "dev").exists()


@pytest.mark.parametrize("samples", [8, 80])
def test_awq_in_batches_writes_the_one_forward_bytes(llama, tmp_path, monkeypatch, samples):
    """AWQ's statistics add up over the batches; its clip samples and the windows its scale search scores (all 8;
    64 of 80, past MODULE_LOSS_TOKENS) are picked by their index among all windows, so batches change nothing."""
    stage = "awq+gptq"
    one = run(monkeypatch, tmp_path, recipe(tmp_path, "one", llama, stage, samples=samples))
    got = run(monkeypatch, tmp_path, recipe(tmp_path, "batched", llama, stage, "disk", 3, samples=samples))
    assert got["loss_total"] == one["loss_total"]
    for fmt in FORMATS[stage]:
        want, have = safetensors_bytes(tmp_path / "one" / fmt), safetensors_bytes(tmp_path / "batched" / fmt)
        assert want.keys() == have.keys() and all(want[k] == have[k] for k in want), fmt


def test_batches_allocate_each_hessian_once(llama, tmp_path, monkeypatch):
    """Over 3 batches, AWQ's Gram matrices and GPTQ's Hessians are made once per input, as in one forward: each is
    a C x C fp64 sum, and one made per batch (then dropped) was a transient C x C at every call."""
    from quantkit.algorithms.gptq import Hessian

    made = []
    init = Hessian.__init__
    monkeypatch.setattr(Hessian, "__init__", lambda self, columns, *a, **kw: (made.append(columns),
                                                                              init(self, columns, *a, **kw))[1])
    run(monkeypatch, tmp_path, recipe(tmp_path, "one", llama, "awq+gptq"))
    one, made[:] = sorted(made), []
    run(monkeypatch, tmp_path, recipe(tmp_path, "batched", llama, "awq+gptq", "disk", 3))
    assert sorted(made) == one and len(one) == 3 * 5  # per block: AWQ's up -> down Gram; q/k/v, o, gate/up, down


def test_disk_offloaded_kill_and_resume_is_byte_identical(llama, tmp_path):
    whole = recipe(tmp_path, "whole", llama, "gptq")
    assert quantize(whole).returncode == 0
    path = recipe(tmp_path, "out", llama, "gptq", "disk", 3)
    assert quantize(path, kill_after_block=0).returncode == -signal.SIGKILL
    assert list((tmp_path / "out" / ".quantkit-activations").glob("*/in-*.safetensors"))  # left by the kill
    resumed = quantize(path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after block 1/3" in resumed.stderr
    assert not (tmp_path / "out" / ".quantkit-activations").exists()
    for fmt in FORMATS["gptq"]:
        assert safetensors_bytes(tmp_path / "out" / fmt) == safetensors_bytes(tmp_path / "whole" / fmt), fmt


@pytest.mark.parametrize("offload", ["device", "cpu"])
def test_plan_on_a_gpu_holds_one_copy_of_the_windows_on_the_host(llama, offload):
    """With the hidden states on a CUDA device, block 0's inputs are still captured on the host and each block's
    checkpoint copies its inputs there: the host part of the plan holds one copy of every window. The plan reads only
    the device's type, so this runs without a GPU."""
    from quantkit.model import decoder_blocks
    from quantkit.quantize import memory, targets as target_plan
    from quantkit.quantize.hidden import Offload
    from quantkit.quantize.source import Streamed
    from quantkit.recipe import parse_recipe

    r = parse_recipe({"model": str(llama), "calibration": {"dataset": "wikitext2", "num_samples": 16, "seq_len": 64},
                      "stages": [{"gptq": {"bits": 4, "group_size": 32}}], "export": {"output": "o"}})
    model = Streamed(str(llama), r.dtype).model
    targets = target_plan.plan(model, r.stage, r.export.formats, r.transforms)[1]
    per_window = 64 * model.config.hidden_size * 4
    gpu, cpu = (memory.plan(model, decoder_blocks(model)[1], targets, r, True, torch.device(d), Offload(offload))
                for d in ("cuda", "cpu"))
    assert gpu.host["hidden_states"] == (16 if offload == "device" else 32) * per_window
    assert gpu.device.get("hidden_states", 0) == (32 * per_window if offload == "device" else 0)
    assert cpu.host["hidden_states"] == 32 * per_window  # on the CPU the device is the host: in and out, once each


def test_captured_block_inputs_are_not_held_once_stored(llama, tmp_path, monkeypatch):
    """Block 0's inputs are captured on the host; once stored where the offload puts them (files here, the GPU on
    one), the host copy must go. The H200 run held it for the whole run: 1 GiB past the plan at 128 x 2048."""
    import weakref

    from quantkit.quantize import pipeline

    captured, alive = [], []
    capture, blocks = pipeline.capture_block_inputs, pipeline._blocks

    def capturing(*args, **kwargs):
        x, calls = capture(*args, **kwargs)
        captured.append(weakref.ref(x))
        return x, calls

    def checking(*args, **kwargs):
        alive.append(sum(r() is not None for r in captured))
        return blocks(*args, **kwargs)

    monkeypatch.setattr(pipeline, "capture_block_inputs", capturing)
    monkeypatch.setattr(pipeline, "_blocks", checking)
    run(monkeypatch, tmp_path, recipe(tmp_path, "disk", llama, "gptq", "disk", 4))
    assert captured and alive == [0]
