"""W4AFP8 (int4 weights in groups, FP8 inputs per token at run time): round-to-nearest and the int-quantized layout as
compressed-tensors computes and writes them, GPTQ weighing its Hessian by the FP8 input, the runtime's FP8 input
as compressed-tensors' forward_quantize makes it, the artifact loaded by transformers, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import IntQuantizationCompressor
from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus
from compressed_tensors.quantization.lifecycle.forward import fake_quantize, forward_quantize
from compressed_tensors.quantization.quant_scheme import W4AFP8
from compressed_tensors.quantization.utils.helpers import calculate_qparams
from conftest import assert_quantize_refuses, run_cli, write_recipe
from tiny_models import make_tiny_model

from quantkit import runtime
from quantkit.algorithms.gptq import GPTQ
from quantkit.algorithms.grid import GridSpec
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.export import compressed_tensors as ct
from quantkit.kernels.w8a8 import W4Fp8Linear, fake_quantize_tokens
from quantkit.progress import Reporter
from quantkit.quantize.run import run_quantize
from quantkit.recipe import load_recipe
from quantkit.verify import verify

SPEC = GridSpec(4, 128, True)
ARGS = W4AFP8["weights"]
# the tiny test Llama's widths (64, 128) take no group of 128: its groups are 32 wide, written beside the preset
TINY = "{scheme: W4AFP8, group_size: 32}"
QCFG = {"format": "int-quantized", "config_groups": {"group_0": {"weights": ARGS.model_dump(mode="json")}}}


def weight(rows: int = 64, cols: int = 256, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g)  # rows of very different ranges
    w[3, :128] = 0  # an all-zero group
    return w.to(dtype)


def test_rtn_is_compressed_tensors_bit_for_bit():
    """quantkit's scales are compressed-tensors' (max|w| / 7.5 of each group) rounded to fp16, the dtype it writes
    int scales in; on those scales its float32 weight is compressed-tensors' fake_quantize bit for bit, and its
    tensors are IntQuantizationCompressor's bytes. (A float16 weight is divided in float32 here, in float16 there:
    0.15-0.3 % of the codes, ties, differ by one; measured, not asserted.)"""
    dtype = torch.float32
    w = weight(dtype=dtype)
    qw = rtn_quantize(w, SPEC)
    groups = w.unflatten(-1, (-1, 128))
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), ARGS)
    nonzero = groups.abs().amax(-1) > 0  # an all-zero group: quantkit's scale 2/15, compressed-tensors' eps
    assert torch.equal(qw.scale[nonzero], scale.to(torch.float16)[nonzero])
    mine_scale = qw.scale.to(dtype)
    assert torch.equal(qw.dequantize(dtype), fake_quantize(w, mine_scale, zp, ARGS))
    written = IntQuantizationCompressor.compress({"weight": w, "weight_scale": mine_scale},
                                                 QuantizationScheme(targets=["Linear"], weights=ARGS))
    mine = ct.encode_int_module(qw, dtype)
    assert sorted(mine) == sorted(written)
    for name, t in written.items():
        assert mine[name].dtype == t.dtype and torch.equal(mine[name], t), name
    back = ct.decode_int_module(mine, QCFG)
    assert back.spec == SPEC and torch.equal(back.codes, qw.codes) and torch.equal(back.dequantize(), qw.dequantize())


def test_the_runtime_input_is_compressed_tensors_fp8_per_token():
    """W4Fp8Linear's input is compressed-tensors' forward_quantize of the W4AFP8 input args (dynamic, per token)
    bit for bit on float32 tokens, a zero token included; its output the float matmul on the dequantized weight."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 17, 256, generator=g) * torch.rand(3, 17, 1, generator=g) * 10
    x[0, 0] = 0
    fq = fake_quantize_tokens(x, "fp8")
    linear = torch.nn.Linear(256, 8)
    linear.quantization_status = QuantizationStatus.FROZEN  # calibrated, not compressed: inputs are quantized
    assert torch.equal(fq, forward_quantize(linear, x, "input", W4AFP8["input_activations"]))
    qw = rtn_quantize(weight(), SPEC)
    layer = W4Fp8Linear(qw)
    assert torch.equal(layer(x), fq @ qw.dequantize().T) and layer.path == "emulated"


def test_gptq_weighs_the_fp8_input_and_beats_rtn():
    """With an identity Hessian GPTQ is RTN code for code; on correlated inputs its output error is below 0.6x
    RTN's (measured 0.54x), with the input the layer reads (FP8 per token) in the Hessian and in the error."""
    w = 0.05 * torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    ident, _ = GPTQ(torch.eye(256), SPEC).quantize(w)
    rtn = rtn_quantize(w, SPEC)
    assert torch.equal(ident.codes, rtn.codes) and torch.equal(ident.scale, rtn.scale)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 256, generator=g) @ (0.1 * torch.randn(256, 256, generator=g) + torch.eye(256))
    xq = fake_quantize_tokens(x, "fp8")
    gptq, _ = GPTQ(2 * xq.T @ xq / xq.shape[0], SPEC).quantize(w)
    err = {name: float(((xq @ q.dequantize().T - x @ w.T) ** 2).mean()) for name, q in (("rtn", rtn), ("gptq", gptq))}
    assert err["gptq"] < 0.6 * err["rtn"], err


