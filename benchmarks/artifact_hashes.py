"""Artifact hashes: proof that a change of quantkit's code changed no artifact byte (issue 39).

    python benchmarks/artifact_hashes.py record benchmarks/artifact_hashes.json    # every cell, the baseline
    python benchmarks/artifact_hashes.py check benchmarks/artifact_hashes.json     # the same runs, compared
    python benchmarks/artifact_hashes.py check F --only 'tiny/llama/*' --quiet      # a subset (fnmatch on names)
    python benchmarks/artifact_hashes.py record F --only 'recipe/*awq*'            # (re)record a subset into F

`check` exits 1 and prints every differing file or number when anything differs, 0 when all is equal.

Cells:
- tiny/FAMILY/METHOD: every family x method of tests/test_families.py, with the stages, formats and calibration
  (WikiText-2, 16 x 64 windows, seed 0) of its recipe, plus the rtn-asym its AWQ cells are ranked against, on
  the tiny random model of that family with x6 outlier channels (tests/tiny_models.py, seed 0), as the test
  builds it. The model's own files are hashed too: a mismatch there means the model changed, not quantkit.
- recipe/NAME: every recipes/*.yaml as shipped, except calibration.num_samples lowered to 8, or to the fewest
  that still give every part of a mixture a window (11 for the AWQ recipes' 5 % fiction part), and export.output in
  a temp folder; the cell records that override. Run cheapest first (fewest calibration tokens): a full recipe
  takes minutes on 2 busy cores, and OUT.json is rewritten after every cell.
`record` writes each cell's recipe into OUT.json and `check` replays those recipes, so later edits to the tests or
the recipes do not move the baseline.

Each cell runs the real CLI's entry point (`python -m quantkit.cli quantize RECIPE --quiet --json SUMMARY`) in a
process forked from this one, which has imported torch, transformers and quantkit but run no tensor op: a fresh
process per cell, without paying the imports (~14 s on 2 busy cores) per cell. Torch runs on one thread
(OMP_NUM_THREADS=1): float reductions may split differently with more threads, and CI machines differ in cores.

Recorded per cell: the exit code (and the error line, for the one cell test_families expects to fail); sha256 and
size of every file under export.output; the `--json` summary's deterministic values, flattened. Dropped from the
summary: outputs (paths of this run's temp folder), timings_s (wall time), memory.rss_start / rss_peak /
device_peak (measured, vary with load and allocator), memory.plan.advice (wording, not behaviour). The memory
plan's byte estimates are kept.

Normalized before hashing, in JSON files only (each such file is hashed as sorted, indented JSON, and `size` is
that text's): absolute paths (this checkout, the temp folder, site-packages) become <repo>, <tmp>, <site-packages>
(config.json's _name_or_path, quantkit.json's recipe and calibration sources); version fields (transformers_version
in config.json and generation_config.json, quantkit.json's quantkit_version and versions) become <version>;
quantkit.json's timings_s is dropped and its `files` map holds the other files' normalized hashes. Safetensors and
every other file are hashed as written.

The header records package versions and the CPU; `check` warns where they differ from the recorded ones, since
float kernels (torch versions, ISAs) may legitimately change the bytes.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import hashlib
import importlib.util
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path[:0] = [str(ROOT), str(TESTS)]  # this checkout's quantkit and tiny_models, not installed ones

PACKAGES = ("torch", "transformers", "compressed-tensors", "safetensors", "tokenizers")
RECIPE_SAMPLES = 8
OUTLIERS = 6.0  # test_families' outlier_factory
MODEL, OUTPUT = "<model>", "<output>"  # placeholders in recorded recipes, filled per run
VERSION_KEYS = {"transformers_version", "quantkit_version", "versions"}
DROPPED_KEYS = {"timings_s"}
DROPPED_SUMMARY = ("outputs", "timings_s", "memory.rss_start", "memory.rss_peak", "memory.device_peak",
                   "memory.plan.advice")
MANIFEST = "quantkit.json"


# ---- what runs: cells and their models ----

def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def matrix_cells() -> dict[str, dict]:
    """tests/test_families.py's family x method cells, as recipes (its `recipe()` as YAML)."""
    tf = _import("test_families", TESTS / "test_families.py")
    methods = tf.METHODS | {"rtn-asym": ([f"rtn: {tf.ASYM4}"], ["gptq"])}
    cells = {}
    for arch in tf.FAMILIES:
        for method, (stages, formats) in methods.items():
            cells[f"tiny/{arch}/{method}"] = {"model": arch, "recipe": {
                "model": MODEL, "dtype": "float32", "device": "cpu",
                "calibration": {"num_samples": 16, "seq_len": 64},
                "stages": [yaml.safe_load(s) for s in stages],
                "export": {"output": OUTPUT, "formats": formats},
            }}
    return cells


