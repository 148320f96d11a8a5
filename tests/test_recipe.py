import copy
import subprocess
import sys

import pytest
import yaml

from quantkit.errors import QuantkitError
from quantkit.recipe import load_recipe, parse_recipe

BASE = {
    "model": "m",
    "calibration": {"dataset": "wikitext2"},
    "stages": [{"gptq": {"bits": 4, "group_size": 64}}],
    "export": {"output": "o", "formats": ["gptq", "compressed-tensors"]},
}


def test_defaults_follow_the_contract():
    r = parse_recipe(copy.deepcopy(BASE))
    g = r.stage.gptq
    assert (g.bits, g.group_size, g.sym, g.act_order, g.damp, g.block_size, g.hessian_dtype, g.ignore) == (
        4, 64, True, False, 0.01, 128, "float32", ["lm_head"])
    assert (r.calibration.num_samples, r.calibration.seq_len, r.calibration.seed) == (128, 512, 0)
    assert r.dtype == "auto" and r.device == "auto"


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d["stages"][0]["gptq"].update(bits=5), "stages.0.gptq.bits: Input should be 2, 3, 4 or 8 (got 5)"),
    (lambda d: d["stages"][0]["gptq"].update(group_size=48), "stages.0.gptq.group_size: Input should be -1, 16, 32, 64, 128 or 256 (got 48)"),
    (lambda d: d["stages"][0].update(awq={}), "stages.0: a stage is exactly one of: gptq, rtn, smoothquant, awq"),
    (lambda d: d["stages"][0].update(fp4={}), "stages.0: unknown key 'fp4' (accepted: gptq, rtn, smoothquant, awq)"),
    (lambda d: d.update(modle="x"), "unknown key 'modle' (accepted: model, dtype, device, load, calibration, moe, stages, overrides, kv_cache, export, release, gates)"),
    (lambda d: d["stages"][0]["gptq"].update(damp=0), "stages.0.gptq.damp: Input should be greater than 0"),
    (lambda d: d["stages"][0]["gptq"].update(hessian_dtype="float16"),
     "stages.0.gptq.hessian_dtype: Input should be 'float32' or 'bfloat16' (got 'float16')"),
    (lambda d: d["calibration"].update(num_samples="many"), "calibration.num_samples: Input should be a valid integer"),
    (lambda d: d.update(dtype="fp8"), "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16' (got 'fp8')"),
    (lambda d: d["export"].update(formats=["marlin"]),
     "export.formats.0: Input should be 'gptq', 'compressed-tensors' or 'awq'"),
    (lambda d: (d["stages"][0]["gptq"].update(bits=3), d["export"].update(formats=["compressed-tensors", "awq"])),
     "stages.0.gptq.bits: 3 bits cannot be stored in awq (it stores 4)"),
    (lambda d: d.pop("calibration"), "calibration: required by the gptq stage"),
    (lambda d: d.pop("model"), "model: Field required"),
    (lambda d: d.update(stages=[]), "stages: List should have at least 1 item"),
    (lambda d: d.update(moe={"calibrate_all": True}),
     "moe: unknown key 'calibrate_all' (accepted: calibrate_all_experts, min_tokens)"),
    (lambda d: d.update(moe={"min_tokens": 0}), "moe.min_tokens: Input should be greater than or equal to 1"),
])
def test_bad_recipes_name_the_field(edit, expected):
    d = copy.deepcopy(BASE)
    edit(d)
    with pytest.raises(QuantkitError) as err:
        parse_recipe(d, "r.yaml")
    assert str(err.value).startswith("r.yaml: ")
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_rtn_needs_no_calibration_and_3_bit_gptq_format_is_fine():
    d = copy.deepcopy(BASE)
    d.pop("calibration")
    d["stages"] = [{"rtn": {"bits": 3, "group_size": 64}}]
    d["export"]["formats"] = ["gptq"]
    assert parse_recipe(d).stage.name == "rtn"


W8A8 = {"bits": 8, "group_size": -1, "activations": {"type": "int"}}


def w8a8(*stages, formats=("compressed-tensors",)):
    return dict(copy.deepcopy(BASE), stages=list(stages), export={"output": "o", "formats": list(formats)})


