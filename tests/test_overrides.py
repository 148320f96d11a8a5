"""Mixed precision: the recipe's per-layer overrides (quantkit/overrides.py), through the plan, the pipeline, the
compressed-tensors artifact (a config group per grid) and the loaders that read it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli, write_recipe

from quantkit import runtime
from quantkit.progress import Reporter
from quantkit.quantize.run import run_quantize
from quantkit.quantize.targets import fused_groups
from quantkit.recipe import load_recipe
from quantkit.verify import verify

# W4 g32 everywhere, but block 0's down_proj W8 per channel and block 1's q/k/v left float
MIXED = """overrides:
  - targets: [mlp.down_proj]
    layers: [0]
    bits: 8
    group_size: -1
  - targets: ["re:.*self_attn\\\\.(q|k|v)_proj"]
    layers: "1-1"
    unquantized: true
"""


def recipe(tmp_path: Path, model: Path, stage: str, overrides: str, formats=("compressed-tensors",),
           out: str = "out", load: str = "auto") -> Path:
    path = write_recipe(tmp_path / f"{out}.yaml", model, tmp_path / out, stage, formats, load=load)
    path.write_text(path.read_text() + overrides)
    return path


def unpack_by_hand(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [rows, n] -> unsigned values [rows, n * 32 / bits], lowest bits first."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    return torch.stack([(w >> (bits * k)) & ((1 << bits) - 1) for k in range(per)], dim=-1).reshape(w.shape[0], -1)


@pytest.mark.parametrize("stage", ["rtn: {bits: 4, group_size: 32}", "gptq: {bits: 4, group_size: 32}",
                                   "awq: {bits: 4, group_size: 32, zero_point: false}"])
def test_mixed_artifact(stage, tiny_llama, tmp_path):
    """Each Linear is stored on its own grid, in a config group of its own grid that names it (no 'Linear' class
    target); quantkit's runtime computes the logits of the weights dequantized by hand from the stored tensors, and
    transformers with compressed-tensors (its per-module decompression) computes the same logits, exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_quantize(load_recipe(recipe(tmp_path, tiny_llama, stage, MIXED)), overwrite=False,
                 report=Reporter(quiet=True))
    art = tmp_path / "out" / "compressed-tensors"
    qcfg = json.loads((art / "config.json").read_text())["quantization_config"]
    groups = qcfg["config_groups"]
    assert {k: (g["weights"]["num_bits"], g["weights"]["group_size"], g["weights"]["strategy"])
            for k, g in groups.items()} == {"group_0": (4, 32, "group"), "group_1": (8, None, "channel")}
    assert groups["group_1"]["targets"] == [r"re:^model\.layers\.0\.mlp\.down_proj$"]
    assert r"re:^model\.layers\.(?:0|1)\.self_attn\.o_proj$" in groups["group_0"]["targets"]
    assert not any(t == "Linear" for g in groups.values() for t in g["targets"])
    assert qcfg["ignore"] == ["lm_head"] + [f"model.layers.1.self_attn.{p}_proj" for p in "kqv"]
    stored = load_file(str(art / "model.safetensors"))
    assert not any(k.startswith("model.layers.1.self_attn.q_proj.weight_") for k in stored)
    original = load_file(str(tiny_llama / "model.safetensors"))
    for p in "qkv":  # left float, untouched (AWQ neither scales nor clips them: their mapping has nothing to round)
        name = f"model.layers.1.self_attn.{p}_proj.weight"
        assert torch.equal(stored[name], original[name])

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.load_state_dict({k: t for k, t in stored.items() if t.is_floating_point()}, strict=False)  # AWQ's norms
    quantized = 0
    for name, m in model.named_modules():
        if f"{name}.weight_packed" not in stored:
            continue
        bits, group = (8, m.in_features) if name == "model.layers.0.mlp.down_proj" else (4, 32)
        scale = stored[f"{name}.weight_scale"]
        assert list(scale.shape) == [m.out_features, m.in_features // group], name
        codes = unpack_by_hand(stored[f"{name}.weight_packed"], bits) - (1 << (bits - 1))
        m.weight.data = (codes.float().reshape(m.out_features, -1, group) * scale.float()[..., None]).reshape(
            m.out_features, -1)
        quantized += 1
    assert quantized == 2 * 7 - 3
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        by_hand = model(ids).logits
        ours = runtime.load(str(art), "float32").model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)(ids).logits
    assert torch.equal(ours, by_hand)
    assert torch.equal(theirs, ours)
    assert verify(art).ok


