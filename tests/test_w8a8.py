"""W8A8 building blocks: int8 / FP8 weights, per-token activation quantization, the Int8Linear / Fp8Linear
layers against float references of the same math, and the int-quantized / float-quantized compressed-tensors
layouts checked against compressed-tensors' own compressors and against transformers loading them."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from quantkit.algorithms.fp8 import FP8_MAX, fp8_quantize
from quantkit.algorithms.grid import INT8_CHANNEL, GridSpec
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.errors import QuantkitError
from quantkit.export import artifact, compressed_tensors, formats
from quantkit.export.base import QuantInfo, split_by_module
from quantkit.kernels.w8a8 import (
    Fp8Linear,
    Int8Linear,
    int8_mm,
    int8_mm_exact,
    int_mm_padded,
    quantize_tokens_fp8,
    quantize_tokens_int8,
    swap_w8a8_linears,
)

FORMATS = {"int8": "int-quantized", "fp8": "float-quantized"}
PRESETS = {"int8": "W8A8", "fp8": "FP8_DYNAMIC"}  # llm-compressor's names for the same schemes


def gen(seed):
    return torch.Generator().manual_seed(seed)


def quantize(w, act):
    return rtn_quantize(w, INT8_CHANNEL) if act == "int8" else fp8_quantize(w)


# ------------------------------------------------------------------------------------------- weights
def test_int8_rtn_is_compressed_tensors_w8a8_weight_quantization():
    """W8A8 int8 reuses the shared grid: llm-compressor's scale (amax/127.5) to fp16 rounding, and with that
    scale compressed-tensors' own compressor produces exactly our stored int8 weight."""
    from compressed_tensors.compressors import IntQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(48, 96, generator=gen(0))
    qw = rtn_quantize(w, INT8_CHANNEL)
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    ct_scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
    assert torch.allclose(qw.scale.float(), ct_scale, rtol=2**-11, atol=0)  # fp16 rounding only
    ours = compressed_tensors.encode_int_module(qw, torch.float32)
    theirs = IntQuantizationCompressor.compress({"weight": w, "weight_scale": ours["weight_scale"]}, scheme)
    assert theirs["weight"].dtype == torch.int8 and torch.equal(theirs["weight"], ours["weight"])