def test_transform_stages_then_one_weight_stage():
    r = parse_recipe(w8a8({"smoothquant": {}}, {"gptq": W8A8}))
    assert [s.name for s in r.transforms] == ["smoothquant"] and r.stage.name == "gptq"
    assert (r.transforms[0].smoothquant.alpha, r.transforms[0].smoothquant.ignore) == (0.8, [])
    act = r.stage.gptq.activations
    assert (act.bits, act.type, act.dynamic, act.strategy, act.kind) == (8, "int", True, "token", "int8")
    assert r.needs_calibration
    fp8 = {"rtn": dict(W8A8, type="float", activations={"type": "float"})}
    r = parse_recipe(dict(w8a8(fp8), calibration=None))  # FP8 RTN needs no data
    assert r.stage.rtn.activations.kind == "fp8" and not r.transforms and not r.needs_calibration
    assert parse_recipe(w8a8({"smoothquant": {"alpha": 0.5}}, {"rtn": W8A8})).transforms[0].args.alpha == 0.5


@pytest.mark.parametrize("stages, edit, expected", [
    ([{"gptq": W8A8}, {"smoothquant": {}}], None,
     "stages.1.smoothquant: transform stages go before the weight stage (stages.0.gptq)"),
    ([{"smoothquant": {}}], None, "stages: the last stage quantizes the weights (gptq, rtn, awq); smoothquant only "
                                  "transforms them"),
    ([{"gptq": W8A8}, {"rtn": W8A8}], None, "stages.0.gptq: one weight-quantizing stage per recipe, the last one "
                                            "(stages.1 is rtn); only smoothquant, awq may come before it"),
    ([{"smoothquant": {}}, {"rtn": W8A8}], lambda d: d.pop("calibration"),
     "calibration: required by the smoothquant stage"),
    ([{"smoothquant": {"alpha": 1}}, {"gptq": W8A8}], None,
     "stages.0.smoothquant.alpha: Input should be less than 1 (got 1)"),
    ([{"smoothquant": {"alpha": 0}}, {"gptq": W8A8}], None,
     "stages.0.smoothquant.alpha: Input should be greater than 0 (got 0)"),
    ([{"smoothquant": {}, "gptq": W8A8}], None, "stages.0: a stage is exactly one of: gptq, rtn, smoothquant, awq"),
    ([{"gptq": dict(W8A8, bits=4)}], None, "stages.0.gptq.bits: W8A8 (activations) needs 8-bit weights: bits: 8"),
    ([{"smoothquant": {}}, {"gptq": dict(W8A8, group_size=64)}], None,
     "stages.1.gptq.group_size: W8A8 (activations) needs one scale per output channel: group_size: -1"),
    ([{"rtn": dict(W8A8, sym=False)}], None,
     "stages.0.rtn.sym: W8A8 (activations) needs symmetric weights, the only ones vLLM runs: sym: true"),
    ([{"gptq": dict(W8A8, activations={"bits": 4})}], None,
     "stages.0.gptq: activations.bits: 4-bit inputs are fp4 (NVFP4, MXFP4), other types 8-bit"),
    ([{"gptq": dict(W8A8, activations={"strategy": "tensor"})}], None,
     "stages.0.gptq.activations.strategy: tensor is for FP8 activations (type: float); int8 ones are per token"),
    ([{"gptq": dict(W8A8, activations={"strategy": "channel"})}], None,
     "stages.0.gptq.activations.strategy: Input should be 'token', 'group' or 'tensor' (got 'channel')"),
    ([{"rtn": {"scheme": "FP8", "activations": {"dynamic": True}}}], None,
     "stages.0.rtn.activations.dynamic: false for strategy: tensor (static inputs have one scale per tensor, "
     "calibrated)"),
    ([{"rtn": {"scheme": "FP8_BLOCK", "activations": {"group_size": None}}}], None,
     "stages.0.rtn.activations.group_size: needed by strategy: group, and only by it"),
    ([{"rtn": {"scheme": "FP8_BLOCK", "activations": {"strategy": "tensor", "dynamic": False, "group_size": None}}}],
     None, "stages.0.rtn.activations.strategy: FP8 block weights take inputs per group of columns (strategy: group) and "
           "only they do; got strategy: tensor with block"),
    ([{"rtn": {"scheme": "FP8_DYNAMIC", "activations": {"strategy": "group", "group_size": 128}}}], None,
     "stages.0.rtn.activations.strategy: FP8 block weights take inputs per group of columns (strategy: group) and "
     "only they do; got strategy: group without block"),
    ([{"rtn": {"scheme": "FP8_BLOCK", "per_tensor": True}}], None,
     "stages.0.rtn.per_tensor: one scale per tensor or per block (block), not both"),
    ([{"rtn": {"block": [64, 64]}}], None, "stages.0.rtn.block: FP8 weights only (type: float)"),
    ([{"rtn": {"scheme": "FP8_BLOCK", "block": [0, 64]}}], None,
     "stages.0.rtn.block.0: Input should be greater than or equal to 1 (got 0)"),
    ([{"rtn": {"scheme": "NVFP5"}}], None,
     "stages.0.rtn.scheme: unknown preset 'NVFP5' (known: W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, FP8, "
     "FP8_BLOCK, W4AFP8, NVFP4A16, NVFP4, MXFP4A16, MXFP4, MXFP8A16, MXFP8) (got 'NVFP5')"),
    ([{"rtn": {"scheme": "FP8"}}], lambda d: d.pop("calibration"), "calibration: required by the rtn stage"),
    ([{"rtn": dict(W8A8, activations={"type": "float"})}], None,
     "stages.0.rtn.activations.type: float activations need float weights (type: float), got type: int"),
    ([{"rtn": dict(W8A8, type="float")}], None,
     "stages.0.rtn.activations.type: int activations need int weights (type: int), got type: float"),
    ([{"gptq": dict(W8A8, type="float", activations={"type": "float"})}], None,
     "stages.0.gptq.type: float (FP8) weights are solved on blocks only (block: [rows, cols], FP8_BLOCK); "
     "per-channel or per-tensor FP8 is rounded to nearest: use rtn with type: float"),
    ([{"gptq": {"scheme": "FP8_BLOCK", "act_order": True}}], None,
     "stages.0.gptq.act_order: FP8 block weights are solved in column order; act_order: false"),
    ([{"gptq": {"scheme": "FP8_BLOCK", "activations": {"strategy": "tensor", "dynamic": False, "group_size": None}}}],
     None, "stages.0.gptq.activations.dynamic: static input scales are calibrated after rounding to nearest; use rtn "
           "(or dynamic inputs)"),
    ([{"rtn": {"bits": 4, "group_size": -1, "type": "float"}}], None,
     "stages.0.rtn.bits: float (FP8) weights need bits: 8 (FP8 e4m3 is 8 bits)"),
    ([{"rtn": {"bits": 8, "group_size": 64, "type": "float"}}], None,
     "stages.0.rtn.group_size: float (FP8) weights need group_size: -1 (one scale per output channel, tensor or "
     "block)"),
    ([{"rtn": {"bits": 8, "group_size": -1, "type": "float"}}], None,
     "stages.0.rtn.activations: float (FP8) weights are written as W8A8 only; add activations: {type: float}"),
    ([{"gptq": W8A8}], lambda d: d["export"].update(formats=["gptq", "compressed-tensors"]),
     "export.formats: gptq stores weight-only quantization; W8A8 (activations) is written as compressed-tensors only"),
])
def test_bad_stage_lists_and_w8a8_settings_name_the_field(stages, edit, expected):
    d = w8a8(*copy.deepcopy(stages))
    if edit:
        edit(d)
    with pytest.raises(QuantkitError) as err:
        parse_recipe(d, "r.yaml")
    assert str(err.value) == f"r.yaml: {expected}"


