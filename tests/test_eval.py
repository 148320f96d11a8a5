"""Evaluation: distribution-shift statistics against brute force, the base cache, lm-eval offline tasks,
generation agreement, the eval JSON contract, and `quantkit report`."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.evaluation.compare import LogitCache
from quantkit.evaluation.distribution import HIST_EDGES, BaseTopK, ShiftAccumulator, token_stats, token_stats_from_topk
from quantkit.data import load_prompts
from quantkit.evaluation.generation import compare
from quantkit.lm_eval_tasks import wikitext_pages
from quantkit.evaluation.tasks import parse_tasks
from tiny_models import tiny_tokenizer
from conftest import run_cli, write_recipe


def brute_force(base_logits, model_logits, targets):
    """Every statistic straight from its definition, in float64 over the whole vocabulary."""
    p = torch.softmax(base_logits.double(), -1)
    q = torch.softmax(model_logits.double(), -1)
    kld = (p * (p.log() - q.log())).sum(-1)
    rows = torch.arange(len(targets))
    return {"kld": kld, "same_top": p.argmax(-1) == q.argmax(-1),
            "delta_p": q[rows, targets] - p[rows, targets],
            "nll_model": -q[rows, targets].log(), "nll_base": -p[rows, targets].log()}


def random_pair(T=64, V=300, seed=0, noise=0.5):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(T, V, generator=g) * 3
    model = base + noise * torch.randn(T, V, generator=g)
    return base, model, torch.randint(0, V, (T,), generator=g)


@pytest.mark.parametrize("noise", [0.05, 0.5, 3.0])
def test_token_stats_equal_brute_force_when_top_k_covers_vocab(noise):
    base, model, targets = random_pair(noise=noise)
    got = token_stats(BaseTopK.from_logits(base, targets, k=base.shape[1]), model, targets)
    ref = brute_force(base, model, targets)
    torch.testing.assert_close(got["kld"].double(), ref["kld"], atol=5e-6, rtol=1e-4)
    assert torch.equal(got["same_top"], ref["same_top"])
    torch.testing.assert_close(got["delta_p"].double(), ref["delta_p"], atol=1e-6, rtol=0)
    torch.testing.assert_close(got["nll_model"].double(), ref["nll_model"], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got["nll_base"].double(), ref["nll_base"], atol=1e-5, rtol=1e-6)
    assert float(got["tail_mass"].max()) == 0.0


def test_top_k_kld_is_the_coarsened_divergence_and_a_lower_bound():
    base, model, targets = random_pair(noise=1.0, seed=1)
    k = 16
    got = token_stats(BaseTopK.from_logits(base, targets, k), model, targets)["kld"].double()
    exact = brute_force(base, model, targets)["kld"]
    # brute force of the coarsened distributions: the top-k tokens of the base plus one "rest" bucket
    p, q = torch.softmax(base.double(), -1), torch.softmax(model.double(), -1)
    idx = p.topk(k, -1).indices
    pk, qk = p.gather(-1, idx), q.gather(-1, idx)
    pr, qr = 1 - pk.sum(-1), 1 - qk.sum(-1)
    coarse = (pk * (pk / qk).log()).sum(-1) + pr * (pr / qr).log()
    torch.testing.assert_close(got, coarse, atol=2e-6, rtol=1e-4)
    assert bool((got <= exact + 1e-6).all()) and float(got.mean()) > 0.3 * float(exact.mean())


@pytest.mark.parametrize("k_model", [300, 64, 8])
def test_model_side_known_only_at_its_top_k(k_model):
    """A serving engine returns the model's top-k log-probs only: with the full vocabulary on both sides every
    statistic is token_stats'; with fewer model tokens the KLD is the divergence coarsened to the tokens in both
    lists, still a lower bound, and near the full one while the lists hold most of the mass."""
    base, model, targets = random_pair(noise=1.0, seed=2)
    b = BaseTopK.from_logits(base, targets, 64)
    full = token_stats(b, model, targets)
    logq = torch.log_softmax(model.double(), -1)
    q_logp, q_idx = logq.topk(k_model, -1)
    got = token_stats_from_topk(b, q_idx.int(), q_logp.float(), logq.gather(-1, targets[:, None])[:, 0].float())
    exact = brute_force(base, model, targets)["kld"]
    for key in ("same_top", "delta_p", "nll_model", "nll_base"):
        torch.testing.assert_close(got[key].double(), full[key].double(), atol=1e-6, rtol=1e-5)
    if k_model == 300:
        torch.testing.assert_close(got["kld"], full["kld"], atol=2e-6, rtol=1e-4)
    # coarsened to S = both top-k lists by brute force
    p, q = torch.softmax(base.double(), -1), logq.exp()
    in_s = torch.zeros_like(p, dtype=torch.bool)
    in_s.scatter_(1, p.topk(64, -1).indices, True)
    in_q = torch.zeros_like(in_s).scatter_(1, q_idx, True)
    s_ = in_s & in_q
    ps, qs = (p * s_).sum(-1), (q * s_).sum(-1)
    coarse = (torch.where(s_, p * (p / q).log(), 0.0)).sum(-1) + (1 - ps) * ((1 - ps) / (1 - qs)).log()
    torch.testing.assert_close(got["kld"].double(), coarse, atol=1e-5, rtol=1e-3)
    assert bool((got["kld"].double() <= exact + 1e-6).all())
    # measured mean ratios to the full-vocabulary KLD: 0.97 (300 = all), 0.94 (64), 0.69 (8)
    assert float(got["kld"].mean()) > {300: 0.9, 64: 0.85, 8: 0.5}[k_model] * float(exact.mean())


def test_summary_matches_numpy_over_all_windows():
    acc, refs = ShiftAccumulator(), []
    for seed in range(3):  # three "windows"
        base, model, targets = random_pair(T=50, seed=seed)
        acc.add(token_stats(BaseTopK.from_logits(base, targets, 300), model, targets))
        refs.append(brute_force(base, model, targets))
    s = acc.summary()
    kld = torch.cat([r["kld"] for r in refs]).numpy()
    dp = torch.cat([r["delta_p"] for r in refs]).numpy()
    nm, nb = (torch.cat([r[k] for r in refs]).numpy() for k in ("nll_model", "nll_base"))
    assert s["tokens"] == 150
    assert s["kld"]["mean"] == pytest.approx(kld.mean(), rel=1e-4)
    assert s["kld"]["stderr"] == pytest.approx(kld.std(ddof=1) / math.sqrt(150), rel=1e-3)
    for key, q in [("median", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)]:
        assert s["kld"][key] == pytest.approx(np.quantile(kld, q), rel=1e-3)
    assert s["kld"]["max"] == pytest.approx(kld.max(), rel=1e-4)
    assert s["same_top"] == pytest.approx(float(torch.cat([r["same_top"] for r in refs]).double().mean()))
    assert s["delta_p"]["mean"] == pytest.approx(dp.mean(), abs=1e-6)
    assert s["delta_p"]["rms"] == pytest.approx(np.sqrt((dp ** 2).mean()), rel=1e-4)
    assert s["ppl"]["model"] == pytest.approx(math.exp(nm.mean()), rel=1e-5)
    assert s["ppl"]["base"] == pytest.approx(math.exp(nb.mean()), rel=1e-5)
    assert s["ppl"]["ln_ratio"]["mean"] == pytest.approx((nm - nb).mean(), abs=1e-5)
    assert sum(s["kld"]["histogram"]["counts"]) == 150
    assert len(s["kld"]["histogram"]["counts"]) == len(HIST_EDGES) - 1
    # each window's own means, in window order (equal windows: their mean is the whole mean)
    assert s["per_window"]["kld"] == pytest.approx([float(r["kld"].double().mean()) for r in refs], rel=1e-4)
    assert s["per_window"]["nll_model"] == pytest.approx([float(r["nll_model"].double().mean()) for r in refs],
                                                         rel=1e-5)
    assert math.exp(np.mean(s["per_window"]["nll_model"])) == pytest.approx(s["ppl"]["model"], rel=1e-6)


def test_paired_comparison_separates_a_shift_from_noise():
    """benchmarks/paired.py: a model worse on every window by 1 % is `worse` with a tight interval; one that differs by
    noise alone is a `tie`; windows that do not line up are refused."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("paired", Path(__file__).parents[1] / "benchmarks" / "paired.py")
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    rng = np.random.default_rng(0)
    ref_nll = rng.uniform(2, 4, 32)
    ref_kld = rng.uniform(0.1, 0.2, 32)

    def body(name, nll, kld):
        return {"model": name, "domains": {"code": {
            "ppl": {"model": math.exp(np.mean(nll))}, "kld": {"mean": float(np.mean(kld))},
            "per_window": {"nll_model": list(map(float, nll)), "kld": list(map(float, kld))}}}}

    ref = body("ref", ref_nll, ref_kld)
    shifted = body("shifted", ref_nll + math.log(1.01) + rng.normal(0, 1e-3, 32), ref_kld + 0.01)
    noisy = body("noisy", ref_nll + rng.normal(0, 0.02, 32), ref_kld + rng.normal(0, 0.01, 32))
    [row] = paired.compare(ref, shifted)
    assert row["ppl_verdict"] == "worse" and row["kld_verdict"] == "worse"
    assert row["ppl_ratio_lo"] < 1.01 < row["ppl_ratio_hi"] and row["ppl_ratio_hi"] - row["ppl_ratio_lo"] < 0.002
    assert row["kld_diff"] == pytest.approx(0.01)
    [row] = paired.compare(ref, noisy)
    assert row["ppl_verdict"] == "tie" and row["kld_verdict"] == "tie"
    assert paired.compare(shifted, ref)[0]["ppl_verdict"] == "better"
    with pytest.raises(SystemExit, match="not scored on the same windows"):
        paired.compare(ref, body("short", ref_nll[:8], ref_kld[:8]))


