"""The support matrix: every family x method on a tiny random model of that family.

Each artifact must
  - reload in quantkit's runtime bit-exactly (logits equal to the in-memory quantized model's);
  - reload in transformers, for the formats it reads, with logits matching (weight-only formats: its own load;
    W8A8: dequantized weights, as its CPU path runs them), and
  - for GPTQ and AWQ, be closer to the float model than RTN at the same settings.
Every row is also written to $QUANTKIT_MATRIX (a JSON-lines file) when set: `python benchmarks/support_matrix.py` runs
this module that way and renders README's support matrix from what the tests measured.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch
import yaml

from quantkit import runtime
from quantkit.families import moe
from quantkit.errors import QuantkitError
from quantkit.export.artifact import write_artifact
from quantkit.kernels.w8a8 import swap_w8a8_linears
from quantkit.model import load_model
from quantkit.progress import Reporter
from quantkit.quantize import pipeline
from quantkit.quantize.calibration import build
from quantkit.recipe import parse_recipe
from tiny_models import FAMILY_EXTRA, MOE_FAMILIES, save_with_outliers

DENSE = [f for f in FAMILY_EXTRA if f not in MOE_FAMILIES] + ["opt"]
FAMILIES = DENSE + list(MOE_FAMILIES)
SYM4 = "{bits: 4, group_size: 32, sym: true}"
ASYM4 = "{bits: 4, group_size: 32, sym: false}"
METHODS = {  # method -> (stages, formats); sym W4 for formats transformers 5.24 reads (no CT asym there)
    "rtn": ([f"rtn: {SYM4}"], ["gptq", "compressed-tensors"]),
    "gptq": (["gptq: {bits: 4, group_size: 32, sym: true, act_order: true}"], ["gptq", "compressed-tensors"]),
    "awq": (["awq: {bits: 4, group_size: 32, zero_point: true}"], ["awq", "compressed-tensors"]),
    "awq+gptq": (["awq: {bits: 4, group_size: 32, zero_point: true}", "gptq: {bits: 4, group_size: 32, sym: false}"],
                 ["gptq", "compressed-tensors"]),
    "smoothquant+gptq w8a8": (["smoothquant: {alpha: 0.5}", "gptq: {bits: 8, group_size: -1, sym: true, "
                               "activations: {type: int}}"], ["compressed-tensors"]),
    "fp8": (["rtn: {bits: 8, group_size: -1, sym: true, type: float, activations: {type: float}}"],
            ["compressed-tensors"]),
}
RTN_OF = {"gptq": "rtn", "awq": "rtn-asym", "awq+gptq": "rtn-asym"}  # the RTN a method must beat, same grid
# what cannot be done, and the one line that says so
UNSUPPORTED = {("olmo2", "smoothquant+gptq w8a8"): "no norm -> Linear pair to smooth in Olmo2DecoderLayer"}
# transformers 5.24 stores experts fused and decompresses packed int4 and FP8 experts only, not int8 ones
TRANSFORMERS_REFUSES = {(arch, "smoothquant+gptq w8a8") for arch in MOE_FAMILIES}
HELD_OUT = dict(dataset="wikitext2", num_samples=4, seq_len=64, seed=11)


def recipe(model, stages: list[str], formats: list[str], out) -> object:
    return parse_recipe({
        "model": str(model), "dtype": "float32", "device": "cpu",
        "calibration": {"num_samples": 16, "seq_len": 64},
        "stages": [yaml.safe_load(s) for s in stages],
        "export": {"output": str(out), "formats": formats},
    })


@dataclass
class Case:
    model: torch.nn.Module  # in memory, quantized
    float_error: float  # mean squared logits error against the float model on held-out tokens
    folders: dict[str, object]
    tokens: torch.Tensor
    names: moe.CheckpointNames


def _quantize(folder, stages, formats, out) -> Case:
    r = recipe(folder, stages, formats, out)
    loaded = load_model(str(folder), "float32")
    model = loaded.model
    names = moe.prepare(model)
    reference = load_model(str(folder), "float32").model
    result = pipeline.quantize(model, r.stage, build(loaded.tokenizer, r.calibration), torch.device("cpu"),
                               formats, Reporter(quiet=True), r.transforms)
    folders = {fmt: write_artifact(out / fmt, fmt, model, loaded.tokenizer, result.qweights, result.info,
                                   torch.float32, 1 << 30, {}, names=names) for fmt in formats}
    if result.info.activations is not None:
        swap_w8a8_linears(model, result.qweights)
    x = build(loaded.tokenizer, r.calibration.model_copy(update=HELD_OUT)).tokens
    with torch.no_grad():
        err = float((reference(x).logits - model(x).logits).square().mean())
    return Case(model, err, folders, x, names)


@pytest.fixture(scope="module")
def outlier_factory(tiny_factory, tmp_path_factory):
    """Tiny models with LLM-style activation outlier channels (x6 in every block norm): what AWQ exists for."""
    made: dict[str, object] = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = save_with_outliers(tiny_factory(arch), tmp_path_factory.mktemp("outliers") / arch, 6.0)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def quantized(outlier_factory, tmp_path_factory):
    made: dict[tuple[str, str], Case] = {}

    def get(arch: str, method: str) -> Case:
        if (arch, method) not in made:
            stages, formats = {"rtn-asym": ([f"rtn: {ASYM4}"], ["gptq"])}.get(method) or METHODS[method]
            out = tmp_path_factory.mktemp(f"{arch}-{method.replace('+', '-').replace(' ', '-')}")
            made[(arch, method)] = _quantize(outlier_factory(arch), stages, formats, out)
        return made[(arch, method)]

    return get


def record(**row) -> None:
    path = os.environ.get("QUANTKIT_MATRIX")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _transformers_logits(folder, x, dequantize: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return hf(x).logits


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("arch", FAMILIES)
def test_family_method_reloads_bit_exactly_and_beats_rtn(quantized, arch, method):
    stages, formats = METHODS[method]
    if (arch, method) in UNSUPPORTED:
        with pytest.raises(QuantkitError, match=UNSUPPORTED[(arch, method)]):
            quantized(arch, method)
        record(family=arch, method=method, formats=[], runtime=[], transformers=[],
               unsupported=UNSUPPORTED[(arch, method)])
        return
    case = quantized(arch, method)
    with torch.no_grad():
        ours = case.model(case.tokens).logits
    row = {"family": arch, "method": method, "formats": formats, "runtime": [], "transformers": [],
           "error": case.float_error}
    for fmt, folder in case.folders.items():
        with torch.no_grad():
            again = runtime.load(str(folder), "float32").model(case.tokens).logits
        assert torch.equal(again, ours), f"{fmt}: runtime reload differs by {float((again - ours).abs().max())}"
        row["runtime"].append(fmt)
        if fmt != "compressed-tensors" or any(k in " ".join(stages) for k in ("sym: false", "zero_point: true")):
            continue  # gptq / awq need gptqmodel / autoawq in transformers; CT asym does not load in 5.24
        w8a8 = "activations" in " ".join(stages)
        if (arch, method) in TRANSFORMERS_REFUSES:
            with pytest.raises(RuntimeError, match="issues during automatic conversion"):
                _transformers_logits(folder, case.tokens, dequantize=w8a8)
            continue
        got = _transformers_logits(folder, case.tokens, dequantize=w8a8)
        # W8A8: transformers dequantizes the weights and keeps activations float; so does the twin
        want = _dense_twin(folder, case.tokens) if w8a8 else ours
        scale = float(want.abs().max())
        assert (got - want).abs().max() <= 1e-5 * scale, f"transformers differs by {float((got - want).abs().max())}"
        row["transformers"].append(fmt)
    if method in RTN_OF:
        rtn = quantized(arch, RTN_OF[method]).float_error
        row["rtn_error"] = rtn
        assert case.float_error < rtn, f"{method} logits error {case.float_error:.3g} >= RTN's {rtn:.3g}"
    record(**row)


def _dense_twin(folder, x: torch.Tensor) -> torch.Tensor:
    """Logits of the float model holding the artifact's dequantized W8A8 weights, decoded by quantkit (float
    activations)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((folder / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32).eval()
    names = moe.prepare(model).inverse()
    state, qweights = runtime.quantized_state_dict(folder, "compressed-tensors", qcfg, torch.float32)
    state = {names(k): v for k, v in state.items()}
    state |= {f"{names.module(k)}.weight": q.dequantize(torch.float32) for k, q in qweights.items()}
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model(x).logits


@pytest.mark.parametrize("arch", FAMILIES)
def test_folding_leaves_every_family_float_function_unchanged(tiny_factory, arch):
    """Every mapping find_mappings gives, folded with random scales in ~[0.05, 20], leaves the logits as they were
    (norm weights and biases moved off 1 / 0 first, so that every fold does something)."""
    from quantkit.algorithms.smoothing import fold
    from quantkit.families.mappings import find_mappings
    from quantkit.model import decoder_blocks

    model = load_model(str(tiny_factory(arch)), "float32").model
    moe.prepare(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
    g = torch.Generator().manual_seed(1)
    folded = 0
    for block in decoder_blocks(model)[1]:
        for m in find_mappings(block)[0]:
            fold(m, torch.exp(torch.randn(m.linears[0].weight.shape[1], generator=g)))
            folded += 1
    with torch.no_grad():
        after = model(ids).logits
    assert folded >= len(decoder_blocks(model)[1])  # at least up -> down in every block
    torch.testing.assert_close(after, before, rtol=0, atol=2e-4 * float(before.abs().max()))