def test_yaml_errors_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nstages: [\n")
    with pytest.raises(QuantkitError, match=r"bad.yaml: line \d+ invalid YAML"):
        load_recipe(bad)
    with pytest.raises(QuantkitError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")


def test_cli_reports_one_line_and_exit_code_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(dict(BASE, stages=[{"gptq": {"bits": 7}}])))
    proc = subprocess.run([sys.executable, "-m", "quantkit.cli", "quantize", str(recipe)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {recipe}: stages.0.gptq.bits: Input should be 2, 3, 4 or 8 (got 7)"
    assert "Traceback" not in proc.stderr


def test_demo_recipe_is_the_shipped_one_on_fewer_windows():
    """`make demo` quantizes recipes/smollm2-135m-gptq-w4a16-demo.yaml: only its calibration size and its output
    folder may differ from the shipped recipe's."""
    from pathlib import Path

    recipes = Path(__file__).parent.parent / "recipes"
    shipped = load_recipe(recipes / "smollm2-135m-gptq-w4a16.yaml").model_dump()
    demo = load_recipe(recipes / "smollm2-135m-gptq-w4a16-demo.yaml").model_dump()
    assert demo["calibration"]["num_samples"] < shipped["calibration"]["num_samples"]
    assert demo["export"]["output"] != shipped["export"]["output"]
    for r in (shipped, demo):
        del r["calibration"]["num_samples"], r["export"]["output"]
    assert demo == shipped
