"""quantkit search: the exact allocation, the sensitivity pass, the chosen recipe and its artifact."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from quantkit.errors import QuantkitError
from quantkit.search import allocate


def _brute(increase, cost, budget):
    best = None
    for pick in itertools.product(range(cost.shape[1]), repeat=cost.shape[0]):
        ch = allocate.choice(list(pick), increase, cost)
        if ch.bytes <= budget and (best is None or ch.worst < best.worst - 1e-12):
            best = ch
    return best


@pytest.mark.parametrize("seed", range(5))
def test_allocation_is_the_exact_min_max(seed):
    """The MILP's worst domain equals brute force's over every mix of 6 groups x 3 candidates x 3 domains."""
    rng = np.random.default_rng(seed)
    inc = rng.random((6, 3, 3)) * np.array([1.0, 0.3, 0.0])[None, :, None]  # a float candidate costs no KLD
    cost = np.tile(np.array([100, 200, 400]), (6, 1)) + rng.integers(0, 50, (6, 3))
    budget = int(cost[:, 1].sum())
    got, want = allocate.allocate(inc, cost, budget), _brute(inc, cost, budget)
    assert got.bytes <= budget
    assert got.worst == pytest.approx(want.worst, rel=1e-6, abs=1e-9)


def test_budget_below_the_cheapest_mix_is_one_line():
    inc = np.zeros((2, 2, 1))
    cost = np.array([[10, 20], [10, 20]])
    with pytest.raises(QuantkitError, match=r"search.budget: 19 bytes .* cheapest candidate of every group already "
                                            r"takes 20"):
        allocate.allocate(inc, cost, 19)


def _search_recipe(path, model, out, budget: str = "{same_bytes_as: {bits: 4, group_size: 32}}",
                   candidates: str = "[{bits: 4, group_size: -1}, {bits: 4, group_size: 32}, {bits: 8, group_size: -1}, "
                                     "unquantized]", export_dtype: str = "auto"):
    path.write_text(
        f"model: {model}\ndtype: float32\n"
        "calibration: {dataset: mixture, num_samples: 16, seq_len: 64, seed: 0}\n"
        "stages:\n  - gptq: {bits: 4, group_size: 32, sym: true, act_order: true}\n"
        f"export: {{output: {out}, formats: [compressed-tensors], dtype: {export_dtype}}}\n"
        f"search:\n  candidates: {candidates}\n  budget: {budget}\n"
        "  domains: [wikitext2, code, chat]\n  tokens: 128\n  seq_len: 64\n  checks: 2\n")
    return path


def _hashes(folder):
    import hashlib

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.glob("*.safetensors"))}


def test_search_end_to_end(tiny_llama, tmp_path, monkeypatch):
    """The chosen mix fits the budget on the written files, keeps fused layers whole, carries predicted and
    measured KLD, and its recipe quantizes to the same bytes again; a second search reads its sensitivity back."""
    from conftest import run_cli

    from quantkit.search import sensitivity

    out = tmp_path / "out"
    recipe = _search_recipe(tmp_path / "r.yaml", tiny_llama, out)
    assert run_cli(monkeypatch, "search", recipe, "--quiet") == 0
    body = json.loads((out / "search" / "search.json").read_text())
    artifact = out / "compressed-tensors"
    written = sum(f.stat().st_size for f in artifact.glob("*.safetensors"))
    assert body["measured"]["bytes"] == written <= body["budget_bytes"]
    assert body["predicted"]["bytes"] <= body["budget_bytes"]
    assert set(body["predicted"]["kld"]) == set(body["measured"]["kld"]) == {"wikitext2", "code", "chat"}
    assert body["measured"]["worst"] == max(body["measured"]["kld"].values()) > 0
    cands = body["candidates"]
    assert cands == ["w4pc", "w4g32", "w8pc", "float"]
    for g in body["groups"]:
        inc = dict(zip(cands, g["increase"]))
        assert inc["float"] == [0.0] * 3
        assert all(a <= b for a, b in zip(inc["w8pc"], inc["w4pc"]))  # 8 bits never costs more than 4 here
        if g["linears"][0].endswith("q_proj"):
            assert [n.rpartition(".")[2] for n in g["linears"]] == ["q_proj", "k_proj", "v_proj"]
    assert body["checks"]["pairs"] > 0
    assert (out / "search" / "pareto.png").stat().st_size > 1000
    # the written recipe: every fused group's members share one override (or none)
    import yaml

    chosen = yaml.safe_load((out / "search" / "recipe.yaml").read_text())
    where = {n: i for i, o in enumerate(chosen.get("overrides", [])) for n in o["targets"]}
    for g in body["groups"]:
        assert len({where.get(n) for n in g["linears"]}) == 1
    before = _hashes(artifact)
    assert run_cli(monkeypatch, "quantize", out / "search" / "recipe.yaml", "--overwrite", "--quiet") == 0
    assert _hashes(artifact) == before

    def refuse(*a, **k):
        raise AssertionError("sensitivity measured again")

    monkeypatch.setattr(sensitivity, "tail_kld", refuse)
    assert run_cli(monkeypatch, "search", recipe, "--overwrite", "--quiet") == 0
    assert json.loads((out / "search" / "search.json").read_text())["groups"] == body["groups"]


@pytest.mark.parametrize("budget, candidates, message", [
    ("{bits_per_weight: 1.0}", None, r"search.budget: \d+ bytes for the searched Linears; the cheapest candidate of "
                                     r"every group already takes \d+"),
    ("{weight_bytes: 1KB}", None, r"search.budget.weight_bytes: 1000 bytes; the tensors no candidate changes "
                                  r"\(embeddings, norms, float Linears\) already take \d+"),
    ("{bits_per_weight: 4}", "[{bits: 4, group_size: 32}, fp8]",
     r"search.candidates.1: 'fp8' is not a candidate; expected a grid \(\{bits, group_size, sym\}\) or unquantized"),
    ("{bits_per_weight: 4}", "[{bits: 4, group_size: 32}, {bits: 5}]", r"search.candidates.1"),
    ("{bits_per_weight: 4, weight_bytes: 1GB}", None, r"search.budget: give exactly one of"),
    ("{bits_per_weight: 4}", "[{bits: 4, group_size: 128}, {bits: 8, group_size: 128}]",
     r"search.candidates: none fits model.layers.0.self_attn.q_proj \(in_features 64\); add one whose group size "
     r"divides it, or unquantized"),
])
def test_search_bad_input_is_one_line(tiny_llama, tmp_path, monkeypatch, capsys, budget, candidates, message):
    from conftest import run_cli

    out = tmp_path / "out"
    kw = {"candidates": candidates} if candidates else {}
    recipe = _search_recipe(tmp_path / "r.yaml", tiny_llama, out, budget, **kw)
    assert run_cli(monkeypatch, "search", recipe) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert __import__("re").search(message, err[0]), err[0]
    assert not (out / "compressed-tensors").exists()


def test_refine_rescales_the_domains_and_keeps_the_best_measured_mix(tiny_llama, tmp_path, monkeypatch):
    """refine: 1: the second allocation's domain factors are the first mix's measured / predicted KLD; the mix kept
    is the one of least measured worst domain, its artifact is the one on disk and its recipe reproduces it."""
    from conftest import run_cli

    out = tmp_path / "out"
    recipe = _search_recipe(tmp_path / "r.yaml", tiny_llama, out)
    recipe.write_text(recipe.read_text() + "  refine: 1\n")
    assert run_cli(monkeypatch, "search", recipe, "--quiet") == 0
    body = json.loads((out / "search" / "search.json").read_text())
    rounds = body["rounds"]
    assert 1 <= len(rounds) <= 2 and rounds[0]["domain_factors"] == [1.0] * 3
    if len(rounds) == 2:
        first = rounds[0]
        want = [first["measured"][d] / first["predicted"][d] for d in body["domains"]]
        assert rounds[1]["domain_factors"] == pytest.approx(want)
    kept = [r for r in rounds if r["kept"]]
    assert len(kept) == 1 and max(kept[0]["measured"].values()) == min(max(r["measured"].values()) for r in rounds)
    assert body["measured"]["kld"] == kept[0]["measured"]
    artifact = out / "compressed-tensors"
    assert kept[0]["bytes"] == sum(f.stat().st_size for f in artifact.glob("*.safetensors")) <= body["budget_bytes"]
    assert not (out / "search" / "rounds").exists()
    before = _hashes(artifact)
    assert run_cli(monkeypatch, "quantize", out / "search" / "recipe.yaml", "--overwrite", "--quiet") == 0
    assert _hashes(artifact) == before


def test_a_refined_allocation_that_repeats_a_mix_keeps_its_artifact(tmp_path, monkeypatch):
    """Round 2 picks round 1's mix again: the loop stops, and round 1's artifact, set aside, is put back."""
    from types import SimpleNamespace

    from quantkit.search import run

    root = tmp_path / "out"

    def quantize(recipe, overwrite, report):
        (root / "compressed-tensors").mkdir(parents=True)
        (root / "compressed-tensors" / "model.safetensors").write_bytes(b"x" * 10)
        return {}

    monkeypatch.setattr(run, "run_quantize", quantize)
    monkeypatch.setattr(run, "_measure", lambda artifact, recipe, sample: {"kld": [0.2, 0.1]})
    monkeypatch.setattr(run, "parse_recipe", lambda raw, path: raw)
    raw = {"model": "m", "stages": [{"gptq": {"bits": 4}}], "export": {"output": str(root)}}
    recipe = SimpleNamespace(export=SimpleNamespace(output=str(root), formats=["compressed-tensors"]))
    from quantkit.algorithms.grid import GridSpec
    from quantkit.progress import Reporter

    (root / "search").mkdir(parents=True)
    rounds = run._rounds(raw, recipe, "gptq", [("a.q",)], [GridSpec(4, -1, True)], np.array([[[0.1, 0.1]]]),
                         np.array([[5]]), 10, np.ones((1, 1), dtype=bool), 1, SimpleNamespace(domains=["x", "y"]),
                         root / "search", False, Reporter(quiet=True))
    assert len(rounds) == 1 and rounds[0]["factors"] == [1.0, 1.0]
    assert (root / "compressed-tensors" / "model.safetensors").read_bytes() == b"x" * 10
    assert not (root / "search" / "rounds").exists()


def test_a_candidate_that_fits_some_groups_only(tmp_path, monkeypatch):
    """Group 64 divides down_proj's 192 inputs, not the other Linears' 96 (as SmolLM2's 576 takes no group of 128):
    they never take it (no measurement, no pick), down_proj does when the budget allows, and the recipe quantizes."""
    from conftest import run_cli
    from tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama", hidden=96)
    out = tmp_path / "out"
    recipe = _search_recipe(tmp_path / "r.yaml", model, out, "{bits_per_weight: 6}",
                            "[{bits: 4, group_size: -1}, {bits: 4, group_size: 64}]")
    assert run_cli(monkeypatch, "search", recipe, "--quiet") == 0
    body = json.loads((out / "search" / "search.json").read_text())
    assert body["candidates"] == ["w4pc", "w4g64"]
    for g in body["groups"]:
        down = g["linears"][0].endswith("down_proj")
        assert (g["increase"][1] is None, g["errors"][1] is None) == (not down, not down), g["linears"]
        # 6 bits a weight leave room: down_proj takes the finer group; the rest can only be per-channel
        assert g["choice"] == ("w4g64" if down else "w4pc")
    assert body["measured"]["bytes"] <= body["budget_bytes"]


def test_card_lists_the_per_layer_grids():
    from quantkit import card
    from quantkit.recipe import parse_recipe

    r = parse_recipe({"model": "x", "stages": [{"rtn": {"bits": 4, "group_size": 64}}],
                      "export": {"output": "o", "formats": ["compressed-tensors"]},
                      "overrides": [{"targets": ["model.layers.0.mlp.down_proj", "model.layers.29.mlp.down_proj",
                                                 "model.layers.3.self_attn.q_proj"], "bits": 8, "group_size": -1},
                                    {"targets": ["mlp.gate_proj", "mlp.up_proj"], "layers": "2-4",
                                     "unquantized": True}]})
    lines = card._mix(r)
    assert "| bits 8, group_size -1 | mlp.down_proj (0, 29); self_attn.q_proj (3) |" in lines
    assert "| float | mlp.gate_proj; mlp.up_proj in blocks 2-4 |" in lines
    experts = parse_recipe({"model": "x", "stages": [{"rtn": {"bits": 4, "group_size": 64}}],
                            "export": {"output": "o", "formats": ["compressed-tensors"]},
                            "overrides": [{"targets": [f"model.layers.{b}.mlp.experts.{e}.down_proj"
                                                       for b in (1, 2) for e in range(4)], "bits": 8}]})
    assert "| bits 8 | mlp.experts.*.down_proj (1, 2) |" in card._mix(experts)  # one row for a layer's experts
    assert card._mix(parse_recipe({"model": "x", "stages": [{"rtn": {"bits": 4, "group_size": 64}}],
                                   "export": {"output": "o"}})) == []


def test_a_decode_speedup_budget_holds_by_the_roofline(tiny_llama, tmp_path, monkeypatch, capsys):
    """decode_speedup: the written artifact's bytes read per token (all but an untied input embedding table; the
    tiny llama ties it to lm_head) are at most the 16-bit original's over the target, search.json says the number is a roofline estimate; a target no mix
    reaches is one line."""
    from conftest import run_cli
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    table = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is table  # tied: lm_head reads the whole table every step
    original = 2 * sum(p.numel() for p in model.parameters())  # the tied table counted once
    out = tmp_path / "out"
    # the float tensors in bfloat16: the tiny model's embeddings outweigh its Linears
    recipe = _search_recipe(tmp_path / "r.yaml", tiny_llama, out, "{decode_speedup: 1.6}", export_dtype="bfloat16")
    assert run_cli(monkeypatch, "search", recipe, "--quiet") == 0
    body = json.loads((out / "search" / "search.json").read_text())
    written = sum(f.stat().st_size for f in (out / "compressed-tensors").glob("*.safetensors"))
    read = written  # every stored byte is read (the table as lm_head)
    speed = body["decode_speedup"]
    assert (speed["read_bytes"], speed["original_read_bytes"], speed["target"]) == (read, original, 1.6)
    assert speed["roofline"] == round(original / read, 3) and original / read >= 1.6
    assert "not a measurement" in speed["basis"]
    recipe = _search_recipe(tmp_path / "r2.yaml", tiny_llama, tmp_path / "out2", "{decode_speedup: 40}")
    capsys.readouterr()
    assert run_cli(monkeypatch, "search", recipe) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and __import__("re").search(
        r"search.budget.decode_speedup: 40.0x allows \d+ bytes read per token; the tensors no candidate changes "
        r"already take \d+", err[0]), err
