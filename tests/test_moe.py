"""Mixture-of-experts: per-expert Linears that compute exactly what the fused experts do, full statistics for every
expert, and artifacts named as the original checkpoint names its experts."""

import io
import json

import pytest
import torch
from safetensors import safe_open

from conftest import run_cli, write_recipe
from quantkit.families import moe
from quantkit.errors import QuantkitError
from quantkit.model import load_model
from quantkit.progress import Reporter
from quantkit.quantize import pipeline
from quantkit.quantize.calibration import build
from quantkit.recipe import parse_recipe
from tiny_models import MOE_FAMILIES

SAMPLES, SEQ = 8, 64


def recipe(model, stage="gptq: {bits: 4, group_size: 32, sym: true}", **moe_args):
    return parse_recipe({"model": str(model), "dtype": "float32", "device": "cpu",
                         "calibration": {"num_samples": SAMPLES, "seq_len": SEQ}, "moe": moe_args,
                         "stages": [__import__("yaml").safe_load(stage)],
                         "export": {"output": "unused", "formats": ["gptq"]}})


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_unfused_experts_give_the_fused_routed_output_exactly(tiny_factory, arch):
    fused = load_model(str(tiny_factory(arch)), "float32").model
    fused.config._experts_implementation = "eager"  # transformers' reference loop (the default may be grouped_mm)
    x = torch.randint(3, 500, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = fused(x).logits
    unfused = load_model(str(tiny_factory(arch)), "float32").model
    assert moe.unfuse(unfused) == sum(1 for m in fused.modules() if moe._fused(m)) > 0
    blocks = moe.experts_of(unfused)
    calls = {}
    for _, experts in blocks:
        for e, expert in enumerate(experts):
            expert.gate_proj.register_forward_pre_hook(
                lambda m, a, key=(id(experts), e): calls.setdefault(key, []).append(
                    (a[0].shape[0], moe.replaying(m))))
    with torch.no_grad():
        assert torch.equal(unfused(x).logits, want)  # routed only, as the runtime runs
        routed = dict(calls)
        calls.clear()
        with moe.calibrating([e for _, e in blocks], True):
            assert torch.equal(unfused(x).logits, want)  # every token through every expert: same output
    tokens = x.numel()
    for key, seen in calls.items():
        # first all tokens, counted; then the routed ones again, marked as a replay the statistics skip
        assert seen[0] == (tokens, False) and all(replay for _, replay in seen[1:]), seen
        assert [n for n, _ in seen[1:]] == [n for n, _ in routed.get(key, [])]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_calibrate_all_experts_gives_every_expert_the_full_token_count(tiny_factory, arch):
    loaded = load_model(str(tiny_factory(arch)), "float32")
    moe.unfuse(loaded.model)
    r = recipe(tiny_factory(arch))
    result = pipeline.quantize(loaded.model, r.stage, build(loaded.tokenizer, r.calibration), torch.device("cpu"),
                               ["gptq"], Reporter(quiet=True), moe_args=r.moe)
    experts = {n: t for n, t in result.tokens.items() if ".experts." in n}
    n_experts = sum(len(e) for _, e in moe.experts_of(loaded.model))
    assert len(experts) == 3 * n_experts and set(experts.values()) == {SAMPLES * SEQ}
    assert all(t == SAMPLES * SEQ for t in result.tokens.values())  # dense and shared-expert Linears too
    # routers stay float, and loaders are told so
    routers = [n for n in result.info.unquantized_linears if n.endswith((".mlp.gate", "shared_expert_gate"))]
    assert len(routers) == len(moe.experts_of(loaded.model)) and not any(n in result.qweights for n in routers)


def test_routed_only_calibration_counts_routed_tokens_and_names_starved_experts(tiny_factory):
    loaded = load_model(str(tiny_factory("qwen3_moe")), "float32")
    moe.unfuse(loaded.model)
    top_k = loaded.model.config.num_experts_per_tok
    r = recipe(tiny_factory("qwen3_moe"), calibrate_all_experts=False, min_tokens=SAMPLES * SEQ * top_k // 8)
    log = io.StringIO()
    result = pipeline.quantize(loaded.model, r.stage, build(loaded.tokenizer, r.calibration), torch.device("cpu"),
                               ["gptq"], Reporter(quiet=True, stream=log), moe_args=r.moe)
    for block in range(2):
        gate = {n: t for n, t in result.tokens.items() if n.startswith(f"model.layers.{block}.mlp.experts.")
                and n.endswith("gate_proj")}
        # each token goes to top_k distinct experts; an expert's gate_proj counts exactly the tokens routed to it
        assert len(gate) == 8 and sum(gate.values()) == SAMPLES * SEQ * top_k
        starved = [n for n, t in gate.items() if t < r.moe.min_tokens]
        assert starved, gate  # the threshold is the mean share: some expert gets less
        for name in starved:
            assert f"warning: {name}: only {gate[name]} calibration tokens routed to this expert " \
                   f"(moe.min_tokens {r.moe.min_tokens}); quantized with RTN" in log.getvalue()


def test_routed_only_calibration_over_several_processes_is_refused(tiny_factory):
    from quantkit.quantize.distributed import Ranks

    loaded = load_model(str(tiny_factory("qwen3_moe")), "float32")
    moe.unfuse(loaded.model)
    r = recipe(tiny_factory("qwen3_moe"), calibrate_all_experts=False)
    with pytest.raises(QuantkitError, match="^moe.calibrate_all_experts: false routes different tokens"):
        pipeline.quantize(loaded.model, r.stage, None, torch.device("cpu"), ["gptq"], Reporter(quiet=True),
                          ranks=Ranks(rank=0, world=2), moe_args=r.moe)


def _checkpoint_keys(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", MOE_FAMILIES)
def test_artifacts_name_every_tensor_as_the_hub_checkpoint_does(tiny_factory, tmp_path, monkeypatch, arch):
    """save_pretrained writes per-expert tensors under the hub's names (Mixtral: block_sparse_moe.experts.E.w1 ...);
    each artifact stores the same modules under the same names, a quantized one's weight as its packed tensors."""
    folder = tiny_factory(arch)
    original = _checkpoint_keys(folder)
    assert any(".experts.0." in k for k in original)  # per-expert, as on the hub
    out = tmp_path / "out"
    path = write_recipe(tmp_path / "r.yaml", folder, out, "gptq: {bits: 4, group_size: 32, sym: true}")
    assert run_cli(monkeypatch, "quantize", path, "--quiet") == 0
    packed = {"gptq": {"qweight", "qzeros", "scales", "g_idx"},
              "compressed-tensors": {"weight_packed", "weight_scale", "weight_shape"}}
    for fmt, suffixes in packed.items():
        stored = _checkpoint_keys(out / fmt)
        quantized = {k.rpartition(".")[0] for k in stored if k.rpartition(".")[2] in suffixes}
        assert quantized and all(f"{m}.weight" in original for m in quantized), sorted(quantized - {
            k.rpartition(".")[0] for k in original})[:3]
        expected = {k for k in original if k.rpartition(".")[0] not in quantized or k.endswith(".bias")}
        expected |= {f"{m}.{s}" for m in quantized for s in suffixes}
        assert stored == expected, (sorted(stored - expected)[:4], sorted(expected - stored)[:4])
        experts = {m for m in quantized if ".experts." in m}
        assert len(experts) == 3 * 8 * (1 if arch == "deepseek_v3" else 2)
        qcfg = json.loads((out / fmt / "config.json").read_text())["quantization_config"]
        if fmt == "compressed-tensors":  # the routers are named as the checkpoint names them
            routers = [n for n in qcfg["ignore"] if n.endswith("gate")]
            assert routers and all(f"{n}.weight" in original for n in routers), qcfg["ignore"]
