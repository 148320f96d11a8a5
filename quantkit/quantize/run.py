"""recipe -> model -> calibration -> layer-wise pipeline -> artifacts: what `quantkit quantize` and the quantize
step of `quantkit release` run."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from ..errors import QuantkitError
from ..export.artifact import MANIFEST_NAME, write_artifact
from ..model import load_model, model_fingerprint, pick_device, torch_dtype
from ..progress import Reporter
from ..recipe import Recipe, parse_size
from ..versions import package_versions
from . import calibration, pipeline
from .checkpoint import BlockCheckpoints, run_key


def recipe_fingerprint(recipe: Recipe) -> dict:
    """What the quantized weights depend on: the recipe without its export / release / gates sections."""
    return recipe.model_dump(mode="json", exclude={"export", "release", "gates"})


def _alive(pid: str) -> bool:
    """Whether the process that owns a temp folder (its name ends in -PID) still runs."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's live process
        pass
    return True


def _written_by(dest: Path, recipe: Recipe) -> bool:
    """dest holds an artifact of this very recipe: rewriting it gives the same files."""
    try:
        return json.loads((dest / MANIFEST_NAME).read_text()).get("recipe") == recipe.model_dump(mode="json")
    except (OSError, ValueError, AttributeError):
        return False


def run_quantize(recipe: Recipe, overwrite: bool, report: Reporter, resume: bool = True) -> dict:
    """Writes every format of the recipe's export; returns the summary `quantkit quantize --json` prints."""
    start = time.perf_counter()
    out_root = Path(recipe.export.output)
    dests = {fmt: out_root / fmt for fmt in recipe.export.formats}
    existing = [d for d in dests.values() if d.exists()]
    # a run of this very recipe killed between two formats left some folders: the same command finishes it
    unfinished = len(existing) < len(dests) and all(_written_by(d, recipe) for d in existing)
    if existing and not overwrite and not unfinished:
        raise QuantkitError(f"export.output: {existing[0]} already exists (pass --overwrite to replace it)")
    for fmt in dests:  # what a killed export left behind (write_artifact's temp and set-aside folders)
        for stale in [*out_root.glob(f".{fmt}.partial-*"), *out_root.glob(f".{fmt}.replaced-*")]:
            if not _alive(stale.name.rpartition("-")[2]):
                shutil.rmtree(stale, ignore_errors=True)
    device = pick_device(recipe.device)
    torch.manual_seed(0)
    with report.timed("load"):
        loaded = load_model(recipe.model, recipe.dtype)
    report.info(f"loaded {recipe.model} ({type(loaded.model).__name__}, {loaded.model.dtype}) "
                f"in {report.timings['load']:.1f} s")
    calib = None
    if recipe.needs_calibration:
        with report.timed("calibration"):
            calib = calibration.build(loaded.tokenizer, recipe.calibration)
        report.info(f"calibration: {tuple(calib.tokens.shape)} tokens from {calib.source} (sha256 {calib.sha256[:12]})")
    versions = package_versions()
    checkpoints = None
    if calib is not None:
        key = run_key({"recipe": recipe_fingerprint(recipe), "model": model_fingerprint(recipe.model),
                       "calibration": calib.sha256, "device": str(device), "versions": versions})
        checkpoints = BlockCheckpoints(out_root, key)
        if not resume:
            checkpoints.clear()
    with report.timed("quantize"):  # the stage's own phases are timed inside the pipeline
        result = pipeline.quantize(loaded.model, recipe.stage, calib, device, recipe.export.formats, report,
                                   recipe.transforms, checkpoints)
    dtype = torch_dtype(recipe.export.dtype, loaded.model.dtype)
    manifest = {
        "quantkit_version": versions["quantkit"],
        "recipe": recipe.model_dump(mode="json"),
        "versions": versions,
        "calibration": None if calib is None else {
            "source": calib.source, "sha256": calib.sha256,
            "num_samples": int(calib.tokens.shape[0]), "seq_len": int(calib.tokens.shape[1]),
        },
        "timings_s": dict(report.timings),
        "losses": result.losses,
    }
    for fmt, dest in dests.items():
        with report.timed(f"export:{fmt}"):
            write_artifact(dest, fmt, loaded.model, loaded.tokenizer, result.qweights, result.info, dtype,
                           parse_size(recipe.export.max_shard_size), manifest, overwrite or unfinished)
        report.info(f"wrote {dest} in {report.timings[f'export:{fmt}']:.1f} s")
    if checkpoints is not None:
        checkpoints.clear()  # every artifact is complete: nothing left to resume
    total = time.perf_counter() - start
    report.info("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.timings.items()) + f"; total {total:.1f} s")
    return {
        "outputs": {fmt: str(d) for fmt, d in dests.items()},
        "timings_s": dict(report.timings) | {"total": round(total, 3)},
        "quantized_modules": len(result.qweights),
        "loss_total": sum(v for v in result.losses.values() if v == v),
        "calibration_sha256": None if calib is None else calib.sha256,
    }
