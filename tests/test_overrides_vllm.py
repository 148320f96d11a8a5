"""Mixed-precision compressed-tensors artifacts in vLLM: which config group vLLM 0.32 gives each of its (fused) layers,
and what its CPU build serves.

On CPU, vLLM 0.32 has no kernel for 8-bit weight-only integer weights (CPUWNA16 and zentorch take uint4 / uint4b8
only: measured on this AVX2 EPYC, a W8A16 and a mixed W4 / W8 artifact both stop in its kernel choice, "Failed to find
a kernel that can implement the WNA16 linear layer ... uint8b128"), and on AVX2 none for 4-bit ones either
(cpu_gemm_wna16 is AVX-512 only): quantkit refuses such artifacts in one line before vLLM loads them. That each
layer finds its own group is checked with vLLM's own matching (CompressedTensorsConfig.get_scheme_dict), run in the
vLLM environment, without serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import write_recipe
from test_overrides import MIXED
from test_vllm import (KERNELS_WORKER, PYTHON, against_quantkit, check_agreement, needs_vllm, refused_for_its_kernel,
                       release_recipe)

from quantkit import runtime
from quantkit.engines.vllm import ONLY_4BIT, VllmEngine, weight_only_bits
from quantkit.errors import QuantkitError
from quantkit.progress import Reporter
from quantkit.quantize.run import run_quantize
from quantkit.recipe import load_recipe

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}
# vLLM's matching, in its environment: each layer name -> [bits, group_size] of its group, or None (left float);
# a MoE layer as CompressedTensorsMoEMethod asks: its expert 0's gate / up / down, which must agree
MATCH = """\
import json, sys
import torch
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

answers = []
for config, request in json.loads(sys.argv[1]):
    cfg = CompressedTensorsConfig.from_config(json.load(open(config))["quantization_config"])
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    cfg._add_fused_moe_to_target_scheme_map()
    out = {}
    for name, (cls, shards) in request.items():
        layer = type(cls, (torch.nn.Module,), {})()
        found = [cfg.get_scheme_dict(layer, n) for n in (shards or [name])]
        assert all(f == found[0] for f in found), name
        w = found[0] and found[0]["weights"]
        out[name] = None if w is None else [w.num_bits, w.group_size or -1]
    answers.append(out)
print(json.dumps(answers))
"""
MOE = """overrides:
  - targets: [mlp.shared_expert]
    bits: 8
    group_size: -1
  - targets: [mlp.experts]
    layers: [1]
    bits: 8
