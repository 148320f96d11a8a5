import copy
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

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
    assert (g.bits, g.group_size, g.sym, g.act_order, g.damp, g.block_size, g.ignore) == (
        4, 64, True, False, 0.01, 128, ["lm_head"])
    assert (r.calibration.num_samples, r.calibration.seq_len, r.calibration.seed) == (128, 512, 0)
    assert r.dtype == "auto" and r.device == "auto"


@pytest.mark.parametrize("edit, expected", [
    (lambda d: d["stages"][0]["gptq"].update(bits=5), "stages.0.gptq.bits: Input should be 2, 3, 4 or 8 (got 5)"),
    (lambda d: d["stages"][0]["gptq"].update(group_size=48), "stages.0.gptq.group_size: Input should be -1, 32, 64, 128 or 256 (got 48)"),
    (lambda d: d["stages"][0].update(awq={}), "stages.0: unknown key 'awq' (accepted: gptq, rtn)"),
    (lambda d: d.update(modle="x"), "unknown key 'modle' (accepted: model, dtype, device, calibration, stages, export)"),
    (lambda d: d["stages"][0]["gptq"].update(damp=0), "stages.0.gptq.damp: Input should be greater than 0"),
    (lambda d: d["calibration"].update(num_samples="many"), "calibration.num_samples: Input should be a valid integer"),
    (lambda d: d.update(dtype="fp8"), "dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16' (got 'fp8')"),
    (lambda d: d["export"].update(formats=["awq"]), "export.formats.0: Input should be 'gptq' or 'compressed-tensors'"),
    (lambda d: d["stages"][0]["gptq"].update(bits=3), "stages.0.gptq.bits: 3 bits cannot be stored in compressed-tensors (it stores 4, 8)"),
    (lambda d: d.pop("calibration"), "calibration: required by the gptq stage"),
    (lambda d: d.pop("model"), "model: Field required"),
    (lambda d: d.update(stages=[]), "stages: List should have at least 1 item"),
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


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-300, 300) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)
field_names = st.sampled_from(["model", "dtype", "device", "calibration", "stages", "export", "gptq", "rtn",
                               "bits", "group_size", "formats", "output", "num_samples", "x"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(field_names, json_values, max_size=6))
def test_parser_only_ever_raises_one_line_validation_errors(data):
    try:
        parse_recipe(data, "fuzz.yaml")
    except QuantkitError as err:
        assert str(err).startswith("fuzz.yaml") and "\n" not in str(err)
