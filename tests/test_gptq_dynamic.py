"""Mixed precision in the gptq format: the recipe's overrides as GPTQModel's `dynamic` (quantkit/export/gptq.py),
read back by quantkit, by a reader written from GPTQModel's rule matching (tests/reference_readers.py), by GPTQModel
7.6 itself (its venv, CPU torch kernel) and, for which rule each of its layers takes, by vLLM 0.32's own functions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import write_recipe
from reference_readers import gptq_dynamic, read_compressed_tensors, read_gptq
from safetensors.torch import load_file
from test_vllm import PYTHON as VLLM_PYTHON
from test_vllm import needs_vllm

from quantkit import runtime
from quantkit.engines.vllm import weight_only_bits
from quantkit.errors import QuantkitError
from quantkit.export.gptq import grid_config
from quantkit.progress import Reporter
from quantkit.quantize.run import run_quantize
from quantkit.recipe import load_recipe
from quantkit.verify import verify

GPTQMODEL = os.environ.get("QUANTKIT_GPTQMODEL_PYTHON", "/work/peers/gptqmodel/bin/python")
# W4 g32 everywhere, block 0's mlp (gate / up: one fused layer, and down) W8 per channel, block 1's o_proj float
MIXED = """overrides:
  - {targets: [mlp], layers: [0], bits: 8, group_size: -1}
  - {targets: [self_attn.o_proj], layers: [1], unquantized: true}
"""
W8 = {"bits": 8, "group_size": -1, "sym": True}
DYNAMIC = {
    r"-:^model\.layers\.1\.self_attn\.o_proj$": {},
    r"+:^model\.layers\.0\.mlp\.(?:gate_proj|up_proj|gate_up_proj)$": W8,  # gate_up_proj: vLLM's fused layer
    r"+:^model\.layers\.0\.mlp\.down_proj$": W8,
}
MOE = "overrides:\n  - {targets: [mlp.experts], layers: [1], bits: 8, group_size: -1}\n"


def quantize(model: Path, out: Path, overrides: str, stage: str = "gptq: {bits: 4, group_size: 32}",
             formats=("gptq", "compressed-tensors")) -> Path:
    path = write_recipe(out.with_suffix(".yaml"), model, out, stage, formats)
    path.write_text(path.read_text() + overrides)
    run_quantize(load_recipe(path), overwrite=False, report=Reporter(quiet=True))
    return out


@pytest.fixture(scope="module")
def mixed(tiny_llama, tmp_path_factory) -> Path:
    return quantize(tiny_llama, tmp_path_factory.mktemp("gptqdyn") / "out", MIXED)


def ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))


def test_the_config_carries_dynamic(mixed, tiny_llama):
    art = mixed / "gptq"
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    assert qcfg["dynamic"] == DYNAMIC
    assert (qcfg["bits"], qcfg["group_size"], qcfg["sym"], qcfg["checkpoint_format"]) == (4, 32, True, "gptq")
    assert json.loads((art / "quantize_config.json").read_text())["dynamic"] == DYNAMIC
    stored = load_file(str(art / "model.safetensors"))
    # 8-bit per channel: 4 codes a word along in, one scale row; 4-bit g32: 8 a word, in / 32 scale rows
    assert [list(stored[f"model.layers.0.mlp.down_proj.{k}"].shape) for k in ("qweight", "qzeros", "scales")] == \
        [[128 * 8 // 32, 64], [1, 64 * 8 // 32], [1, 64]]
    assert [list(stored[f"model.layers.1.mlp.down_proj.{k}"].shape) for k in ("qweight", "qzeros", "scales")] == \
        [[128 * 4 // 32, 64], [4, 64 * 4 // 32], [4, 64]]
    name = "model.layers.1.self_attn.o_proj"
    assert f"{name}.qweight" not in stored
    assert torch.equal(stored[f"{name}.weight"], load_file(str(tiny_llama / "model.safetensors"))[f"{name}.weight"])
    assert weight_only_bits(json.loads((art / "config.json").read_text())) == {4, 8}
    assert verify(art).ok


def test_round_trip_is_bit_exact_and_equals_compressed_tensors(mixed):
    """quantkit decodes every Linear on its own grid: the same codes, scales and zeros as the compressed-tensors
    artifact of the same run, the weights the reference reader gets from GPTQModel's rule matching, and logits
    equal to the compressed-tensors artifact's, exactly."""
    art, ct = mixed / "gptq", mixed / "compressed-tensors"
    theirs = read_gptq(art)
    assert len(theirs) == 2 * 7 - 1 and theirs.keys() == read_compressed_tensors(ct).keys()
    grids = {}
    for fmt, folder in (("gptq", art), ("compressed-tensors", ct)):
        qcfg = json.loads((folder / "config.json").read_text())["quantization_config"]
        grids[fmt] = runtime.quantized_state_dict(folder, fmt, qcfg, torch.float32)[1]
    for n, q in grids["gptq"].items():
        c = grids["compressed-tensors"][n]
        assert q.spec == c.spec and (q.spec.bits == 8) == n.startswith("model.layers.0.mlp."), n
        assert torch.equal(q.codes, c.codes) and torch.equal(q.zero, c.zero), n
        assert torch.equal(q.scale.float(), c.scale.float()), n
    ours = runtime.load(str(art), "float32").model
    state = ours.state_dict()
    for n, w in theirs.items():
        assert torch.equal(w, state[f"{n}.weight"]), n
    with torch.no_grad():
        assert torch.equal(ours(ids()).logits, runtime.load(str(ct), "float32").model(ids()).logits)