"""


def quantize(model: Path, out: Path, stage: str, overrides: str, dtype: str = "") -> Path:
    path = write_recipe(out.with_suffix(".yaml"), model, out, stage, ("compressed-tensors",), extra=dtype)
    path.write_text(path.read_text() + overrides)
    run_quantize(load_recipe(path), overwrite=False, report=Reporter(quiet=True))
    return out / "compressed-tensors"


def expected_layers(artifact: Path) -> dict[str, tuple[str, list[str] | None, list[int] | None]]:
    """vLLM's layer names -> (a class name, the checkpoint names it asks for, [bits, group_size] quantkit's runtime
    decodes them with, or None where they are left float)."""
    qcfg = json.loads((artifact / "config.json").read_text())["quantization_config"]
    _, decoded = runtime.quantized_state_dict(artifact, "compressed-tensors", qcfg, torch.float32)
    grids = {n: [q.spec.bits, q.spec.group_size] for n, q in decoded.items()}
    names = list(grids) + qcfg["ignore"]
    layers: dict[str, tuple[str, list[str] | None, list[int] | None]] = {}
    for n in names:
        head, sep, tail = n.partition(".experts.")
        if sep:  # a MoE layer: vLLM asks for its expert 0's projections
            shards = [f"{head}.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
            layers[f"{head}.experts"] = ("FusedMoE", shards, grids.get(shards[0]))
            continue
        parent, _, leaf = n.rpartition(".")
        if leaf in FUSED:
            layers[f"{parent}.{FUSED[leaf]}"] = ("QKVParallelLinear" if FUSED[leaf] == "qkv_proj"
                                                 else "MergedColumnParallelLinear", None, grids.get(n))
        elif n.startswith("model.layers."):
            layers[n] = ("RowParallelLinear", None, grids.get(n))
    return layers


@needs_vllm
@pytest.mark.slow
def test_vllm_gives_each_layer_its_own_group(tiny_factory, tmp_path):
    """Every layer vLLM builds, fused ones (qkv_proj, gate_up_proj) and MoE layers included, matches the group whose
    grid quantkit's runtime decodes its checkpoint tensors with, and a layer the overrides leave float is ignored
    (one vLLM import for both models: ~15 s)."""
    asked, expected = [], []
    for arch, overrides in (("llama", MIXED), ("qwen2_moe", MOE)):
        artifact = quantize(tiny_factory(arch), tmp_path / arch, "rtn: {bits: 4, group_size: 32}", overrides)
        layers = expected_layers(artifact)
        assert any(v[2] is not None and v[2][0] == 8 for v in layers.values())  # the overrides show
        assert any(v[2] is None for v in layers.values())  # and so do the float layers
        asked.append([str(artifact / "config.json"), {n: [cls, shards] for n, (cls, shards, _) in layers.items()}])
        expected.append({n: v[2] for n, v in layers.items()})
    done = subprocess.run([PYTHON, "-c", MATCH, json.dumps(asked)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == expected


def test_an_8_bit_weight_only_group_is_refused_on_a_cpu_before_vllm_loads(tiny_llama, tmp_path):
    """vLLM's CPU build has no 8-bit weight-only kernel: W8A16, and a mixed artifact with an 8-bit group, are refused
    in one line after asking the worker's kernels (an AVX2 stand-in), and the worker never loads them."""
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(KERNELS_WORKER.format(python=sys.executable, seen=str(tmp_path / "seen"))))
    fake.chmod(0o755)
    artifacts = {"mixed": quantize(tiny_llama, tmp_path / "mixed", "rtn: {bits: 4, group_size: 32}", MIXED),
                 "w8a16": quantize(tiny_llama, tmp_path / "w8a16", "rtn: {bits: 8, group_size: -1}", "")}
    bits = {k: weight_only_bits(json.loads((a / "config.json").read_text())) for k, a in artifacts.items()}
    assert bits == {"mixed": {4, 8}, "w8a16": {8}}
    with VllmEngine(str(fake)) as engine:
        for artifact in artifacts.values():
            with pytest.raises(QuantkitError) as err:
                engine.load(str(artifact), "float16", 128)
            assert str(err.value) == f"vllm: cannot serve {artifact}: {ONLY_4BIT}"
    assert not (tmp_path / "seen").exists()


def test_a_release_of_an_8_bit_group_in_vllm_stops_before_quantizing(tiny_llama, tmp_path, monkeypatch, capsys):
    """release.eval.engine: vllm on a CPU (the AVX2 stand-in), a W4 recipe whose overrides ask for 8 bits: one line,
    before any work."""
    from conftest import run_cli

    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(KERNELS_WORKER.format(python=sys.executable, seen=str(tmp_path / "seen"))))
    fake.chmod(0o755)
    monkeypatch.setenv("QUANTKIT_VLLM_PYTHON", str(fake))
    recipe = release_recipe(tiny_llama, tmp_path, "gptq: {bits: 4, group_size: 32}")
    recipe.write_text(recipe.read_text() + "\n" + MIXED)  # release_recipe ends without one
    assert run_cli(monkeypatch, "release", recipe, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: release.eval.engine: vllm: {ONLY_4BIT}"
    assert not (tmp_path / "out").exists()


@needs_vllm
@pytest.mark.slow
def test_a_mixed_4_bit_artifact_is_served_like_quantkit_or_refused_by_name(tmp_path_factory, tmp_path):
    """W4 g64 with block 0's MLP at W4 per channel (4-bit only: the width vLLM's CPU kernels take): served like
    quantkit's runtime on an AVX-512 CPU (check_agreement's bounds), refused in one line on AVX2."""
    from tiny_models import make_servable_model

    model = make_servable_model(tmp_path_factory.mktemp("servable") / "llama", "llama")
    artifact = quantize(model, tmp_path / "out", "rtn: {bits: 4, group_size: 64}",
                        "overrides:\n  - {targets: [mlp], layers: [0], group_size: -1}\n", ", dtype: float16")
    with VllmEngine(PYTHON) as engine:
        if not refused_for_its_kernel(artifact, engine, tmp_path / "cache"):
            check_agreement(against_quantkit(artifact, engine, tmp_path / "cache"))
