"""Preset scheme names (methods/presets.py), FP8 block weights (FP8_BLOCK) and static FP8 input scales (FP8):
the presets against compressed-tensors' own, the block math bit for bit against compressed-tensors' quantize /
dequantize, the refusal of a block that does not tile a Linear, the static scales against a brute-force max |x| / 448,
transformers' logits on the artifacts against quantkit's runtime, and the new tensors through a resume."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from conftest import write_recipe
from safetensors.torch import load_file
from test_resume import quantize as quantize_cli
from test_resume import safetensors_bytes
from torch import nn

from quantkit.algorithms.fp8 import FP8_MAX, Fp8BlockWeight, Fp8Weight, fp8_block_quantize, fp8_quantize
from quantkit.algorithms.observers import InputObserver
from quantkit.algorithms.scheme import QuantizedTensor
from quantkit.errors import QuantkitError
from quantkit.export import compressed_tensors
from quantkit.export.base import QuantInfo, split_by_module
from quantkit.algorithms.grid import INT8_CHANNEL
from quantkit.methods.presets import SUPPORTED
from quantkit.progress import Reporter
from quantkit.quantize.calibration import build
from quantkit.quantize.resume import FOLDER
from quantkit.quantize.distributed import Ranks
from quantkit.quantize.run import run_quantize
from quantkit.recipe import RTN, load_recipe

# the tiny llama's widths (64; k/v 32) are no multiples of 128: blocks and input groups of 32
BLOCK = "rtn: {scheme: FP8_BLOCK, block: [32, 32], activations: {group_size: 32}}"
STATIC = "rtn: {scheme: FP8}"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def quantize(model, tmp_path, name: str, stage: str):
    recipe = load_recipe(write_recipe(tmp_path / f"{name}.yaml", model, tmp_path / name, stage,
                                      ("compressed-tensors",)))
    run_quantize(recipe, overwrite=False, report=Reporter(quiet=True))
    return recipe, tmp_path / name / "compressed-tensors"


# ------------------------------------------------------------------------------------------ presets
def test_every_preset_is_compressed_tensors_own_as_quantkit_writes_it():
    """Each name's stage arguments, written by the exporter, give compressed-tensors' PRESET_SCHEMES fields."""
    from compressed_tensors.quantization import preset_name_to_scheme

    fields = ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "block_structure")
    for name in SUPPORTED:
        args = RTN.model_validate({"scheme": name.lower()})  # names are matched as compressed-tensors does
        assert args.scheme == name
        preset = preset_name_to_scheme(name, ["Linear"])
        if args.activations is None:  # pack-quantized: the grid quantkit's int exporter writes
            assert (args.bits, args.group_size, args.sym) == (preset.weights.num_bits, preset.weights.group_size,
                                                              preset.weights.symmetric)
            continue
        act = args.activations
        info = QuantInfo("rtn", args.grid, activations=act.kind, block=args.block, per_tensor=args.per_tensor,
                         act_strategy=act.strategy, act_group=act.group_size)
        group = compressed_tensors.encode({}, info, torch.float32).quantization_config["config_groups"]["group_0"]
        for key in ("weights", "input_activations"):
            want = {f: getattr(getattr(preset, key), f) for f in fields}
            want = {f: getattr(v, "value", v) for f, v in want.items()}  # enums as the JSON config spells them
            assert {f: group[key].get(f) for f in fields} == want, (name, key)


def test_keys_beside_a_preset_override_it():
    args = RTN.model_validate({"scheme": "FP8_BLOCK", "block": [64, 64], "activations": {"group_size": 64}})
    assert (args.block, args.type, args.activations.strategy, args.activations.group_size) == (
        (64, 64), "float", "group", 64)
    assert RTN.model_validate({"scheme": "W4A16", "ignore": []}).ignore == []
    # a recipe without the new keys dumps as before (quantkit.json and resume fingerprints unchanged)
    assert set(RTN.model_validate({}).model_dump()) == {"bits", "group_size", "sym", "type", "observer",
                                                        "activations", "ignore"}


# -------------------------------------------------------------------------------------- FP8 block
def test_fp8_block_rtn_is_compressed_tensors_block_quantization_bit_for_bit():
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(256, 384, generator=gen(1)) * torch.logspace(-3, 1, 384)  # blocks of very different ranges
    w[:128, :128] = 0  # an all-zero block: compressed-tensors' eps scale
    args = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).weights
    blocks = w.reshape(2, 128, 3, 128)
    scale, zero = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
    want = ct_quantize(w, scale, zero, args, dtype=torch.float8_e4m3fn)

    fw = fp8_block_quantize(w, (128, 128))
    assert fw.weight.dtype == torch.float8_e4m3fn and fw.scale.shape == (2, 3) and fw.scale[0, 0] > 0
    assert torch.equal(fw.scale, scale) and torch.equal(fw.weight.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(fw.dequantize(), dequantize(want, scale, zero, args))
    # e4m3: 3 mantissa bits, so each normal value is within 2^-4 of itself (relative)
    normal = fw.weight.float().abs() >= 2**-6
    assert torch.all(((fw.dequantize() - w).abs() <= 2**-4 * w.abs())[normal])

    # what quantkit writes decodes to the same weight in our reader and in compressed-tensors' compressor
    info = QuantInfo("rtn", INT8_CHANNEL, activations="fp8", block=(128, 128), act_strategy="group", act_group=128)
    enc = compressed_tensors.encode({"m": fw}, info, torch.float32)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in enc.tensors.items()} == {
        "m.weight": (torch.float8_e4m3fn, (256, 384)), "m.weight_scale": (torch.float32, (2, 3))}
    parts = {k.rsplit(".", 1)[1]: v for k, v in enc.tensors.items()}
    cfg = enc.quantization_config
    assert torch.equal(compressed_tensors.decode_module(parts, cfg).dequantize(), fw.dequantize())
    group = QuantizationScheme.model_validate(cfg["config_groups"]["group_0"])
    out = BaseCompressor.get_value_from_registry(cfg["format"]).decompress(parts, group)
    assert torch.equal(out["weight"].float(), fw.dequantize())


def test_a_block_that_does_not_tile_a_linear_is_one_line_before_any_work(tiny_llama, tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "rtn: {scheme: FP8_BLOCK}",
                                      ("compressed-tensors",)))
    with pytest.raises(QuantkitError) as err:
        run_quantize(recipe, overwrite=False, report=Reporter(quiet=True))
    assert str(err.value) == (
        "stages.0.rtn.block: [128, 128] does not tile model.layers.0.self_attn.q_proj [64, 64]; expected a block "
        "whose rows divide 64 and columns divide 64 (or ignore it)")
    assert not (tmp_path / "out" / "compressed-tensors").exists()


# ---------------------------------------------------------------------------------- static inputs
def test_static_minmax_scales_are_the_brute_force_max_over_the_calibration(tiny_llama, tmp_path):
    """Each Linear's stored input_scale is max |x| / 448 over every calibration window, x its input in the model
    whose earlier blocks run as quantized (static FP8 inputs) and whose own block has rounded weights."""
    from quantkit import runtime

    recipe, folder = quantize(tiny_llama, tmp_path, "static", STATIC)
    loaded = runtime.load(str(folder))
    model = loaded.model
    tokens = build(loaded.tokenizer, recipe.calibration).tokens
    layers = {n: m for n, m in model.named_modules() if hasattr(m, "input_scale") and n.startswith("model.layers")}
    assert len(layers) == 14 and all(m.weight_scale.unique().numel() == 1 for m in layers.values())  # per tensor
    for i in range(2):
        mine = {n: m for n, m in layers.items() if n.startswith(f"model.layers.{i}.")}
        amax, handles = {}, []
        for n, m in mine.items():  # this block: its rounded weights on unquantized inputs
            float_linear = nn.Linear(m.in_features, m.out_features, bias=False)
            float_linear.weight.data = m.weight.float() * m.weight_scale.t()
            handles.append(float_linear.register_forward_pre_hook(
                lambda mod, a, n=n: amax.__setitem__(n, max(amax.get(n, 0.0), float(a[0].abs().max())))))
            model.set_submodule(n, float_linear)
        with torch.no_grad():
            model(tokens)
        for n, m in mine.items():
            model.set_submodule(n, m)
            # measured: equal to the last bit (the pipeline's block forwards and this one read the same windows)
            assert float(m.input_scale) == pytest.approx(amax[n] / FP8_MAX, rel=1e-6), n


def test_observers_clip_as_documented():
    x = torch.randn(100_000, generator=gen(2))
    x[7] = 1000.0  # one outlier
    obs = {k: InputObserver(k) for k in ("minmax", "mse", "percentile")}
    for o in obs.values():
        for part in x.split(30_000):  # batches
            o.update(part)
        o.reduce(Ranks())
    assert torch.equal(obs["minmax"].scale(), torch.tensor([1000.0]) / FP8_MAX)
    assert 3.5 / FP8_MAX < float(obs["percentile"].scale()) < 4.5 / FP8_MAX  # 99.99 % of N(0, 1) is 3.9
    # mse shrinks by at most 19 % (the grid), where clipping costs less than the finer grid gains; FP8's grid is
    # relative (a shrink gains only in its subnormals), so clipping the outlier costs more: it keeps max |x|
    assert torch.equal(obs["mse"].scale(), obs["minmax"].scale())
    assert float(InputObserver("mse").scale()) == torch.finfo(torch.float32).eps  # nothing seen


@pytest.mark.parametrize("stage", [BLOCK, STATIC], ids=["block", "static"])
def test_transformers_logits_on_the_artifact_are_quantkit_runtime_logits(tiny_llama, tmp_path, stage):
    """transformers + compressed-tensors fake-quantize each input (per group / on input_scale) and decompress the
    weights; quantkit's runtime emulates the FP8 layers: the same float32 arithmetic, measured bit-identical."""
    from transformers import AutoModelForCausalLM

    from quantkit import runtime

    _, folder = quantize(tiny_llama, tmp_path, "a", stage)
    ids = torch.randint(3, 500, (2, 24), generator=gen(3))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        ours = runtime.load(str(folder)).model(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)(ids).logits
    assert torch.equal(hf, ours)
    assert (ours - plain).abs().max() > 1e-3  # quantized (weights and inputs)
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    stored = split_by_module(load_file(folder / "model.safetensors"), compressed_tensors.marker(qcfg))
    q_proj = stored["model.layers.0.self_attn.q_proj"]
    if stage == BLOCK:
        assert {k: tuple(v.shape) for k, v in q_proj.items()} == {"weight": (64, 64), "weight_scale": (2, 2)}
    else:
        assert {k: tuple(v.shape) for k, v in q_proj.items()} == {"weight": (64, 64), "weight_scale": (1,),
                                                                 "input_scale": (1,)}


