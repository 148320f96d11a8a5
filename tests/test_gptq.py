import subprocess
import sys

import pytest
import torch

from quantkit.algorithms.gptq import GPTQ, Hessian, NotPositiveDefinite, _permute_, act_order_permutation
from quantkit.algorithms.grid import GridSpec
from quantkit.algorithms.rtn import rtn_quantize


def correlated_inputs(n=2048, cols=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(cols, cols, generator=g) / cols**0.5
    scales = torch.logspace(-1, 1, cols)  # some input channels matter far more than others
    return (torch.randn(n, cols, generator=g) @ mix) * scales + torch.randn(cols, generator=g)


def output_error(x, w, qw):
    return float((x @ (qw.dequantize() - w).T).square().mean())


SPECS = [GridSpec(b, g, s) for b in (2, 3, 4, 8) for g in (-1, 32, 64) for s in (True, False)]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_layer_output(spec, act_order):
    x = correlated_inputs()
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1))
    h = Hessian(128)
    h.add(x)
    qw, loss = GPTQ(h.value(), spec, act_order=act_order).quantize(w)
    rtn = output_error(x, w, rtn_quantize(w, spec))
    gptq = output_error(x, w, qw)
    # GPTQ minimises exactly this error. The inputs put the most important channels last, GPTQ's worst
    # order: plain GPTQ still wins, act-order (important columns first) wins by far, at every width.
    assert gptq < (0.5 if act_order else 0.9) * rtn, (gptq, rtn)
    assert loss > 0
    # codes on the grid, scale/zero shaped per group, dequantization consistent
    assert int(qw.codes.max()) <= spec.maxq
    assert qw.scale.shape == (96, spec.groups(128)) and qw.scale.dtype == torch.float16
    if spec.sym:
        assert torch.all(qw.zero == 2 ** (spec.bits - 1))


def test_gptq_is_deterministic_and_shared_hessian_equals_concatenation():
    x = correlated_inputs()
    h = Hessian(128)
    h.add(x)
    a, b = torch.randn(64, 128), torch.randn(32, 128)
    solver = GPTQ(h.value(), GridSpec(4, 32, True), act_order=True)
    qa, _ = solver.quantize(a)
    qb, _ = solver.quantize(b)
    both, _ = GPTQ(h.value(), GridSpec(4, 32, True), act_order=True).quantize(torch.cat([a, b]))
    assert torch.equal(torch.cat([qa.codes, qb.codes]), both.codes)  # rows are independent given H
    again, _ = solver.quantize(a)
    assert torch.equal(again.codes, qa.codes) and torch.equal(again.scale, qa.scale)


