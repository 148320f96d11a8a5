"""Reliability of quantization runs: a SIGKILL mid-way resumes from the last finished block and gives a
byte-identical artifact; the same recipe always gives byte-identical safetensors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import write_recipe
from tiny_models import make_tiny_model

from quantkit.quantize.resume import FOLDER

STAGES = {
    "gptq": "gptq: {bits: 4, group_size: 32, sym: false, act_order: true}",
    "awq+gptq": "awq: {bits: 4, group_size: 32, zero_point: true, grid: 5}\n  - gptq: {bits: 4, group_size: 32, "
                "sym: false}",
}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama4", "llama", layers=4)


def quantize(recipe: Path, *extra: str, kill_after_block: int | None = None,
             in_flight: bool = False, prelude: str = "") -> subprocess.CompletedProcess:
    """`quantkit quantize` in a child process; with kill_after_block, the child SIGKILLs itself right after that
    block's checkpoint is on disk and named in state.json (the worst moment: the next block is computed, nothing of it
    written). in_flight: right after the block is handed to the background writer instead, its files half-written.
    prelude: code the child runs first."""
    if kill_after_block is not None:
        method = "save" if in_flight else "flush"
        prelude += textwrap.dedent(f"""
            import os, signal
            from quantkit.quantize import resume
            original = resume.BlockCheckpoints.{method}
            def then_die(self, *args):
                done = original(self, *args)
                if (args[0] if {in_flight} else done) == {kill_after_block}:
                    os.kill(os.getpid(), signal.SIGKILL)
                return done
            resume.BlockCheckpoints.{method} = then_die
        """)
    code = prelude + "import sys\nfrom quantkit.cli import main\nsys.argv = ['quantkit'] + sys.argv[1:]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code, "quantize", str(recipe), *extra],
                          capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})


def safetensors_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.safetensors"))}


@pytest.mark.parametrize("stages", ["awq+gptq"])  # AWQ's folded scales and pass counters must survive too
def test_killed_run_resumes_and_is_byte_identical(four_layers, tmp_path, stages):
    formats = ("gptq", "compressed-tensors")
    whole = write_recipe(tmp_path / "whole.yaml", four_layers, tmp_path / "whole", STAGES[stages], formats)
    uninterrupted = quantize(whole)
    assert uninterrupted.returncode == 0

    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", STAGES[stages], formats)
    killed = quantize(recipe, kill_after_block=1)
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "out" / "gptq").exists()  # no artifact yet, and no half-written one
    state = next((tmp_path / "out" / FOLDER).glob("*/state.json"))
    assert json.loads(state.read_text())["done"] == 1

    resumed = quantize(recipe)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after block 2/4" in resumed.stderr
    assert "block 1/4" not in resumed.stderr and "block 4/4" in resumed.stderr  # blocks 1-2 were not redone
    # the counters checkpointed with block 1 are block 1's, not also the next block's (the write is deferred)
    summary = [line for line in uninterrupted.stderr.splitlines() if "mappings scaled" in line]
    assert summary and summary == [line for line in resumed.stderr.splitlines() if "mappings scaled" in line]
    assert not (tmp_path / "out" / FOLDER).exists()  # checkpoints go once the artifacts are complete
    for fmt in formats:
        got, want = safetensors_bytes(tmp_path / "out" / fmt), safetensors_bytes(tmp_path / "whole" / fmt)
        assert got.keys() == want.keys() and all(got[k] == want[k] for k in want), fmt
        files = json.loads((tmp_path / "out" / fmt / "quantkit.json").read_text())["files"]
        assert files == json.loads((tmp_path / "whole" / fmt / "quantkit.json").read_text())["files"]


def test_a_kill_while_a_checkpoint_is_written_resumes_from_the_block_before(four_layers, tmp_path):
    """Block 2's files are still being written when the run dies: state.json names block 1, and the resumed run
    redoes block 2 and gives the uninterrupted bytes."""
    whole = write_recipe(tmp_path / "whole.yaml", four_layers, tmp_path / "whole", STAGES["gptq"], ("gptq",))
    assert quantize(whole).returncode == 0
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", STAGES["gptq"], ("gptq",))
    assert quantize(recipe, kill_after_block=2, in_flight=True).returncode == -signal.SIGKILL
    state = next((tmp_path / "out" / FOLDER).glob("*/state.json"))
    assert json.loads(state.read_text())["done"] == 1
    resumed = quantize(recipe)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after block 2/4" in resumed.stderr and "block 3/4" in resumed.stderr
    assert safetensors_bytes(tmp_path / "out" / "gptq") == safetensors_bytes(tmp_path / "whole" / "gptq")


def test_an_error_in_a_block_keeps_the_checkpoint_written_before_it(four_layers, tmp_path):
    """Block 3/4 fails while block 2/4's files are still being written in the background: they are named in
    state.json before the run ends with its one-line error, so the rerun starts at block 3/4."""
    whole = write_recipe(tmp_path / "whole.yaml", four_layers, tmp_path / "whole", STAGES["gptq"], ("gptq",))
    assert quantize(whole).returncode == 0
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", STAGES["gptq"], ("gptq",))
    fail = textwrap.dedent("""
        from quantkit.errors import QuantkitError
        from quantkit.quantize import pipeline
        check = pipeline.check_hidden_finite
        def failing(hidden, where):
            if where.endswith(".2"):
                raise QuantkitError("calibration: non-finite activations " + where + " (injected)")
            check(hidden, where)
        pipeline.check_hidden_finite = failing
    """)
    failed = quantize(recipe, prelude=fail)
    assert failed.returncode == 2  # the CLI's code for a QuantkitError
    assert failed.stderr.strip().splitlines()[-1] == \
        "error: calibration: non-finite activations after model.layers.2 (injected)"
    state = next((tmp_path / "out" / FOLDER).glob("*/state.json"))
    assert json.loads(state.read_text())["done"] == 1
    resumed = quantize(recipe)
    assert resumed.returncode == 0, resumed.stderr
    progress = [line.split()[1] for line in resumed.stderr.splitlines() if line.startswith("block ")]
    assert "resuming after block 2/4" in resumed.stderr and progress == ["3/4", "4/4"]
    assert safetensors_bytes(tmp_path / "out" / "gptq") == safetensors_bytes(tmp_path / "whole" / "gptq")


def test_checkpoints_of_another_recipe_are_not_used(four_layers, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", four_layers, tmp_path / "out", STAGES["gptq"], ("gptq",))
    assert quantize(recipe, kill_after_block=0).returncode == -signal.SIGKILL
    changed = write_recipe(tmp_path / "changed.yaml", four_layers, tmp_path / "out",
                           STAGES["gptq"].replace("sym: false", "sym: true"), ("gptq",))
    run = quantize(changed)
    assert run.returncode == 0 and "resuming" not in run.stderr
    restart = quantize(recipe, "--overwrite", kill_after_block=0)  # and --no-resume ignores a matching one
    assert restart.returncode == -signal.SIGKILL
    run = quantize(recipe, "--overwrite", "--no-resume")
    assert run.returncode == 0 and "resuming" not in run.stderr and "block 1/4" in run.stderr


def test_same_recipe_gives_byte_identical_safetensors(four_layers, tmp_path):
    outs = []
    for run in ("a", "b"):
        recipe = write_recipe(tmp_path / f"{run}.yaml", four_layers, tmp_path / run, STAGES["gptq"],
                              ("gptq", "compressed-tensors"))
        assert quantize(recipe).returncode == 0
        outs.append(tmp_path / run)
    for fmt in ("gptq", "compressed-tensors"):
        a, b = safetensors_bytes(outs[0] / fmt), safetensors_bytes(outs[1] / fmt)
        assert a and a == b, fmt