def fewest_samples(calibration: dict) -> int:
    """RECIPE_SAMPLES, or more where a mixture would leave a part without a window (quantkit's own split)."""
    from quantkit.quantize.calibration import parts_of, shares
    from quantkit.recipe import Calibration

    weights = [p.weight for p in parts_of(Calibration(**calibration))]
    n = RECIPE_SAMPLES
    while min(shares(weights, n)) == 0:
        n += 1
    return n


def recipe_cells() -> dict[str, dict]:
    cells = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text())
        override: dict[str, Any] = {"export.output": "a temp folder"}
        recipe["export"]["output"] = OUTPUT
        if "calibration" in recipe:  # the FP8 recipe has none: round-to-nearest calibrates nothing
            n = recipe["calibration"]["num_samples"] = fewest_samples(recipe["calibration"])
            override["calibration.num_samples"] = n
        cells[f"recipe/{path.stem}"] = {"model": recipe["model"], "source": f"recipes/{path.name}",
                                        "override": override, "recipe": recipe}
    return dict(sorted(cells.items(), key=lambda kv: _tokens(kv[1]["recipe"])))


def _tokens(recipe: dict) -> int:
    c = recipe.get("calibration")
    return c["num_samples"] * c["seq_len"] if c else 0


def _build_tiny(arch: str, base: Path, dest: Path) -> None:
    from tiny_models import make_tiny_model, save_with_outliers

    save_with_outliers(make_tiny_model(base, arch), dest, OUTLIERS)


def model_files(model: str, tmp: Path, subs: list[tuple[str, str]], quiet: bool) -> tuple[str, dict]:
    """(what a recipe's `model` is, the model's file hashes): a tiny family is built under tmp first; a `pkg:`
    spec (the bundled GGUF) is hashed where it is installed."""
    if model.startswith("pkg:"):
        package, _, rel = model[4:].partition("/")
        path = Path(importlib.util.find_spec(package).submodule_search_locations[0]) / rel
        return model, {path.name: file_entry(path, subs)}
    folder = tmp / "models" / model
    if forked(_build_tiny, (model, tmp / "base" / model, folder), tmp / f"build-{model}.log") != 0:
        raise SystemExit(f"building the tiny {model} failed: {(tmp / f'build-{model}.log').read_text()[-2000:]}")
    log(quiet, f"built tiny {model}")
    return str(folder), hash_tree(folder, subs)


# ---- running a cell ----

def forked(fn: Callable, args: tuple, log_path: Path) -> int | None:
    """fn(*args) in a forked child whose stdout and stderr go to log_path; its exit code."""
    child = multiprocessing.get_context("fork").Process(target=_in_child, args=(fn, args, log_path))
    child.start()
    child.join()
    return child.exitcode


def _in_child(fn: Callable, args: tuple, log_path: Path) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    fn(*args)


def _quantize(recipe: Path, summary: Path) -> None:
    from quantkit import cli

    sys.argv = ["quantkit", "quantize", str(recipe), "--quiet", "--json", str(summary)]
    cli.main()


