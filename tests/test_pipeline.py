"""The whole path on tiny random models: recipe -> layer-wise GPTQ/RTN -> artifacts -> runtime/eval."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import run_cli, write_recipe
from quantkit import runtime
from quantkit.quantize import pipeline
from quantkit.quantize import targets as target_plan
from quantkit.quantize.calibration import build
from quantkit.errors import QuantkitError
from quantkit.model import load_model
from quantkit.progress import Reporter
from quantkit.recipe import parse_recipe
from reference_readers import read_compressed_tensors, read_gptq


def recipe_for(model, stage="gptq: {bits: 4, group_size: 32, sym: true, act_order: true}", samples=8):
    return parse_recipe({
        "model": str(model), "dtype": "float32", "device": "cpu",
        "calibration": {"num_samples": samples, "seq_len": 64},
        "stages": [__import__("yaml").safe_load(stage)],
        "export": {"output": "unused", "formats": ["gptq"]},
    })


@pytest.fixture(scope="module")
def artifacts(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("art")
    recipe = write_recipe(out / "r.yaml", tiny_llama, out / "q",
                          "gptq: {bits: 4, group_size: 32, sym: true, act_order: true}")
    mp = pytest.MonkeyPatch()
    assert run_cli(mp, "quantize", recipe, "--quiet", "--json", out / "q.json") == 0
    mp.undo()
    return out


def test_artifact_folders_are_complete(artifacts):
    for fmt, extra in (("gptq", "quantize_config.json"), ("compressed-tensors", None)):
        folder = artifacts / "q" / fmt
        names = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json", "quantkit.json"} <= names
        assert extra is None or extra in names
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["quantization_config"]["quant_method"] == fmt
        manifest = json.loads((folder / "quantkit.json").read_text())
        assert manifest["format"] == fmt and len(manifest["calibration"]["sha256"]) == 64
        assert manifest["recipe"]["stages"][0]["gptq"]["group_size"] == 32
        assert len(manifest["losses"]) == 14 and all(v > 0 for v in manifest["losses"].values())
        assert set(manifest["files"]) == names - {"quantkit.json"}
    assert not list((artifacts / "q").glob(".*partial*"))
    summary = json.loads((artifacts / "q.json").read_text())
    assert summary["quantized_modules"] == 14 and summary["timings_s"]["total"] > 0


def test_gptq_tensors_have_the_published_shapes(artifacts):
    with safe_open(str(artifacts / "q" / "gptq" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        q = "model.layers.0.self_attn.q_proj"
        assert f.get_tensor(f"{q}.qweight").shape == (64 * 4 // 32, 64)
        assert f.get_tensor(f"{q}.qzeros").shape == (2, 64 * 4 // 32)
        assert f.get_tensor(f"{q}.scales").dtype == torch.float16
        assert torch.equal(f.get_tensor(f"{q}.g_idx"), torch.arange(64, dtype=torch.int32) // 32)
    assert "lm_head.weight" not in names  # tied to the embedding
    assert not any(n.endswith("proj.weight") for n in names)
    # act-order is group-aware: g_idx stays trivial, so loaders must not reorder by it (vLLM's MoE refuses desc_act)
    qcfg = json.loads((artifacts / "q" / "gptq" / "config.json").read_text())["quantization_config"]
    assert qcfg["desc_act"] is False and qcfg["act_group_aware"] is True


def test_both_formats_dequantize_identically_by_reference_and_runtime(artifacts):
    ref_g = read_gptq(str(artifacts / "q" / "gptq"))
    ref_c = read_compressed_tensors(str(artifacts / "q" / "compressed-tensors"))
    assert set(ref_g) == set(ref_c) and len(ref_g) == 14
    state = runtime.load(str(artifacts / "q" / "gptq")).model.state_dict()
    for name in ref_g:
        assert torch.equal(ref_g[name], ref_c[name])
        assert torch.equal(ref_g[name], state[f"{name}.weight"])


def test_transformers_loads_compressed_tensors_artifact_and_matches_runtime(artifacts):
    from transformers import AutoModelForCausalLM

    folder = str(artifacts / "q" / "compressed-tensors")
    hf = AutoModelForCausalLM.from_pretrained(folder)  # no quantkit code on this path
    ours = runtime.load(folder).model
    x = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x).logits, rtol=1e-5, atol=1e-5)


def test_eval_gives_the_same_perplexity_for_both_formats(artifacts, tiny_llama, monkeypatch):
    ppl = {}
    for name, path in (("float", tiny_llama), ("gptq", artifacts / "q" / "gptq"),
                       ("ct", artifacts / "q" / "compressed-tensors")):
        out = artifacts / f"ppl-{name}.json"
        assert run_cli(monkeypatch, "eval", path, "--seq-len", 128, "--max-tokens", 1024, "--quiet", "--json", out) == 0
        body = json.loads(out.read_text())
        assert body["windows"] == 8 and body["tokens"] == 8 * 127
        ppl[name] = body["ppl"]["model"]
    assert ppl["gptq"] == ppl["ct"]
    assert abs(ppl["gptq"] / ppl["float"] - 1) < 0.05  # 4-bit g32 on a random tiny model barely moves


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "opt"])
def test_architectures_quantize_with_one_forward_per_block(tiny_factory, arch):
    loaded = load_model(str(tiny_factory(arch)), "float32")
    recipe = recipe_for(tiny_factory(arch))
    _, blocks = pipeline.decoder_blocks(loaded.model)
    calls = []  # windows per block forward
    for block in blocks:
        block.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    result = pipeline.quantize(loaded.model, recipe.stage, build(loaded.tokenizer, recipe.calibration),
                               torch.device("cpu"), ["gptq"], Reporter(quiet=True))
    n_linear = sum(1 for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear))
    assert len(result.qweights) == n_linear
    # collect + quantize + propagate in a single pass over every window; the first block first runs one window to
    # learn which Linears read one input
    assert calls == [1] + [recipe.calibration.num_samples] * len(blocks)
    assert "lm_head" in result.info.unquantized_linears


def logits_error(tiny, stage):
    ref = load_model(str(tiny), "float32").model
    loaded = load_model(str(tiny), "float32")
    recipe = recipe_for(tiny, stage, samples=16)
    pipeline.quantize(loaded.model, recipe.stage, build(loaded.tokenizer, recipe.calibration),
                      torch.device("cpu"), ["gptq"], Reporter(quiet=True))
    x = build(loaded.tokenizer, recipe_for(tiny, samples=4).calibration.model_copy(update={"seed": 9})).tokens
    with torch.no_grad():
        return float((ref(x).logits - loaded.model(x).logits).square().mean())


def test_gptq_output_is_closer_to_the_original_than_rtn(tiny_llama):
    gptq = logits_error(tiny_llama, "gptq: {bits: 3, group_size: -1, sym: true, act_order: true}")
    rtn = logits_error(tiny_llama, "rtn: {bits: 3, group_size: -1, sym: true}")
    assert gptq < 0.8 * rtn, (gptq, rtn)
    # bf16 Hessians (inputs and each window's product rounded to bf16): another artifact, as close as the fp32 one's
    bf16 = logits_error(tiny_llama, "gptq: {bits: 3, group_size: -1, sym: true, act_order: true, "
                                    "hessian_dtype: bfloat16}")
    assert bf16 != gptq and abs(bf16 / gptq - 1) < 0.05, (bf16, gptq)


def test_quantize_is_deterministic(tiny_llama, tmp_path, monkeypatch):
    digests = []
    for i in range(2):
        recipe = write_recipe(tmp_path / f"r{i}.yaml", tiny_llama, tmp_path / f"o{i}",
                              "gptq: {bits: 4, group_size: 32, sym: false}", formats=("gptq",))
        assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
        digests.append(json.loads((tmp_path / f"o{i}" / "gptq" / "quantkit.json").read_text())["files"])
    assert digests[0]["model.safetensors"] == digests[1]["model.safetensors"]


@pytest.mark.parametrize("load", ["memory", "stream"])
def test_quantize_prints_each_artifact_once_complete(tiny_llama, tmp_path, monkeypatch, capsys, load):
    """`wrote <format>: <path>` on stderr as each folder is finished (a newcomer sees where it is before the
    timings); nothing under --quiet."""
    printed = []

    def info(self, msg):
        if msg.startswith("wrote "):
            fmt, path = msg.removeprefix("wrote ").split(": ")
            printed.append((fmt, path.split(" (")[0], (tmp_path / "o" / fmt / "quantkit.json").exists()))

    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", "rtn: {bits: 4, group_size: 32}",
                          load=load)
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    assert "wrote" not in capsys.readouterr().err
    monkeypatch.setattr(Reporter, "info", info)
    assert run_cli(monkeypatch, "quantize", recipe, "--overwrite") == 0
    assert printed == [(f, str(tmp_path / "o" / f), True) for f in ("gptq", "compressed-tensors")]


def test_sharded_artifact_loads_everywhere(tiny_llama, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", "rtn: {bits: 4, group_size: 32}",
                          formats=("compressed-tensors",), extra=", max_shard_size: 100KB")
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    folder = tmp_path / "o" / "compressed-tensors"
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    x = torch.randint(0, 500, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(str(folder))(x).logits,
                                   runtime.load(str(folder)).model(x).logits, rtol=1e-5, atol=1e-5)


def test_interrupted_export_leaves_nothing_that_looks_finished(tiny_llama, tmp_path, monkeypatch):
    import quantkit.export.artifact as artifact

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(artifact._SpooledShard, "save", boom)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", "rtn: {bits: 4, group_size: 32}")
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 130  # Ctrl-C mid-write
    assert not (tmp_path / "o").exists() or list((tmp_path / "o").iterdir()) == []


@pytest.mark.parametrize("stage, edit, message", [
    ("gptq: {bits: 4, group_size: 128}", None,
     "stages.0.gptq.group_size: 128 does not divide in_features 64 of model.layers.0.self_attn.q_proj; use 32 or 64 or -1"),
    ("gptq: {bits: 4, group_size: 32}", lambda r: r.replace("dataset: wikitext2", "dataset: /nope/c4.jsonl"),
     "calibration.dataset: file not found: /nope/c4.jsonl"),
    ("gptq: {bits: 4, group_size: 32}", lambda r: r.replace("model: ", "model: /nope"),
     "model: not found: /nope"),
    ("gptq: {bits: 4, group_size: 32, ignore: ['re:.*']}", None,
     "stages.0.gptq.ignore: every Linear layer is ignored"),
])
def test_bad_input_is_one_line_and_writes_nothing(tiny_llama, tmp_path, monkeypatch, capsys, stage, edit, message):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", stage)
    if edit:
        recipe.write_text(edit(recipe.read_text()))
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "o").exists()


def test_too_short_calibration_text_and_existing_output(tiny_llama, tmp_path, monkeypatch, capsys):
    short = tmp_path / "short.txt"
    short.write_text("only a few words here")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", "gptq: {bits: 4, group_size: 32}")
    recipe.write_text(recipe.read_text().replace("dataset: wikitext2", f"dataset: {short}"))
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    assert "has 11 tokens, need at least 512 (num_samples 8 x seq_len 64)" in capsys.readouterr().err
    (tmp_path / "o" / "gptq").mkdir(parents=True)
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    assert "already exists (pass --overwrite to replace it)" in capsys.readouterr().err


def test_fused_experts_are_refused_until_unfused_and_odd_layouts_name_their_class(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.families import moe

    cfg = AutoConfig.for_model("mixtral", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(QuantkitError, match="keeps 3-D weights in mlp.experts.gate_up_proj"):
        target_plan.plan(model, recipe_for(tmp_path).stage, ["gptq"])
    model.model.layers[0].mlp.experts.is_transposed = True  # gpt-oss style [in, out] experts
    with pytest.raises(QuantkitError, match="MixtralExperts stores its experts with is_transposed"):
        moe.unfuse(model)