def test_new_fp8_tensors_round_trip_through_to_tensors():
    w = torch.randn(64, 96, generator=gen(4))
    static = fp8_quantize(w, per_tensor=True)
    static.input_scale = torch.tensor([0.25])
    for qt in (fp8_block_quantize(w, (32, 32)), static):
        back = QuantizedTensor.from_tensors(qt.to_tensors(), json.loads(json.dumps(qt.meta())))
        assert type(back) is type(qt) and torch.equal(back.dequantize(), qt.dequantize())
    assert isinstance(back, Fp8Weight) and torch.equal(back.input_scale, static.input_scale)
    assert isinstance(fp8_block_quantize(w, (32, 32)), Fp8BlockWeight)


@pytest.mark.slow  # three quantkit processes (~50 s on 2 busy cores)
@pytest.mark.parametrize("stage, tensor", [(STATIC, "input_scale"),
                                           ("gptq: {scheme: NVFP4}", "input_global_scale")])  # observed before GPTQ
def test_a_killed_static_run_resumes_with_its_input_scales(tmp_path, stage, tensor):
    """The scales of the blocks done before the kill come back from the checkpoint: the resumed artifact is the
    uninterrupted one byte for byte."""
    from tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "llama4", "llama", layers=4)
    whole = write_recipe(tmp_path / "whole.yaml", model, tmp_path / "whole", stage, ("compressed-tensors",))
    assert quantize_cli(whole).returncode == 0
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "out", stage, ("compressed-tensors",))
    assert quantize_cli(recipe, kill_after_block=1).returncode == -signal.SIGKILL
    assert json.loads(next((tmp_path / "out" / FOLDER).glob("*/state.json")).read_text())["done"] == 1
    resumed = quantize_cli(recipe)
    assert resumed.returncode == 0 and "resuming after block 2/4" in resumed.stderr, resumed.stderr
    got = safetensors_bytes(tmp_path / "out" / "compressed-tensors")
    assert got == safetensors_bytes(tmp_path / "whole" / "compressed-tensors")
    assert any(k.endswith(f"layers.0.self_attn.q_proj.{tensor}")
               for k in load_file(tmp_path / "out" / "compressed-tensors" / "model.safetensors"))


