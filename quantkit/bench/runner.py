"""`quantkit bench`: the artifact and its original, one worker process each, on the same device in one run;
the device's own peaks measured first; ratios and a roofline diagnosis per decode run."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..errors import QuantkitError
from ..files import write_json_atomic
from ..model import pick_device
from ..progress import Reporter
from . import peaks
from .worker import WorkerSpec

# A decode step is bound by whichever of moving its bytes or doing its FLOPs takes longer at the device's peak;
# when even that one explains less than this share of the measured step, the rest is launch / framework overhead.
BOUND_SHARE = 0.5


@dataclass
class BenchOptions:
    baseline: str | None = None
    batches: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 512
    gen_len: int = 128
    device: str = "auto"
    dtype: str = "auto"  # the artifact's compute dtype: bfloat16 on CUDA, float32 on CPU
    baseline_dtype: str = "auto"  # the original's: bfloat16 on CUDA, float32 on CPU
    reps: int = 3
    compile: bool = False
    int4_backend: str = "auto"  # W4A16 on CPU: quantkit's AVX2 kernel when it builds, else PyTorch's
    kv_budget: int = 2**30  # bytes of KV cache the capacity figure fills with sequences of prompt_len + gen_len


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def auto_dtype(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" else "float32"


def run_worker(spec: WorkerSpec) -> dict:
    with tempfile.TemporaryDirectory(prefix="quantkit-bench-") as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(asdict(spec)))
        proc = subprocess.run([sys.executable, "-m", "quantkit.bench.worker", str(spec_file), str(out_file)],
                              env=os.environ.copy())
        if proc.returncode != 0 or not out_file.is_file():
            raise QuantkitError(f"bench: {spec.name} {spec.path} failed (worker exit {proc.returncode}, see above)")
        return json.loads(out_file.read_text())


def diagnose(run: dict, copy_bw: float, flops: float) -> dict:
    """Roofline figures of one decode run and where its time goes, in words."""
    step_s = run["ms_per_token"]["median"] / 1000
    t_mem = run["bytes_per_decode_step"] / copy_bw
    t_flop = run["flops_per_decode_step"] / flops
    bw_pct = 100 * t_mem / step_s
    flop_pct = 100 * t_flop / step_s
    if max(t_mem, t_flop) >= BOUND_SHARE * step_s:
        bound = "memory-bound" if t_mem >= t_flop else "compute-bound"
        why = (f"moving {run['bytes_per_decode_step'] / 1e6:.0f} MB per step at the measured peak would take "
               f"{100 * t_mem / step_s:.0f} % of the step" if bound == "memory-bound" else
               f"its FLOPs at the measured peak would take {100 * t_flop / step_s:.0f} % of the step")
    else:
        bound = "overhead-bound"
        why = (f"weights + KV at peak bandwidth explain {bw_pct:.0f} % of the step and FLOPs {flop_pct:.0f} %: "
               "the rest is kernel launches and framework work between them")
    return {"name": run["name"], "path": run["path"], "variant": run["variant"], "batch": run["batch"],
            "achieved_bw_bytes_s": run["bytes_per_decode_step"] / step_s, "bw_pct_of_peak": bw_pct,
            "flops_pct_of_peak": flop_pct, "gpu_util_pct": run.get("gpu_util_pct"), "bound": bound, "why": why}


def ratios(runs: list[dict]) -> list[dict]:
    base = {(r["variant"], r["batch"]): r for r in runs if r["name"] == "base"}
    out = []
    for r in runs:
        b = base.get((r["variant"], r["batch"]))
        if r["name"] != "model" or b is None:
            continue
        out.append({"path": r["path"], "variant": r["variant"], "batch": r["batch"],
                    "decode_speedup": r["decode_tok_s"]["median"] / b["decode_tok_s"]["median"],
                    "prefill_speedup": r["prefill_tok_s"]["median"] / b["prefill_tok_s"]["median"],
                    "weight_bytes_ratio": r["weight_bytes"] / b["weight_bytes"],
                    "peak_mem_ratio": r["peak_mem_bytes"] / b["peak_mem_bytes"]})
    return out


def kv_capacity(models: list[dict], context: int, budget: int) -> list[dict]:
    """Each model's KV cache as a server stores it: bytes per token, and how many sequences of `context` tokens fit
    in `budget` bytes (vs the original's, with --baseline)."""
    base = next((m["kv_cache"] for m in models if m["name"] == "base"), None)
    out = []
    for m in models:
        per_token = m["kv_cache"]["bytes_per_token"]
        row = {"name": m["name"], "path": m["path"], "dtype": m["kv_cache"]["dtype"], "bytes_per_token": per_token,
               "context": context, "budget_bytes": budget, "sequences": budget // (per_token * context)}
        if base is not None:
            row["capacity_ratio"] = base["bytes_per_token"] / per_token
        out.append(row)
    return out


def run_bench(artifacts: list[str], o: BenchOptions, rep: Reporter) -> dict:
    device = pick_device(o.device)
    dtype, base_dtype = auto_dtype(o.dtype, device), auto_dtype(o.baseline_dtype, device)
    rep.info(f"bench on {device_name(device)}: measuring peak copy bandwidth and {dtype} matmul FLOP/s")
    copy_bw = peaks.copy_bandwidth(device)
    flops = peaks.matmul_flops(device, getattr(torch, dtype))
    rep.info(f"peak copy {copy_bw / 1e9:.1f} GB/s, matmul {flops / 1e12:.2f} TFLOP/s")
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the peak probes' buffers (GiBs): give them back before the workers start
    common = dict(device=device.type, batches=list(o.batches), prompt_len=o.prompt_len, gen_len=o.gen_len,
                  reps=o.reps, compile=o.compile, int4_backend=o.int4_backend, quiet=rep.quiet)
    models = [run_worker(WorkerSpec(name="model", path=a, dtype=dtype, **common)) for a in artifacts]
    if o.baseline:
        models.append(run_worker(WorkerSpec(name="base", path=o.baseline, dtype=base_dtype, **common)))
    runs = [r for m in models for r in m.pop("runs")]
    return {
        "device": device.type,
        "device_name": device_name(device),
        "settings": {"batches": list(o.batches), "prompt_len": o.prompt_len, "gen_len": o.gen_len, "reps": o.reps,
                     "compile": o.compile, "int4_backend": o.int4_backend, "dtype": dtype, "baseline_dtype": base_dtype},
        "peaks": {"copy_bw_bytes_s": copy_bw, "matmul_flops": flops, "matmul_dtype": dtype},
        "models": models,
        "runs": runs,
        "ratios": ratios(runs),
        "kv_capacity": kv_capacity(models, o.prompt_len + o.gen_len, o.kv_budget),
        "roofline": [diagnose(r, copy_bw, flops) for r in runs],
    }


def label(path: str) -> str:
    """An artifact's folder and format (`w8a8/compressed-tensors`): format folders alone repeat across schemes."""
    return "/".join(Path(path).parts[-2:])


def markdown(body: dict) -> str:
    mb = 1e6
    lines = [f"Device: {body['device_name']}; peak copy {body['peaks']['copy_bw_bytes_s'] / 1e9:.1f} GB/s, "
             f"{body['peaks']['matmul_dtype']} matmul {body['peaks']['matmul_flops'] / 1e12:.2f} TFLOP/s (measured). "
             f"Prompt {body['settings']['prompt_len']}, {body['settings']['gen_len']} generated tokens, "
             f"median of {body['settings']['reps']} (min–max).", ""]
    for m in body["models"]:
        kernels = ", ".join(f"{k} ×{n}" for k, n in m["kernels"].items())
        lines.append(f"- {m['name']} `{m['path']}` ({m['dtype']}): {kernels}")
    lines += ["", "| model | path | variant | batch | prefill tok/s | decode tok/s | ms/token | weights MB | peak mem MB "
              "| KV MB | decode BW % peak | bound |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r, d in zip(body["runs"], body["roofline"]):
        ms = r["ms_per_token"]
        lines.append(
            f"| {r['name']} | {label(r['path'])} | {r['variant']} | {r['batch']} | {r['prefill_tok_s']['median']:.0f} "
            f"| {r['decode_tok_s']['median']:.1f} | {ms['median']:.2f} ({ms['min']:.2f}–{ms['max']:.2f}) "
            f"| {r['weight_bytes'] / mb:.1f} | {r['peak_mem_bytes'] / mb:.0f} | {r['kv_cache_bytes'] / mb:.1f} "
            f"| {d['bw_pct_of_peak']:.0f} | {d['bound']} |")
    if body["ratios"]:
        lines += ["", "| model vs base | variant | batch | decode speedup | prefill speedup | weight bytes | peak memory |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for q in body["ratios"]:
            lines.append(f"| {label(q['path'])} | {q['variant']} | {q['batch']} | {q['decode_speedup']:.2f}× | {q['prefill_speedup']:.2f}× "
                         f"| {100 * q['weight_bytes_ratio']:.1f} % | {100 * q['peak_mem_ratio']:.1f} % |")
    if body.get("kv_capacity"):
        k0 = body["kv_capacity"][0]
        lines += ["", f"| model | path | KV cache | bytes / token | sequences of {k0['context']} tokens in "
                      f"{k0['budget_bytes'] / 2**30:g} GiB | vs base |", "|---|---|---|---:|---:|---:|"]
        for k in body["kv_capacity"]:
            ratio = f"{k['capacity_ratio']:.2f}×" if "capacity_ratio" in k else "–"
            lines.append(f"| {k['name']} | {label(k['path'])} | {k['dtype']} | {k['bytes_per_token']:,} "
                         f"| {k['sequences']:,} | {ratio} |")
    lines += [""] + [f"- {d['name']} {label(d['path'])} {d['variant']} batch {d['batch']}: {d['bound']} — {d['why']}"
                     + (f"; GPU busy {d['gpu_util_pct']:.0f} % of the time" if d.get("gpu_util_pct") is not None else "")
                     for d in body["roofline"]]
    return "\n".join(lines)


def record_in_manifest(artifact: str, body: dict, key: str = "bench") -> Path | None:
    """Adds the results under `key` in the artifact's quantkit.json (written to a temp file, then renamed)."""
    manifest = Path(artifact) / "quantkit.json"
    if not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    data[key] = body
    write_json_atomic(manifest, data)
    return manifest
