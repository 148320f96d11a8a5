"""MXFP8 (e4m3 values, power-of-two e8m0 scales per 32 columns; MXFP8A16 weight-only, MXFP8 with its inputs quantized
the same way at run time): round-to-nearest and the mxfp8-quantized layout as compressed-tensors computes and writes
them, the runtime's MX input as compressed-tensors' forward_quantize makes it, GPTQ on the MX grid, the artifact
loaded by transformers, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import MXFP8QuantizationCompressor
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, forward_quantize
from compressed_tensors.quantization.quant_scheme import MXFP8
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from conftest import assert_quantize_refuses, run_cli, write_recipe
from tiny_models import make_tiny_model

from quantkit import runtime
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.mxfp8 import MX8, Mxfp8Weight, fake_quantize_mx, mxfp8_rtn
from quantkit.algorithms.scheme import QuantizedTensor
from quantkit.export import ct_mxfp8
from quantkit.kernels.w8a8 import Mxfp8Linear
from quantkit.progress import Reporter
from quantkit.quantize.run import run_quantize
from quantkit.recipe import load_recipe
from quantkit.verify import verify

ARGS = MXFP8["weights"]


def weight(rows: int = 64, cols: int = 256, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 4 ** torch.randn(rows, 1, generator=g)
    w[3, :32] = 0  # an all-zero group
    w[5, 40] = 1e4  # a group whose max rounds up to the next power of two
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rtn_is_compressed_tensors_bit_for_bit(dtype):
    """quantkit's e8m0 exponents and e4m3 values are compressed-tensors' (calculate_qparams of each group's min and
    max, fake_quantize) bit for bit, and its tensors are MXFP8QuantizationCompressor's bytes."""
    w = weight(dtype=dtype)
    groups = w.unflatten(-1, (-1, 32))
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)
    qw = mxfp8_rtn(w)
    assert torch.equal(qw.dequantize(dtype), fake_quantize(w, scale, zp, ARGS))
    written = MXFP8QuantizationCompressor.compress({"weight": w, "weight_scale": scale},
                                                   QuantizationScheme(targets=["Linear"], weights=ARGS))
    mine = ct_mxfp8.encode_module(qw)
    assert sorted(mine) == sorted(written)
    for name, t in written.items():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name].view(torch.uint8), t.view(torch.uint8)), name
    back = ct_mxfp8.decode_module(mine)
    assert torch.equal(back.dequantize(), qw.dequantize())
    assert isinstance(QuantizedTensor.from_tensors(qw.to_tensors(), qw.meta()), Mxfp8Weight)


def test_the_runtime_input_is_compressed_tensors_mx_quantization():
    """Mxfp8Linear's input is compressed-tensors' forward_quantize of MXFP8's input args (dynamic, groups of 32,
    e8m0 scales) bit for bit on float32 tokens, a zero token included; its output the float matmul on the
    dequantized weight."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 17, 256, generator=g) * torch.rand(3, 17, 1, generator=g) * 10
    x[0, 0] = 0
    linear = torch.nn.Linear(256, 8)
    linear.quantization_status = QuantizationStatus.FROZEN  # calibrated, not compressed: inputs are quantized
    fq = fake_quantize_mx(x)
    assert torch.equal(fq, forward_quantize(linear, x, "input", MXFP8["input_activations"]))
    assert not torch.equal(fq, x)
    qw = mxfp8_rtn(weight())
    layer = Mxfp8Linear(qw)
    assert torch.equal(layer(x), fq @ qw.dequantize().T) and layer.path == "emulated"


def test_gptq_on_the_mx_grid():
    """With an identity Hessian GPTQ is RTN byte for byte; on correlated inputs (MX-quantized, as the layer reads
    them) the error its weights add to the output is below 0.6x RTN's (measured 0.51x)."""
    w = 0.05 * torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    ident, _ = GPTQ(torch.eye(256), MX8).quantize(w)
    rtn = mxfp8_rtn(w)
    assert torch.equal(ident.codes.view(torch.uint8), rtn.codes.view(torch.uint8))
    assert torch.equal(ident.scale, rtn.scale)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g) @ (0.1 * torch.randn(256, 256, generator=g) + torch.eye(256))
    xq = fake_quantize_mx(x)
    gptq, _ = GPTQ(2 * xq.T @ xq / xq.shape[0], MX8).quantize(w)
    # the error the weights add to the layer's output on the input it reads (the input's own rounding is no
    # weight's to undo: e4m3 rounds inputs and weights alike)
    err = {name: float(((xq @ (q.dequantize() - w).T) ** 2).mean()) for name, q in (("rtn", rtn), ("gptq", gptq))}
    assert err["gptq"] < 0.6 * err["rtn"], err


def quantize(model: Path, out: Path, stage: str, formats=("compressed-tensors",)):
    recipe = load_recipe(write_recipe(out.with_suffix(".yaml"), model, out, stage, formats))
    return run_quantize(recipe, overwrite=False, report=Reporter(quiet=True))


