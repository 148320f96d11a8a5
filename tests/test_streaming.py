"""Streamed quantization (`load: stream`): a safetensors checkpoint read one block at a time gives the same
artifact bytes as the in-memory path, stays within its memory plan, resumes after a kill, and a run that cannot fit
stops before any work with the option to change."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import run_cli, write_recipe
from safetensors import safe_open
from test_resume import quantize, safetensors_bytes
from tiny_models import tiny_config, tiny_tokenizer

STAGES = {
    "rtn": "rtn: {bits: 4, group_size: 32, sym: true}",
    "gptq": "gptq: {bits: 4, group_size: 32, sym: false, act_order: true}",
    "awq+gptq": "awq: {bits: 4, group_size: 32, zero_point: true, grid: 4}\n  - gptq: {bits: 4, group_size: 32, sym: false}",
    "sq-w8a8": "smoothquant: {alpha: 0.8}\n  - gptq: {bits: 8, group_size: -1, activations: {bits: 8}}",
    "sq-rtn": "smoothquant: {alpha: 0.8}\n  - rtn: {bits: 8, group_size: -1, activations: {bits: 8}}",
}
FORMATS = {"rtn": ("gptq", "compressed-tensors", "awq"), "gptq": ("gptq", "compressed-tensors"),
           "awq+gptq": ("awq", "compressed-tensors"), "sq-w8a8": ("compressed-tensors",),
           "sq-rtn": ("compressed-tensors",)}


def sharded_checkpoint(folder: Path, tied: bool, layers: int = 4, hidden: int = 64, shard: str = "60KB",
                       dtype=torch.float32) -> Path:
    """A tiny Llama saved as a hub checkpoint is: sharded safetensors with an index, tokenizer, configs."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    cfg = tiny_config("llama", len(tok), hidden=hidden, layers=layers)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    folder.mkdir(parents=True)
    model.save_pretrained(folder, max_shard_size=shard)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {tied: sharded_checkpoint(root / f"tied-{tied}", tied) for tied in (True, False)}


def artifact_files(folder: Path) -> dict[str, bytes]:
    """Everything but the manifest (which records the load mode, output path and timings)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "quantkit.json"}


# the head plays no part in the transforms: the tied / untied pair is covered by rtn and gptq
@pytest.mark.parametrize("stages,tied", [("rtn", True), ("rtn", False), ("gptq", True), ("gptq", False),
                                         ("awq+gptq", True), ("sq-w8a8", True)])
def test_streamed_and_in_memory_artifacts_are_byte_identical(checkpoints, tmp_path, monkeypatch, stages, tied):
    ckpt = checkpoints[tied]
    assert len(list(ckpt.glob("model-*.safetensors"))) > 3  # really sharded
    outs = {}
    for load in ("memory", "stream"):
        out = tmp_path / load
        recipe = write_recipe(tmp_path / f"{load}.yaml", ckpt, out, STAGES[stages], FORMATS[stages],
                              extra=", max_shard_size: 40KB", load=load)
        assert run_cli(monkeypatch, "quantize", recipe, "--quiet", "--json", tmp_path / f"{load}.json") == 0
        assert json.loads((tmp_path / f"{load}.json").read_text())["load"] == load
        outs[load] = out
    for fmt in FORMATS[stages]:
        mem, stream = artifact_files(outs["memory"] / fmt), artifact_files(outs["stream"] / fmt)
        assert sum(n.endswith(".safetensors") for n in mem) > 1, "the artifact should be sharded too"
        assert mem.keys() == stream.keys()
        for name in mem:
            assert mem[name] == stream[name], f"{fmt}/{name}"
        index = json.loads(mem["model.safetensors.index.json"])["weight_map"]
        # the tied head is stored once, as the original stores it; an untied one is kept
        assert "model.embed_tokens.weight" in index and ("lm_head.weight" in index) == (not tied)
        original = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
        assert ("lm_head.weight" in original) == (not tied)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_checkpoints_stream_each_expert_by_its_hub_name_byte_identically(tmp_path, monkeypatch, arch):
    """A sharded per-expert checkpoint (Mixtral: block_sparse_moe.experts.E.w1 ...) streamed block by block writes
    the in-memory run's bytes; each expert Linear is read by its checkpoint name."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), layers=3), dtype=torch.float32)
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt, max_shard_size="60KB")
    tok.save_pretrained(ckpt)
    assert len(list(ckpt.glob("model-*.safetensors"))) > 3
    outs = {}
    for load in ("memory", "stream"):
        recipe = write_recipe(tmp_path / f"{load}.yaml", ckpt, tmp_path / load, STAGES["gptq"], FORMATS["gptq"],
                              extra=", max_shard_size: 40KB", load=load)
        assert run_cli(monkeypatch, "quantize", recipe, "--quiet", "--json", tmp_path / f"{load}.json") == 0
        assert json.loads((tmp_path / f"{load}.json").read_text())["load"] == load
        outs[load] = tmp_path / load
    for fmt in FORMATS["gptq"]:
        mem, stream = artifact_files(outs["memory"] / fmt), artifact_files(outs["stream"] / fmt)
        assert mem.keys() == stream.keys() and all(mem[n] == stream[n] for n in mem), fmt


