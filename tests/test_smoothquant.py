"""SmoothQuant + W8A8: the scale formula, folding that leaves the float model unchanged, the error it removes
from a block with outlier channels, and `quantkit quantize` of W8A8 int8 (with and without SmoothQuant) and
FP8 recipes, read back by quantkit's runtime as Int8Linear / Fp8Linear layers and by plain transformers."""

import json

import pytest
import torch
import yaml
from torch import nn

from conftest import run_cli, write_recipe
from quantkit import runtime
from quantkit.quantize import calibration, pipeline, smoothquant_pass
from quantkit.algorithms.grid import INT8_CHANNEL
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.algorithms.smoothquant import MIN_SCALE, channel_absmax, smoothing_scale
from quantkit.families.mappings import norm_mappings
from quantkit.errors import QuantkitError
from quantkit.kernels.w8a8 import Fp8Linear, Int8Linear, fake_quantize_tokens, swap_w8a8_linears
from quantkit.model import decoder_blocks, load_model
from quantkit.progress import Reporter
from quantkit.recipe import SmoothQuant, load_recipe
from tiny_models import add_outliers, save_with_outliers, tiny_config

SMOOTHED = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny tensors, one CPU thread


def gen(seed):
    return torch.Generator().manual_seed(seed)




def tiny_llama_model(outliers: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", 512), dtype=torch.float32).eval()
    return add_outliers(model, 50.0) if outliers else model


def block0_call(model: nn.Module, ids: torch.Tensor):
    """Block 0 of model with its input and call arguments, and a function giving its output."""
    block = decoder_blocks(model)[1][0]
    seen = {}
    handle = block.register_forward_hook(lambda m, a, kw, out: seen.update(args=a, kw=kw), with_kwargs=True)
    with torch.no_grad():
        model(ids)
    handle.remove()

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = block(*seen["args"], **seen["kw"])
        return out[0] if isinstance(out, tuple) else out

    return block, seen["args"][0], run


def smooth(sq: smoothquant_pass.SmoothQuantPass, i: int, block: nn.Module, run) -> None:
    handles = sq.observe(i, block)
    run()
    for h in handles:
        h.remove()
    assert sq.apply(i, block) == []


# ------------------------------------------------------------------------------------------------ math
def test_scale_formula_dead_columns_and_floor():
    x = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -0.25, 1.0, 0.0], [0.5, 0.5, 2.0, 0.0]])
    w2 = torch.tensor([[-2.0, 0.1, 0.0, 0.0]])
    s = smoothing_scale(x, [w1, w2], alpha=0.5)
    # max|W| over the concatenated rows: [2, 0.5, 2, 0]; column 3 is dead, so it keeps the activation max
    torch.testing.assert_close(s, torch.tensor([2 / 2**0.5, 1 / 0.5**0.5, MIN_SCALE, 9.0]))
    big = torch.randn(3, 100, 32, generator=gen(0))
    assert torch.equal(channel_absmax(big, chunk=7), big.abs().reshape(-1, 32).amax(0))


def test_only_norm_mappings_are_smoothed():
    model = tiny_llama_model(outliers=False)
    mappings, notes = norm_mappings(decoder_blocks(model)[1][0])
    assert [(m.prev_name, m.names) for m in mappings] == [
        ("input_layernorm", SMOOTHED[:3]), ("post_attention_layernorm", SMOOTHED[3:])]
    assert notes == []  # GQA's skipped v_proj -> o_proj is AWQ's business, not reported here
    blocks = decoder_blocks(model)[1]
    sq = smoothquant_pass.SmoothQuantPass(SmoothQuant(ignore=["model.layers.1.post_attention_layernorm"]),
                                    "stages.0.smoothquant", "model.layers", blocks)
    assert [len(m) for m in sq.mappings] == [2, 1]
    with pytest.raises(QuantkitError, match=r"^stages.0.smoothquant.ignore: every norm -> Linear mapping is "
                                            r"ignored; nothing to smooth$"):
        smoothquant_pass.SmoothQuantPass(SmoothQuant(ignore=["re:.*norm"]), "stages.0.smoothquant", "model.layers", blocks)


