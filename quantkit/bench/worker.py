"""Bench one model in this process: `python -m quantkit.bench.worker SPEC.json OUT.json`.

The runner starts one worker per model so that each model's peak memory is its own (a process's RSS never
shrinks back after a bigger model was freed) and the base never shares the device with the artifact."""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import QuantkitError, first_line
from ..progress import Reporter
from ..resources import rss_bytes
from .decode import EagerDecoder, StaticDecoder, decode_step_flops, generate_timed, kv_cache_bytes, tensor_bytes
from .monitor import Sampler, gpu_utilization_probe


@dataclass
class WorkerSpec:
    name: str  # "model" | "base"
    path: str
    dtype: str  # float32 | bfloat16 | float16
    device: str  # cpu | cuda
    batches: list[int]
    prompt_len: int
    gen_len: int
    reps: int
    compile: bool
    int4_backend: str = "auto"
    seed: int = 0
    quiet: bool = False


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def kernels_used(model: nn.Module, device: torch.device) -> dict[str, int]:
    """The matmul each Linear-like layer runs, counted: W8A8 layers report what their last forward ran,
    W4Linear and plain Linear layers what they are built to run."""
    from ..kernels.w4a16 import W4Linear, kernel_name

    names = []
    for m in model.modules():
        if isinstance(m, W4Linear):
            names.append(kernel_name(device, m.backend))
        elif hasattr(m, "path") and hasattr(m, "weight_scale"):  # Int8Linear / Fp8Linear
            names.append(f"{type(m).__name__}:{m.path}")
        elif isinstance(m, nn.Linear):
            names.append(f"F.linear:{str(m.weight.dtype).removeprefix('torch.')}")
    return dict(sorted(Counter(names).items()))


def load(spec: WorkerSpec, device: torch.device) -> nn.Module:
    from .. import runtime

    loaded = runtime.load(spec.path, spec.dtype, int4_device=device, int4_backend=spec.int4_backend)
    return loaded.model.to(device=device)


def bench(spec: WorkerSpec, rep: Reporter) -> dict:
    device = torch.device(spec.device)
    dtype = getattr(torch, spec.dtype)
    torch.manual_seed(spec.seed)
    model = load(spec, device)
    sizes = tensor_bytes(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    decoders = [EagerDecoder(model)] + ([StaticDecoder(model)] if spec.compile else [])
    gpu_probe = gpu_utilization_probe(device.index or 0) if device.type == "cuda" else None
    runs = []
    for decoder in decoders:
        variant = decoder.variant
        for batch in spec.batches:
            prompt = torch.randint(vocab, (batch, spec.prompt_len), generator=torch.Generator().manual_seed(spec.seed))
            prompt = prompt.to(device)
            rep.info(f"[{spec.name}] {variant} batch {batch}: warm-up")
            try:  # the warm-up also captures / compiles the static variant
                generate_timed(decoder, prompt, spec.gen_len if variant != "eager" else min(spec.gen_len, 8))
            except Exception as err:  # a capture or compile failure costs that variant, not the whole bench
                if variant == "eager":
                    raise
                rep.warn(f"[{spec.name}] {variant} batch {batch} skipped: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}")
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            rss = Sampler(rss_bytes, 0.005).start()
            util = Sampler(gpu_probe, 0.02) if gpu_probe else None
            timings = []
            for r in range(spec.reps):
                if util and r == 0:
                    util.start()
                timings.append(generate_timed(decoder, prompt, spec.gen_len))
                if util and r == 0:
                    util.stop()
            rss_peak = max(rss.stop())
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss_peak
            decode = [t.decode_s for t in timings]
            context = spec.prompt_len + spec.gen_len // 2  # the mean cache length a decode step reads
            kv_read = kv_cache_bytes(model.config, batch, context, dtype)
            run = {
                "name": spec.name,
                "path": spec.path,
                "variant": variant,
                "batch": batch,
                "prefill_tok_s": spread([batch * spec.prompt_len / t.prefill_s for t in timings]),
                "decode_tok_s": spread([batch * spec.gen_len / s for s in decode]),
                "ms_per_token": spread([1000 * s / spec.gen_len for s in decode]),
                "weight_bytes": sizes["total"],
                "peak_mem_bytes": int(peak),
                "kv_cache_bytes": kv_cache_bytes(model.config, batch, spec.prompt_len + spec.gen_len, dtype),
                "bytes_per_decode_step": sizes["total"] - sizes["embedding"] + kv_read,
                "flops_per_decode_step": decode_step_flops(model, batch, context),
                "gpu_util_pct": statistics.mean(util.values) if util and util.values else None,
            }
            runs.append(run)
            rep.info(f"[{spec.name}] {variant} batch {batch}: prefill {run['prefill_tok_s']['median']:.1f} tok/s, "
                     f"decode {run['decode_tok_s']['median']:.1f} tok/s ({run['ms_per_token']['median']:.2f} ms/step)")
    from ..runtime import kv_cache_scheme

    # what a serving engine keeps per token: 16-bit keys and values, or 8-bit ones with an FP8 KV cache
    fp8 = kv_cache_scheme(spec.path) is not None
    kv = {"dtype": "fp8_e4m3" if fp8 else "16-bit",
          "bytes_per_token": kv_cache_bytes(model.config, 1, 1, torch.float8_e4m3fn if fp8 else torch.float16)}
    return {"name": spec.name, "path": spec.path, "dtype": spec.dtype, "kernels": kernels_used(model, device),
            "weight_bytes": sizes["total"], "kv_cache": kv, "runs": runs}


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = WorkerSpec(**json.loads(open(spec_path).read()))
    try:
        body = bench(spec, Reporter(spec.quiet))
    except QuantkitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:  # OOM, a transformers API change...: one line, the parent names the model
        print(f"error: {type(err).__name__}: {first_line(err)}", file=sys.stderr)
        sys.exit(1)
    with open(out_path, "w") as f:
        json.dump(body, f)


if __name__ == "__main__":
    main()

