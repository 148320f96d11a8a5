"""`quantkit release` end to end on a tiny model: gates that pass, gates that fail (exit code and table),
steps skipped on a re-run, the model card, and `quantkit gate` on the report."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import run_cli

from quantkit.export.artifact import sha256_file
from quantkit.gates import evaluate, table
from quantkit.recipe import Gates
from quantkit.release import data_fingerprint

RELEASE = ("release: {eval: {datasets: [wikitext2], seq_len: 128, max_tokens: 1024, generation: false}, "
           "bench: {batches: [1], prompt_len: 16, gen_len: 4, reps: 1}}")


def write(path: Path, model: Path, out: Path, gates: str) -> Path:
    path.write_text(
        f"model: {model}\ndtype: float32\ndevice: cpu\n"
        "calibration: {dataset: wikitext2, num_samples: 8, seq_len: 64, seed: 0}\n"
        "stages:\n  - gptq: {bits: 4, group_size: 32, sym: true}\n"
        f"export: {{output: {out}, formats: [compressed-tensors, gptq]}}\n{RELEASE}\ngates: {gates}\n")
    return path


LOOSE = "{ppl_increase_pct: 50, kld_mean_max: 1.0, same_top_min: 0.5, weight_bytes_ratio_max: 0.95}"
STRICT = "{ppl_increase_pct: 0.001, kld_mean_max: 0.0, same_top_min: 1.0, decode_speedup_min: 100}"


@pytest.fixture(scope="module")
def released(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    recipe = write(root / "loose.yaml", tiny_llama, root / "out", LOOSE)
    mp = pytest.MonkeyPatch()
    code = run_cli(mp, "release", recipe, "--quiet")
    mp.undo()
    return root, recipe, code


def test_release_passes_its_gates_and_writes_the_card(released, capsys):
    root, _, code = released
    assert code == 0
    report = json.loads((root / "out" / "release" / "report.json").read_text())
    assert report["gates"]["passed"] and len(report["gates"]["results"]) == 4
    assert report["steps"] == {"quantize": "ran", "eval": "ran", "bench": "ran"}
    measured = {r["name"]: r["measured"] for r in report["gates"]["results"]}
    assert measured["kld_mean_max[wikitext2]"] == report["eval"]["kld"]["mean"]
    ppl = report["eval"]["ppl"]
    assert measured["ppl_increase_pct[wikitext2]"] == pytest.approx(100 * (ppl["model"] / ppl["base"] - 1))
    assert measured["weight_bytes_ratio_max"] == report["bench"]["ratios"][0]["weight_bytes_ratio"]
    card = (root / "out" / "compressed-tensors" / "README.md").read_text()
    assert "## Release gates: passed" in card and f"{ppl['model']:.4f}" in card and "vllm serve" in card
    assert "## Speed and memory" in card and report["bench"]["device_name"] in card
    other = (root / "out" / "gptq" / "README.md").read_text()
    assert "measured on the `compressed-tensors` artifact" in other
    manifest = json.loads((root / "out" / "gptq" / "quantkit.json").read_text())
    assert manifest["files"]["README.md"] == sha256_file(root / "out" / "gptq" / "README.md")


def test_release_signs_last_and_verify_accepts(released, tiny_llama, tmp_path, monkeypatch, capsys):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    root, _, _ = released
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    (tmp_path / "k.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    signed = write(tmp_path / "signed.yaml", tiny_llama, root / "out", LOOSE)  # same stages: only cards and signing
    signed.write_text(signed.read_text().replace("release: {", f"release: {{sign_key: {tmp_path / 'k.pem'}, "))
    assert run_cli(monkeypatch, "release", signed, "--quiet") == 0
    report = json.loads((root / "out" / "release" / "report.json").read_text())
    assert set(report["steps"].values()) == {"skipped (inputs unchanged)"}
    assert report["signatures"] == [str(root / "out" / f / "model.sig") for f in ("compressed-tensors", "gptq")]
    assert "Signed with OpenSSF model-signing" in (root / "out" / "gptq" / "README.md").read_text()
    for fmt in ("compressed-tensors", "gptq"):  # the card is among the signed files
        capsys.readouterr()
        assert run_cli(monkeypatch, "verify", root / "out" / fmt, "--public-key", tmp_path / "k.pub", "--quiet") == 0
        assert capsys.readouterr().out.strip().endswith(", signature ok)")
    capsys.readouterr()
    assert run_cli(monkeypatch, "release", released[1], "--quiet") == 0  # unsigned again: the old signature is stale
    assert f"warning: {root / 'out' / 'gptq' / 'model.sig'}: left by an earlier signed release" in capsys.readouterr().err
    (tmp_path / "bad.pem").write_text("no key")  # a key that cannot sign fails before any step runs
    signed.write_text(signed.read_text().replace(str(tmp_path / "k.pem"), str(tmp_path / "bad.pem")))
    assert run_cli(monkeypatch, "release", signed, "--quiet") == 2
    assert capsys.readouterr().err.startswith(f"error: release.sign_key: {tmp_path / 'bad.pem'}: not an unencrypted")


def test_rerun_skips_every_step_and_a_failing_gate_exits_1(released, tiny_llama, monkeypatch, capsys):
    root, _, _ = released
    before = (root / "out" / "gptq" / "model.safetensors").stat().st_mtime_ns
    strict = write(root / "strict.yaml", tiny_llama, root / "out", STRICT)  # same stages: nothing to redo
    capsys.readouterr()
    assert run_cli(monkeypatch, "release", strict, "--quiet") == 1
    out = capsys.readouterr().out
    report = json.loads((root / "out" / "release" / "report.json").read_text())
    assert set(report["steps"].values()) == {"skipped (inputs unchanged)"}
    assert (root / "out" / "gptq" / "model.safetensors").stat().st_mtime_ns == before
    assert out.splitlines()[0].split() == ["gate", "measured", "required", "result"]
    assert "kld_mean_max" in out and "FAIL" in out and "release:" in out and "FAILED" in out
    assert "## Release gates: FAILED" in (root / "out" / "compressed-tensors" / "README.md").read_text()


def test_gate_command_on_the_report(released, tmp_path, monkeypatch, capsys):
    root, recipe, _ = released
    report = root / "out" / "release" / "report.json"
    out_json = tmp_path / "gates.json"
    assert run_cli(monkeypatch, "gate", report, "--recipe", recipe, "--json", out_json) == 0
    assert json.loads(out_json.read_text())["passed"] is True
    assert run_cli(monkeypatch, "gate", report, "--recipe", root / "strict.yaml") == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("gates: FAILED")
    assert run_cli(monkeypatch, "gate", tmp_path / "nope.json") == 2
    assert "not a readable release report" in capsys.readouterr().err
    broken = json.loads(report.read_text())
    del broken["gates"]["declared"]["kld_mean_max"]
    broken["gates"]["declared"]["same_top_min"] = "high"
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert run_cli(monkeypatch, "gate", tmp_path / "broken.json") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "broken.json: gates.declared: same_top_min" in err
    broken["eval"] = {"ppl": 5}
    broken["gates"]["declared"] = {"ppl_increase_pct": 3}
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert run_cli(monkeypatch, "gate", tmp_path / "broken.json") == 2
    assert "malformed release report" in capsys.readouterr().err


def test_release_and_quantize_write_the_same_bytes(released, tiny_llama, tmp_path, monkeypatch, capsys):
    root, recipe, _ = released
    plain = tmp_path / "plain.yaml"
    plain.write_text(recipe.read_text().replace(f"output: {root / 'out'}", f"output: {tmp_path / 'q'}"))
    assert run_cli(monkeypatch, "quantize", plain, "--quiet") == 0
    for fmt in ("gptq", "compressed-tensors"):
        assert (tmp_path / "q" / fmt / "model.safetensors").read_bytes() == \
            (root / "out" / fmt / "model.safetensors").read_bytes(), fmt
    # a run killed between two formats: the same command finishes it without --overwrite
    shutil.rmtree(tmp_path / "q" / "gptq")
    dead, live = tmp_path / "q" / ".gptq.partial-999999999", tmp_path / "q" / f".gptq.partial-{os.getppid()}"
    dead.mkdir(), live.mkdir()
    assert run_cli(monkeypatch, "quantize", plain, "--quiet") == 0
    assert not dead.exists() and live.exists()  # a killed run's temp folder goes, a running one's stays
    assert (tmp_path / "q" / "gptq" / "model.safetensors").read_bytes() == \
        (root / "out" / "gptq" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert run_cli(monkeypatch, "quantize", plain, "--quiet") == 2  # complete: replacing it needs --overwrite
    assert "already exists (pass --overwrite" in capsys.readouterr().err
    # release will not replace folders another recipe wrote unless asked
    other = write(tmp_path / "other.yaml", tiny_llama, tmp_path / "q", LOOSE)
    other.write_text(other.read_text().replace("sym: true", "sym: false"))
    assert run_cli(monkeypatch, "release", other, "--quiet") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "already exists (pass --overwrite" in err


def test_changed_stage_reruns_quantize(released, tiny_llama, monkeypatch, capsys):
    root, _, _ = released
    changed = write(root / "changed.yaml", tiny_llama, root / "out", LOOSE)
    changed.write_text(changed.read_text().replace("sym: true", "sym: false"))
    assert run_cli(monkeypatch, "release", changed, "--quiet") == 0
    report = json.loads((root / "out" / "release" / "report.json").read_text())
    assert report["steps"] == {"quantize": "ran", "eval": "ran", "bench": "ran"}


def test_gates_fail_when_nothing_was_measured():
    results = evaluate(Gates(kld_mean_max=0.1, decode_speedup_min=2.0), {"ppl": {"model": 10.0}}, None)
    assert [r.passed for r in results] == [False, False]
    assert "not measured" in table(results)


def test_gate_declared_for_a_task_not_evaluated_is_a_recipe_error(tiny_llama, tmp_path, monkeypatch, capsys):
    recipe = write(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "{tasks: {arc_easy: {min_ratio: 0.98}}}")
    assert run_cli(monkeypatch, "release", recipe) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gates.tasks.arc_easy: the task is not evaluated" in err



def test_task_gates_read_filtered_metrics_and_guard_perplexities():
    ev = {"tasks": {"gsm8k": {"model": {"exact_match,strict-match": 0.30}, "base": {"exact_match,strict-match": 0.40}},
                    "wikitext": {"model": {"word_perplexity": 30.0}, "base": {"word_perplexity": 20.0}}}}
    gates = Gates(tasks={"gsm8k": {"min_ratio": 0.7, "min": 0.35}, "wikitext": {"min_ratio": 0.6, "min": 1, "max": 25}})
    got = {r.name: r for r in evaluate(gates, ev, None)}
    assert got["tasks.gsm8k.min_ratio"].passed and got["tasks.gsm8k.min_ratio"].measured == pytest.approx(0.75)
    assert not got["tasks.gsm8k.min"].passed and got["tasks.gsm8k.min"].measured == 0.30
    assert got["tasks.wikitext.min_ratio"].measured == pytest.approx(20 / 30)  # base / model for perplexities
    assert not got["tasks.wikitext.min"].passed and "lower-is-better" in got["tasks.wikitext.min"].detail
    assert not got["tasks.wikitext.max"].passed and got["tasks.wikitext.max"].op == "<="


def test_card_lists_a_task_without_a_main_metric():
    from quantkit.card import _quality

    lines = _quality({"domains": {"wikitext2": {"ppl": {"model": 2.0, "base": 1.0}}}, "tasks": {"odd": {"model": {"f1": 1}}}})
    assert "| odd ? | - | - |" in lines


def test_edited_data_file_changes_its_fingerprint(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("one two three\n")
    first = data_fingerprint(str(text), "calibration", "calibration.dataset")
    text.write_text("one two four\n")
    assert data_fingerprint(str(text), "calibration", "calibration.dataset")["sha256"] != first["sha256"]


def test_weight_gate_needs_the_bench(tiny_llama, tmp_path, monkeypatch, capsys):
    recipe = write(tmp_path / "r.yaml", tiny_llama, tmp_path / "out", "{weight_bytes_ratio_max: 0.5}")
    recipe.write_text(recipe.read_text().replace("bench: {", "bench: {enabled: false, "))
    assert run_cli(monkeypatch, "release", recipe) == 2
    assert "gates.weight_bytes_ratio_max: needs the bench" in capsys.readouterr().err
