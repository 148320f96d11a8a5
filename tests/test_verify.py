"""`quantkit verify`: a fresh artifact passes; a tampered, truncated or incomplete one fails with exit code 1 and
names the file or tensor; a folder that is no artifact is a usage error (exit code 2, one line)."""

import json
import shutil

import pytest
from safetensors import safe_open

from conftest import run_cli, write_recipe
from quantkit.export.artifact import sha256_file


@pytest.fixture(scope="module")
def artifacts(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("verify")
    recipe = write_recipe(out / "r.yaml", tiny_llama, out / "q", "rtn: {bits: 4, group_size: 32}")
    mp = pytest.MonkeyPatch()
    assert run_cli(mp, "quantize", recipe, "--quiet") == 0
    mp.undo()
    return out / "q"


def verify(monkeypatch, capsys, folder, *args) -> tuple[int, list[str], str]:
    capsys.readouterr()
    code = run_cli(monkeypatch, "verify", folder, *args)
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err


def edit_config(folder, **changes):
    """Edits config.json and re-signs it in quantkit.json, so only the tensor checks can notice."""
    cfg = json.loads((folder / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(cfg))
    manifest = json.loads((folder / "quantkit.json").read_text())
    manifest["files"]["config.json"] = sha256_file(folder / "config.json")
    (folder / "quantkit.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_a_fresh_artifact_verifies(artifacts, monkeypatch, capsys, tmp_path, fmt):
    folder = artifacts / fmt
    code, lines, err = verify(monkeypatch, capsys, folder, "--json", tmp_path / "v.json")
    files = json.loads((folder / "quantkit.json").read_text())["files"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = len(list(f.keys()))
    assert code == 0 and err == "", lines
    assert lines[-1] == f"verify: {folder} ok ({len(files)} files, {tensors} tensors, unsigned)"
    assert all(line.startswith("ok ") for line in lines[:-1])
    body = json.loads((tmp_path / "v.json").read_text())
    assert body["artifact"] == str(folder) and body["ok"] and all(c["ok"] for c in body["checks"])
    assert body["signed"] == "unsigned" and lines[0].startswith("ok    signature    unsigned: ")
    assert {c["name"] for c in body["checks"]} == {"signature", "manifest", "sha256", "code", "safetensors", "config",
                                                   "layout", "shapes", "dtype", "forward"}


def flip_middle_byte(folder):
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, first, also", [
    (flip_middle_byte, "model.safetensors: sha256 mismatch (expected ", None),
    (truncate, "model.safetensors: sha256 mismatch (expected ",
     "FAIL  safetensors  model.safetensors: unreadable (Error while deserializing header"),
    (lambda f: (f / "config.json").unlink(), "config.json: missing", "FAIL  config       config.json: unreadable (No such file"),
    (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json: missing", None),
])
def test_damage_is_named(artifacts, monkeypatch, capsys, tmp_path, damage, first, also):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    damage(folder)
    code, lines, _ = verify(monkeypatch, capsys, folder)
    assert code == 1
    assert lines[-1].startswith(f"verify: {folder} FAILED: {first}"), lines[-1]
    assert also is None or any(line.startswith(also) for line in lines), lines


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_a_config_that_no_longer_fits_the_tensors(artifacts, monkeypatch, capsys, tmp_path, fmt):
    folder = shutil.copytree(artifacts / fmt, tmp_path / fmt)
    edit_config(folder, hidden_size=128)
    code, lines, _ = verify(monkeypatch, capsys, folder, "--quiet")
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"verify: {folder} FAILED: model.layers.0."), lines[0]
    assert "stores int32 [" in lines[0] and "for config.json's Linear [128, " in lines[0]  # the packed words


def test_a_float_dtype_other_than_config_says(artifacts, monkeypatch, capsys, tmp_path):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    edit_config(folder, dtype="bfloat16")
    code, lines, _ = verify(monkeypatch, capsys, folder, "--quiet")
    assert code == 1
    assert ": float32, config.json dtype is bfloat16" in lines[-1], lines


def test_a_manifest_with_a_key_twice_is_refused(artifacts, monkeypatch, capsys, tmp_path):
    """A second "files" key would win in json.loads and could list re-hashed files: verify names it instead."""
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    text = (folder / "quantkit.json").read_text()
    (folder / "quantkit.json").write_text(text.replace('{', '{"files": {"config.json": "0"}, ', 1))
    code, lines, _ = verify(monkeypatch, capsys, folder, "--quiet")
    assert code == 1
    assert lines[-1] == f"verify: {folder} FAILED: quantkit.json: unreadable (not valid JSON (key 'files' appears " \
        "twice); expected a JSON object)", lines


def test_unlisted_files_are_a_warning(artifacts, monkeypatch, capsys, tmp_path):
    folder = shutil.copytree(artifacts / "gptq", tmp_path / "gptq")
    (folder / "notes.txt").write_text("hi")
    code, lines, err = verify(monkeypatch, capsys, folder, "--quiet")
    assert code == 0 and lines == [f"verify: {folder} ok (6 files, 62 tensors, unsigned)"]
    assert err == "warning: notes.txt: present but not listed in quantkit.json\n"


def test_not_an_artifact_is_a_usage_error(monkeypatch, capsys, tmp_path):
    code, lines, err = verify(monkeypatch, capsys, tmp_path)
    assert code == 2 and lines == []
    assert err == f"error: ARTIFACT: {tmp_path} has no quantkit.json (not written by quantkit quantize)\n"
