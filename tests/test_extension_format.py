"""The scheme and format seams from outside: a format registered here, in the test file, without editing quantkit,
is written by `quantkit quantize`, checked by `quantkit verify`, read back by the runtime bit for bit and evaluated;
a result kind defined here survives the resume checkpoint.

The toy layout, `toy-rows`: each quantized Linear stored unpacked, one byte per code, row-major as the pipeline's
QuantizedWeight holds it (`<m>.codes` uint8 [out, in], `<m>.scales` fp16 [out, groups], `<m>.zeros` uint8
[out, groups]); no loader but quantkit reads it.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli, write_recipe

from quantkit import runtime
from quantkit.algorithms.grid import GridSpec, QuantizedWeight
from quantkit.algorithms.rtn import rtn_quantize
from quantkit.algorithms.scheme import QuantizedTensor, Scheme
from quantkit.export import formats
from quantkit.export.base import Encoded
from quantkit.export.layout import F16, Layout, Part
from quantkit.export.registry import FORMATS

U8 = (torch.uint8,)


class ToyRows(formats.Format):
    name = "toy-rows"
    bits = (4, 8)
    loaders = [("quantkit", "quantkit eval {path}")]

    def packed_dims(self, out: int, cols: int) -> dict[str, int]:
        return {}  # one byte per code: nothing to pack

    def encode(self, qweights, info, dtype) -> Encoded:
        self.require_weight_only(info)
        tensors = {}
        for name, qw in qweights.items():
            tensors |= {f"{name}.codes": qw.codes.contiguous(), f"{name}.scales": qw.scale.contiguous(),
                        f"{name}.zeros": qw.zero.contiguous()}
        spec = info.spec
        return Encoded(tensors, {"quant_method": self.name, "bits": spec.bits, "group_size": spec.group_size,
                                 "sym": spec.sym})

    def marker(self, qcfg):
        return "codes"

    def decode(self, parts, qcfg):
        groups = parts["scales"].shape[1]
        spec = GridSpec(qcfg["bits"], qcfg["group_size"] if groups > 1 else -1, qcfg["sym"])
        return QuantizedWeight(parts["codes"], parts["scales"], parts["zeros"], spec)

    def layout(self, qcfg):
        parts = {"codes": Part(U8, lambda d: [[d.out, d.cols]]), "scales": Part(F16, lambda d: [[d.out, d.groups]]),
                 "zeros": Part(U8, lambda d: [[d.out, d.groups]])}
        return Layout(self.name, parts, int(qcfg["bits"]), int(qcfg["group_size"]))

    def weight_only_int(self, qcfg):
        return False  # no engine kernel reads it


@pytest.fixture
def toy_format():
    fmt = formats.register(ToyRows())
    yield fmt
    del FORMATS[fmt.name]


@pytest.fixture(scope="module")
def quantized(tiny_llama, tmp_path_factory):
    """gptq W4 g32 asym with act-order written as toy-rows and as gptq (read by its own tested decoder)."""
    mp = pytest.MonkeyPatch()
    formats.register(ToyRows())
    try:
        root = tmp_path_factory.mktemp("toy")
        recipe = write_recipe(root / "r.yaml", tiny_llama, root / "q",
                              "gptq: {bits: 4, group_size: 32, sym: false, act_order: true}",
                              formats=("toy-rows", "gptq"))
        assert run_cli(mp, "quantize", recipe, "--quiet") == 0
        yield root / "q"
    finally:
        mp.undo()
        FORMATS.pop("toy-rows", None)


def test_quantize_writes_the_registered_format(quantized, toy_format):
    folder = quantized / "toy-rows"
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "toy-rows", "bits": 4, "group_size": 32, "sym": False}
    assert json.loads((folder / "quantkit.json").read_text())["format"] == "toy-rows"
    assert runtime.artifact_format(folder) == "toy-rows"


def test_runtime_reads_it_back_bit_exact(quantized, toy_format):
    toy = runtime.load(str(quantized / "toy-rows"), dtype="float32").model.state_dict()
    gptq = runtime.load(str(quantized / "gptq"), dtype="float32").model.state_dict()
    assert toy.keys() == gptq.keys()
    for name in toy:
        assert torch.equal(toy[name], gptq[name]), name
    # and the decoded weights are the pipeline's codes, unpacked: 4-bit values, 7 layers x 2 blocks
    _, qweights = runtime.quantized_state_dict(quantized / "toy-rows", "toy-rows",
                                               {"quant_method": "toy-rows", "bits": 4, "group_size": 32, "sym": False},
                                               torch.float32)
    assert len(qweights) == 14 and all(int(q.codes.max()) <= 15 for q in qweights.values())


def test_verify_and_eval_run_on_it(quantized, toy_format, monkeypatch, capsys):
    folder = quantized / "toy-rows"
    assert run_cli(monkeypatch, "verify", folder, "--json", quantized / "verify.json") == 0
    checks = {c["name"]: c for c in json.loads((quantized / "verify.json").read_text())["checks"]}
    assert checks["layout"]["ok"] and "toy-rows tensors" in checks["layout"]["detail"]
    assert checks["forward"]["ok"]
    ppl = {}
    for name in ("toy-rows", "gptq"):
        out = quantized / f"eval-{name}.json"
        assert run_cli(monkeypatch, "eval", quantized / name, "--seq-len", 64, "--max-tokens", 256, "--quiet",
                       "--json", out) == 0
        body = json.loads(out.read_text())
        assert body["tokens"] == 4 * 63
        ppl[name] = body["ppl"]["model"]
    assert ppl["toy-rows"] == ppl["gptq"]  # the same weights, another layout
    assert 1 < ppl["toy-rows"] < 1e4


def test_recipe_checks_ask_the_registered_format(tiny_llama, toy_format, tmp_path, monkeypatch, capsys):
    for stage, message in (
        ("gptq: {bits: 3, group_size: 32}", "stages.0.gptq.bits: 3 bits cannot be stored in toy-rows (it stores 4, 8)"),
        ("gptq: {bits: 8, group_size: -1, activations: {type: int}}",
         "export.formats: toy-rows stores weight-only quantization"),
    ):
        recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "q", stage, formats=("toy-rows",))
        assert run_cli(monkeypatch, "quantize", recipe, "--quiet") != 0
        assert message in capsys.readouterr().err
    FORMATS.pop("toy-rows")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "q", "rtn: {bits: 4}", formats=("toy-rows",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") != 0
    assert "export.formats.0: Input should be 'gptq', 'compressed-tensors' or 'awq'" in capsys.readouterr().err
    formats.register(ToyRows())  # the fixture's teardown removes it again


class SignedRows(QuantizedTensor):
    """A new result kind, defined here: signed int8 codes times one float32 scale per row."""

    kind = "toy-signed-rows"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        self.codes, self.scale = codes, scale

    @property
    def scheme(self) -> Scheme:
        return Scheme("int", 8, -1, True, torch.float32)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.codes.float() * self.scale).to(dtype)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scale": self.scale}

    def meta(self) -> dict:
        return {"kind": self.kind}

    @classmethod
    def restore(cls, tensors, meta) -> SignedRows:
        return cls(tensors["codes"], tensors["scale"])


def test_a_new_result_kind_survives_the_resume_checkpoint(tmp_path):
    """quantize/resume.py stores any QuantizedTensor through to_tensors / meta and rebuilds it by kind."""
    from safetensors.torch import load_file, save_file

    from quantkit.quantize.resume import _pack_weights, _unpack_weights

    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    scale = w.abs().amax(1, keepdim=True) / 127
    toy = SignedRows(torch.round(w / scale).to(torch.int8), scale)
    int4 = rtn_quantize(w, GridSpec(4, 32, False))
    tensors, specs = _pack_weights({"a.q_proj": toy, "a.k_proj": int4})
    save_file(tensors, str(tmp_path / "block.safetensors"))
    back = _unpack_weights(load_file(str(tmp_path / "block.safetensors")), json.loads(json.dumps(specs)))
    assert isinstance(back["a.q_proj"], SignedRows) and isinstance(back["a.k_proj"], QuantizedWeight)
    for name, q in (("a.q_proj", toy), ("a.k_proj", int4)):
        assert torch.equal(back[name].dequantize(), q.dequantize())
    assert torch.allclose(toy.dequantize(), w, atol=float(scale.max()))