def test_opt_mappings_and_an_unsmoothable_architecture_is_refused_up_front():
    from transformers import AutoConfig, AutoModelForCausalLM

    opt = AutoModelForCausalLM.from_config(tiny_config("opt", 512))
    mappings, _ = norm_mappings(decoder_blocks(opt)[1][0])
    assert [(m.prev_name, m.names) for m in mappings] == [
        ("self_attn_layer_norm", SMOOTHED[:3]), ("final_layer_norm", ["fc1"])]
    # a norm class quantkit does not know may not compute weight * normalize(x): never folded into
    class ScaledTanhNorm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            return torch.tanh(x) * self.weight

    cfg = AutoConfig.for_model("llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2)
    odd = AutoModelForCausalLM.from_config(cfg)
    layer = odd.model.layers[0]
    layer.input_layernorm, layer.post_attention_layernorm = ScaledTanhNorm(32), ScaledTanhNorm(32)
    with pytest.raises(QuantkitError, match=r"^stages.0.smoothquant: no norm -> Linear pair to smooth in "
                                            r"LlamaDecoderLayer \(.*ScaledTanhNorm is not known to compute weight"):
        smoothquant_pass.SmoothQuantPass(SmoothQuant(), "stages.0.smoothquant", "model.layers", decoder_blocks(odd)[1])


# ------------------------------------------------------------------------------------------- folding
@pytest.mark.parametrize("outliers", [False, True])
def test_folding_leaves_the_float_model_unchanged(outliers):
    model = tiny_llama_model(outliers)
    ids = torch.randint(0, 512, (2, 32), generator=gen(1))
    with torch.no_grad():
        ref = model(ids).logits
    blocks = decoder_blocks(model)[1]
    norms = [b.input_layernorm.weight.clone() for b in blocks]
    sq = smoothquant_pass.SmoothQuantPass(SmoothQuant(alpha=0.8), "stages.0.smoothquant", "model.layers", blocks)
    for i, block in enumerate(blocks):
        smooth(sq, i, block, lambda: model(ids))
    assert sq.smoothed == 4
    assert all(not torch.allclose(b.input_layernorm.weight, n) for b, n in zip(blocks, norms))  # it did fold
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)  # measured 2.7e-6 with outliers


def test_inline_smoothing_folds_the_same_scales_without_a_forward_of_its_own():
    """SmoothQuant right before gptq smooths inside gptq's forward: the Linears read x / s as the forward runs,
    the float function stays the same and the scales equal observe() / apply()'s."""
    ids = torch.randint(0, 512, (2, 32), generator=gen(1))
    separate, inline = tiny_llama_model(True), tiny_llama_model(True)
    with torch.no_grad():
        ref = separate(ids).logits
    passes = [smoothquant_pass.SmoothQuantPass(SmoothQuant(alpha=0.8), "stages.0.smoothquant", "model.layers",
                                         decoder_blocks(m)[1]) for m in (separate, inline)]
    for i, (a, b) in enumerate(zip(decoder_blocks(separate)[1], decoder_blocks(inline)[1])):
        smooth(passes[0], i, a, lambda: separate(ids))
        handles, warnings = passes[1].inline(i, b)
        with torch.no_grad():
            out = inline(ids).logits  # block i reads x / s while its scales are folded
        for h in handles:
            h.remove()
        assert warnings() == []
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            torch.testing.assert_close(getattr(b, norm).weight, getattr(a, norm).weight, rtol=1e-5, atol=1e-6)
    assert passes[1].smoothed == passes[0].smoothed == 4
    handles, warnings = passes[1].inline(0, decoder_blocks(inline)[1][0])  # hooks in place, never run
    for h in handles:
        h.remove()
    assert warnings() == [f"model.layers.0.{n} was not reached by calibration data; left unsmoothed"
                          for n in ("input_layernorm", "post_attention_layernorm")]