def test_sub_4bit_compressed_tensors_artifact_loads_in_transformers(tiny_llama, tmp_path):
    """W3A16 g32 with block 0's down_proj at W2: compressed-tensors' dense packing (values crossing int32 words) of
    both widths; transformers with compressed-tensors computes quantkit's runtime logits exactly, verify passes, and
    the vLLM refusal sees both widths."""
    from transformers import AutoModelForCausalLM

    from quantkit.engines.vllm import weight_only_bits

    over = "overrides:\n  - {targets: [mlp.down_proj], layers: [0], bits: 2}\n"
    run_quantize(load_recipe(recipe(tmp_path, tiny_llama, "gptq: {bits: 3, group_size: 32}", over)), overwrite=False,
                 report=Reporter(quiet=True))
    art = tmp_path / "out" / "compressed-tensors"
    config = json.loads((art / "config.json").read_text())
    assert sorted(g["weights"]["num_bits"] for g in config["quantization_config"]["config_groups"].values()) == [2, 3]
    assert weight_only_bits(config) == {2, 3}
    ids = torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = runtime.load(str(art), "float32").model(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(art, dtype=torch.float32)(ids).logits
    assert torch.equal(theirs, ours)
    assert verify(art).ok


def test_the_same_recipe_writes_the_same_bytes(tiny_llama, tmp_path):
    """Run again, and loaded whole instead of streamed block by block: the same bytes."""
    digests = []
    for out, load in (("a", "stream"), ("b", "stream"), ("c", "memory")):
        run_quantize(load_recipe(recipe(tmp_path, tiny_llama, "gptq: {bits: 4, group_size: 32}", MIXED, out=out,
                                        load=load)), overwrite=False, report=Reporter(quiet=True))
        art = tmp_path / out / "compressed-tensors"
        digests.append({f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(art.iterdir())
                        if f.name != "quantkit.json"})
    assert digests[0] == digests[1] == digests[2]


def test_fused_groups_in_model_order():
    names = [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"] + \
        [f"model.layers.0.mlp.experts.{e}.{p}" for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")] + \
        ["model.layers.0.mlp.shared_expert.gate_proj", "model.layers.0.mlp.shared_expert.up_proj",
         "model.layers.0.mlp.shared_expert.down_proj"]
    assert fused_groups(names) == [
        tuple(names[:3]), (names[3],), tuple(names[4:10]), tuple(names[10:12]), (names[12],)]