def test_streamed_run_reads_only_one_block_at_a_time(checkpoints, tmp_path, monkeypatch):
    """Every block is materialised once, alone, and goes back to the meta device before the next one loads."""
    from quantkit.quantize import source

    ckpt = checkpoints[True]
    seen: list[tuple[int, int, int]] = []  # (block loaded, blocks with real weights, real weights outside blocks)
    load = source.Streamed.load

    def spy(self, i, block, device):
        load(self, i, block, device)
        real = sum(any(p.device.type != "meta" for p in b.parameters()) for b in self.blocks)
        outer = [n for n, p in self.model.named_parameters() if p.device.type != "meta" and
                 not n.startswith(self.prefix + ".")]
        seen.append((i, real, len(outer)))

    monkeypatch.setattr(source.Streamed, "load", spy)
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, tmp_path / "o", STAGES["gptq"], ("gptq",), load="stream")
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    assert seen == [(i, 1, 0) for i in range(4)]


def test_streamed_kill_and_resume_is_byte_identical(checkpoints, tmp_path):
    ckpt = checkpoints[True]
    formats = ("gptq", "compressed-tensors")
    whole = write_recipe(tmp_path / "whole.yaml", ckpt, tmp_path / "whole", STAGES["awq+gptq"], formats,
                         load="memory")
    assert quantize(whole).returncode == 0
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, tmp_path / "out", STAGES["awq+gptq"], formats, load="stream")
    assert quantize(recipe, kill_after_block=1).returncode == -signal.SIGKILL
    assert not (tmp_path / "out" / "gptq").exists()
    resumed = quantize(recipe)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after block 2/4" in resumed.stderr and "block 1/4 " not in resumed.stderr
    for fmt in formats:
        got, want = safetensors_bytes(tmp_path / "out" / fmt), safetensors_bytes(tmp_path / "whole" / fmt)
        assert got.keys() == want.keys() and all(got[k] == want[k] for k in want), fmt


def test_activations_that_cannot_fit_fail_before_any_work(checkpoints, tmp_path, monkeypatch, capsys):
    # 2M windows x 2048 tokens x 64 hidden: terabytes of hidden states; the text has nowhere near that many tokens,
    # so reaching calibration would fail with another message: the plan comes first
    recipe = write_recipe(tmp_path / "r.yaml", checkpoints[True], tmp_path / "o", STAGES["gptq"], ("gptq",),
                          samples=2_000_000, seq_len=2048, load="stream")
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: memory plan: the run needs ")
    # auto offload tried the device, host memory and then disk: even files cannot hold them
    assert "of disk space under export.output" in err[-1] and "the largest part is hidden_states" in err[-1]
    assert err[-1].endswith("lower calibration.num_samples or calibration.seq_len")
    assert not any(line.startswith("calibration:") for line in err)
    assert not (tmp_path / "o").exists()


def test_in_memory_model_that_cannot_fit_names_load_stream(checkpoints, tmp_path, monkeypatch, capsys):
    from quantkit.quantize import run

    plans = {}
    for load in ("memory", "stream"):
        recipe = write_recipe(tmp_path / f"{load}.yaml", checkpoints[True], tmp_path / load, STAGES["rtn"],
                              ("gptq",), load=load)
        assert run_cli(monkeypatch, "quantize", recipe, "--quiet", "--json", tmp_path / f"{load}.json") == 0
        plans[load] = json.loads((tmp_path / f"{load}.json").read_text())["memory"]["plan"]["host_total"]
    assert plans["stream"] < plans["memory"]
    # free memory between the two plans: the whole model does not fit, one block at a time does
    monkeypatch.setattr(run, "host_available", lambda: (plans["memory"] + plans["stream"]) // 2)
    assert run_cli(monkeypatch, "quantize", tmp_path / "memory.yaml", "--overwrite") == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the largest part is weights" in err
    assert err.endswith("set load: stream (safetensors checkpoints) to hold one block at a time")
    auto = write_recipe(tmp_path / "a.yaml", checkpoints[True], tmp_path / "a", STAGES["rtn"], ("gptq",))
    assert run_cli(monkeypatch, "quantize", auto, "--quiet", "--json", tmp_path / "a.json") == 0
    assert json.loads((tmp_path / "a.json").read_text())["load"] == "stream"  # auto streams it


def test_stream_needs_a_safetensors_folder(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config("llama", 512).to_dict()))
    recipe = write_recipe(tmp_path / "r.yaml", folder, tmp_path / "o", STAGES["rtn"], ("gptq",), load="stream")
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: model: {folder} has no model.safetensors or model.safetensors.index.json (load: stream reads "
        "safetensors checkpoints; use load: memory)")