def run_cell(name: str, cell: dict, model: str, tmp: Path, subs: list[tuple[str, str]]) -> dict:
    folder = tmp / "cells" / name.replace("/", "__").replace(" ", "_").replace("+", "-")
    folder.mkdir(parents=True)
    recipe = copy.deepcopy(cell["recipe"])
    recipe["model"], recipe["export"]["output"] = model, str(folder / "out")
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    code = forked(_quantize, (folder / "recipe.yaml", folder / "summary.json"), folder / "log.txt")
    result: dict[str, Any] = {"exit": code}
    if code != 0:
        lines = (folder / "log.txt").read_text().splitlines()
        # the CLI's error line; or, for a crash, its traceback's last line
        said = [line for line in lines if line.startswith("error:")] or lines[-1:] or ["no output"]
        result["error"] = normalize(said[-1], subs)
    else:
        summary = json.loads((folder / "summary.json").read_text())
        result["summary"] = {k: v for k, v in flatten(summary).items()
                             if not any(k == d or k.startswith(d + ".") for d in DROPPED_SUMMARY)}
        result["files"] = hash_tree(folder / "out", subs)
    shutil.rmtree(folder)
    return result


# ---- hashing ----

def normalize(obj: Any, subs: list[tuple[str, str]]) -> Any:
    """obj with absolute paths as placeholders, version fields as <version>, timings dropped."""
    if isinstance(obj, dict):
        return {k: "<version>" if k in VERSION_KEYS else normalize(v, subs)
                for k, v in obj.items() if k not in DROPPED_KEYS}
    if isinstance(obj, list):
        return [normalize(v, subs) for v in obj]
    if isinstance(obj, str):
        for path, placeholder in subs:
            obj = obj.replace(path, placeholder)
    return obj


def file_entry(path: Path, subs: list[tuple[str, str]], hashes: dict[str, str] | None = None) -> dict:
    """sha256 and size of a file, a JSON one normalized (see the docstring); hashes: the other files' normalized
    hashes, which a manifest's `files` map lists."""
    data = path.read_bytes()
    entry: dict[str, Any] = {}
    if path.suffix == ".json":
        body = json.loads(data)
        if path.name == MANIFEST and hashes is not None:
            body["files"] = {k: hashes.get(k, v) for k, v in body["files"].items()}
        normalized = normalize(body, subs)
        if normalized != json.loads(data):
            data = (json.dumps(normalized, indent=2, sort_keys=True) + "\n").encode()
            entry["normalized"] = True
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)} | entry


def hash_tree(root: Path, subs: list[tuple[str, str]]) -> dict[str, dict]:
    """Every file under root by relative path; manifests last, as their `files` map lists the others."""
    out: dict[str, dict] = {}
    for path in sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: (p.name == MANIFEST, str(p))):
        folder = {k.rpartition("/")[2]: v["sha256"] for k, v in out.items()
                  if Path(root, k).parent == path.parent}
        out[str(path.relative_to(root))] = file_entry(path, subs, folder)
    return out


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        return {k: v for key, value in obj.items() for k, v in flatten(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): obj}


# ---- the environment ----

def environment() -> dict:
    import torch

    versions = {"python": sys.version.split()[0]}
    for pkg in PACKAGES:
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = "not installed"
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    isa = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4", "vnni")))
    return {"versions": versions, "cpu": {"model": model, "torch_capability": torch.backends.cpu.get_cpu_capability(),
                                          "isa_flags": isa}, "threads": 1}


def substitutions(tmp: Path) -> list[tuple[str, str]]:
    """(absolute path, placeholder), longest first (the temp folder may sit under another)."""
    paths = {str(tmp): "<tmp>", str(tmp.resolve()): "<tmp>", str(ROOT): "<repo>",
             sysconfig.get_paths()["purelib"]: "<site-packages>"}
    return sorted(paths.items(), key=lambda kv: -len(kv[0]))


def log(quiet: bool, line: str) -> None:
    if not quiet:
        print(line, flush=True)


# ---- record and check ----

