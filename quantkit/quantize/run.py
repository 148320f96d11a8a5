"""recipe -> model -> calibration -> layer-wise pipeline -> artifacts: what `quantkit quantize` and the quantize
step of `quantkit release` run."""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import QuantkitError
from ..export.artifact import INDEX_NAME, MANIFEST_NAME, WEIGHTS_NAME, ArtifactWriter, write_artifact
from ..export.base import QuantInfo
from ..families import moe
from ..model import (decoder_blocks, load_config, load_model, load_tokenizer, meta_model, model_fingerprint,
                     pick_device, resolve_model_path, torch_dtype)
from ..progress import Reporter
from ..recipe import Recipe, parse_size
from ..resources import host_available, peak_rss_bytes, reset_peak_rss, rss_bytes
from ..untrusted import check_finite, check_positions
from ..versions import package_versions
from . import calibration, distributed, memory, observers, pipeline, targets as target_plan, transforms
from .hidden import FOLDER as ACTIVATIONS
from .hidden import Offload
from .resume import FOLDER as RESUME
from .resume import BlockCheckpoints, run_key
from .memory import fmt_bytes
from .source import InMemory, Streamed


def recipe_fingerprint(recipe: Recipe) -> dict:
    """What the quantized weights depend on: the recipe without its export / release / gates sections, nor how the
    weights are loaded (both paths give the same bytes, so a killed in-memory run resumes streamed), nor where the
    activations go (the run key has the layout the memory plan resolved)."""
    skip = {k: True for k in ("export", "release", "gates", "load")}
    return recipe.model_dump(mode="json", exclude=skip | {"calibration": {"offload": True, "batch_size": True}})


@dataclass
class RunPlan:
    """What a run decides once, before any weight is read, and passes down."""

    folder: str  # the model reference resolved: its folder or hub id
    gguf: str | None  # and its GGUF file
    streamed: Streamed | None  # the streamed source, None: the whole model is loaded
    info: QuantInfo  # what the weight stage writes, checked against the grid and the formats
    memory: memory.MemoryPlan
    offload: Offload  # where the hidden states live, how many windows a forward takes


def plan_run(recipe: Recipe, device: torch.device, report: Reporter, local_ranks: int = 1) -> RunPlan:
    """The source of the weights, what gets quantized, the memory plan and where the activations go, decided and
    checked before any weight is read. load: auto streams a local safetensors folder (the same bytes as loading it
    whole, at a fraction of the memory) unless the calibration samples the whole model (`self`). local_ranks:
    processes on this node, each with the plan's host memory to itself."""
    transforms.check(recipe.stages)
    folder, gguf = resolve_model_path(recipe.model)
    local = not gguf and Path(folder).is_dir()
    if recipe.load == "stream" and not local:
        raise QuantkitError(f"load: stream reads a local safetensors folder; {recipe.model} is "
                            f"{'a GGUF file' if gguf else 'a hub id'} (use load: memory or auto)")
    safetensors = local and any((Path(folder) / f).is_file() for f in (WEIGHTS_NAME, INDEX_NAME))
    samples_model = recipe.calibration is not None and any(
        p.dataset == "self" for p in calibration.parts_of(recipe.calibration))
    # auto: .bin folders, and self-calibration, load whole
    wanted = recipe.load == "stream" or (recipe.load == "auto" and safetensors and not samples_model)
    streamed = Streamed(folder, recipe.dtype) if local and wanted else None
    skeleton = streamed.model if streamed else meta_model(recipe.model, *load_config(recipe.model, recipe.dtype))
    moe.unfuse(skeleton)  # what the pipeline will quantize (Streamed has unfused its own)
    _, blocks = decoder_blocks(skeleton)
    _, targets, info = target_plan.plan(skeleton, recipe.stage, recipe.export.formats, recipe.transforms,
                                        recipe.overrides)
    observers.check_model(skeleton, recipe)
    info = replace(info, kv_cache=recipe.kv_cache and recipe.kv_cache.strategy)
    files = (0, False) if streamed else memory.weight_files(folder, gguf)
    host_free = host_available() // local_ranks
    device_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    disk_free = memory.disk_available(recipe.export.output) // local_ranks
    free = (f"free: host {fmt_bytes(host_free)}" + (f" per process ({local_ranks} on this node)" if local_ranks > 1
                                                     else "")
            + (f", device {fmt_bytes(device_free)}" if device_free is not None else "") + f", disk {fmt_bytes(disk_free)}")
    try:
        offload, chosen = memory.choose(
            lambda off: memory.plan(skeleton, blocks, targets, recipe, streamed is not None, device, off, files), recipe,
            host_free, device_free, disk_free)
    except QuantkitError as err:
        report.info(free)
        raise err from None
    report.info(f"{chosen.describe()}; {free}")
    if recipe.needs_calibration:  # past its positions OPT's embedding fails, Llama's RoPE runs on untrained
        check_positions(skeleton.config, recipe.calibration.seq_len, "calibration.seq_len", recipe.model)
    return RunPlan(folder, gguf, streamed, info, chosen, replace(offload, folder=Path(recipe.export.output) / ACTIVATIONS))