def test_fp8_weights_match_compressed_tensors_and_e4m3_error_bound():
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(64, 128, generator=gen(1)) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different size
    fw = fp8_quantize(w)
    amax = w.abs().amax(1, keepdim=True)
    assert fw.weight.dtype == torch.float8_e4m3fn and fw.scale.dtype == torch.float32
    assert torch.equal(fw.scale, amax / 448)
    assert torch.all(fw.weight.float().abs().amax(1) == FP8_MAX)  # every row uses the whole range
    scheme = preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])
    ct_scale, _ = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
    assert torch.equal(fw.scale, ct_scale)
    theirs = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": fw.scale}, scheme)["weight"]
    assert torch.equal(theirs.view(torch.uint8), fw.weight.view(torch.uint8))
    # e4m3: 3 mantissa bits, so half a step is 2^-4 relative for normals and 2^-10 (x scale) below 2^-6
    err = (fw.dequantize() - w).abs()
    assert torch.all(err <= 2**-4 * w.abs() + 2**-10 * fw.scale)
    # a scale half as large clips the top of every row far beyond that bound
    clipped = (w / (fw.scale / 2)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * (fw.scale / 2)
    assert not torch.all((clipped - w).abs() <= 2**-4 * w.abs() + 2**-10 * fw.scale)


# --------------------------------------------------------------------------------------- activations
def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def test_per_token_int8_error_is_bounded_and_outlier_channels_ruin_it():
    x = torch.randn(64, 256, generator=gen(2))
    codes, scale = quantize_tokens_int8(x)
    assert codes.dtype == torch.int8 and scale.shape == (64, 1)
    assert torch.equal(scale, x.abs().amax(1, keepdim=True) / 127)
    deq = codes.float() * scale
    assert torch.all((deq - x).abs() <= scale / 2 + 1e-7)  # round to nearest, nothing clipped
    clean = rel_err(deq, x)
    assert clean < 0.01  # measured 0.0070
    # a few channels 50x larger (what LLM activations look like): every token's scale grows with them, and the
    # ordinary channels lose most of their resolution; SmoothQuant moves that range into the weights
    spiky = x.clone()
    spiky[:, :4] *= 50
    codes, scale = quantize_tokens_int8(spiky)
    rest = rel_err((codes.float() * scale)[:, 4:], spiky[:, 4:])
    assert rest > 10 * clean  # measured 0.167: 24x worse


def test_per_token_fp8_quantization():
    x = torch.randn(16, 64, generator=gen(3))
    x[3] = 0  # an all-zero token keeps vLLM's floor scale instead of dividing by zero
    q, scale = quantize_tokens_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and torch.all(q.float()[3] == 0)
    assert torch.equal(scale[:3], x[:3].abs().amax(1, keepdim=True) / 448)
    assert torch.all((q.float() * scale - x).abs() <= 2**-4 * x.abs() + 2**-10 * scale)


# ------------------------------------------------------------------------------------------- layers
@pytest.mark.parametrize("shape", [(5, 7, 3), (17, 16, 16), (33, 64, 48), (2, 1024, 8), (2, 4096, 8), (3, 2500, 5)])
def test_int8_gemm_paths_are_exact(shape):
    m, k, n = shape
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen(k))
    b = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen(n))
    if k == 4096:
        a[:], b[:] = -128, -128  # the largest sum int32 accumulation must hold: 4096 * 2^14
    if k == 1024:
        a[:], b[:] = -128, -128  # the largest float32 chunk: 1024 * 2^14 = 2^24, still exact
    acc, path = int8_mm(a, b.t())
    assert path == "fp32-chunked"  # CPU: torch._int_mm's CPU kernel is ~15x slower than float32 GEMMs
    assert acc.dtype == torch.int32 and torch.equal(acc, int8_mm_exact(a, b.t()))
    assert torch.equal(acc, torch._int_mm(a, b.t()))
    assert torch.equal(acc.long(), a.long() @ b.long().t())


@pytest.mark.parametrize("m", [1, 8, 16, 17])
def test_int_mm_padded_covers_decode_batches(m):
    """CUDA's _int_mm refuses M <= 16 (decode); int_mm_padded pads with zero rows: still the exact product."""
    a = torch.randint(-128, 128, (m, 64), dtype=torch.int8, generator=gen(m))
    b = torch.randint(-128, 128, (64, 24), dtype=torch.int8, generator=gen(m + 1))
    acc = int_mm_padded(a, b)
    assert acc.shape == (m, 24) and acc.dtype == torch.int32
    assert torch.equal(acc.long(), a.long() @ b.long())


def test_int8_linear_equals_float_reference():
    lin = nn.Linear(64, 48, bias=True)
    torch.nn.init.normal_(lin.bias, generator=gen(4))
    layer = Int8Linear.from_linear(lin)
    x = torch.randn(3, 7, 64, generator=gen(5))
    y = layer(x)
    assert layer.path == "fp32-chunked" and y.shape == (3, 7, 48) and y.dtype == torch.float32
    qw = rtn_quantize(lin.weight.detach(), INT8_CHANNEL)
    codes, scale = quantize_tokens_int8(x.reshape(-1, 64))
    ref = (codes.double() * scale.double()) @ qw.dequantize(torch.float64).t() + lin.bias.double()
    torch.testing.assert_close(y.reshape(-1, 48).double(), ref, rtol=1e-6, atol=1e-6)
    assert rel_err(y, lin(x).detach()) < 0.02  # and it is still the Linear: measured 0.0034


