"""FP8 KV cache (recipe `kv_cache`): k / v scales are amax / 448 of the keys and values the quantized model's
attention sees, per tensor or per KV head, the same bits whatever the run's shape (streamed, micro-batched, resumed);
written as compressed-tensors / vLLM read them; quantkit's runtime passes every state through e4m3 with them."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from conftest import write_recipe
from safetensors.torch import load_file
from test_distributed import quantkit
from test_resume import quantize as quantize_in_child
from tiny_models import make_tiny_model
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from quantkit.errors import QuantkitError
from quantkit.kernels import kv_cache
from quantkit.progress import Reporter
from quantkit.quantize import calibration
from quantkit.quantize.run import run_quantize
from quantkit.recipe import load_recipe, parse_recipe
from quantkit.runtime import load

GPTQ = "gptq: {bits: 4, group_size: 32}"
RTN = "rtn: {bits: 4, group_size: 32}"


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama3", "llama", layers=3)


def kv_recipe(tmp_path: Path, model: Path, name: str, stage: str = GPTQ, strategy: str = "tensor",
              calibration_extra: str = "", load_mode: str = "auto") -> Path:
    path = write_recipe(tmp_path / f"{name}.yaml", model, tmp_path / name, stage, ("compressed-tensors",),
                        samples=6, load=load_mode)
    text = path.read_text().replace("seed: 0}", f"seed: 0{calibration_extra}}}")
    path.write_text(text + f"kv_cache: {{bits: 8, type: float, strategy: {strategy}}}\n")
    return path


def run(recipe: Path) -> Path:
    run_quantize(load_recipe(recipe), overwrite=False, report=Reporter(quiet=True))
    return Path(load_recipe(recipe).export.output) / "compressed-tensors"


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


@contextmanager
def attention_inputs(seen: list):
    """Records the key / value states every sdpa attention call receives (what the attention computes with)."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def recording(module, query, key, value, *args, **kwargs):
        seen.append((key, value))
        return sdpa(module, query, key, value, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["sdpa"] = recording
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def states_without_kv_cache(artifact: Path, tokens: torch.Tensor) -> list:
    """Each layer's keys and values on `tokens`, by the artifact's weights with the KV cache hooks off."""
    loaded = load(str(artifact))
    for m in kv_cache.attention_modules(loaded.model).values():
        m._forward_pre_hooks.clear()
    seen: list = []
    with attention_inputs(seen), torch.no_grad():
        loaded.model(input_ids=tokens, use_cache=False)
    return seen


@pytest.mark.parametrize("strategy", ["tensor", "head"])
def test_scales_are_amax_over_448_of_what_the_quantized_attention_sees(three_layers, tmp_path, strategy):
    """GPTQ W4 + FP8 KV: brute force over the calibration windows through the quantized model (its dequantized
    weights, whole-model forward) gives the artifact's scales to the bit."""
    recipe = kv_recipe(tmp_path, three_layers, "out", strategy=strategy)
    artifact = run(recipe)
    r = load_recipe(recipe)
    calib = calibration.build(load(str(artifact)).tokenizer, r.calibration, str(three_layers), "float32")
    stored = tensors(artifact)
    dims = (0, 2, 3) if strategy == "head" else (0, 1, 2, 3)
    for i, (k, v) in enumerate(states_without_kv_cache(artifact, calib.tokens)):
        for kind, x in (("k", k), ("v", v)):
            want = x.abs().amax(dim=dims).reshape([1] if strategy == "tensor" else [-1, 1, 1]) / 448
            got = stored[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert got.dtype == torch.float32 and torch.equal(got, want), (i, kind)
    assert sum(k.endswith(("k_scale", "v_scale")) for k in stored) == 6


def test_streamed_and_micro_batched_runs_write_the_in_memory_bytes(three_layers, tmp_path):
    ref = run(kv_recipe(tmp_path, three_layers, "memory", strategy="head", load_mode="memory"))
    want = (ref / "model.safetensors").read_bytes()
    assert (run(kv_recipe(tmp_path, three_layers, "stream", strategy="head", load_mode="stream"))
            / "model.safetensors").read_bytes() == want
    batches = run(kv_recipe(tmp_path, three_layers, "batches", strategy="head",
                            calibration_extra=", offload: cpu, batch_size: 4"))
    assert (batches / "model.safetensors").read_bytes() == want


@pytest.mark.slow  # three child processes and torchrun: about a minute on a busy machine
def test_resumed_and_two_rank_runs_write_the_one_process_bytes(three_layers, tmp_path):
    """The checkpoint keeps the amax of the blocks done; two ranks reduce theirs by max (one window per forward
    everywhere: a matmul's last bits depend on its rows)."""
    want = (run(kv_recipe(tmp_path, three_layers, "one", strategy="head")) / "model.safetensors").read_bytes()
    recipe = kv_recipe(tmp_path, three_layers, "resumed", strategy="head")
    assert quantize_in_child(recipe, kill_after_block=1).returncode != 0
    state = json.loads(next((tmp_path / "resumed").glob(".quantkit-resume/*/state.json")).read_text())
    assert len(state["extra"]["observers"][0]) == 2  # blocks 0 and 1's amax, saved with their checkpoints
    resumed = quantize_in_child(recipe)
    assert resumed.returncode == 0 and "resuming after block 2/3" in resumed.stderr, resumed.stderr
    assert (tmp_path / "resumed" / "compressed-tensors" / "model.safetensors").read_bytes() == want
    two = quantkit("quantize", kv_recipe(tmp_path, three_layers, "two", strategy="head"), "--nproc", 2)
    assert two.returncode == 0 and "2 processes (3 windows on rank 0)" in two.stderr, two.stderr
    assert (tmp_path / "two" / "compressed-tensors" / "model.safetensors").read_bytes() == want


def test_runtime_quantize_dequantize_is_the_reference(three_layers, tmp_path):
    """What the attention computes with in quantkit's runtime is compressed-tensors' own fake-quantization of the
    states the attention made (float32: e4m3(clamp(x / s)) · s), and an RTN recipe with kv_cache calibrates too."""
    artifact = run(kv_recipe(tmp_path, three_layers, "rtn", stage=RTN, strategy="head"))
    scales = tensors(artifact)
    model = load(str(artifact)).model
    made: list = []  # the states before the runtime's hook (registered after it, so it sees them first)
    for m in kv_cache.attention_modules(model).values():
        kv_cache.on_states(m, lambda k, v: made.append((k, v)) or (k, v))
    seen: list = []
    with attention_inputs(seen), torch.no_grad():
        model(input_ids=torch.arange(3, 51).reshape(2, 24), use_cache=False)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="attn_head", dynamic=False)
    changed = 0
    assert len(seen) == len(made) == 3
    for i, ((k, v), (fk, fv)) in enumerate(zip(seen, made)):
        for kind, got, x in (("k", k, fk), ("v", v, fv)):
            s = scales[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert torch.equal(got, fake_quantize(x, s, torch.zeros_like(s), args))
            changed += int((got != x).sum())
    assert changed > 0.9 * sum(k.numel() + v.numel() for k, v in seen)  # e4m3 keeps 3 mantissa bits


def test_qdq_clamps_and_rounds_like_e4m3():
    s = torch.tensor([0.5])
    x = torch.tensor([1.0, 300.0, -300.0, 0.26, 0.29, 1.0625])
    # 300 / 0.5 = 600 clamps to 448; e4m3 keeps 3 mantissa bits: 0.52 -> 0.5, 0.58 -> 0.5625, 2.125 -> 2.0 (a tie,
    # to even)
    assert kv_cache.qdq(x, s).tolist() == [1.0, 224.0, -224.0, 0.25, 0.28125, 1.0]
    assert kv_cache.scale_of(torch.tensor([0.0, 896.0])).tolist() == [torch.finfo(torch.float32).tiny, 2.0]


def test_layout_is_what_compressed_tensors_and_vllm_read(three_layers, tmp_path):
    artifact = run(kv_recipe(tmp_path, three_layers, "head", strategy="head"))
    qcfg = json.loads((artifact / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                       "strategy": "attn_head", "group_size": None}
    QuantizationArgs.model_validate(qcfg["kv_cache_scheme"])  # compressed-tensors reads it back
    scales = {k: v for k, v in tensors(artifact).items() if k.endswith(("k_scale", "v_scale"))}
    assert sorted(scales) == sorted(f"model.layers.{i}.self_attn.{kind}_scale" for i in range(3) for kind in "kv")
    heads = json.loads((three_layers / "config.json").read_text())["num_key_value_heads"]
    assert {(t.dtype, tuple(t.shape)) for t in scales.values()} == {(torch.float32, (heads, 1, 1))}
    from quantkit.verify import verify
    assert verify(artifact).ok


BAD = [
    ("kv_cache: {bits: 4}", "kv_cache.bits: Input should be 8 (got 4)"),
    ("kv_cache: {type: int}", "kv_cache.type: Input should be 'float' (got 'int')"),
    ("kv_cache: {strategy: channel}", "kv_cache.strategy: Input should be 'tensor' or 'head' (got 'channel')"),
    ("kv_cache: {scale: 1}", "kv_cache: unknown key 'scale' (accepted: bits, type, strategy)"),
]


@pytest.mark.parametrize("block,line", BAD)
def test_bad_kv_cache_is_one_line(tmp_path, block, line):
    path = write_recipe(tmp_path / "r.yaml", "m", tmp_path / "o", GPTQ, ("compressed-tensors",))
    path.write_text(path.read_text() + block + "\n")
    with pytest.raises(QuantkitError) as err:
        load_recipe(path)
    assert str(err.value) == f"{path}: {line}"


def test_formats_without_kv_scales_and_uncalibrated_recipes_are_refused():
    base = {"model": "m", "stages": [{"rtn": {"bits": 4}}], "kv_cache": {}, "export": {"output": "o"}}
    with pytest.raises(QuantkitError) as err:
        parse_recipe(base)
    assert str(err.value) == "recipe: kv_cache: its k / v scales are calibrated; add a calibration section"
    with pytest.raises(QuantkitError) as err:
        parse_recipe(base | {"calibration": {}, "export": {"output": "o", "formats": ["compressed-tensors", "gptq"]}})
    assert str(err.value) == ("recipe: export.formats: gptq cannot carry an FP8 KV cache's k / v scales; a recipe "
                              "with kv_cache is written as compressed-tensors only")
    # without kv_cache the recipe's dump (quantkit.json, the resume key) has no kv_cache key
    assert "kv_cache" not in parse_recipe(base | {"kv_cache": None}).model_dump()


def test_bench_reports_kv_bytes_per_token_and_capacity(three_layers, tmp_path):
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64): 11,520 bytes per token in fp8, 23,040 in 16 bits; a GiB
    holds twice the sequences."""
    from transformers import LlamaConfig

    from quantkit.bench.decode import kv_cache_bytes
    from quantkit.bench.runner import kv_capacity, markdown
    from quantkit.runtime import kv_cache_scheme

    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)
    fp8, b16 = (kv_cache_bytes(cfg, 1, 1, d) for d in (torch.float8_e4m3fn, torch.float16))
    assert (fp8, b16) == (11520, 23040)
    models = [{"name": "model", "path": "out/compressed-tensors",
               "kv_cache": {"dtype": "fp8_e4m3", "bytes_per_token": fp8}},
              {"name": "base", "path": "base", "kv_cache": {"dtype": "16-bit", "bytes_per_token": b16}}]
    rows = kv_capacity(models, 640, 2**30)
    assert [(r["sequences"], r["capacity_ratio"]) for r in rows] == [(145, 2.0), (72, 1.0)]
    body = {"device_name": "cpu", "peaks": {"copy_bw_bytes_s": 1e9, "matmul_dtype": "float32", "matmul_flops": 1e9},
            "settings": {"prompt_len": 512, "gen_len": 128, "reps": 1}, "models": [], "runs": [], "roofline": [],
            "ratios": [], "kv_capacity": rows}
    assert "| model | out/compressed-tensors | fp8_e4m3 | 11,520 | 145 | 2.00× |" in markdown(body)
    artifact = run(kv_recipe(tmp_path, three_layers, "bench"))
    assert kv_cache_scheme(artifact)["strategy"] == "tensor" and kv_cache_scheme(three_layers) is None


def test_transformers_loads_the_artifact_but_ignores_its_kv_scales(three_layers, tmp_path):
    """compressed-tensors 0.20.1 hooks attention modules whose forward takes `past_key_values`; transformers 5.25's
    take `cache`, so from_pretrained reports k_scale / v_scale as unexpected and runs a 16-bit KV cache: its logits
    are quantkit's with the KV cache hooks off (docs/formats.md). Fails when that changes."""
    from transformers import AutoModelForCausalLM

    artifact = run(kv_recipe(tmp_path, three_layers, "hf"))
    ids = torch.arange(3, 35).reshape(1, 32)
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(str(artifact), dtype=torch.float32)(ids).logits
        ours = load(str(artifact)).model
        with_kv = ours(ids).logits
        for m in kv_cache.attention_modules(ours).values():
            m._forward_pre_hooks.clear()
        assert torch.equal(hf, ours(ids).logits) and not torch.equal(hf, with_kv)