@pytest.mark.parametrize("arch,overrides,line", [
    ("llama", "overrides:\n  - {targets: [self_attn.q_proj], bits: 8, group_size: -1}\n",
     "overrides.0: splits the fused layer model.layers.0.self_attn.{q_proj,k_proj,v_proj}: vLLM runs them as one "
     "matmul with one scheme; target all of them"),
    ("llama", "overrides:\n  - {targets: [mlp], bits: 8}\n  - {targets: [mlp.up_proj], layers: [1], "
     "unquantized: true}\n",
     "overrides.1: splits the fused layer model.layers.1.mlp.{gate_proj,up_proj}: vLLM runs them as one matmul "
     "with one scheme; target all of them"),
    ("qwen3_moe", "overrides:\n  - {targets: [mlp.experts.3], bits: 8}\n",
     "overrides.0: splits the fused layer model.layers.0.mlp.experts.*: vLLM runs a MoE layer's experts as one "
     "kernel with one scheme; target all of them"),
    ("mixtral", "overrides:\n  - {targets: [down_proj], layers: [1], bits: 8}\n",
     "overrides.0: splits the fused layer model.layers.1.mlp.experts.*: vLLM runs a MoE layer's experts as one "
     "kernel with one scheme; target all of them"),
    ("llama", "overrides:\n  - {targets: [mlp.down_projection], bits: 8}\n",
     "overrides.0.targets: matches no quantized Linear (e.g. model.layers.0.self_attn.q_proj)"),
    ("llama", "overrides:\n  - {targets: [mlp], layers: [2], bits: 8}\n",
     "overrides.0.layers: block 2 is not a decoder block (the model has 2: 0-1)"),
    ("llama", "overrides:\n  - {targets: [o_proj], layers: \"1-1\", group_size: 128}\n",
     "overrides.0.group_size: 128 does not divide in_features 64 of model.layers.1.self_attn.o_proj; use 32 or 64 "
     "or -1"),
])
def test_bad_overrides_of_the_model_are_one_line(arch, overrides, line, tiny_factory, tmp_path, monkeypatch, capsys):
    path = recipe(tmp_path, tiny_factory(arch), "rtn: {bits: 4, group_size: 32}", overrides)
    assert run_cli(monkeypatch, "quantize", path, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {line}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("stage,overrides,formats,line", [
    ("rtn: {bits: 4, group_size: 32}", "overrides:\n  - {targets: [mlp], unquantized: true, bits: 8}\n",
     ("compressed-tensors",), "overrides.0: unquantized: a Linear left float takes no bits"),
    ("rtn: {scheme: FP8_DYNAMIC}", "overrides:\n  - {targets: [mlp], unquantized: true}\n",
     ("compressed-tensors",), "overrides: per-layer overrides change an int weight-only grid; stages.0.rtn is "
     "W8A8 (mixing kinds of schemes in one artifact is not supported yet)"),
    ("rtn: {bits: 4, group_size: 32}", "overrides:\n  - {targets: [mlp.down_proj], bits: 3}\n",
     ("compressed-tensors", "awq"), "export.formats: awq stores one grid; a recipe with overrides is written as gptq "
     "or compressed-tensors"),
    ("rtn: {bits: 4, group_size: 32}", "overrides:\n  - {targets: [mlp], layers: \"3-1\", bits: 8}\n",
     ("compressed-tensors",), "overrides.0.layers: a list of block indices or a range like \"0-3\" (first <= last), "
     "got '3-1' (got '3-1')"),
])
def test_bad_override_recipes_are_one_line(stage, overrides, formats, line, tiny_llama, tmp_path, monkeypatch,
                                           capsys):
    path = recipe(tmp_path, tiny_llama, stage, overrides, formats)
    assert run_cli(monkeypatch, "quantize", path, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {path}: {line}"
    assert not (tmp_path / "out").exists()


def test_readers_of_one_input_on_two_grids_are_each_solved_on_their_own(one_thread):
    """GPTQ's readers of one input (q/k/v; a MoE layer's experts and its shared expert) on different grids: a
    factorization per grid from the one Hessian, each Linear's result bit for bit the one GPTQ gives it alone."""
    from torch import nn

    from quantkit.algorithms.gptq import GPTQ, Hessian
    from quantkit.algorithms.grid import GridSpec
    from quantkit.export.base import QuantInfo
    from quantkit.methods.gptq import GPTQ as GPTQArgs
    from quantkit.quantize.distributed import Ranks
    from quantkit.quantize.gptq import _solve_group, _solvers
    from quantkit.quantize.targets import QuantResult

    torch.manual_seed(0)
    x = torch.randn(4, 32, 64)
    linears = {"a": nn.Linear(64, 48, bias=False), "b": nn.Linear(64, 16, bias=False)}
    w4, w8 = GridSpec(4, 32, True), GridSpec(8, -1, True)
    result = QuantResult({}, QuantInfo(method="gptq", spec=w4, overrides={"b": w8}))
    args = GPTQArgs(bits=4, group_size=32, act_order=True)

    def hessian() -> Hessian:
        h = Hessian(64)
        h.add(x)
        return h

    alone = {n: GPTQ(hessian(), spec, args.damp, args.block_size, True).quantize(linears[n].weight.data.clone())[0]
             for n, spec in (("a", w4), ("b", w8))}
    h = hessian()
    _solve_group(["a", "b"], lambda: _solvers(h, args, ["a", "b"], result, Reporter(quiet=True), "a"), linears,
                 h.count, result, Ranks(), release=False)
    for n in linears:
        assert result.qweights[n].spec == alone[n].spec
        assert torch.equal(result.qweights[n].codes, alone[n].codes), n
        assert torch.equal(result.qweights[n].scale, alone[n].scale), n


def test_verify_reads_each_module_with_its_own_group(tiny_llama, tmp_path):
    """A config that puts block 0's 8-bit down_proj in the 4-bit group (its group dropped) is caught by the layout
    check, naming that module: verify reads each module's bits and group size from the group that targets it."""
    run_quantize(load_recipe(recipe(tmp_path, tiny_llama, "rtn: {bits: 4, group_size: 32}", MIXED)),
                 overwrite=False, report=Reporter(quiet=True))
    art = tmp_path / "out" / "compressed-tensors"
    layout = next(c for c in verify(art).checks if c.name == "layout")
    assert layout.ok and layout.detail.startswith("11 quantized modules")
    config = json.loads((art / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    groups["group_0"]["targets"] += groups.pop("group_1")["targets"]
    (art / "config.json").write_text(json.dumps(config))
    layout = next(c for c in verify(art).checks if c.name == "layout")
    assert not layout.ok
    assert layout.detail.startswith("model.layers.0.mlp.down_proj.weight_packed: int32 [64, 32]"), layout.detail