def _alive(pid: str) -> bool:
    """Whether the process that owns a temp folder (its name ends in -PID) still runs."""
    return pid.isdigit() and distributed.alive(int(pid))


def _written_by(dest: Path, recipe: Recipe) -> bool:
    """dest holds an artifact of this very recipe: rewriting it gives the same files."""
    try:
        return json.loads((dest / MANIFEST_NAME).read_text()).get("recipe") == recipe.model_dump(mode="json")
    except (OSError, ValueError, AttributeError):
        return False


def run_quantize(recipe: Recipe, overwrite: bool, report: Reporter, resume: bool = True) -> dict:
    """Writes every format of the recipe's export; returns the summary `quantkit quantize --json` prints. Under
    torchrun every rank calls this; rank 0 prints progress and writes the artifacts."""
    out_root = Path(recipe.export.output)
    made = _make_output(out_root)
    try:
        ranks = distributed.init(pick_device(recipe.device).type, out_root / distributed.FOLDER)
        report.quiet = report.quiet or ranks.rank > 0
        try:
            summary = _run(recipe, overwrite, report, resume, ranks)
        except QuantkitError as err:
            raise QuantkitError(ranks.record_failure(str(err))) from None
        finally:
            ranks.close()
    except Exception:  # not KeyboardInterrupt: an interrupted run keeps its folder to resume from
        if made is not None:
            _take_back(out_root, made)
        raise
    return summary


def _make_output(out: Path) -> Path | None:
    """Creates export.output before any work; returns the topmost folder this made (None: it existed). A file in
    the way, or a place no folder can be made or written, is one line now, not a traceback after the work."""
    if out.exists() and not out.is_dir():
        raise QuantkitError(f"export.output: {out} is a file; expected a folder (or a path not taken yet)")
    top = next((p for p in [out.absolute(), *out.absolute().parents] if p.parent.exists()), None)
    made = None if out.exists() else top
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise QuantkitError(f"export.output: cannot create {out}: {err.strerror or err}") from None
    if not os.access(out, os.W_OK):
        raise QuantkitError(f"export.output: {out} is not writable")
    return made


def _take_back(out: Path, top: Path) -> None:
    """A failed run removes the folders it made; per-block resume checkpoints stay for the next try, and so do the
    ranks' failure lines (only a run of several processes has them), which the launcher reads after every rank ends."""
    for p in out.iterdir():
        if p.is_dir() and p.name not in (RESUME, distributed.FOLDER):
            shutil.rmtree(p, ignore_errors=True)
        elif not p.is_dir():
            p.unlink(missing_ok=True)
    for p in [out.absolute(), *out.absolute().parents]:
        if any(p.iterdir()):
            return
        p.rmdir()
        if p == top:
            return


