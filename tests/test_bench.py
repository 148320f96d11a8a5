"""`quantkit bench`: the int4 kernel layer against the dequantized reference, artifacts loaded onto it, the
byte / FLOP accounting behind the roofline, and the command end to end on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from conftest import write_recipe

from quantkit import runtime
from quantkit.algorithms.grid import GridSpec, QuantizedWeight
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.bench.decode import (EagerDecoder, StaticDecoder, decode_step_flops, generate_timed,
                                   kept_write_positions, kv_cache_bytes, tensor_bytes)
from quantkit.bench.runner import diagnose, ratios
from quantkit.cli import cli
from quantkit.errors import QuantkitError
from quantkit.kernels import int4_cpu
from quantkit.kernels.w4a16 import W4Linear, kernel_name, pick_backend, supports

CPU = torch.device("cpu")
AVX2, WHY_NOT = int4_cpu.available()
# PyTorch's kernel rounds activations and scales to bfloat16 (measured 0.3 % relative error); quantkit's computes
# in float32 with the stored scales (measured ~1e-7). A wrong nibble order or zero term gives ~100 %.
BACKENDS = [pytest.param("torch", 0.01, id="torch"),
            pytest.param("quantkit", 1e-5, id="quantkit", marks=pytest.mark.skipif(not AVX2, reason=WHY_NOT))]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def act_order(qw: QuantizedWeight, seed: int) -> QuantizedWeight:
    """The same weight with its columns shuffled, as GPTQ act-order stores it (g_idx names each column's group)."""
    cols = qw.shape[1]
    perm = torch.randperm(cols, generator=gen(seed))
    g_idx = (torch.arange(cols) // qw.spec.span(cols))[perm]
    return QuantizedWeight(qw.codes[:, perm], qw.scale, qw.zero, qw.spec, g_idx=g_idx)


# ------------------------------------------------------------------------------------------- the kernel layer
@pytest.mark.parametrize("backend,bound", BACKENDS)
@pytest.mark.parametrize("group_size,sym", [(32, True), (64, False), (128, False), (-1, False), (-1, True)])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_w4linear_equals_dequantized_reference(backend, bound, group_size, sym, tokens):
    w = torch.randn(208, 256, generator=gen(1))
    bias = torch.randn(208, generator=gen(2))
    qw = rtn_quantize(w, GridSpec(4, group_size, sym))
    layer = W4Linear(qw, bias, CPU, backend)
    x = torch.randn(2, tokens, 256, generator=gen(3))
    ref = x.double() @ qw.dequantize(torch.float64).T + bias.double()
    y = layer(x)
    assert y.shape == (2, tokens, 208) and y.dtype == torch.float32
    assert rel(y, ref) < bound


@pytest.mark.parametrize("backend,bound", BACKENDS)
def test_w4linear_detects_a_wrong_packing(backend, bound):
    qw = rtn_quantize(torch.randn(64, 128, generator=gen(4)), GridSpec(4, 64, False))
    x = torch.randn(3, 128, generator=gen(5))
    ref = x.double() @ qw.dequantize(torch.float64).T
    assert rel(W4Linear(qw, None, CPU, backend)(x), ref) < bound
    swapped = QuantizedWeight(qw.codes.view(64, 64, 2).flip(-1).reshape(64, 128), qw.scale, qw.zero, qw.spec)
    assert rel(W4Linear(swapped, None, CPU, backend)(x), ref) > 0.3  # what the bound guards against
    shifted = QuantizedWeight(qw.codes, qw.scale, (qw.zero.int() + 1).clamp(max=15).to(torch.uint8), qw.spec)
    assert rel(W4Linear(shifted, None, CPU, backend)(x), ref) > 0.05


@pytest.mark.parametrize("backend,bound", BACKENDS)
def test_w4linear_act_order_gathers_the_input_columns(backend, bound):
    qw = act_order(rtn_quantize(torch.randn(64, 256, generator=gen(6)), GridSpec(4, 64, False)), seed=7)
    layer = W4Linear(qw, None, CPU, backend)
    assert layer.perm is not None
    x = torch.randn(5, 256, generator=gen(8))
    assert rel(layer(x), x.double() @ qw.dequantize(torch.float64).T) < bound


def test_backend_choice():
    assert pick_backend("auto", CPU) == ("quantkit" if AVX2 else "torch")
    assert pick_backend("torch", CPU) == "torch"
    assert pick_backend("auto", torch.device("cuda")) == "torch"
    with pytest.raises(QuantkitError, match="backend 'x' is not one of auto, torch, quantkit"):
        pick_backend("x", CPU)
    with pytest.raises(QuantkitError, match="CPU-only"):
        pick_backend("quantkit", torch.device("cuda"))


def test_w4linear_refuses_what_the_kernel_cannot_take():
    assert "8-bit" in supports(rtn_quantize(torch.randn(32, 64), GridSpec(8, -1, True)), CPU)
    assert "out_features % 16" in supports(rtn_quantize(torch.randn(40, 64), GridSpec(4, 32, True)), CPU)
    assert supports(rtn_quantize(torch.randn(32, 96), GridSpec(4, 96 // 2, True)), CPU).startswith("group size 48")
    # per channel on PyTorch's CPU kernel: the scale is repeated over groups of 32..256, so 48 columns cannot
    assert "per-channel" in supports(rtn_quantize(torch.randn(32, 48), GridSpec(4, -1, True)), CPU)
    with pytest.raises(QuantkitError, match="int4 kernel: shape"):
        W4Linear(rtn_quantize(torch.randn(40, 64), GridSpec(4, 32, True)), None, CPU)


# ------------------------------------------------------------------------------------------- artifacts on it
@pytest.fixture(scope="module")
def artifacts(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    out = {}
    for name, stage, formats in [
        ("rtn", "rtn: {bits: 4, group_size: 32, sym: false}", ("gptq", "compressed-tensors", "awq")),
        ("actorder", "gptq: {bits: 4, group_size: 32, sym: true, act_order: true}", ("gptq",)),
        ("w8a8", "rtn: {bits: 8, group_size: -1, sym: true, activations: {bits: 8, type: int}}",
         ("compressed-tensors",)),
    ]:
        recipe = write_recipe(root / f"{name}.yaml", tiny_llama, root / name, stage, formats=formats)
        result = CliRunner().invoke(cli, ["quantize", str(recipe), "--quiet"])
        assert result.exit_code == 0, result.output
        for fmt in formats:
            out[f"{name}/{fmt}"] = root / name / fmt
    return out


@pytest.mark.parametrize("backend,bound", BACKENDS)
@pytest.mark.parametrize("which", ["rtn/gptq", "rtn/compressed-tensors", "rtn/awq", "actorder/gptq"])
def test_artifacts_load_onto_the_int4_kernel(artifacts, which, backend, bound):
    path = str(artifacts[which])
    reference = runtime.load(path).model  # dequantized float Linears
    fast = runtime.load(path, int4_device=CPU, int4_backend=backend).model
    kernels = [m for m in fast.modules() if isinstance(m, W4Linear)]
    assert len(kernels) == 14  # 2 blocks x 7 Linears; lm_head stays float (ignored by the recipe)
    assert all(k.perm is None and k.backend == backend for k in kernels)  # act-order here keeps static groups
    ids = torch.randint(0, 500, (2, 24), generator=gen(9))
    with torch.no_grad():
        assert rel(fast(ids).logits, reference(ids).logits) < bound


def test_w8a8_artifact_benches_on_its_int8_layers(artifacts):
    model = runtime.load(str(artifacts["w8a8/compressed-tensors"]), int4_device=CPU).model
    assert not any(isinstance(m, W4Linear) for m in model.modules())
    assert sum(type(m).__name__ == "Int8Linear" for m in model.modules()) == 14
    flops = decode_step_flops(model, 1, 0)  # W8A8 layers count as Linears: every block weight plus lm_head
    linears = sum(m.weight.numel() for m in model.modules() if type(m).__name__ in ("Int8Linear", "Linear"))
    assert flops == 2 * linears


# ------------------------------------------------------------------------------------------- accounting
def test_kv_cache_bytes_match_the_cache_transformers_fills(tiny_llama):
    model = runtime.load(str(tiny_llama)).model
    decoder = EagerDecoder(model)
    decoder.prefill(torch.randint(0, 500, (3, 20)), 20)
    filled = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                 for layer in decoder.cache.layers)
    assert kv_cache_bytes(model.config, 3, 20, torch.float32) == filled


def test_tensor_bytes_count_a_tied_head_once(tiny_llama):
    model = runtime.load(str(tiny_llama)).model
    sizes = tensor_bytes(model)
    params = sum(p.numel() * 4 for p in model.parameters())  # parameters() already yields the tied weight once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert sizes["total"] == params + buffers
    assert sizes["embedding"] == 0  # tied: the head reads the whole table every step


def test_decoders_generate_what_greedy_generate_does(tiny_llama):
    model = runtime.load(str(tiny_llama)).model
    prompt = torch.randint(3, 500, (2, 12), generator=gen(10))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, 12:]

    def tokens(decoder):
        out = [decoder.prefill(prompt, 18)]
        for i in range(5):
            out.append(decoder.step(out[-1], 12 + i))
        return torch.cat(out, 1)

    assert torch.equal(tokens(EagerDecoder(model)), want)
    static = StaticDecoder(model)
    assert static.variant == "static+compile"
    static.compiled = model.forward  # the static cache path itself, without paying for a compile in unit tests
    assert torch.equal(tokens(static), want) and torch.equal(tokens(static), want)  # the cache is reset and reused
    t = generate_timed(EagerDecoder(model), prompt, 5)
    assert t.prefill_s > 0 and t.decode_s > 0


def test_warm_up_forwards_do_not_move_the_static_cache_writes(tiny_llama):
    """The CUDA graph path runs two warm-up forwards before its capture. transformers' static layers write at a counter
    each forward advances: unless kept_write_positions restores it, later steps write past where they should (on
    the H200 the 64th step wrote past the cache's end)."""
    model = runtime.load(str(tiny_llama)).model
    prompt = torch.randint(3, 500, (2, 12), generator=gen(11))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[:, 12:]
    static = StaticDecoder(model)
    static.compiled = model.forward
    with torch.no_grad():
        out = [static.prefill(prompt, 18)]
        with kept_write_positions(static.cache):
            for _ in range(2):
                static._forward(out[-1], torch.tensor([12]))
        assert all(int(layer.cumulative_length) == 12 for layer in static.cache.layers)
        for i in range(5):
            out.append(static.step(out[-1], 12 + i))
    assert torch.equal(torch.cat(out, 1), want)


@pytest.mark.parametrize("ms,nbytes,flops,bound", [
    (10.0, 8e7, 1e9, "memory-bound"),  # 8 ms of the 10 moving weights
    (4.0, 1e6, 3e9, "compute-bound"),  # 3 ms of the 4 in FLOPs
    (100.0, 8e7, 1e9, "overhead-bound"),  # neither explains half of it
])
def test_roofline_diagnosis(ms, nbytes, flops, bound):
    run = {"name": "model", "path": "a", "variant": "eager", "batch": 1, "ms_per_token": {"median": ms},
           "bytes_per_decode_step": nbytes, "flops_per_decode_step": flops}
    d = diagnose(run, copy_bw=1e10, flops=1e12)
    assert d["bound"] == bound
    assert d["bw_pct_of_peak"] == pytest.approx(100 * nbytes / 1e10 / (ms / 1000))
    assert d["flops_pct_of_peak"] == pytest.approx(100 * flops / 1e12 / (ms / 1000))
    assert d["achieved_bw_bytes_s"] == pytest.approx(nbytes / (ms / 1000))


def test_ratios_pair_model_and_base_runs():
    def run(name, batch, decode, prefill, weights, peak):
        return {"name": name, "path": "a", "variant": "eager", "batch": batch, "decode_tok_s": {"median": decode},
                "prefill_tok_s": {"median": prefill}, "weight_bytes": weights, "peak_mem_bytes": peak}

    out = ratios([run("model", 1, 30, 100, 25, 50), run("base", 1, 10, 200, 100, 80), run("model", 8, 1, 1, 1, 1)])
    assert out == [{"path": "a", "variant": "eager", "batch": 1, "decode_speedup": 3.0, "prefill_speedup": 0.5,
                    "weight_bytes_ratio": 0.25, "peak_mem_ratio": 0.625}]


# ------------------------------------------------------------------------------------------- the command
def test_bench_command_end_to_end(artifacts, tiny_llama, tmp_path):
    art = artifacts["rtn/gptq"]
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    result = CliRunner().invoke(cli, ["bench", str(art), "--baseline", str(tiny_llama), "--batch", "1,2",
                                      "--prompt-len", "16", "--gen-len", "4", "--reps", "3", "--quiet",
                                      "--json", str(out), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    body = json.loads(out.read_text())
    assert [(r["name"], r["batch"]) for r in body["runs"]] == [("model", 1), ("model", 2), ("base", 1), ("base", 2)]
    for r in body["runs"]:
        assert set(r) >= {"name", "batch", "prefill_tok_s", "decode_tok_s", "ms_per_token", "weight_bytes",
                          "peak_mem_bytes", "kv_cache_bytes"}
        assert r["decode_tok_s"]["min"] <= r["decode_tok_s"]["median"] <= r["decode_tok_s"]["max"]
        # an odd number of reps: the median run is the same run for tok/s and ms/token
        assert r["decode_tok_s"]["median"] == pytest.approx(r["batch"] * 1000 / r["ms_per_token"]["median"])
    assert [m["name"] for m in body["models"]] == ["model", "base"]
    assert body["models"][0]["kernels"] == {"F.linear:float32": 1, kernel_name(CPU, pick_backend("auto", CPU)): 14}
    assert body["models"][1]["kernels"] == {"F.linear:float32": 15}
    assert [q["batch"] for q in body["ratios"]] == [1, 2]
    base_w, model_w = body["runs"][2]["weight_bytes"], body["runs"][0]["weight_bytes"]
    assert body["ratios"][0]["weight_bytes_ratio"] == pytest.approx(model_w / base_w) and model_w < 0.6 * base_w
    assert body["peaks"]["copy_bw_bytes_s"] > 1e8 and len(body["roofline"]) == 4
    assert f"| model | {art.parent.name}/gptq | eager | 1 |" in md.read_text()
    manifest = json.loads((art / "quantkit.json").read_text())
    assert manifest["bench"]["runs"] == body["runs"]


def test_bench_command_errors(tmp_path, monkeypatch, capsys):
    from quantkit.cli import main

    def run(*args) -> int:
        monkeypatch.setattr("sys.argv", ["quantkit", "bench", *args])
        with pytest.raises(SystemExit) as exc:
            main()
        return exc.value.code

    assert run(str(tmp_path / "nope")) == 2
    assert capsys.readouterr().err.strip() == f"error: ARTIFACT: not found: {tmp_path / 'nope'}"
    assert run(str(tmp_path), "--batch", "1,x") == 2
    assert "expected positive integers separated by commas, got '1,x'" in capsys.readouterr().err
    assert run(str(tmp_path), "--baseline", str(tmp_path / "base")) == 2  # before any model is benched
    assert capsys.readouterr().err.strip() == f"error: --baseline: not found: {tmp_path / 'base'} " \
        "(expected an HF folder, a .gguf file or a hub id org/name)"
