"""Time the quantkit W4A16 CPU kernel against float32 F.linear and torch's int4pack CPU GEMM on SmolLM2 shapes.

  python benchmarks/int4_cpu_kernel.py --threads 1

"hot": one weight, so after the first call it sits in cache. "stack" (M <= 8): 30 distinct copies of the weight
(about SmolLM2-135M's 30 layers) run one after the other per measurement, so the float32 working set exceeds the
32 MB L3 and weights stream from DRAM as they do in decode; its times are per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from quantkit.kernels import int4_cpu

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (N, K): q/o, k/v, gate/up, down
TOKENS = [1, 8, 512]
LAYERS = 30


def median_us(fn, x: torch.Tensor, layers: list[dict], min_time: float) -> float:
    """Median microseconds per layer of one pass of fn(x, layer) over `layers`."""
    for layer in layers:  # warm-up (and the kernel build on the first call)
        fn(x, layer)
    samples: list[float] = []
    start = time.perf_counter()
    # at least 3 passes (torch's int4pack takes ~1 s per M=512 call here), more while min_time lasts
    while len(samples) < 3 or (time.perf_counter() - start < min_time and len(samples) < 200):
        t0 = time.perf_counter()
        for layer in layers:
            fn(x, layer)
        samples.append((time.perf_counter() - t0) / len(layers))
    return statistics.median(samples) * 1e6


def make_layer(n: int, k: int, group: int, gen: torch.Generator) -> dict:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=gen).float()
    weight = (codes.float() - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)
    # torch's int4pack: w = (q - 8) * scale + zero, scales_and_zeros [K/g, N, 2]
    torch_zero = (8 - zeros) * scales
    return {
        "weight": weight,
        "packed": int4_cpu.pack(codes),
        "scales": scales,
        "zeros": zeros,
        "tpacked": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2),
        "tsz": torch.stack([scales, torch_zero], dim=-1).transpose(0, 1).contiguous(),
    }


def impls(group: int) -> dict:
    return {
        "fp32": lambda x, lay: F.linear(x, lay["weight"]),
        "int4pack": lambda x, lay: torch.ops.aten._weight_int4pack_mm_for_cpu(x, lay["tpacked"], group, lay["tsz"]),
        "quantkit": lambda x, lay: int4_cpu.int4_gemm(x, lay["packed"], lay["scales"], lay["zeros"], group),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=64, help="64: the SmolLM2 W4A16 recipes' group size")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of samples per cell (at least 3)")
    args = ap.parse_args()
    ok, reason = int4_cpu.available()
    if not ok:
        raise SystemExit(reason)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    run = impls(args.group_size)
    print(f"threads={args.threads} group_size={args.group_size}; median us per layer ('stack': {LAYERS} layers)")
    print(f"{'N':>5} {'K':>5} {'M':>4} {'variant':>7} {'fp32':>9} {'int4pack':>9} {'quantkit':>9} {'vs fp32':>8}")
    for n, k in SHAPES:
        layers = [make_layer(n, k, args.group_size, gen) for _ in range(LAYERS)]
        for m in TOKENS:
            x = torch.randn(m, k, generator=gen)
            # the stack variant is about decode; at M=512 every kernel is compute-bound
            variants = [("hot", layers[:1])] + ([("stack", layers)] if m <= 8 else [])
            for variant, stack in variants:
                us = {name: median_us(fn, x, stack, args.min_time) for name, fn in run.items()}
                print(f"{n:>5} {k:>5} {m:>4} {variant:>7} {us['fp32']:>9.1f} {us['int4pack']:>9.1f} "
                      f"{us['quantkit']:>9.1f} {us['fp32'] / us['quantkit']:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
