"""The method seam from outside: a weight method registered here, in the test file, without editing quantkit, is
accepted by the recipe, run by `quantkit quantize`, exported, read back by the runtime bit for bit and evaluated.

The toy method, `rtn_floor`: RTN's grid (scale and zero from the observer), but each code is floor(w / scale +
offset) instead of round-to-nearest, so with offset < 0.5 it rounds down more often than RTN does.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, write_recipe
from pydantic import Field
from transformers import AutoModelForCausalLM

from quantkit import recipe, runtime
from quantkit.algorithms.grid import OBSERVERS, SCALE_DTYPE, GridSpec, QuantizedWeight
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.methods import METHODS, Method, register
from quantkit.methods.config import WeightQuant

SPEC = GridSpec(4, 32, True)
STAGE = "rtn_floor: {bits: 4, group_size: 32}"


class RTNFloor(WeightQuant):
    offset: float = Field(0.25, ge=0, lt=1)  # added before the floor; 0.5 would be round half up


def floor_quantize(weight: torch.Tensor, spec: GridSpec, offset: float, observer: str) -> QuantizedWeight:
    out, cols = weight.shape
    w = weight.float().reshape(-1, spec.span(cols))  # one row per (output row, group)
    scale, zero = OBSERVERS[observer](w, spec)
    codes = (w / scale[:, None] + offset).floor_().add_(zero[:, None]).clamp_(0, spec.maxq)
    groups = spec.groups(cols)
    return QuantizedWeight(codes=codes.to(torch.uint8).reshape(out, cols),
                           scale=scale.reshape(out, groups).to(SCALE_DTYPE),
                           zero=zero.reshape(out, groups).to(torch.uint8), spec=spec)


class RTNFloorMethod(Method):
    key = "rtn_floor"
    config = RTNFloor
    weight = True
    calibrated = False

    def round(self, module, args, spec):
        qw = floor_quantize(module.weight.data, spec, args.offset, args.observer)
        deq = qw.dequantize(module.weight.dtype)
        loss = float((deq.double() - module.weight.data.double()).square().mean())
        module.weight.data = deq
        return qw, loss


def unregister() -> None:
    METHODS.pop("rtn_floor", None)
    recipe._recipe_model.cache_clear()  # drops the models built with the extension


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    """rtn_floor W4 g32 in compressed-tensors and gptq, and plain RTN on the same grid to compare with."""
    mp = pytest.MonkeyPatch()
    register(RTNFloorMethod())
    try:
        root = tmp_path_factory.mktemp("rtn_floor")
        for name, stage in (("floor", STAGE), ("rtn", "rtn: {bits: 4, group_size: 32}")):
            r = write_recipe(root / f"{name}.yaml", tiny_llama, root / name, stage,
                             formats=("compressed-tensors", "gptq"))
            assert run_cli(mp, "quantize", r, "--quiet") == 0
        yield root
    finally:
        mp.undo()
        unregister()


def test_runtime_reads_the_methods_own_result_bit_exact(quantized, tiny_llama):
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
    linears = {n: m.weight.data for n, m in base.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 14  # 7 per block, 2 blocks
    # the extension is written where used only: RTN's record is the same as without it
    stages = {name: json.loads((quantized / name / "gptq" / "quantkit.json").read_text())["recipe"]["stages"][0]
              for name in ("floor", "rtn")}
    assert list(stages["rtn"]) == ["gptq", "rtn", "smoothquant", "awq"]
    assert stages["floor"]["rtn_floor"] == RTNFloor(bits=4, group_size=32).model_dump()
    rtn = runtime.load(str(quantized / "rtn" / "compressed-tensors"), dtype="float32").model.state_dict()
    for fmt in ("compressed-tensors", "gptq"):
        got = runtime.load(str(quantized / "floor" / fmt), dtype="float32").model.state_dict()
        for name, w in linears.items():
            key = f"model.layers.{name}.weight"
            want = floor_quantize(w, SPEC, 0.25, "minmax").dequantize(torch.float32)
            assert torch.equal(got[key], want), (fmt, key)
            assert torch.equal(rtn[key], rtn_quantize(w, SPEC).dequantize(torch.float32)), key
            assert not torch.equal(got[key], rtn[key]), key  # another rounding: other codes


def test_eval_runs_on_it(quantized, monkeypatch):
    ppl = {}
    for name in ("floor", "rtn"):
        out = quantized / f"eval-{name}.json"
        assert run_cli(monkeypatch, "eval", quantized / name / "compressed-tensors", "--seq-len", 64,
                       "--max-tokens", 256, "--quiet", "--json", out) == 0
        ppl[name] = json.loads(out.read_text())["ppl"]["model"]
    assert all(1 < p < 1e4 for p in ppl.values()), ppl
    assert ppl["floor"] != ppl["rtn"]
    assert ppl["floor"] < 1.5 * ppl["rtn"], ppl  # a biased rounding on the same grid: a little worse at most


def test_an_unregistered_method_is_an_unknown_key(quantized, tiny_llama, tmp_path, monkeypatch, capsys):
    # rtn_floor once its registration is removed (the module fixture keeps it until the last test), and a key never
    # registered: the error of a recipe without extensions, the kinds listed as at import
    unregister()
    try:
        for stage in (STAGE, "rtn_ceil: {bits: 4}"):
            r = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "q", stage)
            assert run_cli(monkeypatch, "quantize", r, "--quiet") != 0
            err = capsys.readouterr().err
            key = stage.split(":")[0]
            assert f"stages.0: unknown key '{key}' (accepted: gptq, rtn, smoothquant, awq)" in err
            assert len(err.strip().splitlines()) == 1, err
    finally:
        register(RTNFloorMethod())  # the fixture's teardown removes it again


class NoopFold(WeightQuant):
    pass


class NoopFoldMethod(Method):
    """A transform method registered without a block pass (quantize.transforms.transform_pass)."""

    key = "noop_fold"
    config = NoopFold
    transform = True


def test_a_transform_method_without_a_block_pass_is_refused_before_any_work(tiny_llama, tmp_path, monkeypatch,
                                                                            capsys):
    register(NoopFoldMethod())
    try:
        r = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "q", "noop_fold: {}\n  - rtn: {bits: 4}")
        assert run_cli(monkeypatch, "quantize", r, "--quiet") == 2
        err = capsys.readouterr().err
        assert err == ("error: stages.0.noop_fold: a transform method needs a block pass registered with "
                       "quantize.transforms.transform_pass for NoopFold\n")
        assert not (tmp_path / "q").exists()
    finally:
        METHODS.pop("noop_fold", None)
        recipe._recipe_model.cache_clear()