@pytest.mark.parametrize("stage", ["rtn: {scheme: MXFP8}", "gptq: {scheme: MXFP8}", "rtn: {scheme: MXFP8A16}"])
def test_artifact_loads_in_quantkit_and_transformers(stage, tiny_factory, tmp_path, monkeypatch):
    """The artifact is mxfp8-quantized with the preset's args; read back and written again it is the same bytes (RTN's
    those of the original weights), verify passes, and transformers (compressed-tensors decompressing the weights
    and, for MXFP8, MX-quantizing each input) computes quantkit's runtime logits bit for bit."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # compressed-tensors 0.20.1 decompresses MXFP8 weights in bfloat16 (decompress_mx_scale's dtype), which a float32
    # model's Linear refuses; the same powers of two in float32 (exact either way) let it run
    monkeypatch.setattr(MXFP8QuantizationCompressor, "_decompress_scale",
                        classmethod(lambda cls, scale: decompress_mx_scale(scale).float()))
    model = tiny_factory("llama")
    quantize(model, tmp_path / "out", stage)
    art = tmp_path / "out" / "compressed-tensors"
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "mxfp8-quantized"
    group = qcfg["config_groups"]["group_0"]
    assert (group["weights"]["num_bits"], group["weights"]["group_size"], group["weights"]["type"]) == (8, 32, "float")
    act = group["input_activations"]
    if "MXFP8A16" in stage:
        assert act is None
    else:
        assert (act["type"], act["strategy"], act["group_size"], act["dynamic"]) == ("float", "group", 32, True)
    stored = runtime.read_tensors(art)
    _, decoded = runtime.quantized_state_dict(art, "compressed-tensors", qcfg, torch.float32)
    assert len(decoded) == 2 * 7
    original = load_file(str(model / "model.safetensors"))
    for name, qw in decoded.items():
        if stage.startswith("rtn"):
            assert torch.equal(qw.codes.view(torch.uint8), mxfp8_rtn(original[f"{name}.weight"]).codes.view(torch.uint8))
        for suffix, t in ct_mxfp8.encode_module(qw).items():
            assert torch.equal(t.view(torch.uint8), stored[f"{name}.{suffix}"].view(torch.uint8)), name
    assert verify(art).ok
    loaded = runtime.load(str(art), "float32").model
    layer = type(loaded.model.layers[0].mlp.down_proj)
    assert layer is (torch.nn.Linear if "MXFP8A16" in stage else Mxfp8Linear)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(ids).logits
    assert torch.equal(theirs, ours)
    assert float((plain - ours).abs().max()) > 1e-4  # quantized


@pytest.mark.parametrize("stage,formats,line", [
    ("rtn: {scheme: MXFP8A16}", ("gptq",),
     "stages.0.rtn.type: mxfp8 weights cannot be stored in gptq (it stores int)"),
    ("gptq: {scheme: MXFP8A16}", ("compressed-tensors", "awq"),
     "stages.0.gptq.type: mxfp8 weights cannot be stored in awq (it stores int)"),
    ("rtn: {scheme: MXFP8}", ("gptq",),
     "export.formats: gptq stores weight-only quantization; MXFP8 (MX activations) is written as "
     "compressed-tensors only"),
    ("rtn: {scheme: MXFP8, group_size: 64}", ("compressed-tensors",),
     "stages.0.rtn: group_size: MXFP8 sets group_size: 32; drop group_size or the scheme"),
    ("rtn: {type: mxfp8, bits: 8, group_size: 64}", ("compressed-tensors",),
     "stages.0.rtn: group_size: mxfp8 weights are e4m3 with a power-of-two scale per 32 columns (MXFP8A16, MXFP8): "
     "group_size: 32"),
    ("rtn: {scheme: MXFP8, activations: null}", ("compressed-tensors",),
     "stages.0.rtn: activations: MXFP8 sets its inputs; drop activations or the scheme (only NVFP4 takes "
     "activations: {observer: minmax | percentile} beside it)"),
    ("rtn: {bits: 8, group_size: -1, activations: {type: mxfp8}}", ("compressed-tensors",),
     "stages.0.rtn: activations.type: mxfp8 inputs go with mxfp8 weights (MXFP8), got type: int"),
    ("awq: {bits: 4, group_size: 32}\n  - gptq: {scheme: MXFP8}", ("compressed-tensors",),
     "stages.1.gptq.type: awq searches its scales on an int grid; mxfp8 weights after awq are not supported "
     "(drop the awq stage)"),
])
def test_bad_mxfp8_recipes_are_one_line(stage, formats, line, tiny_factory, tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_factory("llama"), tmp_path / "out", stage, formats)
    assert_quantize_refuses(monkeypatch, capsys, recipe, line, tmp_path / "out")


def test_a_width_the_groups_do_not_divide_is_one_line(tmp_path, monkeypatch, capsys):
    model = make_tiny_model(tmp_path / "w48", "llama", hidden=48)  # not a multiple of 32
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", "rtn: {scheme: MXFP8}",
                          ("compressed-tensors",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: stages.0.rtn.scheme: MXFP8 needs in_features a multiple of 32 (its group size); "
        "model.layers.0.self_attn.q_proj has 48")
    assert not (tmp_path / "out").exists()


def test_the_resume_checkpoint_keeps_mxfp8_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    from quantkit.quantize.resume import _pack_weights, _unpack_weights

    qw = mxfp8_rtn(weight())
    tensors, specs = _pack_weights({"a.q_proj": qw})
    save_file(tensors, str(tmp_path / "block.safetensors"))
    back = _unpack_weights(load_file(str(tmp_path / "block.safetensors")), json.loads(json.dumps(specs)))["a.q_proj"]
    assert isinstance(back, Mxfp8Weight) and torch.equal(back.dequantize(), qw.dequantize())