@pytest.mark.slow
def test_streamed_peak_host_memory_stays_within_the_plan(tmp_path):
    """A 24-block, ~230 MB float32 checkpoint: the streamed run's peak resident memory above its start stays under
    the plan's bound (one block, the solver's buffers, a shard and a fixed allowance), and the in-memory run of the
    same recipe goes well past that bound, within its own plan."""
    ckpt = sharded_checkpoint(tmp_path / "ckpt", tied=False, layers=24, hidden=512, shard="64MB")
    growth, plans = {}, {}
    for load in ("stream", "memory"):
        recipe = write_recipe(tmp_path / f"{load}.yaml", ckpt, tmp_path / load, STAGES["gptq"], ("gptq",),
                              samples=4, seq_len=64, extra=", max_shard_size: 16MB", load=load)
        run = quantize(recipe, "--json", str(tmp_path / f"{load}.json"))
        assert run.returncode == 0, run.stderr
        mem = json.loads((tmp_path / f"{load}.json").read_text())["memory"]
        growth[load], plans[load] = mem["rss_peak"] - mem["rss_start"], mem["plan"]["host_total"]
    weights = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert plans["stream"] < weights * 0.6 and plans["stream"] < plans["memory"] / 2, (plans, weights)
    assert growth["stream"] <= plans["stream"], (growth, plans)
    assert plans["stream"] * 1.5 < growth["memory"] <= plans["memory"], (growth, plans)
    with safe_open(str(next(ckpt.glob("model-*.safetensors"))), "pt") as f:
        assert f.keys()  # the checkpoint really is safetensors shards


def test_a_checkpoint_missing_a_tensor_is_named(checkpoints, tmp_path, monkeypatch, capsys):
    import shutil

    ckpt = shutil.copytree(checkpoints[True], tmp_path / "ckpt")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.up_proj.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, tmp_path / "o", STAGES["rtn"], ("gptq",), load="stream")
    assert run_cli(monkeypatch, "quantize", recipe) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"error: model: {ckpt} has no tensor for model.layers.2.mlp.up_proj.weight (and 0 more); is it a checkpoint "
        "of this config.json?")


def test_eval_base_streamed_block_by_block_matches_the_whole_base(checkpoints, tmp_path, monkeypatch):
    """`quantkit eval --base-load stream` gets the base's log-probs block by block over all windows; the shift it
    measures equals the one from the base loaded whole (batched vs one-window matmuls: last-bit differences)."""
    ckpt = checkpoints[False]
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, tmp_path / "o", STAGES["rtn"], ("compressed-tensors",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    res = {}
    for load in ("memory", "stream"):
        out = tmp_path / f"{load}.json"
        assert run_cli(monkeypatch, "eval", tmp_path / "o" / "compressed-tensors", "--base", ckpt, "--base-load", load,
                       "--seq-len", 128, "--max-tokens", 1024, "--no-generation", "--cache-dir", tmp_path / load,
                       "--quiet", "--json", out) == 0
        res[load] = json.loads(out.read_text())
    mem, stream = res["memory"], res["stream"]
    assert mem["windows"] == stream["windows"] == 8
    assert abs(stream["ppl"]["base"] / mem["ppl"]["base"] - 1) < 1e-5
    assert stream["ppl"]["model"] == mem["ppl"]["model"]  # the artifact side is the same code path
    assert abs(stream["kld"]["mean"] - mem["kld"]["mean"]) < 1e-6 and stream["kld"]["mean"] > 1e-4
    assert stream["same_top"] == pytest.approx(mem["same_top"], abs=2e-3)


def test_eval_base_stream_refuses_what_needs_the_whole_base(checkpoints, tmp_path, monkeypatch, capsys):
    ckpt = checkpoints[False]
    assert run_cli(monkeypatch, "eval", ckpt, "--base", ckpt, "--base-load", "stream", "--max-tokens", 512,
                   "--seq-len", 128, "--cache-dir", tmp_path, "--quiet") == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --base-load stream: only the base's log-probs are computed block by block; generation (pass "
        "--no-generation) needs the whole base (or its cached results)")


@pytest.mark.parametrize("preset, expected", [(None, "1"), ("0", "0")])
def test_quantize_asks_torch_for_huge_pages_unless_told_otherwise(tiny_llama, tmp_path, monkeypatch, preset, expected):
    """torch reads THP_MEM_ALLOC_ENABLE once, at its first allocation: `quantkit quantize` sets it before the run
    (the torchrun ranks it launches inherit it) and keeps a value the caller set."""
    import os

    import quantkit.quantize.run as run

    seen = {}

    def record(*args, **kwargs):
        seen["thp"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
        return {}

    monkeypatch.setattr(run, "run_quantize", record)
    if preset is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", preset)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", STAGES["rtn"], ("gptq",))
    assert run_cli(monkeypatch, "quantize", recipe) == 0
    assert seen == {"thp": expected}