# ---------------------------------------------------------------------------------------------- error
def w8a8_block_errors(smoothed: bool) -> dict[str, float]:
    """Relative errors, against the float block, of block 0 of a tiny llama with outlier channels: its
    residual update with only the Linears' inputs quantized per token (int8), with W8A8 int8 layers, and
    each W8A8 Linear's own output."""
    model = tiny_llama_model(outliers=True)
    block, x, run = block0_call(model, torch.randint(0, 512, (4, 64), generator=gen(2)))
    names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear)]
    inputs, outputs = {}, {}
    hooks = [block.get_submodule(n).register_forward_hook(
        lambda m, a, out, n=n: outputs.__setitem__(n, out.detach())) for n in names]
    ref = run() - x
    for h in hooks:
        h.remove()
    if smoothed:
        smooth(smoothquant_pass.SmoothQuantPass(SmoothQuant(alpha=0.8), "stages.0.smoothquant", "model.layers",
                                          decoder_blocks(model)[1]), 0, block, run)
    hooks = [block.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: inputs.__setitem__(n, a[0].detach())) for n in names]
    torch.testing.assert_close(run() - x, ref, rtol=0, atol=1e-5)  # same float block
    for h in hooks:
        h.remove()
    hooks = [block.get_submodule(n).register_forward_pre_hook(lambda m, a: (fake_quantize_tokens(a[0], "int8"),))
             for n in names]
    errors = {"activations": float((run() - x - ref).norm() / ref.norm())}
    for h in hooks:
        h.remove()
    swap_w8a8_linears(block, {n: rtn_quantize(block.get_submodule(n).weight.detach(), INT8_CHANNEL) for n in names})
    errors["w8a8"] = float((run() - x - ref).norm() / ref.norm())
    for n in names:
        with torch.no_grad():
            errors[n] = float((block.get_submodule(n)(inputs[n]) - outputs[n]).norm() / outputs[n].norm())
    return errors


def test_smoothquant_removes_most_of_the_outlier_error():
    plain, smoothed = w8a8_block_errors(False), w8a8_block_errors(True)
    ratio = {k: smoothed[k] / plain[k] for k in plain}
    # int8 tokens alone: measured 0.0369 -> 0.0155 (0.42x)
    assert ratio["activations"] < 0.55, (plain, smoothed)
    # int8 weights and tokens: 0.0405 -> 0.0274 (0.68x); o_proj / down_proj read unsmoothed inputs
    assert ratio["w8a8"] < 0.8, (plain, smoothed)
    for name in SMOOTHED:  # measured 0.50x .. 0.58x (e.g. k_proj 0.0172 -> 0.0086, q_proj 0.0151 -> 0.0088)
        assert ratio[name] < 0.65, (name, plain[name], smoothed[name])
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert abs(ratio[name] - 1) < 0.05, (name, plain[name], smoothed[name])


# ---------------------------------------------------------------------------------------- end to end
INT8 = "{bits: 8, group_size: -1, activations: {type: int}}"
RECIPES = {
    "sq-int8": ["smoothquant: {alpha: 0.8}", f"gptq: {INT8}"],
    "int8": [f"gptq: {INT8}"],
    "fp8": ["rtn: {bits: 8, group_size: -1, type: float, activations: {type: float}}"],
}


@pytest.fixture(scope="module")
def outlier_llama(tiny_llama, tmp_path_factory):
    """tests/tiny_models.py's llama with outlier channels in every norm, as an HF folder."""
    return save_with_outliers(tiny_llama, tmp_path_factory.mktemp("outlier") / "llama", 50.0)


