"""The W4A16 CPU kernel: its packing layout, its output against a float64 dequantize-then-matmul reference on
every code path (M=1 / small-M GEMV tiles, N tails, the dequantize + sgemm prefill path), and its input checks."""

import os

import pytest
import torch

from quantkit.kernels import int4_cpu

# Observed errors are at most ~1.5e-6 of max|y|; a wrong nibble order or zero term is off by ~1
# (test_bound_catches_wrong_nibble_order_and_zero_term).
TOL = 1e-4
SHAPES = [(576, 32), (576, 64), (576, 576), (1536, 32), (1536, 64), (1536, 128), (1536, 1536)]  # (K, group size)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """Builds the extension once (the first time on a machine takes ~30 s) or skips the module."""
    ok, reason = int4_cpu.available()
    if not ok:
        pytest.skip(reason)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def problem(n, k, group, sym, seed=0):
    g = gen(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.full_like(scales, 8.0) if sym else torch.randint(0, 16, scales.shape, generator=g).float()
    return int4_cpu.pack(codes), scales, zeros


def rel_err(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def test_pack_round_trip():
    codes = torch.randint(0, 16, (203, 1536), generator=gen(1), dtype=torch.uint8)
    packed = int4_cpu.pack(codes)
    assert packed.shape == (203, 768) and packed.dtype == torch.uint8
    assert torch.equal(int4_cpu.unpack(packed), codes)
    assert torch.equal(int4_cpu.pack(codes.to(torch.int32)), packed)


def test_pack_layout():
    # byte j of each 16-code run: q[j] low nibble, q[j + 8] high nibble
    codes = torch.arange(32).remainder(16).reshape(1, 32)
    expected = [j | (j + 8) << 4 for j in range(8)] * 2
    assert int4_cpu.pack(codes).tolist() == [expected]


@pytest.mark.parametrize("k,group", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 6, 8, 17, 64])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_matches_reference(m, k, group, sym):
    n = 203 if m <= 8 else 600  # 203: a tail after the 4-row blocks; 600: a tail after the 256-row dequant blocks
    packed, scales, zeros = problem(n, k, group, sym, seed=m)
    x = torch.randn(m, k, generator=gen(m + 100))
    y = int4_cpu.int4_gemm(x, packed, scales, zeros, group)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert rel_err(y, int4_cpu.reference(x, packed, scales, zeros, group)) < TOL


@pytest.mark.parametrize("m", [1, 8, 17])
def test_bound_catches_wrong_nibble_order_and_zero_term(m):
    packed, scales, zeros = problem(203, 576, 64, sym=False)
    x = torch.randn(m, 576, generator=gen(2))
    ref = int4_cpu.reference(x, packed, scales, zeros, 64)
    swapped = (packed >> 4) | (packed << 4)
    assert rel_err(int4_cpu.int4_gemm(x, swapped, scales, zeros, 64), ref) > 100 * TOL
    sym_zeros = torch.full_like(zeros, 8.0)  # a kernel that ignored the zero points
    assert rel_err(int4_cpu.int4_gemm(x, packed, scales, sym_zeros, 64), ref) > 100 * TOL


def test_leading_dims_dtype_and_strides():
    packed, scales, zeros = problem(203, 576, 64, sym=False)
    x = torch.randn(2, 3, 1152, generator=gen(3))[..., ::2]  # non-contiguous [2, 3, 576]
    ref = int4_cpu.reference(x.reshape(6, 576), packed, scales, zeros, 64).reshape(2, 3, 203)
    y = int4_cpu.int4_gemm(x, packed, scales, zeros, 64)
    assert y.shape == (2, 3, 203) and rel_err(y, ref) < TOL
    y16 = int4_cpu.int4_gemm(x.bfloat16(), packed, scales.half(), zeros.double(), 64)
    assert y16.dtype == torch.bfloat16
    assert rel_err(y16, int4_cpu.reference(x.bfloat16().reshape(6, 576), packed, scales.half(), zeros, 64)
                   .reshape(2, 3, 203)) < 1e-2  # bf16 output rounding


def test_bad_shapes_raise_value_error():
    x = torch.randn(1, 40)
    packed, scales, zeros = torch.zeros(4, 20, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1)
    with pytest.raises(ValueError, match="K=40"):
        int4_cpu.int4_gemm(x, packed, scales, zeros, 40)
    with pytest.raises(ValueError, match="K=40"):
        int4_cpu.pack(torch.zeros(4, 40, dtype=torch.uint8))
    packed, scales, zeros = problem(4, 576, 64, sym=True)
    x = torch.randn(1, 576)
    for group in (128, 8, 0):  # 128 does not divide 576; 8 is not a multiple of 16
        with pytest.raises(ValueError, match=f"got {group}$"):
            int4_cpu.int4_gemm(x, packed, scales, zeros, group)
    with pytest.raises(ValueError, match="scales must be"):
        int4_cpu.int4_gemm(x, packed, scales[:, :4], zeros, 64)


def test_a_lock_left_by_a_killed_build_is_removed_once_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = int4_cpu.build_dir()
    assert folder.parent == tmp_path and folder.name.startswith("quantkit_int4_cpu-")
    folder.mkdir()
    lock = folder / "lock"
    lock.touch()
    int4_cpu.clear_stale_lock(folder)
    assert lock.exists()  # a build may be running
    old = lock.stat().st_mtime - int4_cpu.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    int4_cpu.clear_stale_lock(folder)
    assert not lock.exists()
    int4_cpu.clear_stale_lock(folder)  # no lock: nothing to do
