"""Bad input to `quantkit quantize`: one stderr line `error: <field or file>: ...`, exit code 2, and nothing
half-written (no artifact folder, no `.partial-` temp folder; an earlier artifact stays intact).

Covered elsewhere, not repeated here: recipe validation of every field (test_recipe.py, test_recipe_fuzz.py), a wrong
type through the CLI (test_recipe.py), a missing model or calibration file, a group size that does not divide
in_features and an all-ignoring recipe (test_pipeline.py), MoE models (test_pipeline.py)."""

import errno
import re
import shutil

import pytest
import torch

from conftest import run_cli, write_recipe
from quantkit.quantize.resume import FOLDER as RESUME
from quantkit.export import artifact

RTN = "rtn: {bits: 4, group_size: 32}"  # no calibration: the quickest run to reach the check under test
GPTQ = "gptq: {bits: 4, group_size: 32}"


def fails(monkeypatch, capsys, recipe, *args) -> str:
    """`quantkit quantize RECIPE --quiet ARGS`: checks exit code 2 and one stderr line, and returns that line."""
    capsys.readouterr()
    code = run_cli(monkeypatch, "quantize", recipe, "--quiet", *args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
    return err.strip()


def assert_nothing_written(out) -> None:
    # per-block resume checkpoints may stay (a rerun continues from them); they are not an artifact
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert left in ([], [RESUME]), left


def model_copy(tiny_llama, dest, arch=None, edit=None):
    """tiny_llama's tokenizer next to another model: `arch` (config overrides) or tiny_llama with `edit` applied."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if arch:
        model = AutoModel.from_config(AutoConfig.for_model(vocab_size=512, **arch))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
        with torch.no_grad():
            edit(model)
    model.save_pretrained(str(dest))
    for f in tiny_llama.glob("tokenizer*"):
        shutil.copy(f, dest)
    return dest


@pytest.mark.parametrize("write, message", [
    (lambda r: r.write_text(r.read_text() + "modle: x\n"), "r.yaml: unknown key 'modle' (accepted: model, "),
    (lambda r: r.write_text("model: x\nstages: [\n"), "r.yaml: line 3 invalid YAML: "),
    (lambda r: r.unlink(), "r.yaml: recipe file not found"),
])
def test_recipe_file_problems(tiny_llama, tmp_path, monkeypatch, capsys, write, message):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", RTN)
    write(recipe)
    assert fails(monkeypatch, capsys, recipe).startswith(f"error: {tmp_path / message}")
    assert_nothing_written(tmp_path / "o")


@pytest.mark.parametrize("arch, message", [
    # GPT-2's blocks hold Conv1D layers, not nn.Linear: no decoder blocks quantkit can quantize
    ({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128},
     "error: model: no decoder blocks of nn.Linear layers in GPT2LMHeadModel (unsupported architecture; "
     "supported: Llama, Mistral, Qwen2, Qwen3, Gemma 2/3, Phi-3, Granite, OLMo 2, OPT; MoE: Qwen3-MoE, Qwen2-MoE, "
     "Mixtral, OLMoE, DeepSeek-V3)"),
    ({"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 1, "num_heads": 4, "d_kv": 16},
     ("error: model: cannot load {model}: Unrecognized configuration class <class "
      "'transformers.models.t5.configuration_t5.T5Config'> for this kind of AutoModel: AutoModelForCausalLM.")),
])
def test_unsupported_architectures(tiny_llama, tmp_path, monkeypatch, capsys, arch, message):
    model = model_copy(tiny_llama, tmp_path / "model", arch=arch)
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", RTN)
    assert fails(monkeypatch, capsys, recipe) == message.format(model=model)
    assert_nothing_written(tmp_path / "o")


@pytest.mark.parametrize("text, message", [
    ("", r"contains no text"),
    # more than seq_len tokens, so windows could be drawn, but far fewer than 8 x 64: they would mostly repeat
    ("The tower is 324 metres tall, about the same height as an 81-storey building. " * 3,
     r"has \d{3} tokens, need at least 512 \(num_samples 8 x seq_len 64\); use a longer text or lower num_samples"),
])
def test_calibration_text_too_small(tiny_llama, tmp_path, monkeypatch, capsys, text, message):
    data = tmp_path / "calib.txt"
    data.write_text(text)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", GPTQ)
    recipe.write_text(recipe.read_text().replace("dataset: wikitext2", f"dataset: {data}"))
    line = fails(monkeypatch, capsys, recipe)
    assert line.startswith(f"error: calibration.dataset: {data} ")
    assert re.search(message, line), line
    assert_nothing_written(tmp_path / "o")


@pytest.mark.parametrize("weight, value, where", [
    # the block's output overflows: caught after the block
    ("model.layers.1.mlp.down_proj.weight", 1e37, "after model.layers.1"),
    # overflow inside the block: caught before a Linear builds an inf/NaN Hessian (not blamed on GPTQ's damping)
    ("model.layers.1.self_attn.o_proj.weight", float("inf"), "entering model.layers.1.mlp.gate_proj"),
])
def test_non_finite_activations_name_the_block(tiny_llama, tmp_path, monkeypatch, capsys, weight, value, where):
    model = model_copy(tiny_llama, tmp_path / "model", edit=lambda m: m.get_parameter(weight).fill_(value))
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", GPTQ)
    assert fails(monkeypatch, capsys, recipe) == (
        f"error: calibration: non-finite activations {where} (fp16 overflow?); use dtype: bfloat16 or float32")
    assert_nothing_written(tmp_path / "o")


def test_disk_full_and_existing_output_leave_the_old_artifact_intact(tiny_llama, tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, out, RTN, formats=("gptq",))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(artifact._SpooledShard, "add", disk_full)  # the first bytes written
        message = f"error: export.output: cannot write {out / 'gptq'}: No space left on device"
        assert fails(m, capsys, recipe) == message
        assert_nothing_written(out)
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    before = {p.name: p.read_bytes() for p in (out / "gptq").iterdir()}
    with monkeypatch.context() as m:
        m.setattr(artifact._SpooledShard, "add", disk_full)  # the first bytes written
        assert fails(m, capsys, recipe, "--overwrite") == message
    assert fails(monkeypatch, capsys, recipe) == (
        f"error: export.output: {out / 'gptq'} already exists (pass --overwrite to replace it)")
    assert {p.name: p.read_bytes() for p in (out / "gptq").iterdir()} == before
    assert sorted(p.name for p in out.iterdir()) == ["gptq"]  # no .partial- temp folder