def test_fp8_linear_emulation_equals_float_reference_and_cpu_scaled_mm():
    lin = nn.Linear(64, 48, bias=False)
    layer = Fp8Linear.from_linear(lin)
    x = torch.randn(32, 64, generator=gen(6))
    y = layer(x)
    assert layer.path == "emulated"
    fw = fp8_quantize(lin.weight.detach())
    q, s = quantize_tokens_fp8(x)
    ref = (q.double() * s.double()) @ fw.dequantize(torch.float64).t()
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
    assert rel_err(y, lin(x).detach()) < 0.06  # measured 0.036: two e4m3 roundings
    # this torch build also runs the row-wise scaled FP8 GEMM on CPU: same numbers as the emulation
    mm = torch._scaled_mm(q, fw.weight.t(), scale_a=s, scale_b=fw.scale.t().contiguous(), out_dtype=torch.float32)
    torch.testing.assert_close(mm, y, rtol=1e-6, atol=1e-6)


def test_swap_w8a8_linears_replaces_exactly_the_named_layers():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.Linear(16, 8))
    x = torch.randn(4, 32, generator=gen(7))
    ref = model(x).detach()
    swap_w8a8_linears(model, {"0": quantize(model[0].weight.detach(), "int8"),
                              "2": quantize(model[2].weight.detach(), "fp8")})
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], Fp8Linear) and type(model[3]) is nn.Linear
    assert rel_err(model(x).detach(), ref) < 0.05
    with pytest.raises(QuantkitError, match="1: not an nn.Linear"):
        swap_w8a8_linears(model, {"1": quantize(torch.randn(8, 8), "int8")})
    with pytest.raises(QuantkitError, match="3: quantized weight"):
        swap_w8a8_linears(model, {"3": quantize(torch.randn(8, 8), "int8")})


# ------------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_w8a8_layout_config_and_library_decompression(act):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme

    qw = quantize(torch.randn(32, 64, generator=gen(8)), act)
    enc = compressed_tensors.encode({"m.proj": qw}, QuantInfo("rtn", INT8_CHANNEL, activations=act,
                                                             unquantized_linears=["lm_head"]), torch.float32)
    dtype = torch.int8 if act == "int8" else torch.float8_e4m3fn
    assert {k: (v.dtype, tuple(v.shape)) for k, v in enc.tensors.items()} == {
        "m.proj.weight": (dtype, (32, 64)), "m.proj.weight_scale": (torch.float32, (32, 1))}
    cfg = enc.quantization_config
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == FORMATS[act]
    assert cfg["ignore"] == ["lm_head"]
    group = cfg["config_groups"]["group_0"]
    preset = preset_name_to_scheme(PRESETS[act], ["Linear"])
    for key in ("weights", "input_activations"):
        fields = ("num_bits", "type", "symmetric", "strategy", "dynamic")
        assert {f: group[key][f] for f in fields} == {f: getattr(getattr(preset, key), f) for f in fields}
    # our reader and compressed-tensors' own compressor for that format name agree with the weight we wrote
    parts = {k.rsplit(".", 1)[1]: v for k, v in enc.tensors.items()}
    assert compressed_tensors.marker(cfg) == "weight_scale"
    assert torch.equal(compressed_tensors.decode_module(parts, cfg).dequantize(), qw.dequantize())
    compressor = BaseCompressor.get_value_from_registry(cfg["format"])
    out = compressor.decompress(parts, QuantizationScheme.model_validate(group))
    assert torch.equal(out["weight"].float(), qw.dequantize())