def test_hessian_is_a_sum_so_shards_combine():
    x = correlated_inputs(n=1000)
    whole, left, right = Hessian(128), Hessian(128), Hessian(128)
    whole.add(x)
    left.add(x[:300])
    right.add(x[300:])
    left.sum += right.sum  # what an all-reduce across calibration shards would do
    left.count += right.count
    torch.testing.assert_close(left.value(), whole.value(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(whole.value(), 2 * x.T @ x / 1000, rtol=1e-5, atol=1e-4)


def test_hessian_of_windows_is_bit_identical_however_they_are_shared():
    """What makes N processes give the one-process GPTQ: the same Hessian to the bit, whatever the split and order."""
    windows = correlated_inputs(n=1600).view(16, 100, 128)
    one = Hessian(128)
    one.add(windows)
    for split in ([slice(0, 16, 2), slice(1, 16, 2)], [slice(0, 5), slice(5, 11), slice(11, 16)]):
        parts = [Hessian(128) for _ in split]
        for part, s in zip(parts, split):
            part.add(windows[s])
        total = Hessian(128)
        total.sum.copy_(sum(part.sum for part in reversed(parts)))  # an all-reduce, in another order
        total.count = sum(part.count for part in parts)
        assert torch.equal(total.value(), one.value())
    fp32 = sum((w.T @ w for w in windows[1::2]), torch.zeros(128, 128)) + sum(w.T @ w for w in windows[0::2])
    assert not torch.equal(fp32 * (2.0 / 1600), one.value())  # in fp32 the order would show
    assert torch.equal(one.value(), one.take())  # the same value, the sum consumed
    assert one.sum is None


@pytest.mark.parametrize("cols", [96, 300, 2 * Hessian.BAND])
def test_hessian_sums_only_the_upper_triangle_and_mirrors_it(cols):
    """The bands hold the upper triangle alone; the matrix they give is the whole per-window fp64 sum, symmetric."""
    windows = torch.randn(5, 40, cols, generator=torch.Generator().manual_seed(cols))
    h = Hessian(cols)
    h.add(windows)
    assert h.sum.numel() < 0.5 * cols * cols + Hessian.BAND * cols  # not the whole square
    reference = sum((w.T.double() @ w.double() for w in windows), torch.zeros(cols, cols, dtype=torch.float64))
    value = h.value()
    assert torch.equal(value, value.T)
    torch.testing.assert_close(value.double(), reference * (2.0 / 200), rtol=1e-6, atol=1e-6)
    assert h.count == 200
    # a Hessian handed to GPTQ is consumed: the solver holds the only copy of the matrix
    solver = GPTQ(h, GridSpec(4, -1, True))
    assert h.sum is None and solver.hinv.shape == (cols, cols)


PEAK_RISE = """
import torch
from quantkit.algorithms.gptq import GPTQ, Hessian
from quantkit.algorithms.grid import GridSpec
cols = {cols}
h = Hessian(cols)
h.add(torch.randn(4, 64, cols) + torch.randn(4, 64, 1))  # correlated, full rank after damping
{setup}
kib = lambda key: int(open("/proc/self/status").read().split(key + ":")[1].split()[0])
before = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
{measured}
print((kib("VmHWM") - before) * 1024)
"""
PEAK_COLS = 4096


def peak_rise(measured: str, setup: str = "") -> int:
    """Bytes the peak RSS of a fresh process rises by while `measured` runs, after a PEAK_COLS-wide Hessian h is summed
    and `setup` has run."""
    script = PEAK_RISE.format(cols=PEAK_COLS, setup=setup, measured=measured)
    return int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout)


def test_solver_holds_one_matrix_while_it_takes_permutes_and_factors():
    """Hessian.take, act-order's permutation and the three LAPACK steps all work in the Hessian sum's own storage:
    the peak rises by a small part of one C x C matrix (it rose by a whole one when each step made a new matrix)."""
    rise = peak_rise("solver = GPTQ(h, GridSpec(4, 128, True), act_order=True)")
    assert rise / (4 * PEAK_COLS * PEAK_COLS) < 0.5  # 0.2 measured; 1.13 with a new matrix per step


def test_quantize_many_holds_one_fp32_copy_of_the_weights():
    """GPTQ's working copy of the stacked weights is written straight into one fp32 buffer in act-order, and the
    codes straight into their original column order: per weight the peak rises by its fp32 copy and its uint8 codes
    (and, once the fp32 copy is freed, each weight's own copy of its codes), not also by a reordered copy of the
    codes (7 measured when it did), a stacked bf16 copy and a permuted fp32 one (10)."""
    setup = ("solver = GPTQ(h, GridSpec(4, 128, True), act_order=True)\n"
             "weights = [torch.randn(1024, cols, dtype=torch.bfloat16) for _ in range(2)]  # e.g. gate and up")
    rise = peak_rise("out = solver.quantize_many(weights)", setup)
    assert rise / (2048 * PEAK_COLS) < 6.5  # 6.0 measured


def test_take_and_the_retry_give_the_out_of_place_results_bit_for_bit():
    """The in-place solver computes exactly what copies would: take() is value(), the factor is LAPACK's on a copy,
    and a retry after a failed in-place factorization starts again from H as it was (read back from its file)."""
    x = correlated_inputs(n=512, cols=192)
    h = Hessian(192)
    h.add(x.view(4, 128, 192))
    value = h.value()
    assert torch.equal(h.take(), value)

    def factor(matrix, damp):  # out of place, on one thread as the solver runs LAPACK
        damped = matrix.clone()
        damped.diagonal().add_(damp * matrix.diagonal().mean())
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
        finally:
            torch.set_num_threads(threads)

    assert torch.equal(GPTQ(value, GridSpec(4, 64, True)).hinv, factor(value, 0.01))
    indefinite = value - 0.05 * value.diagonal().mean() * torch.eye(192)  # fails at damp 0.01, not at 0.1
    solver = GPTQ(indefinite, GridSpec(4, 64, True))
    assert solver.damp == pytest.approx(0.1) and torch.equal(solver.hinv, factor(indefinite, 0.1))
    perm = torch.randperm(192, generator=torch.Generator().manual_seed(0))
    permuted = value.clone()
    _permute_(permuted, perm)
    assert torch.equal(permuted, value[perm][:, perm])


def test_bf16_gram_rounds_each_window_once_and_keeps_the_solution():
    """hessian_dtype bfloat16: bf16 activations give the fp64 reference Hessian of those very values to within one
    bf16 rounding per window, GPTQ's layer-output error stays put, and windows still sum in any order to the bit."""
    windows = correlated_inputs(n=16 * 256, cols=256).view(16, 256, 256).bfloat16()
    reference = sum((w.double().T @ w.double() for w in windows), torch.zeros(256, 256, dtype=torch.float64))
    reference *= 2.0 / windows[..., 0].numel()
    fp32, bf16 = Hessian(256), Hessian(256, gram_dtype=torch.bfloat16)
    fp32.add(windows)
    bf16.add(windows)

    def rel(h):
        return float((h.value().double() - reference).norm() / reference.norm())

    assert rel(fp32) < 1e-6
    assert 2 ** -14 < rel(bf16) < 2 ** -9  # rounded in bf16 (not fp32), but only once per window
    halves = [Hessian(256, gram_dtype=torch.bfloat16) for _ in range(2)]
    halves[0].add(windows[1::2])
    halves[1].add(windows[0::2])
    assert torch.equal(halves[0].sum + halves[1].sum, bf16.sum)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    x = windows.reshape(-1, 256).float()
    spec = GridSpec(4, 64, True)
    q32, _ = GPTQ(fp32.value(), spec, act_order=True).quantize(w)
    q16, _ = GPTQ(bf16.value(), spec, act_order=True).quantize(w)
    # codes do move (one flip travels along its row through the error feedback); what GPTQ minimises does not
    assert output_error(x, w, q16) < 1.02 * output_error(x, w, q32)


def test_act_order_keeps_groups_contiguous_and_ranks_by_diagonal():
    diag = torch.tensor([1.0, 9, 2, 3, 8, 0, 7, 4])
    perm = act_order_permutation(diag, span=4)
    assert perm.tolist() == [1, 3, 2, 0, 4, 6, 7, 5]
    assert sorted(perm[:4].tolist()) == [0, 1, 2, 3]
    assert act_order_permutation(diag, span=8).tolist() == [1, 4, 6, 7, 3, 2, 0, 5]


def test_non_positive_definite_hessian_retries_with_more_damping():
    x = correlated_inputs(n=64)
    h = 2 * x.T @ x / 64
    h -= 0.05 * torch.diag(h).mean() * torch.eye(128)  # indefinite: damp 0.01 cannot fix it, 0.1 can
    warnings = []
    solver = GPTQ(h, GridSpec(4, 32, True), damp=0.01, warn=warnings.append)
    assert solver.damp == pytest.approx(0.1)
    assert warnings == ["Hessian not positive definite at damp=0.01; retrying with damp=0.1"]
    with pytest.raises(NotPositiveDefinite):
        GPTQ(-torch.eye(128), GridSpec(4, 32, True))


def test_dead_inputs_get_zero_weight():
    x = correlated_inputs()
    x[:, 5] = 0
    h = Hessian(128)
    h.add(x)
    qw, _ = GPTQ(h.value(), GridSpec(4, 32, False)).quantize(torch.randn(16, 128))
    assert torch.all(qw.dequantize()[:, 5] == 0)


def test_quantize_many_is_each_weight_quantized_alone_bit_for_bit():
    """Linears sharing a Hessian (q/k/v, every expert's gate/up) are solved in one pass over their stacked rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2048, 256, generator=g)
    solver = GPTQ(x.T @ x * 2 / 2048, GridSpec(4, 64, True), 0.01, 64, act_order=True)
    weights = [torch.randn(rows, 256, generator=g) * 0.02 for rows in (64, 128, 32)]
    for (one, loss), (many, many_loss) in zip([solver.quantize(w) for w in weights], solver.quantize_many(weights)):
        assert torch.equal(one.codes, many.codes) and torch.equal(one.scale, many.scale)
        assert torch.equal(one.zero, many.zero) and many_loss == pytest.approx(loss, rel=1e-5)


def test_release_empties_each_weights_own_storage_once_copied_and_keeps_the_bits():
    """release=True (the pipeline swaps the quantized weights in right after): a weight that is all of its storage
    is emptied, one that shares its storage (a view of a fused tensor) is left alone; the results do not change."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1024, 128, generator=g)
    solver = GPTQ(x.T @ x * 2 / 1024, GridSpec(4, 64, True), act_order=True)
    fused = torch.randn(96, 128, generator=g)
    weights = [torch.randn(64, 128, generator=g), fused[32:]]
    kept = solver.quantize_many([w.clone() for w in weights])
    released = solver.quantize_many(weights, release=True)
    assert weights[0].untyped_storage().nbytes() == 0 and fused.untyped_storage().nbytes() == 96 * 128 * 4
    for (a, la), (b, lb) in zip(kept, released):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and la == lb


@pytest.mark.parametrize("spec", [GridSpec(4, 64, True), GridSpec(4, 64, False), GridSpec(3, -1, True)], ids=str)
def test_mse_observer_clips_outliers_and_never_loses_to_minmax(spec):
    from quantkit.algorithms.grid import find_params, mse_params, quantize_codes

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w[torch.arange(64), torch.randint(0, 64, (64,), generator=g)] *= 8  # one outlier per row stretches min-max
    rows = w.reshape(-1, spec.span(128))

    def err(params):
        s, z = params
        return ((quantize_codes(rows, s[:, None], z[:, None], spec.maxq) - z[:, None]) * s[:, None] - rows).abs()

    minmax, mse = err(find_params(rows, spec)), err(mse_params(rows, spec))
    assert torch.all(mse.pow(2.4).sum(1) <= minmax.pow(2.4).sum(1) * (1 + 1e-6))  # p = 1 is a candidate
    assert float(mse.square().mean()) < 0.97 * float(minmax.square().mean())  # clipping the outlier pays
    # in RTN and GPTQ: the same grid search, chosen by `observer`
    assert float((rtn_quantize(w, spec, "mse").dequantize() - w).square().mean()) == pytest.approx(
        float(mse.square().mean()), rel=1e-5)
    x = correlated_inputs()
    h = Hessian(128)
    h.add(x)
    gptq_mse, _ = GPTQ(h.value(), spec, act_order=True, observer="mse").quantize(w)
    gptq, _ = GPTQ(h.value(), spec, act_order=True).quantize(w)
    assert output_error(x, w, gptq_mse) < output_error(x, w, gptq)
