"""What the device can do at best, measured in the same run as the model: copy bandwidth and matmul FLOP/s.
A roofline against a datasheet number would hide a throttled or shared device; these are what this process
actually got."""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_time(fn, device: torch.device, reps: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 5) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once), well beyond the caches."""
    nbytes = nbytes or (2 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _median_time(lambda: dst.copy_(src), device, reps)
    return 2 * nbytes / seconds


def matmul_flops(device: torch.device, dtype: torch.dtype, reps: int = 5) -> float:
    """FLOP/s of a square matmul big enough to be compute-bound, in the dtype the model computes in."""
    n = 8192 if device.type == "cuda" else 1536
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = _median_time(lambda: a @ b, device, reps)
    return 2 * n**3 / seconds
