"""FP4 weights (NVFP4A16, MXFP4A16): round-to-nearest as compressed-tensors computes it, GPTQ on the e2m1 grid, the
nvfp4- / mxfp4-pack-quantized layouts as its compressors write them, loaded back by quantkit and by transformers,
and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from conftest import assert_quantize_refuses, run_cli, write_recipe
from tiny_models import make_tiny_model

from quantkit import runtime
from quantkit.algorithms.fp4 import FUSED, SPECS, VALUES, Fp4Weight, fp4_rtn
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.scheme import QuantizedTensor
from quantkit.export import ct_fp4
from quantkit.progress import Reporter
from quantkit.quantize.run import run_quantize
from quantkit.recipe import load_recipe
from quantkit.verify import verify

PRESETS = list(SPECS)


def weight(rows: int = 64, cols: int = 256, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)  # rows of very different ranges
    w[3, :32] = 0  # all-zero groups: compressed-tensors' eps scale
    return w.to(dtype)


def reference(w: torch.Tensor, preset: str, fused: tuple[torch.Tensor, ...] = ()) -> tuple[torch.Tensor, dict]:
    """compressed-tensors on w, as llm-compressor's min-max observer feeds it (its global scale over the weights
    of w's fused layer, `fused`, where it has one): fake_quantize's weight, and what its compressor writes."""
    spec = SPECS[preset]
    together = torch.cat([t.flatten() for t in (w, *fused)])
    gs = generate_gparam(*(t.reshape(1) for t in torch.aminmax(together))) if spec.global_scale else None
    groups = w.unflatten(-1, (-1, spec.group_size))
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), spec.args, global_scale=gs)
    state = {"weight": w, "weight_scale": scale} | ({} if gs is None else {"weight_global_scale": gs})
    compressor = NVFP4PackedCompressor if spec.global_scale else MXFP4PackedCompressor
    written = compressor.compress(state, QuantizationScheme(targets=["Linear"], weights=spec.args))
    return fake_quantize(w, scale, zp, spec.args, global_scale=gs), written


def test_rounding_is_cast_to_fp4_bit_for_bit():
    """quantkit's one-bucketize rounding against compressed-tensors' cast_to_fp4: every threshold, the floats either
    side of it, signed zeros and a dense sample, compared as bits (so -0 counts)."""
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    from quantkit.algorithms.fp4 import round_values

    edges = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    near = torch.cat([edges, torch.nextafter(edges, torch.tensor(9.0)), torch.nextafter(edges, torch.tensor(-9.0))])
    sample = 3 * torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    x = torch.cat([near, -near, sample, torch.tensor([-0.0, 1e-30, -1e-30, 7.0, -7.0])])
    assert torch.equal(round_values(x, torch.tensor(1.0)).view(torch.int32), cast_to_fp4(x.clamp(-6, 6)).view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", PRESETS)
def test_rtn_is_compressed_tensors_bit_for_bit(preset, dtype):
    w = weight(dtype=dtype)
    fake, written = reference(w, preset)
    qw = fp4_rtn(w, SPECS[preset])
    assert torch.equal(qw.dequantize(dtype), fake)
    mine = ct_fp4.encode_module(qw)
    assert sorted(mine) == sorted(written)
    for name, t in written.items():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name].view(torch.uint8), t.view(torch.uint8)), name
    back = ct_fp4.decode_module(mine, ct_fp4.FORMAT[preset])
    assert torch.equal(back.codes, qw.codes) and torch.equal(back.dequantize(), qw.dequantize())
    theirs = unpack_fp4_from_uint8(written["weight_packed"], *w.shape, dtype=torch.float32)
    assert torch.equal(VALUES[back.codes.long()].view(torch.int32), theirs.view(torch.int32))


@pytest.mark.parametrize("preset", PRESETS)
def test_gptq_beats_rtn_on_the_layer_output(preset):
    """Measured: GPTQ's output error 0.51x (NVFP4) / 0.52x (MXFP4) RTN's on correlated inputs; the bound fails if
    the error feedback or the group scales break."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g) @ (0.1 * torch.randn(256, 256, generator=g) + torch.eye(256))
    w = 0.05 * torch.randn(96, 256, generator=g)
    h = 2 * x.T @ x / x.shape[0]
    spec = SPECS[preset]
    rtn = fp4_rtn(w, spec)
    gptq, _ = GPTQ(h, spec).quantize(w)
    err = {name: float(((x @ (q.dequantize() - w).T) ** 2).mean()) for name, q in (("rtn", rtn), ("gptq", gptq))}
    assert err["gptq"] < 0.6 * err["rtn"], err
    assert torch.equal(gptq.global_scale, rtn.global_scale) if spec.global_scale else gptq.global_scale is None
    # stacked with another weight (q/k/v), each keeps its own codes, scales and global scale
    many = GPTQ(h, spec).quantize_many([w, 3 * w[:32]])
    for a, b in zip(many[0][0].to_tensors().values(), gptq.to_tensors().values()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("preset", PRESETS)
def test_the_resume_checkpoint_keeps_fp4_weights(preset, tmp_path):
    from safetensors.torch import load_file, save_file

    from quantkit.quantize.resume import _pack_weights, _unpack_weights

    qw = fp4_rtn(weight(), SPECS[preset])
    tensors, specs = _pack_weights({"a.q_proj": qw})
    save_file(tensors, str(tmp_path / "block.safetensors"))
    back = _unpack_weights(load_file(str(tmp_path / "block.safetensors")), json.loads(json.dumps(specs)))["a.q_proj"]
    assert isinstance(back, Fp4Weight) and back.spec == qw.spec
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert isinstance(QuantizedTensor.from_tensors(qw.to_tensors(), qw.meta()), Fp4Weight)


def quantize(model: Path, out: Path, stage: str, formats=("compressed-tensors",)):
    recipe = load_recipe(write_recipe(out.with_suffix(".yaml"), model, out, stage, formats))
    return run_quantize(recipe, overwrite=False, report=Reporter(quiet=True))


@pytest.mark.parametrize("stage,preset,bound", [
    ("rtn: {scheme: NVFP4A16, ignore: [lm_head]}", "NVFP4A16", 5e-3),
    ("gptq: {scheme: MXFP4A16}", "MXFP4A16", 0.0),
    ("gptq: {scheme: NVFP4A16}", "NVFP4A16", 5e-3),
])
def test_artifact_loads_in_quantkit_and_transformers(stage, preset, bound, tiny_factory, tmp_path):
    """The artifact holds exactly the weights the run made; transformers (compressed-tensors decompressing) computes
    quantkit's logits: MXFP4 exactly, NVFP4 within 5e-3 of the largest logit (compressed-tensors dequantizes in
    bfloat16; measured 1.0e-3)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from safetensors.torch import load_file

    model = tiny_factory("llama")
    quantize(model, tmp_path / "out", stage)
    art = tmp_path / "out" / "compressed-tensors"
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == ct_fp4.FORMAT[preset]
    stored = runtime.read_tensors(art)
    _, decoded = runtime.quantized_state_dict(art, "compressed-tensors", qcfg, torch.float32)
    assert len(decoded) == 2 * 7  # every Linear of both blocks
    original = load_file(str(model / "model.safetensors"))
    for name, qw in decoded.items():  # read back and written again: the same bytes
        for suffix, t in ct_fp4.encode_module(qw).items():
            assert torch.equal(t.view(torch.uint8), stored[f"{name}.{suffix}"].view(torch.uint8)), name
        if stage.startswith("rtn"):  # and RTN's are compressed-tensors' on the original weight
            parent, _, leaf = name.rpartition(".")
            fused = next((g for g in FUSED if leaf in g), ())  # q/k/v, gate/up: one global scale (NVFP4)
            assert torch.equal(qw.dequantize(), reference(original[f"{name}.weight"], preset,
                                                          tuple(original[f"{parent}.{m}.weight"] for m in fused))[0])
    if SPECS[preset].global_scale:
        scales = {n.split(".")[-2]: float(t) for n, t in stored.items() if n.startswith("model.layers.0.")
                  and n.endswith("weight_global_scale")}
        assert scales["q_proj"] == scales["k_proj"] == scales["v_proj"] != scales["o_proj"]
        assert scales["gate_proj"] == scales["up_proj"] != scales["down_proj"]
    assert verify(art).ok
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = runtime.load(str(art), "float32").model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(
            art, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False))(ids).logits
    assert float((theirs - ours).abs().max()) <= bound * float(ours.abs().max())


@pytest.mark.parametrize("stage,formats,line", [
    ("rtn: {scheme: NVFP4A16}", ("gptq",),
     "stages.0.rtn.type: fp4 weights cannot be stored in gptq (it stores int)"),
    ("gptq: {scheme: MXFP4A16}", ("awq",),
     "stages.0.gptq.type: fp4 weights cannot be stored in awq (it stores int)"),
    ("rtn: {scheme: NVFP4A16, group_size: 32}", ("compressed-tensors",),
     "stages.0.rtn: group_size: NVFP4A16 sets group_size: 16; drop group_size or the scheme"),
    ("rtn: {scheme: NVFP8}", ("compressed-tensors",),
     "stages.0.rtn.scheme: unknown preset 'NVFP8' (known: W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, FP8, "
     "FP8_BLOCK, W4AFP8, NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP8A16, MXFP8) (got 'NVFP8')"),
    ("rtn: {type: fp4, group_size: 64}", ("compressed-tensors",),
     "stages.0.rtn: group_size: fp4 weights need group_size: 16 (NVFP4A16) or 32 (MXFP4A16), got 64"),
    ("awq: {bits: 4, group_size: 32}\n  - gptq: {scheme: MXFP4A16}", ("compressed-tensors",),
     "stages.1.gptq.type: awq searches its scales on an int grid; fp4 weights after awq are not supported "
     "(drop the awq stage, or give awq the weight-only FP4 scheme (NVFP4A16 / MXFP4A16))"),
])
def test_bad_fp4_recipes_are_one_line(stage, formats, line, tiny_factory, tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_factory("llama"), tmp_path / "out", stage, formats)
    assert_quantize_refuses(monkeypatch, capsys, recipe, line, tmp_path / "out")


def test_a_width_the_groups_do_not_divide_is_one_line(tmp_path, monkeypatch, capsys):
    model = make_tiny_model(tmp_path / "w48", "llama", hidden=48)  # a multiple of 16, not of 32
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", "rtn: {scheme: MXFP4A16}",
                          ("compressed-tensors",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: stages.0.rtn.scheme: MXFP4A16 needs in_features a multiple of 32 (its group size); "
        "model.layers.0.self_attn.q_proj has 48")
    assert not (tmp_path / "out").exists()