def run_all(cells: dict[str, dict], quiet: bool, done: Callable[[dict, dict], None] = lambda m, r: None
            ) -> tuple[dict, dict]:
    """(model hashes by model, result by cell) for the given cells; done(models, results) after each cell."""
    tmp = Path(tempfile.mkdtemp(prefix="artifact-hashes-"))
    subs = substitutions(tmp)
    models, paths, results = {}, {}, {}
    try:
        for i, (name, cell) in enumerate(cells.items(), 1):
            if cell["model"] not in models:
                paths[cell["model"]], models[cell["model"]] = model_files(cell["model"], tmp, subs, quiet)
            start = time.perf_counter()
            results[name] = run_cell(name, cell, paths[cell["model"]], tmp, subs)
            results[name]["wall_s"] = round(time.perf_counter() - start, 1)  # what the cell costs; never compared
            log(quiet, f"[{i}/{len(cells)}] {name}: exit {results[name]['exit']}, "
                       f"{len(results[name].get('files', {}))} files, {results[name]['wall_s']} s")
            done(models, results)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return models, results


def selected(cells: dict[str, dict], pattern: str | None) -> dict[str, dict]:
    chosen = {k: v for k, v in cells.items() if pattern is None or fnmatch.fnmatch(k, pattern)}
    if not chosen:
        raise SystemExit(f"--only {pattern}: no cell matches")
    return chosen


def record(out: Path, pattern: str | None, quiet: bool) -> int:
    start = time.perf_counter()
    cells = selected(matrix_cells() | recipe_cells(), pattern)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = {"recorded": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit, **environment()}
    kept: dict = {"models": {}, "cells": {}}
    if pattern and out.exists():  # a subset recorded into an earlier baseline: its other cells stay
        kept = json.loads(out.read_text())
        if any(differences(key, kept[key], head[key]) for key in ("versions", "cpu", "threads")):
            raise SystemExit(f"{out} was recorded with other versions or CPU: record every cell anew")

    def write(models: dict, results: dict) -> None:  # after every cell: a long run killed keeps what it did
        body = head | {"models": kept["models"] | models,
                       "cells": kept["cells"] | {name: cells[name] | result for name, result in results.items()}}
        out.write_text(json.dumps(body, indent=1) + "\n")

    models, results = run_all(cells, quiet, write)
    files = sum(len(r.get("files", {})) for r in results.values())
    print(f"recorded {len(cells)} cells, {files} artifact files, {len(models)} models in "
          f"{time.perf_counter() - start:.0f} s: {out}")
    return 0


def differences(what: str, recorded: dict, now: dict) -> list[str]:
    was, got = flatten(recorded), flatten(now)
    return [f"{what}: {key}: recorded {was.get(key, '(absent)')}, now {got.get(key, '(absent)')}"
            for key in sorted(was.keys() | got.keys()) if was.get(key) != got.get(key)]


def check(baseline: Path, pattern: str | None, quiet: bool) -> int:
    start = time.perf_counter()
    body = json.loads(baseline.read_text())
    env = environment()
    for key in ("versions", "cpu", "threads"):
        for line in differences(key, body[key], env[key]):
            print(f"warning: {line} (hashes may legitimately differ)", file=sys.stderr)
    cells = selected({k: {f: v[f] for f in ("model", "recipe")} for k, v in body["cells"].items()}, pattern)
    models, results = run_all(cells, quiet)
    diffs = [line for m in models for line in differences(f"model {m} (its cells then differ too)",
                                                          body["models"][m], models[m])]
    for name, result in results.items():
        compared = ("exit", "error", "summary", "files")  # not wall_s
        diffs += differences(name, {k: v for k, v in body["cells"][name].items() if k in compared},
                             {k: v for k, v in result.items() if k in compared})
    for line in diffs:
        print(line)
    files = sum(len(r.get("files", {})) for r in results.values())
    verdict = f"{len(diffs)} differences" if diffs else "all equal"
    print(f"checked {len(cells)} cells, {files} artifact files, {len(models)} models in "
          f"{time.perf_counter() - start:.0f} s: {verdict}")
    return 1 if diffs else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["record", "check"])
    ap.add_argument("json", type=Path, help="record: where to write; check: the recorded baseline")
    ap.add_argument("--only", metavar="PATTERN", help="cells whose name matches (fnmatch), e.g. 'tiny/llama/*'")
    ap.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"  # read when torch loads: one thread
    # imported once here, where no tensor op has run (so no thread pool exists), and inherited by every forked cell
    import quantkit.cli  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    return (record if args.command == "record" else check)(args.json, args.only, args.quiet)


if __name__ == "__main__":
    raise SystemExit(main())