def _run(recipe: Recipe, overwrite: bool, report: Reporter, resume: bool, ranks: distributed.Ranks) -> dict:
    start = time.perf_counter()
    out_root = Path(recipe.export.output)
    dests = {fmt: out_root / fmt for fmt in recipe.export.formats}
    existing = [d for d in dests.values() if d.exists()]
    # a run of this very recipe killed between two formats left some folders: the same command finishes it
    unfinished = len(existing) < len(dests) and all(_written_by(d, recipe) for d in existing)
    if existing and not overwrite and not unfinished:
        raise QuantkitError(f"export.output: {existing[0]} already exists (pass --overwrite to replace it)")
    for fmt in dests if ranks.rank == 0 else ():  # what a killed export left behind (temp and set-aside folders)
        for stale in [*out_root.glob(f".{fmt}.partial-*"), *out_root.glob(f".{fmt}.replaced-*")]:
            if not _alive(stale.name.rpartition("-")[2]):
                shutil.rmtree(stale, ignore_errors=True)
    for stale in (out_root / ACTIVATIONS).glob("*"):  # the activations a killed run offloaded to disk
        if not _alive(stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    device = pick_device(recipe.device)
    if device.type == "cuda" and ranks.active:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", ranks.rank)))
    torch.manual_seed(0)
    planned = plan_run(recipe, device, report, int(os.environ.get("LOCAL_WORLD_SIZE", ranks.world)))
    streamed, mem_plan, offload = planned.streamed, planned.memory, planned.offload
    tokenizer = streamed.tokenizer if streamed else load_tokenizer(recipe.model)
    if streamed and recipe.calibration and any(p.dataset == "self" for p in calibration.parts_of(recipe.calibration)):
        raise QuantkitError("calibration.dataset: self samples from the whole model, but it does not fit in memory "
                            "and is streamed block by block; calibrate on text instead")
    calib = None
    if recipe.needs_calibration:
        with report.timed("calibration"):
            calib = calibration.build(tokenizer, recipe.calibration, recipe.model, recipe.dtype, device, report)
        report.info(f"calibration: {tuple(calib.tokens.shape)} tokens from {calib.source} (sha256 {calib.sha256[:12]})")
    if device.type == "cuda":  # cuBLAS and cuSOLVER load at first use: host memory of the libraries, not the plan's
        torch.linalg.cholesky(torch.eye(2, device=device) @ torch.eye(2, device=device))
    rss_start = rss_bytes()  # libraries imported, skeleton and calibration built: the rest is what the plan bounds
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if streamed is None:
        source = InMemory()
        with report.timed("load"):
            model = load_model(recipe.model, recipe.dtype, tokenizer).model
        names = moe.prepare(model)
        moe_blocks = moe.experts_of(model)
        if moe_blocks:
            report.info(f"moe: {len(moe_blocks)} blocks of {len(moe_blocks[0][1])} experts as "
                        f"per-expert Linears (calibrate_all_experts {str(recipe.moe.calibrate_all_experts).lower()})")
        report.info(f"loaded {recipe.model} ({type(model).__name__}, {model.dtype}) in {report.timings['load']:.1f} s")
        for name, p in model.named_parameters():  # before NaN spreads to every activation
            check_finite(name, p)
    else:
        model, source, names = streamed.model, streamed, streamed.names
        report.info(f"streaming {recipe.model} ({type(model).__name__}, {streamed.dtype}) block by block")
    versions = package_versions()
    checkpoints = None
    if calib is not None:
        key = run_key({"recipe": recipe_fingerprint(recipe), "model": model_fingerprint(recipe.model),
                       "calibration": calib.sha256, "device": device.type, "versions": versions,
                       "processes": ranks.world, "offload": [offload.where, offload.batch_size]})
        checkpoints = BlockCheckpoints(out_root, key, ranks)
        if not resume and ranks.rank == 0:
            checkpoints.clear()
        ranks.barrier()  # no rank saves before an old run's checkpoints are gone
    dtype = torch_dtype(recipe.export.dtype, streamed.dtype if streamed else model.dtype)
    shard_bytes = parse_size(recipe.export.max_shard_size)
    with ExitStack() as writers:
        if streamed is not None and ranks.rank == 0:  # every format is filled as blocks finish
            streamed.writers = {fmt: writers.enter_context(ArtifactWriter(dest, fmt, planned.info, dtype, shard_bytes,
                                                                          overwrite or unfinished, names))
                                for fmt, dest in dests.items()}
        with report.timed("quantize"):  # the stage's own phases are timed inside the pipeline
            result = pipeline.quantize(model, recipe.stage, calib, device, recipe.export.formats, report,
                                       recipe.transforms, checkpoints, source, ranks, recipe.moe, offload,
                                       observers.build(recipe), recipe.overrides)
        result.info = replace(result.info, kv_cache=planned.info.kv_cache)
        manifest = {
            "quantkit_version": versions["quantkit"],
            "recipe": recipe.model_dump(mode="json"),
            "versions": versions,
            "calibration": None if calib is None else {
                "source": calib.source, "sha256": calib.sha256, "parts": calib.parts,
                "num_samples": int(calib.tokens.shape[0]), "seq_len": int(calib.tokens.shape[1]),
            },
            "timings_s": dict(report.timings),
            "losses": result.losses,
        }
        if streamed is not None and ranks.rank == 0:
            with report.timed("export"):
                streamed.finish()
                for fmt, writer in streamed.writers.items():
                    writer.add_extra(result.extra_tensors)
                    writer.finish(model.config, tokenizer, streamed.generation_config, manifest)
                    report.info(f"wrote {fmt}: {dests[fmt]}")  # each path as soon as that folder is complete
        for fmt, dest in dests.items() if streamed is None and ranks.rank == 0 else ():
            with report.timed(f"export:{fmt}"):
                write_artifact(dest, fmt, model, tokenizer, result.qweights, result.info, dtype, shard_bytes,
                               manifest, overwrite or unfinished, names, result.extra_tensors)
            report.info(f"wrote {fmt}: {dest} ({report.timings[f'export:{fmt}']:.1f} s)")
    if checkpoints is not None and ranks.rank == 0:
        checkpoints.clear()  # every artifact is complete: nothing left to resume
    ranks.finished()
    total = time.perf_counter() - start
    report.info("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in report.timings.items()) + f"; total {total:.1f} s")
    peak = peak_rss_bytes()
    device_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    report.info(f"peak host memory {fmt_bytes(peak)}, {fmt_bytes(peak - rss_start)} above the start "
                f"(plan {fmt_bytes(mem_plan.host_total)})"
                + ("" if device_peak is None else f"; peak device memory {fmt_bytes(device_peak)} allocated by torch "
                   f"(plan {fmt_bytes(mem_plan.device_total)})"))
    return {
        "outputs": {fmt: str(d) for fmt, d in dests.items()},
        "load": "stream" if streamed is not None else "memory",
        "timings_s": dict(report.timings) | {"total": round(total, 3)},
        "memory": {"plan": mem_plan.as_dict(), "rss_start": rss_start, "rss_peak": peak, "device_peak": device_peak},
        "quantized_modules": len(result.losses),
        "loss_total": sum(v for v in result.losses.values() if v == v),
        "calibration_sha256": None if calib is None else calib.sha256,
    }
