"""AWQ: scale folding on every tiny architecture, the scale and clip searches against plain RTN, and the
AutoAWQ GEMM layout checked against the reference reader written from AutoAWQ's source."""

import json

import pytest
import torch
from torch import nn

from quantkit.algorithms import awq
from quantkit.algorithms.grid import GridSpec, QuantizedWeight
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.algorithms.smoothing import fold
from quantkit.errors import QuantkitError
from quantkit.export import awq as awq_format
from quantkit.export.artifact import write_safetensors
from quantkit.export.base import QuantInfo
from quantkit.families.mappings import find_mappings
from quantkit.model import decoder_blocks
from reference_readers import read_awq_gemm
from tiny_models import tiny_config

QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
LLAMA = {
    "input_layernorm": (QKV, "self_attn"),
    "self_attn.v_proj": (["self_attn.o_proj"], "self_attn.o_proj"),
    "post_attention_layernorm": (["mlp.gate_proj", "mlp.up_proj"], "mlp"),
    "mlp.up_proj": (["mlp.down_proj"], "mlp.down_proj"),
}
OPT = {
    "self_attn_layer_norm": (QKV, "self_attn"),
    "self_attn.v_proj": (["self_attn.out_proj"], "self_attn.out_proj"),
    "final_layer_norm": (["fc1"], "fc1"),
    "fc1": (["fc2"], "fc2"),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors, one CPU thread


def tiny(arch: str, gqa: bool = True, **overrides) -> nn.Module:
    """A random tiny model straight from tests/tiny_models.py's config (no tokenizer needed here)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, vocab_size=512)
    if not gqa:
        cfg.num_key_value_heads = cfg.num_attention_heads
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------- folding
@pytest.mark.parametrize("arch, gqa", [("llama", True), ("llama", False), ("mistral", True), ("qwen2", False),
                                       ("qwen3", True), ("qwen3", False), ("opt", False)])
def test_fold_leaves_every_block_output_unchanged(arch, gqa):
    model = tiny(arch, gqa)
    with torch.no_grad():  # norm weights away from 1 and biases away from 0, so every fold does something
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids, output_hidden_states=True).hidden_states
    expected = dict(OPT if arch == "opt" else LLAMA)
    if gqa:
        del expected["self_attn.v_proj"]
    g = torch.Generator().manual_seed(1)
    for block in decoder_blocks(model)[1]:
        mappings, notes = find_mappings(block)
        assert {m.prev_name: (m.names, m.inspect_name) for m in mappings} == expected, notes
        assert len(notes) == int(gqa)
        for m in mappings:
            assert m.inspect is block.get_submodule(m.inspect_name)
            fold(m, torch.exp(torch.randn(m.linears[0].in_features, generator=g)))  # s in ~[0.05, 20]
    with torch.no_grad():
        after = model(ids, output_hidden_states=True).hidden_states
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.allclose(a, b, rtol=0, atol=1e-5 * float(a.abs().max())), f"block {i - 1} output changed"


def test_gqa_skips_v_to_o_with_a_note():
    mappings, notes = find_mappings(tiny("llama").model.layers[0])
    assert "self_attn.v_proj" not in [m.prev_name for m in mappings]
    assert notes == ["self_attn.v_proj -> self_attn.o_proj: skipped, self_attn.v_proj.out_features 32 != "
                     "self_attn.o_proj.in_features 64"]


def test_unverifiable_pairs_are_skipped_with_notes():
    post_norm = tiny("opt", do_layer_norm_before=False).model.decoder.layers[0]  # OPT-350m style
    mappings, notes = find_mappings(post_norm)
    assert [m.prev_name for m in mappings] == ["self_attn.v_proj", "fc1"]
    assert all("is applied after" in n for n in notes) and len(notes) == 2
    gelu = tiny("opt", activation_function="gelu").model.decoder.layers[0]
    mappings, notes = find_mappings(gelu)
    assert "fc1" not in [m.prev_name for m in mappings] and notes == [
        "fc1 -> fc2: skipped, activation GELUActivation is not ReLU"]
    assert find_mappings(nn.Sequential(nn.Linear(4, 4))) == (
        [], ["Sequential: no known AWQ mapping structure (expected Llama- or OPT-style module names)"])


# ------------------------------------------------------------------------------------ scale and clip
def outlier_inputs(tokens: int, cols: int, seed: int, channels: int = 6, factor: float = 20.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=g)
    x[:, torch.randperm(cols, generator=g)[:channels]] *= factor
    return x, g


def output_error(x, w, wq):
    return float((x @ (wq - w).T).square().mean())


@pytest.mark.parametrize("spec, bound", [(GridSpec(4, 64, sym=False), 0.5), (GridSpec(4, 32, sym=True), 0.8)])
def test_awq_beats_rtn_on_a_linear_with_outlier_channels_and_clip_helps(spec, bound):
    x, g = outlier_inputs(1024, 256, seed=0)
    w = torch.randn(128, 256, generator=g) * 0.02
    rtn = output_error(x, w, rtn_quantize(w, spec).dequantize())
    loss = awq.linear_loss(x.T @ x / len(x), [w])
    res = awq.search_scale(awq.activation_sum(x[None]) / len(x), [w], spec, loss, duo_scaling=False)
    # the Gram-matrix loss is the plain output MSE; α = 0 without duo scaling is s = 1, i.e. RTN
    assert res.losses[0] == pytest.approx(rtn, rel=1e-4)
    scaled = output_error(x, w, awq.fake_quantize(w, res.scale, spec))
    assert scaled == pytest.approx(min(res.losses), rel=1e-4) and res.ratio > 0
    # measured: 0.36 (asym g64), 0.68 (sym g32); s = 1 (scales ignored) would give 1.0
    assert scaled < bound * rtn, (scaled / rtn, res.losses)
    # clipping is searched on the folded weight and input (W·s, x/s); measured 0.90 and 0.70 of the AWQ error
    ws, xs = w * res.scale, x / res.scale
    clipped = awq.search_clip(ws, xs, spec, rows_per_batch=48)  # several row batches, one ragged
    assert torch.all(clipped.abs() <= ws.abs())
    assert output_error(xs, ws, rtn_quantize(clipped, spec).dequantize()) < scaled


@pytest.mark.parametrize("prev", ["input_layernorm", "post_attention_layernorm"])
def test_awq_on_a_block_through_the_norm_fold(prev):
    """A tiny Llama block: norm -> q,k,v scored on self_attn's output, norm -> gate,up on the MLP's."""
    model = tiny("llama")
    block = model.model.layers[0]
    mapping = next(m for m in find_mappings(block)[0] if m.prev_name == prev)
    norm, module = mapping.prev, mapping.inspect
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(2))
    h, _ = outlier_inputs(256, 64, seed=1, channels=3, factor=25.0)
    h = h.reshape(2, 128, 64)
    position = model.model.rotary_emb(h, torch.arange(128)[None].expand(2, -1))
    kwargs = {"position_embeddings": position, "attention_mask": None} if module is block.self_attn else {}
    spec = GridSpec(4, 32, sym=False)
    with torch.no_grad():
        x = norm(h)
    weights = [lin.weight.detach().clone() for lin in mapping.linears]
    loss = awq.module_loss(lambda: module(x, **kwargs), mapping.linears)
    rtn = loss([rtn_quantize(w, spec).dequantize() for w in weights])
    res = awq.search_scale(awq.activation_sum(x) / (2 * 128), weights, spec, loss)
    assert all(torch.equal(lin.weight, w) for lin, w in zip(mapping.linears, weights))  # restored
    assert min(res.losses) < 0.5 * rtn, (min(res.losses) / rtn, res.losses)  # measured 0.32 for both
    # folding s for real and quantizing the folded weights reproduces the searched error
    with torch.no_grad():
        ref = module(x, **kwargs)
        ref = ref[0] if isinstance(ref, tuple) else ref
        fold(mapping, res.scale)
        for lin in mapping.linears:
            lin.weight.copy_(rtn_quantize(lin.weight, spec).dequantize())
        out = module(norm(h), **kwargs)
        out = out[0] if isinstance(out, tuple) else out
    assert float((out - ref).square().mean()) == pytest.approx(min(res.losses), rel=1e-3)


def _clip_by_rtn(weight, x, spec, n_grid=20, max_shrink=0.5):
    """search_clip written plainly (rtn_quantize per shrink, one group at a time): its reference."""
    out, cols = weight.shape
    span, groups = spec.span(cols), spec.groups(cols)
    x = x.reshape(-1, cols)[:: max(1, x.shape[0] // 512)]
    wg = weight.reshape(out, groups, span)
    best_max = wg.abs().amax(-1, keepdim=True)
    best_err = torch.full(best_max.shape, float("inf"))
    for i in range(int(max_shrink * n_grid)):
        m = wg.abs().amax(-1, keepdim=True) * (1 - i / n_grid)
        q = rtn_quantize(wg.clamp(-m, m).reshape(out, cols), spec).dequantize().reshape(out, groups, span)
        err = torch.einsum("tgs,ogs->otg", x.reshape(-1, groups, span), q - wg).square().mean(1)[..., None]
        better = err < best_err
        best_err, best_max = torch.where(better, err, best_err), torch.where(better, m, best_max)
    return wg.clamp(-best_max, best_max).reshape(out, cols)


@pytest.mark.parametrize("spec", [GridSpec(4, 32, False), GridSpec(4, 64, True), GridSpec(3, -1, False)])
def test_fast_quantize_dequantize_and_clip_match_rtn_exactly(spec):
    """The search's fused fake quantization is rtn_quantize(...).dequantize() bit for bit (so what a
    candidate is scored on is what gets stored), and the clip search picks what plain RTN scoring picks."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen) * torch.rand(1, 128, generator=gen) * 3
    w[3, :32] = 0  # an empty group
    w[5] = w[5].abs()  # a group without negatives
    s = torch.rand(128, generator=gen) + 0.5
    assert torch.equal(awq.fake_quantize(w, s, spec), rtn_quantize(w * s, spec).dequantize() / s)
    x = torch.randn(600, 128, generator=gen)
    fast, plain = awq.search_clip(w, x, spec), _clip_by_rtn(w, x, spec)
    assert torch.allclose(fast, plain, rtol=0, atol=1e-6) or (fast != plain).float().mean() < 0.01