def test_generation_compare_definitions():
    tok = tiny_tokenizer()
    base = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 9]]
    model = [[5, 6, 7, 8], [5, 6, 1, 8, 3], [4]]
    out = compare(base, model, tok, ["a", "b", "c"])
    per = out["per_prompt"]
    assert [p["first_divergence"] for p in per] == [4, 2, 0]
    assert [p["token_agreement"] for p in per] == [1.0, 3 / 5, 0.0]
    assert per[0]["rouge_l"] == 1.0 and out["identical"] == pytest.approx(1 / 3)
    assert out["token_agreement"] == pytest.approx((1 + 0.6 + 0) / 3)


def test_prompt_file_errors(tmp_path):
    assert len(load_prompts(None)) == 16
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(QuantkitError, match=r"--gen-prompts: .*line 1: expected a JSON object with a 'prompt'"):
        load_prompts(str(bad))
    with pytest.raises(QuantkitError, match="--gen-prompts: file not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(QuantkitError, match="listed twice"):
        parse_tasks("arc_easy,arc_easy")


def test_wikitext_document_level_pages():
    from quantkit.data import BUNDLED

    raw = (BUNDLED / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    pages = wikitext_pages(raw)
    assert len(pages) == 62  # EleutherAI/wikitext_document_level's test split has 62 articles
    assert pages[0]["page"].startswith(" = Robert Boulter = ")
    assert all(p["page"].startswith(" = ") and not p["page"].startswith(" = = ") for p in pages)
    # nothing but the blank line before the first heading is dropped
    assert "\n".join(p["page"] for p in pages) == raw.removeprefix(" \n")


def test_logit_cache_abort_leaves_nothing(tmp_path):
    entry = LogitCache(tmp_path, "k")
    entry.start()
    entry.write(0, BaseTopK.from_logits(torch.randn(4, 10), torch.zeros(4, dtype=torch.long), 3))
    entry.abort()
    assert not entry.complete() and not any((tmp_path / "base-logits").iterdir())


# --- end to end on a tiny model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rtn_artifact(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    recipe = write_recipe(out / "r.yaml", tiny_llama, out / "q", "rtn: {bits: 4, group_size: 32, sym: true}",
                          formats=("compressed-tensors",))
    mp = pytest.MonkeyPatch()
    assert run_cli(mp, "quantize", recipe, "--quiet") == 0
    mp.undo()
    return out / "q" / "compressed-tensors"


EVAL = ["--seq-len", "128", "--max-tokens", "1024", "--quiet", "--gen-tokens", "8"]


def run_eval(monkeypatch, tmp_path, model, *extra, name="e.json"):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / name
    code = run_cli(monkeypatch, "eval", model, *EVAL, "--cache-dir", tmp_path / "cache", "--json", out, *extra)
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_eval_json_contract_and_base_cache(monkeypatch, tmp_path, tiny_llama, rtn_artifact):
    code, first = run_eval(monkeypatch, tmp_path, rtn_artifact, "--base", tiny_llama, "--tasks", "arc_easy,lambada_openai",
                           "--limit", "6", name="a.json")
    assert code == 0
    assert first["base_cache_hit"] == {"logits": {"wikitext2": False}, "tasks": False, "generation": False}
    for key in ("mean", "stderr", "median", "p90", "p95", "p99", "p999", "max"):
        assert first["kld"][key] >= 0
    assert first["kld"]["max"] >= first["kld"]["p99"] >= first["kld"]["median"]
    assert 0 <= first["same_top"] <= 1 and first["delta_p"]["rms"] >= abs(first["delta_p"]["mean"])
    assert first["ppl"]["model"] > 1 and first["ppl"]["base"] > 1 and first["tokens"] == 8 * 127
    assert set(first["tasks"]) == {"arc_easy", "lambada_openai"}
    arc = first["tasks"]["arc_easy"]
    assert {"acc", "acc_norm"} <= set(arc["model"]) and {"acc", "acc_norm"} <= set(arc["base"])
    assert first["tasks_settings"]["n_samples"]["arc_easy"] == 6
    assert first["generation"]["prompts"] == 16 and 0 <= first["generation"]["token_agreement"] <= 1

    # second artifact evaluation: the base is not run again, and the numbers are the same
    code, second = run_eval(monkeypatch, tmp_path, rtn_artifact, "--base", tiny_llama, "--tasks", "arc_easy,lambada_openai",
                            "--limit", "6", name="b.json")
    assert code == 0 and second["base_cache_hit"] == {"logits": {"wikitext2": True}, "tasks": True, "generation": True}
    assert second["base_size_bytes"] == first["base_size_bytes"] > second["size_bytes"]
    assert "base_logits_wikitext2" not in second["timings_s"] and "base_tasks" not in second["timings_s"]
    assert second["kld"] == first["kld"] and second["tasks"] == first["tasks"]
    assert second["generation"]["per_prompt"] == first["generation"]["per_prompt"]

    # different data or settings -> a different entry
    code, third = run_eval(monkeypatch, tmp_path, rtn_artifact, "--base", tiny_llama, "--max-tokens", "768",
                           "--no-generation", name="c.json")
    assert code == 0 and third["base_cache_hit"]["logits"] == {"wikitext2": False} and third["tokens"] == 6 * 127
    code, fourth = run_eval(monkeypatch, tmp_path, rtn_artifact, "--base", tiny_llama, "--kld-top-k", "64",
                            "--no-generation", name="d.json")
    assert code == 0 and fourth["base_cache_hit"]["logits"] == {"wikitext2": False}


def test_task_definitions_load_by_path_without_quantkit(tmp_path):
    """vLLM's worker loads eval/lm_eval_tasks.py by its path, where quantkit is not installed: it must build the
    bundled tasks from the standard library, lm_eval and datasets alone."""
    import subprocess
    import sys

    from quantkit.data import BUNDLED
    from quantkit import lm_eval_tasks

    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('t', {lm_eval_tasks.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"task = m.local_task('arc_easy', __import__('pathlib').Path({str(BUNDLED)!r}))\n"
        "print(len(task.test_docs()), any(k.startswith('quantkit') for k in sys.modules))\n"
        "try:\n    m.local_task('lambada_openai', __import__('pathlib').Path('/nowhere'))\n"
        "except m.MissingData as err:\n    print(err)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = (BUNDLED / "arc_easy" / "ARC-Easy-Test.jsonl").read_text().splitlines()
    assert run.stdout.split("\n")[:2] == [f"{len([r for r in rows if r.strip()])} False",
                                          "/nowhere/lambada_openai/lambada_test.jsonl"]


def test_local_arc_easy_matches_brute_force_loglikelihood(monkeypatch, tiny_llama):
    """lm-eval's accuracy on the bundled ARC-Easy equals argmax of summed continuation log-probs computed here."""
    from quantkit import runtime
    from quantkit.data import BUNDLED
    from quantkit.evaluation.tasks import run_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    loaded = runtime.load(str(tiny_llama))
    model, tok = loaded.model, loaded.tokenizer
    result = run_tasks(model, tok, ["arc_easy"], 10, None, 4, 256, "cpu", quiet=True)
    rows = [json.loads(x) for x in (BUNDLED / "arc_easy" / "ARC-Easy-Test.jsonl").read_text().splitlines()[:10]]
    correct = 0
    for r in rows:
        ctx = f"Question: {r['question']['stem']}\nAnswer:"
        ctx_ids = tok(ctx, add_special_tokens=False)["input_ids"]
        scores = []
        for c in r["question"]["choices"]:
            whole = tok(ctx + " " + c["text"], add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([whole[:-1]])).logits[0].double(), -1)
            cont = range(len(ctx_ids), len(whole))
            scores.append(sum(float(logp[i - 1, whole[i]]) for i in cont))
        labels = [c["label"] for c in r["question"]["choices"]]
        correct += labels[int(np.argmax(scores))] == r["answerKey"]
    assert result["scores"]["arc_easy"]["acc"] == pytest.approx(correct / 10)
    assert result["settings"]["add_bos_token"] is None  # lm-eval leaves BOS to the tokenizer's default


def test_eval_errors(monkeypatch, tmp_path, capsys, rtn_artifact):
    from tiny_models import tiny_config

    code, _ = run_eval(monkeypatch, tmp_path, rtn_artifact, "--gen-prompts", tmp_path / "none.jsonl")
    assert code == 2 and "error: --gen-prompts: generation agreement needs --base" in capsys.readouterr().err

    # a base with another tokenizer cannot be compared token by token
    tok = tiny_tokenizer(vocab_size=300)
    other = tmp_path / "other"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(tiny_config("llama", len(tok))).save_pretrained(other)
    tok.save_pretrained(other)
    code, out = run_eval(monkeypatch, tmp_path, rtn_artifact, "--base", other, "--no-generation")
    err = capsys.readouterr().err
    assert code == 2 and out is None
    assert "error: --base: " in err and "tokenizes the evaluation text differently" in err
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # no half-written cache entry

    code = run_cli(monkeypatch, "report", tmp_path / "missing.json", "--out", tmp_path / "rep")
    assert code == 2 and "missing.json: not a readable quantkit eval JSON" in capsys.readouterr().err


def test_report_table_and_plots(monkeypatch, tmp_path, tiny_llama, rtn_artifact):
    code, body = run_eval(monkeypatch, tmp_path, rtn_artifact, "--base", tiny_llama, "--no-generation")
    assert code == 0
    body["name"] = "rtn-copy"
    (tmp_path / "copy.json").write_text(json.dumps(body))
    code = run_cli(monkeypatch, "report", rtn_artifact, tmp_path / "copy.json", "--base", tiny_llama, *EVAL,
                   "--no-generation", "--cache-dir", tmp_path / "cache", "--out", tmp_path / "rep")
    assert code == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| model | format | size MB | PPL")
    assert any(r.startswith("| base: ") for r in rows) and any(r.startswith("| rtn-copy |") for r in rows)
    assert f"{body['ppl']['model']:.4f}" in md
    results = json.loads((tmp_path / "rep" / "report.json").read_text())["results"]
    assert results[0]["kld"] == body["kld"]  # evaluated again here: same numbers
    for png in ("kld_distribution.png", "quality_vs_size.png"):
        data = (tmp_path / "rep" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_greedy_generation_pads_a_batch_with_eos_when_the_tokenizer_has_no_pad_token(tiny_llama):
    """Many base models ship no pad token; batched prompts of different lengths are left-padded with eos, and each
    row's continuation equals that prompt's continuation generated alone."""
    from quantkit.evaluation.generation import greedy
    from quantkit.model import load_model
    from quantkit.progress import Reporter

    loaded = load_model(str(tiny_llama), "float32")
    tok = loaded.tokenizer
    assert tok.pad_token is None
    prompts = ["The history of the", "A long time ago , in the valley of the river , there"]
    batched = greedy(loaded.model, tok, prompts, 6, 2, "cpu", Reporter(quiet=True), "gen")
    alone = [greedy(loaded.model, tok, [p], 6, 1, "cpu", Reporter(quiet=True), "gen")[0] for p in prompts]
    assert tok.pad_token is None and tok.padding_side == "right"  # the tokenizer is given back as it was
    assert batched == alone and all(len(r) == 6 for r in batched)