def test_verify_reads_each_module_with_its_rule(mixed, tmp_path):
    """A config whose 8-bit down_proj rule is dropped (so the module reads as 4-bit g32) is caught by the layout check,
    naming that module."""
    art = tmp_path / "gptq"
    shutil.copytree(mixed / "gptq", art)
    layout = next(c for c in verify(art).checks if c.name == "layout")
    assert layout.ok and layout.detail.startswith("13 quantized modules"), layout.detail
    config = json.loads((art / "config.json").read_text())
    del config["quantization_config"]["dynamic"][r"+:^model\.layers\.0\.mlp\.down_proj$"]
    (art / "config.json").write_text(json.dumps(config))
    layout = next(c for c in verify(art).checks if c.name == "layout")
    assert not layout.ok
    assert layout.detail.startswith("model.layers.0.mlp.down_proj.qweight: int32 [32, 64]; gptq stores int32 "
                                    "[16, 64]"), layout.detail


def test_rules_are_read_as_gptqmodel_and_vllm_read_them():
    """The first rule in order whose regex re.match-es (start-anchored) the name; '-:' leaves a Linear float."""
    qcfg = {"bits": 4, "group_size": 32, "sym": True, "dynamic": {
        r"+:.*\.mlp\.": {"bits": 8, "group_size": -1}, r"+:.*down_proj": {"bits": 2}, r"-:.*o_proj": {}}}
    assert grid_config(qcfg, "model.layers.0.mlp.down_proj") | {"dynamic": None} == \
        {"bits": 8, "group_size": -1, "sym": True, "dynamic": None}
    assert grid_config(qcfg, "model.layers.0.self_attn.q_proj") is qcfg
    assert grid_config(qcfg, "x.down_proj")["bits"] == 2 == gptq_dynamic(qcfg, "x.down_proj")["bits"]
    assert gptq_dynamic(qcfg, "model.layers.0.mlp.down_proj")["bits"] == 8
    with pytest.raises(QuantkitError, match=r"^quantization_config.dynamic: model.layers.0.self_attn.o_proj is "
                       r"stored quantized but '-:.\*o_proj' leaves it float$"):
        grid_config(qcfg, "model.layers.0.self_attn.o_proj")
    with pytest.raises(QuantkitError, match=r"^quantization_config.dynamic: '\+:\(' is not a regex"):
        grid_config({"dynamic": {"+:(": {}}}, "a")
    # DYNAMIC's rules name exactly their Linears, and vLLM's fused gate_up_proj, not qkv_proj
    for name, bits in (("model.layers.0.mlp.gate_proj", 8), ("model.layers.0.mlp.gate_up_proj", 8),
                       ("model.layers.0.mlp.down_proj", 8), ("model.layers.10.mlp.down_proj", 4),
                       ("model.layers.0.mlp.down_proj_x", 4), ("model.layers.0.self_attn.qkv_proj", 4)):
        assert grid_config({"bits": 4, "group_size": 32, "dynamic": DYNAMIC}, name)["bits"] == bits, name