@pytest.fixture(scope="module")
def w8a8_artifacts(outlier_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("w8a8")
    mp = pytest.MonkeyPatch()
    for name, stages in RECIPES.items():
        recipe = write_recipe(out / f"{name}.yaml", outlier_llama, out / name, stages[0],
                              formats=("compressed-tensors",))
        recipe.write_text(recipe.read_text().replace(f"  - {stages[0]}\n", "".join(f"  - {s}\n" for s in stages)))
        assert run_cli(mp, "quantize", recipe, "--quiet") == 0
    mp.undo()
    return out


def in_memory(recipe_path):
    """The same recipe run by the pipeline in this process, with its W8A8 layers swapped in."""
    recipe = load_recipe(recipe_path)
    loaded = load_model(recipe.model, recipe.dtype)
    calib = calibration.build(loaded.tokenizer, recipe.calibration) if recipe.needs_calibration else None
    result = pipeline.quantize(loaded.model, recipe.stage, calib, torch.device("cpu"), recipe.export.formats,
                               Reporter(quiet=True), recipe.transforms)
    swap_w8a8_linears(loaded.model, result.qweights)
    return loaded.model, result


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")  # dequantize=True on a quantized folder
@pytest.mark.parametrize("name", list(RECIPES))
def test_w8a8_artifact_runs_the_same_in_quantkit_and_transformers(w8a8_artifacts, name):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    folder = w8a8_artifacts / name / "compressed-tensors"
    act = "fp8" if name == "fp8" else "int8"
    qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == ("float-quantized" if act == "fp8" else "int-quantized")
    manifest = json.loads((folder / "quantkit.json").read_text())
    stages = [k for s in manifest["recipe"]["stages"] for k, v in s.items() if v is not None]
    assert stages == [s.split(":")[0] for s in RECIPES[name]]

    ours = runtime.load(str(folder)).model
    kind = Fp8Linear if act == "fp8" else Int8Linear
    layers = {n: type(m) for n, m in ours.named_modules() if isinstance(m, (nn.Linear, Int8Linear, Fp8Linear))}
    assert sum(t is kind for t in layers.values()) == 14 and layers["lm_head"] is nn.Linear
    memory, result = in_memory(w8a8_artifacts / f"{name}.yaml")
    assert result.info.activations == act and result.info.method == "+".join(s.split(":")[0] for s in RECIPES[name])
    ids = torch.randint(3, 500, (2, 40), generator=gen(3))
    with torch.no_grad():
        got = ours(ids).logits
        assert torch.equal(got, memory(ids).logits)  # the artifact is exactly the in-memory quantized model
        hf = AutoModelForCausalLM.from_pretrained(folder)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(folder, quantization_config=CompressedTensorsConfig(
            dequantize=True))(ids).logits
    # transformers fake-quantizes tokens on compressed-tensors' grid (tests/test_w8a8.py): FP8 is vLLM's grid,
    # int8 divides amax by 127.5 instead of vLLM's 127, an error of the same size as the quantization itself
    noise = float((hf - plain).abs().max())
    assert noise > 1e-3  # activations really are quantized: measured 0.032 sq-int8, 0.080 int8, 0.135 fp8
    if act == "fp8":
        torch.testing.assert_close(got, hf, rtol=0, atol=1e-5)
    else:
        assert 0 < float((got - hf).abs().max()) < 3 * noise  # measured 1.6x (sq-int8), 1.5x (int8)


def test_smoothquant_artifact_folds_into_the_norms_and_is_closer_to_the_original(outlier_llama, w8a8_artifacts):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(outlier_llama, dtype=torch.float32).eval()
    sq, plain = (runtime.load(str(w8a8_artifacts / n / "compressed-tensors")).model for n in ("sq-int8", "int8"))
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(plain.state_dict()[norm], original.state_dict()[norm])
    assert not torch.allclose(sq.state_dict()[norm], original.state_dict()[norm])
    ids = torch.randint(3, 500, (4, 64), generator=gen(4))
    with torch.no_grad():
        ref = original(ids).logits
        err = {n: float((m(ids).logits - ref).norm() / ref.norm()) for n, m in (("sq", sq), ("plain", plain))}
    assert err["sq"] < 0.8 * err["plain"], err  # measured 0.056 vs 0.092 (0.61x)


def test_pipeline_smooths_inside_the_gptq_forward(w8a8_artifacts):
    _, result = in_memory(w8a8_artifacts / "sq-int8.yaml")
    assert "smoothquant" not in result.timings and result.timings["forward+quantize"] > 0  # no float forward


def test_recipe_errors_reach_the_cli_as_one_line(tiny_llama, tmp_path, monkeypatch, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", f"gptq: {INT8}")
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"error: {recipe}: export.formats: gptq stores weight-only quantization; W8A8 (activations) "
                   "is written as compressed-tensors only")
    assert not (tmp_path / "o").exists()
    data = yaml.safe_load(recipe.read_text())
    data["stages"] = [{"smoothquant": {}}, {"gptq": {"bits": 4, "group_size": 32}}, {"smoothquant": {}}]
    recipe.write_text(yaml.safe_dump(data))
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: {recipe}: stages.2.smoothquant: transform stages go before the weight stage (stages.1.gptq)")
