"""W4A16 GEMM on x86 CPUs: a C++ AVX2/FMA kernel that multiplies float activations with 4-bit weight codes.

torch's own CPU int4 path (`_weight_int4pack_mm_for_cpu`) is ~10x slower than a float32 `F.linear` on AVX2-only
CPUs; this kernel reads 4 bits (plus group scales / zeros) per weight and beats float32 at decode, where the
weights come from DRAM. Layout, math and the prefill path are described in csrc/int4_gemm_cpu.cpp.

The extension is compiled on first use into a folder of torch's extension cache (~/.cache/torch_extensions or
$TORCH_EXTENSIONS_DIR) named after the source, flags and torch version; `available()` says whether this machine
can run it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "int4_gemm_cpu.cpp"
RUN = 16  # a packed run: 16 codes in 8 bytes, byte j = q[j] | q[j + 8] << 4
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]
STALE_LOCK_S = 600  # a build takes ~1 min; a lock this old was left by a build that was killed


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _first_line(exc: BaseException) -> str:
    """The line of a build failure worth showing: the compiler's first error, else the message's first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if ": error:" in line or ": fatal error:" in line]
    return (errors or lines or [type(exc).__name__])[0][:300]


def build_dir() -> Path:
    """This source's build folder: a new source, flag set or torch gets its own, never a half-written older one."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode()).hexdigest()
    return Path(root) / f"quantkit_int4_cpu-{key[:12]}"


def clear_stale_lock(folder: Path) -> None:
    """torch's build lock outlives a killed build, and every later build then waits on it forever."""
    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


@functools.cache
def _load():
    """(the op, None) or (None, why not)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"int4 CPU kernel needs x86-64, this is {platform.machine()}"
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        return None, f"int4 CPU kernel needs AVX2 and FMA, this CPU lacks {', '.join(sorted(missing))}"
    try:
        from torch.utils.cpp_extension import load

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(folder)
        # a plain shared library that registers torch.ops.quantkit_int4.int4_gemm when loaded
        load(
            name="quantkit_int4_cpu",
            sources=[str(SOURCE)],
            build_directory=str(folder),
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        return torch.ops.quantkit_int4.int4_gemm.default, None  # .default skips overload resolution per call
    except Exception as exc:  # noqa: BLE001 - any build failure means "not available", never a crash
        return None, f"int4 CPU kernel failed to build: {_first_line(exc)}"


def available() -> tuple[bool, str]:
    """(True, "") when the kernel is built and runs here, else (False, one-line reason). Never raises."""
    op, reason = _load()
    return op is not None, reason or ""


def pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] with values 0..15 (K a multiple of 16) -> uint8 [N, K/2] in the kernel's layout."""
    n, k = codes.shape
    if k % RUN:
        raise ValueError(f"pack: K must be a multiple of {RUN}, got K={k}")
    runs = codes.to(torch.uint8).reshape(n, k // RUN, 2, RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: uint8 [N, K/2] -> uint8 codes [N, K]."""
    n, half = packed.shape
    runs = packed.reshape(n, half // (RUN // 2), 1, RUN // 2)
    return torch.cat([runs & 0xF, runs >> 4], dim=2).reshape(n, half * 2)


def _check(k: int, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> None:
    if k % RUN:
        raise ValueError(f"int4_gemm: K must be a multiple of {RUN}, got K={k}")
    if group_size <= 0 or group_size % RUN or k % group_size:
        raise ValueError(f"int4_gemm: group_size must be a multiple of {RUN} that divides K={k}, got {group_size}")
    n = packed.shape[0]
    if packed.shape != (n, k // 2):
        raise ValueError(f"int4_gemm: packed must be [N, K/2] = [{n}, {k // 2}], got {list(packed.shape)}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.shape != (n, k // group_size):
            raise ValueError(f"int4_gemm: {name} must be [N, K/group_size] = [{n}, {k // group_size}], "
                             f"got {list(t.shape)}")


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """x [..., K] @ W.T with W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], g = k // group_size, q packed by
    `pack`. Computes in float32 and returns x.dtype, shape [..., N]."""
    k = x.shape[-1]
    _check(k, packed, scales, zeros, group_size)
    op, reason = _load()
    if op is None:
        raise RuntimeError(reason)
    # each skipped no-op conversion saves ~1-3 us of Python overhead on a ~20-100 us decode GEMV
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    y = op(x2.float().contiguous(), packed.contiguous(), scales.float().contiguous(), zeros.float().contiguous(),
           group_size)
    if x.dim() != 2:
        y = y.reshape(*x.shape[:-1], -1)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def _per_column(t: torch.Tensor, group_size: int) -> torch.Tensor:
    return t.double().repeat_interleave(group_size, dim=1)


def reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """What `int4_gemm` computes, by dequantizing in float64 and multiplying (returns float64)."""
    _check(x.shape[-1], packed, scales, zeros, group_size)
    w = (unpack(packed).double() - _per_column(zeros, group_size)) * _per_column(scales, group_size)
    return x.double() @ w.T