def test_moe_experts_take_one_rule(tiny_factory, tmp_path):
    """A MoE layer's experts on their own grid: one rule for all of them (and vLLM's `mlp.experts` layer); quantkit
    and the reference reader decode them the same, bit for bit."""
    out = quantize(tiny_factory("qwen3_moe"), tmp_path / "moe", MOE, "rtn: {bits: 4, group_size: 32}", ("gptq",))
    art = out / "gptq"
    dynamic = json.loads((art / "config.json").read_text())["quantization_config"]["dynamic"]
    rule = r"+:^model\.layers\.1\.mlp\.experts(?:\.\d+\.(?:gate_proj|up_proj|down_proj))?$"
    assert dynamic == {rule: W8} | {rf"-:^model\.layers\.{b}\.mlp\.gate$": {} for b in range(2)}  # routers: float
    theirs, state = read_gptq(art), runtime.load(str(art), "float32").model.state_dict()
    assert sum(n.startswith("model.layers.1.mlp.experts.") for n in theirs) == 8 * 3
    for n, w in theirs.items():
        assert torch.equal(w, state[f"{n}.weight"]), n
        assert gptq_dynamic({"dynamic": dynamic}, n) == (W8 if n.startswith("model.layers.1.mlp.experts.") else {})
    assert gptq_dynamic({"dynamic": dynamic}, "model.layers.1.mlp.experts") == W8  # vLLM's MoE layer


def test_an_asymmetric_override_writes_v2(tiny_llama, tmp_path):
    """gptq v1 stores zero - 1 and cannot hold an asymmetric grid's zero of 0: one asymmetric grid makes the whole
    artifact gptq_v2, and it still decodes bit for bit."""
    out = quantize(tiny_llama, tmp_path / "asym", "overrides:\n  - {targets: [mlp.down_proj], sym: false}\n",
                   "rtn: {bits: 4, group_size: 32}", ("gptq", "compressed-tensors"))
    qcfg = json.loads((out / "gptq" / "config.json").read_text())["quantization_config"]
    assert (qcfg["checkpoint_format"], qcfg["sym"]) == ("gptq_v2", True)
    asym = {"bits": 4, "group_size": 32, "sym": False}
    assert qcfg["dynamic"] == {r"+:^model\.layers\.(?:0|1)\.mlp\.down_proj$": asym}
    theirs, state = read_gptq(out / "gptq"), runtime.load(str(out / "gptq"), "float32").model.state_dict()
    for n, w in theirs.items():
        assert torch.equal(w, state[f"{n}.weight"]), n
    assert read_compressed_tensors(out / "compressed-tensors").keys() == theirs.keys()


