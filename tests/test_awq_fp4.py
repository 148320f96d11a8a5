"""AWQ on FP4 grids (`awq: {scheme: NVFP4A16 | MXFP4A16}`): its scale and clip searches score candidates with the
FP4 rounding the artifact stores, the artifact is the preset's layout as llm-compressor writes it, transformers
loads it, awq -> gptq rounds on the same grid, and the recipes that mix grids are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_quantize_refuses, run_cli, write_recipe
from peer_layout import compare, documented
from tiny_models import make_tiny_model

from quantkit import runtime
from quantkit.algorithms import awq
from quantkit.algorithms.fp4 import SPECS, fp4_rtn, global_scale_of
from quantkit.algorithms.grid import GridSpec

PRESETS = list(SPECS)
FIXTURES = Path(__file__).parent / "fixtures" / "peer_layouts" / "llama"


@pytest.mark.parametrize("preset", PRESETS)
def test_quantize_dequantize_is_fp4_rtn_bit_for_bit(preset):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g)
    spec = SPECS[preset]
    assert torch.equal(awq.quantize_dequantize(w.clone(), spec), fp4_rtn(w, spec).dequantize())
    if spec.global_scale:  # a fused layer's global scale, given
        gs = global_scale_of(3 * w, spec)
        assert torch.equal(awq.quantize_dequantize(w.clone(), spec, global_scale=gs), fp4_rtn(w, spec, gs).dequantize())


@pytest.mark.parametrize("preset, scaled_bound, clipped_bound", [("NVFP4A16", 0.8, 0.7), ("MXFP4A16", 0.9, 0.9)])
def test_scales_and_clips_lower_the_fp4_output_error(preset, scaled_bound, clipped_bound):
    """Inputs with a few channels 20x the others (LLM activation outliers): AWQ's scale search on the FP4 grid, then
    its clip search, against plain FP4 rounding of the same weight, on the layer's output. Measured: NVFP4 0.76x
    after scaling, 0.63x after clipping; MXFP4 (power-of-two scales) 0.88x, clipping changes little. The scale found
    on the int grid of the same groups gives 0.80x / 0.94x on the FP4 one: the search must score FP4's rounding."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g)
    x[:, :8] *= 20
    w = 0.05 * torch.randn(96, 256, generator=g)
    spec = SPECS[preset]
    gram = x.T @ x / x.shape[0]

    def err(q: torch.Tensor) -> float:
        return float(((x @ (q - w).T) ** 2).mean())

    rtn = err(fp4_rtn(w, spec).dequantize())
    res = awq.search_scale(x.abs().mean(0), [w], spec, awq.linear_loss(gram, [w]))
    scaled = err(awq.fake_quantize(w, res.scale, spec))
    clipped = awq.search_clip(w * res.scale, x / res.scale, spec)
    both = err(fp4_rtn(clipped, spec).dequantize() / res.scale)
    on_int = awq.search_scale(x.abs().mean(0), [w], GridSpec(4, spec.group_size, True), awq.linear_loss(gram, [w]))
    assert scaled < scaled_bound * rtn, (scaled, rtn)
    assert scaled < 0.97 * err(awq.fake_quantize(w, on_int.scale, spec))
    assert both < clipped_bound * rtn, (both, rtn)


@pytest.mark.parametrize("preset, stage, bound", [
    ("NVFP4A16", "awq: {scheme: NVFP4A16}", 5e-3),
    ("MXFP4A16", "awq: {scheme: MXFP4A16}", 0.0),
])
def test_awq_fp4_artifact(preset, stage, bound, tmp_path, monkeypatch):
    """The artifact has llm-compressor's layout for the preset (its recorded RTN fixture: AWQ changes the values,
    not the layout), and transformers with compressed-tensors gives quantkit's logits (NVFP4 within 5e-3 of the
    largest logit: compressed-tensors dequantizes it in bfloat16, as tests/test_fp4.py says)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    fixture = FIXTURES / f"{preset}.json"
    peer = json.loads(fixture.read_text())
    model = make_tiny_model(tmp_path / "llama", "llama", **peer["shapes"])
    out = tmp_path / "out"
    recipe = write_recipe(tmp_path / "r.yaml", model, out, stage, formats=("compressed-tensors",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    art = out / "compressed-tensors"
    assert compare(art, fixture) == documented(fixture)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = runtime.load(str(art), "float32").model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(
            art, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))(ids).logits
    assert float((theirs - ours).abs().max()) <= bound * float(ours.abs().max())


def test_awq_then_gptq_on_nvfp4_inputs(tiny_llama, tmp_path, monkeypatch):
    """awq searches on NVFP4's weight grid, then gptq solves on it with FP4 inputs (W4A4): the artifact carries the
    calibrated input global scales, and its held-out logits are closer to the float model's than RTN's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 100, (4, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)(ids).logits
    errors = {}
    for name, stages in (("awq+gptq", "awq: {scheme: NVFP4A16}\n  - gptq: {scheme: NVFP4}"),
                         ("rtn", "rtn: {scheme: NVFP4}")):
        out = tmp_path / name
        recipe = write_recipe(tmp_path / f"{name}.yaml", tiny_llama, out, stages, formats=("compressed-tensors",),
                              samples=32)
        assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
        art = out / "compressed-tensors"
        assert any(k.endswith("input_global_scale") for k in load_file(str(art / "model.safetensors")))
        with torch.no_grad():
            errors[name] = float((runtime.load(str(art), "float32").model(ids).logits - ref).square().mean())
    assert errors["awq+gptq"] < errors["rtn"], errors


@pytest.mark.parametrize("stages, formats, line", [
    ("awq: {scheme: NVFP4A16}", ("awq",), "stages.0.awq.type: fp4 weights cannot be stored in awq (it stores int)"),
    ("awq: {scheme: MXFP4A16}\n  - gptq: {scheme: NVFP4A16}", ("compressed-tensors",),
     "stages.1.gptq.scheme: must round on MXFP4A16's grid to match stages.0.awq (scheme: MXFP4A16); awq searches "
     "its scales on the grid gptq then rounds to"),
    ("awq: {scheme: NVFP4}", ("compressed-tensors",),
     "stages.0.awq: scheme: awq searches int grids or the FP4 weight-only presets NVFP4A16 and MXFP4A16, got NVFP4 "
     "(FP4 inputs: awq, then gptq with that scheme)"),
    ("awq: {scheme: NVFP4A16, zero_point: true}", ("compressed-tensors",),
     "stages.0.awq: zero_point: NVFP4A16 sets zero_point: false; drop zero_point or the scheme"),
])
def test_bad_awq_fp4_recipes_are_one_line(stages, formats, line, tiny_llama, tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", stages, formats=formats)
    assert_quantize_refuses(monkeypatch, capsys, recipe, line, tmp_path / "out")
