"""Calibration over torch.distributed (gloo, 2 processes under torchrun via `quantkit quantize --nproc 2`): the
artifact is the one-process artifact byte for byte, a rank that dies or fails ends the run with one line naming it,
and the same command resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import write_recipe
from safetensors.torch import load_file
from tiny_models import make_tiny_model

from quantkit.export import gptq
from quantkit.export.base import split_by_module

GPTQ = "gptq: {bits: 4, group_size: 32, sym: false, act_order: true}"


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama4", "llama", layers=4)


def quantkit(*args, hook: str = "", cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The quantkit CLI in a child process. hook: Python run at start-up in every process (torchrun's workers too,
    through sitecustomize), to make one rank fail on purpose."""
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    if hook:
        site = cwd / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(textwrap.dedent(hook))
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "quantkit.cli", *map(str, args)], capture_output=True, text=True,
                          env=env)


def codes(folder: Path) -> dict[str, torch.Tensor]:
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = {}
    for f in folder.glob("*.safetensors"):
        tensors |= load_file(f)
    return {m: gptq.decode_module(t, qcfg).codes for m, t in split_by_module(tensors, gptq.MARKER).items()}


def agreement(a: Path, b: Path) -> float:
    ca, cb = codes(a), codes(b)
    assert ca.keys() == cb.keys() and ca
    same = sum(int((ca[k] == cb[k]).sum()) for k in ca)
    return same / sum(ca[k].numel() for k in ca)


def test_two_ranks_write_the_one_process_artifact(four_layers, tmp_path):
    """Every window's Hessian term is computed alone and summed in fp64 (algorithms/gptq.py): the ranks' shares add
    up to the one-process Hessian to the bit, so the artifact is byte-identical, not merely close."""
    runs = {}
    for nproc in (1, 2):
        recipe = write_recipe(tmp_path / f"{nproc}.yaml", four_layers, tmp_path / f"p{nproc}", GPTQ, ("gptq",),
                              samples=16)
        run = quantkit("quantize", recipe, "--nproc", nproc)
        assert run.returncode == 0, run.stderr
        runs[nproc] = tmp_path / f"p{nproc}" / "gptq"
    assert "2 processes (8 windows on rank 0)" in run.stderr
    assert not (tmp_path / "p2" / ".quantkit-ranks").exists()  # nothing of the ranks is left behind
    assert agreement(runs[1], runs[2]) == 1.0
    assert (runs[1] / "model.safetensors").read_bytes() == (runs[2] / "model.safetensors").read_bytes()