def test_w8a8_refusals():
    info = QuantInfo("rtn", GridSpec(4, 32, True), activations="int8")
    with pytest.raises(QuantkitError, match="m: int-quantized needs 8-bit symmetric per-channel"):
        compressed_tensors.encode({"m": rtn_quantize(torch.randn(8, 64), info.spec)}, info, torch.float32)
    fp8 = QuantInfo("rtn", INT8_CHANNEL, activations="fp8")
    with pytest.raises(QuantkitError, match="m: float-quantized needs FP8 weights"):
        compressed_tensors.encode({"m": rtn_quantize(torch.randn(8, 64), INT8_CHANNEL)}, fp8, torch.float32)
    with pytest.raises(QuantkitError, match="export.formats: gptq stores weight-only"):
        formats.get("gptq").encode({}, fp8, torch.float32)
    with pytest.raises(QuantkitError, match="quantization_config.format: 'naive-quantized'"):
        compressed_tensors.marker({"format": "naive-quantized"})


# ----------------------------------------------------------------------------------- transformers
def qdq_tokens(x, act):
    """compressed-tensors' dynamic per-token fake quantization (calculate_qparams + fake_quantize), written out:
    int8 takes scale = amax / 127.5 (half its 255-step range) and clamps to [-128, 127]; vLLM's kernels divide
    by 127 instead. FP8 takes amax / 448 like vLLM."""
    if act == "int8":
        s = x.abs().amax(-1, keepdim=True) / 127.5
        return torch.round((x / s).clamp(-128, 127)) * s
    s = x.abs().amax(-1, keepdim=True) / 448
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")  # dequantize=True on a quantized folder
@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_transformers_runs_w8a8_checkpoints_as_dequantized_weights_times_fake_quantized_tokens(
        tiny_llama, tmp_path, act):
    """transformers 5.24 + compressed-tensors 0.20.1 on CPU load the int8 / FP8 weights as stored, decompress
    them to float on the first forward, and fake-quantize every quantized Linear's input per token with
    compressed-tensors' grid (no int8 / FP8 matmul). With `dequantize=True` activations stay float."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers")]
    qweights = {n: quantize(model.get_submodule(n).weight.detach(), act) for n in names}
    info = QuantInfo("rtn", INT8_CHANNEL, unquantized_linears=["lm_head"], activations=act)
    folder = artifact.write_artifact(tmp_path / act, "compressed-tensors", model, AutoTokenizer.from_pretrained(
        tiny_llama), qweights, info, torch.float32, 1 << 30, {})
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    stored = split_by_module(load_file(folder / "model.safetensors"), compressed_tensors.marker(qcfg))
    assert sorted(stored) == sorted(names)

    hf = AutoModelForCausalLM.from_pretrained(folder)
    q_proj = hf.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == (torch.int8 if act == "int8" else torch.float8_e4m3fn)  # kept compressed
    ids = torch.randint(3, 500, (2, 24), generator=gen(9))
    with torch.no_grad():
        got = hf(ids).logits
        assert q_proj.weight.dtype == torch.float32  # decompressed by the first forward
        for n, qw in qweights.items():
            model.get_submodule(n).weight.copy_(qw.dequantize())
        plain = model(ids).logits
        hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a: (qdq_tokens(a[0], act),))
                 for n in names]
        fake = model(ids).logits
        for h in hooks:
            h.remove()
        swap_w8a8_linears(model, qweights)
        ours = model(ids).logits
        dense = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CompressedTensorsConfig(
            dequantize=True))(ids).logits
    torch.testing.assert_close(got, fake, rtol=0, atol=1e-6)  # measured: bit-identical
    assert (got - plain).abs().max() > 1e-3  # activations really are quantized (measured 5.1e-3 int8, 2.2e-2 fp8)
    torch.testing.assert_close(dense, plain, rtol=0, atol=1e-6)
    if act == "fp8":  # same grid as vLLM: our emulated Fp8Linear gives transformers' logits
        torch.testing.assert_close(ours, got, rtol=0, atol=1e-5)
    else:  # vLLM's int8 grid (amax/127) is not compressed-tensors' (amax/127.5): same size of error, not equal
        gap, noise = (ours - got).abs().max(), (got - plain).abs().max()
        assert 0 < gap < 3 * noise  # measured 5.9e-3 vs 5.1e-3