def quantize(model: Path, out: Path, stage: str, formats=("compressed-tensors",)):
    recipe = load_recipe(write_recipe(out.with_suffix(".yaml"), model, out, stage, formats))
    return run_quantize(recipe, overwrite=False, report=Reporter(quiet=True))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_artifact_loads_in_quantkit_and_transformers(method, tiny_factory, tmp_path):
    """The artifact is int-quantized with FP8 token inputs in its config; read back and written again it is the same
    bytes (RTN's codes those of the original weights), verify passes, and transformers (compressed-tensors
    decompressing the weights and fake-quantizing each input per token) computes quantkit's runtime logits bit for
    bit (the same float32 arithmetic)."""
    from transformers import AutoModelForCausalLM
    from safetensors.torch import load_file

    model = tiny_factory("llama")
    quantize(model, tmp_path / "out", f"{method}: {TINY}")
    art = tmp_path / "out" / "compressed-tensors"
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "int-quantized"
    group = qcfg["config_groups"]["group_0"]
    assert (group["weights"]["num_bits"], group["weights"]["group_size"], group["weights"]["strategy"]) == (4, 32,
                                                                                                            "group")
    act = group["input_activations"]
    assert (act["type"], act["strategy"], act["dynamic"], act["num_bits"]) == ("float", "token", True, 8)
    stored = runtime.read_tensors(art)
    _, decoded = runtime.quantized_state_dict(art, "compressed-tensors", qcfg, torch.float32)
    assert len(decoded) == 2 * 7
    original = load_file(str(model / "model.safetensors"))
    for name, qw in decoded.items():
        if method == "rtn":  # RTN's codes are those of the original weight
            assert torch.equal(qw.codes, rtn_quantize(original[f"{name}.weight"], GridSpec(4, 32, True)).codes), name
        for suffix, t in ct.encode_int_module(qw, torch.float32).items():
            assert torch.equal(t, stored[f"{name}.{suffix}"]), name
    assert verify(art).ok
    loaded = runtime.load(str(art), "float32").model
    assert isinstance(loaded.model.layers[0].mlp.down_proj, W4Fp8Linear)
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = loaded(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(ids).logits
    assert torch.equal(theirs, ours)
    assert float((plain - ours).abs().max()) > 1e-3  # quantized (weights and inputs)


@pytest.mark.parametrize("stage,formats,line", [
    (f"rtn: {TINY}", ("gptq",), "export.formats: gptq stores weight-only quantization; W4AFP8 (FP8 activations) "
                                "is written as compressed-tensors only"),
    (f"gptq: {TINY}", ("compressed-tensors", "awq"), "export.formats: awq stores weight-only quantization; W4AFP8 "
                                                     "(FP8 activations) is written as compressed-tensors only"),
    ("rtn: {scheme: W4AFP8, group_size: 32, sym: false}", ("compressed-tensors",),
     "stages.0.rtn.sym: W4AFP8 (int weights, FP8 activations) needs symmetric weights: sym: true"),
    ("rtn: {scheme: W4AFP8, group_size: 32, bits: 2}", ("compressed-tensors",),
     "stages.0.rtn.bits: W4AFP8 (int weights, FP8 activations) needs 4-bit weights: bits: 4"),
    ("rtn: {scheme: W4AFP8, group_size: 32, activations: {strategy: group, group_size: 32}}", ("compressed-tensors",),
     "stages.0.rtn.activations.strategy: W4AFP8 quantizes its inputs per token at run time (strategy: token, "
     "dynamic: true), got strategy: group"),
])
def test_bad_w4afp8_recipes_are_one_line(stage, formats, line, tiny_factory, tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_factory("llama"), tmp_path / "out", stage, formats)
    assert_quantize_refuses(monkeypatch, capsys, recipe, line, tmp_path / "out")


def test_a_width_the_groups_do_not_divide_is_one_line(tmp_path, monkeypatch, capsys):
    model = make_tiny_model(tmp_path / "w64", "llama")  # hidden 64: no group of 128
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", "rtn: {scheme: W4AFP8}",
                          ("compressed-tensors",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: stages.0.rtn.group_size: 128 does not divide in_features 64 of model.layers.0.self_attn.q_proj; "
        "use 32 or 64 or -1")
    assert not (tmp_path / "out").exists()