def test_two_ranks_calibrate_every_expert_of_an_moe_model(tiny_factory, tmp_path):
    """calibrate_all_experts: every rank runs every expert on its windows, so each expert's Hessian is all-reduced
    on every rank in the same order, whatever the router sends where."""
    runs = {}
    for nproc in (1, 2):
        recipe = write_recipe(tmp_path / f"{nproc}.yaml", tiny_factory("qwen3_moe"), tmp_path / f"p{nproc}",
                              "gptq: {bits: 4, group_size: 32, sym: true}", ("gptq",), samples=8)
        run = quantkit("quantize", recipe, "--nproc", nproc)
        assert run.returncode == 0, run.stderr
        runs[nproc] = tmp_path / f"p{nproc}" / "gptq"
    assert agreement(runs[1], runs[2]) == 1.0
    assert (runs[1] / "model.safetensors").read_bytes() == (runs[2] / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_two_ranks_with_activations_on_disk_in_batches_write_the_one_process_artifact(tiny_factory, tmp_path, arch):
    """Each rank's 8 windows in batches of 3, 3 and 2, spilled to files: the waves of batched GPTQ reduce the same
    Hessians in the same order as one process running one forward."""
    runs = {}
    for nproc, offload in ((1, ""), (2, ", offload: disk, batch_size: 3")):
        recipe = write_recipe(tmp_path / f"{nproc}.yaml", tiny_factory(arch), tmp_path / f"p{nproc}", GPTQ, ("gptq",),
                              samples=16)
        recipe.write_text(recipe.read_text().replace("seed: 0}", "seed: 0" + offload + "}"))
        run = quantkit("quantize", recipe, "--nproc", nproc)
        assert run.returncode == 0, run.stderr
        runs[nproc] = tmp_path / f"p{nproc}" / "gptq"
    assert "activations on disk, 3 batches of 3 windows" in run.stderr
    assert (runs[1] / "model.safetensors").read_bytes() == (runs[2] / "model.safetensors").read_bytes()


KILL_RANK_1 = """
    import os, signal
    if os.environ.get("RANK") == "1":
        from quantkit.quantize import resume
        flush = resume.BlockCheckpoints.flush
        def flush_then_{what}(self):
            if flush(self) == 1:  # block 1's checkpoint is on disk
                {action}
        resume.BlockCheckpoints.flush = flush_then_{what}
"""


@pytest.fixture(scope="module")
def two_rank_gptq(four_layers, tmp_path_factory) -> Path:
    """An uninterrupted 2-rank GPTQ artifact of four_layers, which every resumed run must equal byte for byte."""
    tmp = tmp_path_factory.mktemp("whole")
    assert quantkit("quantize", write_recipe(tmp / "whole.yaml", four_layers, tmp / "whole", GPTQ, ("gptq",),
                                             samples=16), "--nproc", 2).returncode == 0
    return tmp / "whole" / "gptq"


@pytest.mark.parametrize("what,action,line", [
    ("die", "os.kill(os.getpid(), signal.SIGKILL)", "error: rank 1: died"),
    ("fail", "from quantkit.errors import QuantkitError; raise QuantkitError('calibration: injected failure')",
     "error: rank 1: calibration: injected failure"),
])
def test_a_failing_rank_ends_the_run_with_its_line_and_the_run_resumes(four_layers, two_rank_gptq, tmp_path, what,
                                                                       action, line):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", GPTQ, ("gptq",), samples=16)
    failed = quantkit("quantize", recipe, "--nproc", 2, hook=KILL_RANK_1.format(what=what, action=action),
                      cwd=tmp_path)
    assert failed.returncode == 2
    errors = [x for x in failed.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), failed.stderr
    assert "Traceback" not in failed.stderr
    assert not (tmp_path / "out" / "gptq").exists()
    resumed = quantkit("quantize", recipe, "--nproc", 2)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after block 2/4" in resumed.stderr
    for f in ("model.safetensors", "config.json"):  # the resumed run is the uninterrupted one, byte for byte
        assert (tmp_path / "out" / "gptq" / f).read_bytes() == (two_rank_gptq / f).read_bytes()


W8A8 = ("gptq: {bits: 8, group_size: -1, sym: true, "
        "activations: {bits: 8, type: int, dynamic: true, strategy: token}}")


@pytest.mark.parametrize("stages,formats", [
    ("awq: {bits: 4, group_size: 32, zero_point: true}\n  - " + GPTQ, ("gptq",)),
    ("smoothquant: {alpha: 0.5}\n  - " + W8A8, ("compressed-tensors",)),  # smoothed inside gptq's forward
    ("smoothquant: {alpha: 0.5}\n  - rtn: {bits: 8, group_size: -1, sym: true, "
     "activations: {bits: 8, type: int, dynamic: true, strategy: token}}", ("compressed-tensors",)),
], ids=["awq+gptq", "sq+gptq", "sq+rtn"])  # AWQ as the weight stage runs the same pass before RTN
def test_two_ranks_reduce_awq_and_smoothquant_statistics_to_the_one_process_artifact(four_layers, tmp_path,
                                                                                     stages, formats):
    """AWQ's channel sums, Gram matrices and scale-search errors and SmoothQuant's max |x| are reduced over the ranks
    in forms that equal the one-process values; AWQ's scored windows (16 x 512 tokens is over MODULE_LOSS_TOKENS,
    so 8 of the 16 windows are scored, 4 on each rank) and clip samples are chosen among all windows."""
    out = {}
    for nproc in (1, 2):
        recipe = write_recipe(tmp_path / f"{nproc}.yaml", four_layers, tmp_path / f"p{nproc}", stages, formats,
                              samples=16, seq_len=512)
        run = quantkit("quantize", recipe, "--nproc", nproc)
        assert run.returncode == 0, run.stderr
        out[nproc] = tmp_path / f"p{nproc}" / formats[0]
    if "awq:" in stages:
        summary = [x for x in run.stderr.splitlines() if "mappings scaled" in x]
        assert summary and " 0 mappings" not in summary[0], run.stderr
    for f in ("model.safetensors", "config.json"):
        assert (out[1] / f).read_bytes() == (out[2] / f).read_bytes(), f