@pytest.mark.slow  # torchrun with 2 processes, and one more (~60 s on 2 busy cores)
@pytest.mark.parametrize("observer", ["minmax", "percentile"])
def test_two_ranks_write_the_one_process_static_artifact(tmp_path, observer):
    """The ranks' max |x| (reduced by max) and |x| histograms (by sum) are the one process's: same bytes."""
    from test_distributed import quantkit
    from tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama")
    stage = "rtn: {scheme: FP8, activations: {observer: %s}}" % observer
    for nproc in (1, 2):
        recipe = write_recipe(tmp_path / f"{nproc}.yaml", model, tmp_path / f"p{nproc}", stage, ("compressed-tensors",))
        run = quantkit("quantize", recipe, "--nproc", nproc)
        assert run.returncode == 0, run.stderr
    one, two = tmp_path / "p1" / "compressed-tensors", tmp_path / "p2" / "compressed-tensors"
    for f in ("model.safetensors", "config.json"):
        assert (one / f).read_bytes() == (two / f).read_bytes(), f


# ------------------------------------------------------------------------------- GPTQ on FP8 blocks
def test_gptq_on_fp8_blocks_is_rtn_without_correlations_and_beats_it_with_them():
    from quantkit.algorithms.gptq import GPTQ

    w = torch.randn(64, 128, generator=gen(6))
    spec = INT8_CHANNEL  # unused on the FP8 path
    rtn = fp8_block_quantize(w, (32, 32))
    alone, _ = GPTQ(torch.eye(128), spec, damp=1e-9, fp8_block=(32, 32)).quantize(w)  # nothing to compensate
    assert torch.equal(alone.weight.view(torch.uint8), rtn.weight.view(torch.uint8))
    assert torch.equal(alone.scale, rtn.scale)
    x = torch.randn(2048, 128, generator=gen(7)) @ torch.randn(128, 128, generator=gen(8))  # correlated inputs
    solved, loss = GPTQ(x.T @ x, spec, fp8_block=(32, 32)).quantize(w)
    assert torch.equal(solved.scale, rtn.scale)  # the blocks' scales come from the weight, fixed before the solve
    out_err = {k: float((x @ (q.dequantize() - w).T).norm()) for k, q in (("gptq", solved), ("rtn", rtn))}
    assert out_err["gptq"] < 0.8 * out_err["rtn"], out_err  # measured 0.69
    # several weights in one pass: each gets its own rows and blocks, bit for bit
    (a, _), (b, _) = GPTQ(x.T @ x, spec, fp8_block=(32, 32)).quantize_many([w[:32], w[32:]])
    one = [GPTQ(x.T @ x, spec, fp8_block=(32, 32)).quantize(part)[0] for part in (w[:32], w[32:])]
    assert all(torch.equal(p.weight.view(torch.uint8), q.weight.view(torch.uint8)) and torch.equal(p.scale, q.scale)
               for p, q in zip((a, b), one))


def test_gptq_fp8_block_artifact_loads_in_transformers_as_in_quantkit(tiny_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    from quantkit import runtime

    _, folder = quantize(tiny_llama, tmp_path, "g", BLOCK.replace("rtn:", "gptq:"))
    ids = torch.randint(3, 500, (2, 24), generator=gen(3))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        ours = runtime.load(str(folder)).model(ids).logits
    assert torch.equal(hf, ours)
    assert json.loads((folder / "quantkit.json").read_text())["recipe"]["stages"][0]["gptq"]["block"] == [32, 32]