GPTQMODEL_WORKER = """\
import sys, torch
from gptqmodel import BACKEND, GPTQModel

model = GPTQModel.load(sys.argv[1], backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
weights, grids = {}, {}
for name, m in model.model.named_modules():
    if hasattr(m, "dequantize_weight") and hasattr(m, "qweight"):
        grids[name] = [m.bits, m.group_size]
        w = m.dequantize_weight()
        weights[name] = (w.T if w.shape[0] == m.in_features else w).half().contiguous()
    elif isinstance(m, torch.nn.Linear):
        grids[name] = None
with torch.no_grad():
    logits = model.model(input_ids=torch.load(sys.argv[2])).logits.float()
torch.save({"weights": weights, "grids": grids, "logits": logits}, sys.argv[3])
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path(GPTQMODEL).exists(), reason=f"no GPTQModel venv at {GPTQMODEL}")
def test_gptqmodel_reads_the_mixed_artifact(mixed, tmp_path):
    """GPTQModel 7.6 (its own venv: importing it is ~6 s of the ~12 s) loads the artifact with its CPU torch kernel:
    each Linear on its rule's grid (8-bit per channel: group_size in_features), the float one an nn.Linear, every
    dequantized weight bit for bit quantkit's in float16, logits within 2e-3 of quantkit's float16 runtime (4.9e-4
    measured, logits ~1.4 in size; GPTQModel's TorchLinear runs in float16 only)."""
    art = mixed / "gptq"
    torch.save(ids(), tmp_path / "ids.pt")
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", TORCH_COMPILE_DISABLE="1")
    done = subprocess.run([GPTQMODEL, "-c", GPTQMODEL_WORKER, str(art), str(tmp_path / "ids.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    grids = {n: g for n, g in theirs["grids"].items() if n.startswith("model.layers.")}
    assert grids == {f"model.layers.{b}.{m}": (None if (b, m) == (1, "self_attn.o_proj") else
                                               [8, 64 if m != "mlp.down_proj" else 128] if b == 0 and "mlp" in m
                                               else [4, 32])
                     for b in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                 "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    ours = runtime.load(str(art), "float16").model
    state = ours.state_dict()
    for n, w in theirs["weights"].items():
        assert torch.equal(w, state[f"{n}.weight"]), n
    with torch.no_grad():
        diff = (theirs["logits"] - ours(ids()).logits.float()).abs().max().item()
    assert diff < 2e-3


VLLM_MATCH = """\
import json, sys
from copy import deepcopy
from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig
from vllm.model_executor.layers.quantization.utils.gptq_utils import (get_dynamic_override, is_layer_gptq_quantized,
                                                                      override_config)

answers = []
for folder, layers in json.loads(sys.argv[1]):
    cfg = AutoGPTQConfig.from_config(json.load(open(folder + "/config.json"))["quantization_config"])
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    cfg.maybe_update_config(folder)  # which modules hold quantized tensors (safetensors metadata)
    out = {}
    for name, moe in layers:  # get_linear_quant_method / get_moe_quant_method's steps
        quantized = moe or is_layer_gptq_quantized(name, cfg.modules_in_block_to_quantize, cfg.packed_modules_mapping)
        if get_dynamic_override(cfg, layer_name=name) is False or not quantized:
            out[name] = None
            continue
        c = deepcopy(cfg)
        override_config(c, prefix=name)
        out[name] = [c.weight_bits, c.group_size]
    answers.append(out)
print(json.dumps(answers))
"""


@needs_vllm
@pytest.mark.slow
def test_vllm_gives_each_layer_its_rule(mixed, tiny_factory, tmp_path):
    """vLLM 0.32's own rule matching (auto_gptq.py, gptq_utils.py; run in its environment without serving: its CPU
    build has no kernel to serve these here) on the names of the layers it builds: fused qkv_proj / gate_up_proj and a
    MoE layer's experts take the rule of their checkpoint Linears, and the float o_proj is left float (~17 s)."""
    moe = quantize(tiny_factory("qwen3_moe"), tmp_path / "moe", MOE, "rtn: {bits: 4, group_size: 32}", ("gptq",))
    dense = [f"model.layers.{b}.{m}" for b in range(2) for m in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                  "mlp.gate_up_proj", "mlp.down_proj")]
    experts = [f"model.layers.{b}.{m}" for b in range(2) for m in ("self_attn.qkv_proj", "self_attn.o_proj",
                                                                    "mlp.experts")]
    asked = [[str(mixed / "gptq"), [[n, False] for n in dense]],
             [str(moe / "gptq"), [[n, n.endswith("experts")] for n in experts]]]
    done = subprocess.run([VLLM_PYTHON, "-c", VLLM_MATCH, json.dumps(asked)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    dense_want = {n: None if n == "model.layers.1.self_attn.o_proj" else
                  [8, -1] if n.startswith("model.layers.0.mlp.") else [4, 32] for n in dense}
    moe_want = {n: [8, -1] if n == "model.layers.1.mlp.experts" else [4, 32] for n in experts}
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [dense_want, moe_want]


def test_the_awq_format_still_refuses_overrides(tiny_llama, tmp_path, monkeypatch, capsys):
    from conftest import run_cli

    path = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "rtn: {bits: 4, group_size: 32}",
                        ("gptq", "awq"))
    path.write_text(path.read_text() + MIXED)
    assert run_cli(monkeypatch, "quantize", path, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: {path}: export.formats: awq stores one grid; a recipe with overrides is written as gptq or "
        "compressed-tensors")
    assert not (tmp_path / "out").exists()