def test_clip_skips_query_and_key_only():
    assert [awq.clip_applies(n) for n in ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.down_proj", "fc1"]] == [
        False, False, True, True, True, True]


# ------------------------------------------------------------------------------------- GEMM format
def same(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return (torch.equal(a.codes, b.codes) and torch.equal(a.zero, b.zero)
            and torch.equal(a.scale.half(), b.scale.half()) and a.spec == b.spec)


def test_gemm_word_layout_by_hand():
    qw = QuantizedWeight(codes=torch.arange(8, dtype=torch.uint8)[:, None], scale=torch.ones(8, 1).half(),
                         zero=torch.full((8, 1), 8, dtype=torch.uint8), spec=GridSpec(4, -1, True))
    t = awq_format.encode_module(qw)
    assert t["qweight"].shape == (1, 1) and t["qweight"].dtype == torch.int32
    assert int(t["qweight"][0, 0]) & 0xFFFFFFFF == 0x75316420  # nibble k holds output column [0,2,4,6,1,3,5,7][k]
    assert int(t["qzeros"][0, 0]) & 0xFFFFFFFF == 0x88888888


@pytest.mark.parametrize("shape", [(64, 128), (24, 256), (136, 384)])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sym", [True, False])
def test_gemm_round_trips_bit_exact_and_agrees_with_reference_reader(tmp_path, shape, group, sym):
    spec = GridSpec(4, group, sym)
    g = torch.Generator().manual_seed(shape[0] + group + sym)
    qw = rtn_quantize(torch.randn(*shape, generator=g), spec)
    info = QuantInfo("awq", spec, unquantized_linears=["lm_head", "model.layers.0.mlp.down_proj"])
    enc = awq_format.encode({"model.layers.0.self_attn.q_proj": qw}, info)
    out, cols = shape
    parts = {k.rsplit(".", 1)[1]: v for k, v in enc.tensors.items()}
    assert parts["qweight"].shape == (cols, out // 8) and parts["qzeros"].shape == (cols // group, out // 8)
    assert parts["scales"].shape == (cols // group, out) and parts["scales"].dtype == torch.float16
    assert same(awq_format.decode_module(parts, enc.quantization_config), qw)
    write_safetensors(tmp_path, enc.tensors, 1 << 30)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": enc.quantization_config}))
    for name, body in enc.extra_files.items():
        (tmp_path / name).write_text(json.dumps(body))
    assert torch.equal(read_awq_gemm(str(tmp_path))["model.layers.0.self_attn.q_proj"], qw.dequantize())


def test_gemm_config_is_what_autoawq_and_transformers_read():
    from transformers import AwqConfig

    info = QuantInfo("awq", GridSpec(4, 64, True), unquantized_linears=["lm_head", "model.layers.1.mlp.down_proj"])
    enc = awq_format.encode({}, info)
    cfg = AwqConfig.from_dict(enc.quantization_config)
    assert (cfg.bits, cfg.group_size, cfg.zero_point, cfg.format) == (4, 64, True, "gemm")
    assert cfg.modules_to_not_convert == ["model.layers.1.mlp.down_proj"]  # lm_head is never converted anyway
    assert enc.extra_files["quant_config.json"] == {
        "zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM",
        "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]}


def test_gemm_refuses_what_it_cannot_store():
    w = torch.randn(16, 64)
    with pytest.raises(QuantkitError, match="bits: 8") as err:
        awq_format.encode_module(rtn_quantize(w, GridSpec(8, 32, True)), "m.proj")
    assert "\n" not in str(err.value)
    qw = rtn_quantize(w, GridSpec(4, 32, True))
    qw.g_idx = torch.arange(64) // 32  # contiguous groups spelled out: fine
    awq_format.encode_module(qw)
    qw.g_idx = torch.arange(64) % 2  # act-order g_idx
    with pytest.raises(QuantkitError, match="g_idx") as err:
        awq_format.encode_module(qw, "m.proj")
    assert "\n" not in str(err.value)
    with pytest.raises(QuantkitError, match="out_features=12"):
        awq_format.encode_module(rtn_quantize(torch.randn(12, 64), GridSpec(4, 32, True)))
