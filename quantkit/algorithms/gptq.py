"""GPTQ (Frantar et al., 2022): quantize a weight column by column, spreading each column's rounding
error over the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

One `GPTQ` object holds one prepared Hessian (damped, permuted, inverted, Cholesky-factored) and can
quantize every weight that reads the same input -- q/k/v or gate/up share it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

from .grid import OBSERVERS, SCALE_DTYPE, GridSpec, QuantizedWeight, quantize_codes


class NotPositiveDefinite(RuntimeError):
    pass


class Hessian:
    """H = 2/n · Σ xᵀx over calibration tokens. Kept as a sum and a count, so calibration shards on several
    processes combine by all-reducing `sum` and `count`.

    Each calibration window's xᵀx is computed on its own in `gram_dtype` (fp32 unless asked) and summed in fp64. A
    window's term then does not depend on which other windows share its batch, and fp64 sums of a few hundred fp32
    terms come out the same in any order. So N processes, each summing its share, get the one-process Hessian. A
    last-bit difference would matter: GPTQ's error feedback carries one flipped code along the rest of its row.

    H is symmetric, so only its upper triangle is summed: `sum` is one flat fp64 buffer of row bands, band b holding
    rows [r0, r1) from column r0 on. That halves both the matmul flops and the fp64 sum, whose memory (and whose
    fp32 → fp64 additions) cost as much as the matmuls on a CPU.

    gram_dtype bfloat16 (opt-in) multiplies bf16 activations -- exactly the values a bf16 model computes -- on the
    bf16 matmul units a CPU's fp32 path leaves idle (3.4× the flops here), then rounds each window's xᵀx to bf16
    once (relative 2⁻⁹ per entry, independent across windows, so the fp64 sum keeps the per-window determinism)."""

    BAND = 128  # rows per band: big enough for an efficient matmul, small enough to waste little of the lower half

    def __init__(self, columns: int, device: torch.device | str = "cpu", gram_dtype: torch.dtype = torch.float32):
        self.columns, self.count, self.gram_dtype = columns, 0, gram_dtype
        self.bands = [(r0, min(columns, r0 + self.BAND)) for r0 in range(0, columns, self.BAND)]
        sizes = [(r1 - r0) * (columns - r0) for r0, r1 in self.bands]
        self.sum = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
        self._views = [v.view(r1 - r0, columns - r0) for v, (r0, r1) in zip(self.sum.split(sizes), self.bands)]

    def add(self, x: torch.Tensor) -> None:
        """x: [windows, tokens, columns] (or [tokens, columns]: one window)."""
        windows = x if x.dim() > 2 else x.unsqueeze(0)
        for w in windows:
            w = w.reshape(-1, w.shape[-1]).to(self.sum.device, self.gram_dtype)
            for (r0, r1), band in zip(self.bands, self._views):
                band.add_(w[:, r0:r1].T @ w[:, r0:])
            self.count += w.shape[0]

    def full(self, scale: float) -> torch.Tensor:
        """scale · the summed matrix, whole and symmetric, in fp32."""
        out = torch.empty(self.columns, self.columns, device=self.sum.device)
        for (r0, r1), band in zip(self.bands, self._views):
            rows = (band * scale).float()
            out[r0:r1, r0:] = rows
            out[r1:, r0:r1] = rows[:, r1 - r0:].T
        return out

    def value(self) -> torch.Tensor:
        return self.full(2.0 / max(self.count, 1))

    def take(self) -> torch.Tensor:
        """value(), dropping the sum: the fp64 bands and the fp32 matrix are the only two at the peak."""
        h = self.value()
        self.sum = self._views = None
        return h


def act_order_permutation(diag: torch.Tensor, span: int) -> torch.Tensor:
    """Columns with the largest Hessian diagonal first, keeping each quantization group contiguous
    (groups ranked by their largest diagonal entry, columns ranked inside each group). Groups stay
    static -- g_idx remains col // group_size -- so act-order artifacts keep the fast kernels."""
    cols = diag.numel()
    if span == cols:
        return torch.argsort(diag, descending=True, stable=True)
    by_group = diag.view(cols // span, span)
    within = torch.argsort(by_group, dim=1, descending=True, stable=True)
    rank = torch.argsort(by_group.max(dim=1).values, descending=True, stable=True)
    return (rank[:, None] * span + within[rank]).flatten()


def _upper_inverse_cholesky(box: list[torch.Tensor], damp: float, warn: Callable[[str], None]):
    """The upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹. box: [H], handed over: H is damped in place and
    freed once factored, so no more than two C x C matrices are alive at once (a 14k-wide down_proj's is 0.8 GB)."""
    h = box.pop()
    diag = h.diagonal().clone()
    mean_diag = diag.mean()
    for _ in range(4):
        h.diagonal().copy_(diag).add_(damp * mean_diag)
        lower, info = torch.linalg.cholesky_ex(h)
        if info == 0:
            del h
            inverse = torch.cholesky_inverse(lower)
            del lower
            upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if info == 0:
                return upper, damp
            h = torch.linalg.inv(inverse)  # rounding left H⁻¹ indefinite (rare): H again, to damp more
            del inverse
        warn(f"Hessian not positive definite at damp={damp:g}; retrying with damp={damp * 10:g}")
        damp *= 10
    raise NotPositiveDefinite(f"Hessian not positive definite even at damp={damp / 10:g}")


class GPTQ:
    def __init__(
        self,
        hessian: torch.Tensor | Hessian,
        spec: GridSpec,
        damp: float = 0.01,
        block_size: int = 128,
        act_order: bool = False,
        warn: Callable[[str], None] = lambda msg: None,
        observer: str = "minmax",
    ):
        """hessian: a matrix (copied), or a Hessian, whose sum is consumed: the solver then owns the only copy."""
        h = hessian.take() if isinstance(hessian, Hessian) else hessian.float().clone()
        self.spec, self.block_size, self.find_params = spec, block_size, OBSERVERS[observer]
        self.dead = torch.diag(h) == 0  # inputs that never fired: their weights cannot matter
        h[self.dead, self.dead] = 1
        cols = h.shape[0]
        self.perm = act_order_permutation(torch.diag(h), spec.span(cols)) if act_order else None
        if self.perm is not None:  # rows, then columns: two matrices at a time, not three
            h = h[self.perm]
            h = h[:, self.perm]
        box = [h]
        del h
        with _one_thread(box[0].device):  # LAPACK's potri scales badly across CPU threads (10x slower on 2)
            self.hinv, self.damp = _upper_inverse_cholesky(box, damp, warn)

    @torch.no_grad()
    def quantize(self, weight: torch.Tensor) -> tuple[QuantizedWeight, float]:
        """Returns the quantized weight (original column order) and GPTQ's loss Σ (w-q)²/(2·[H⁻¹]ᵢᵢ²)."""
        with _one_thread(self.hinv.device):  # thousands of tiny ops: CPU threads add only sync overhead
            qw, losses = self._quantize(weight)
        return qw, float(losses.sum())

    @torch.no_grad()
    def quantize_many(self, weights: list[torch.Tensor]) -> list[tuple[QuantizedWeight, float]]:
        """quantize() of each weight, in one pass over their stacked rows: GPTQ treats rows independently, so the
        codes and scales are each weight's own (bit-identical, tested), at the cost of one column loop."""
        with _one_thread(self.hinv.device):
            qw, losses = self._quantize(torch.cat(weights))
        out, start = [], 0
        for w in weights:
            rows = slice(start, start + w.shape[0])
            out.append((QuantizedWeight(codes=qw.codes[rows], scale=qw.scale[rows], zero=qw.zero[rows], spec=qw.spec),
                        float(losses[rows].sum())))
            start += w.shape[0]
        return out

    def _quantize(self, weight: torch.Tensor) -> tuple[QuantizedWeight, torch.Tensor]:
        spec, hinv, perm = self.spec, self.hinv, self.perm
        # Work on Wᵀ: a weight column is then a contiguous row, and the rank-1 updates are BLAS ger calls.
        wt = weight.T.to(hinv.device, torch.float32, copy=True, memory_format=torch.contiguous_format)
        wt[self.dead] = 0
        if perm is not None:
            wt = wt[perm]
        cols, rows = wt.shape
        span = spec.span(cols)
        codes = torch.empty_like(wt)
        scale = torch.empty(spec.groups(cols), rows, device=wt.device)
        zero = torch.empty_like(scale)
        losses = torch.zeros(rows, device=wt.device)
        s = z = None
        for i1 in range(0, cols, self.block_size):
            i2 = min(i1 + self.block_size, cols)
            w1, h1 = wt[i1:i2].clone(), hinv[i1:i2, i1:i2]
            diag = h1.diagonal().tolist()  # Python floats: one op less per column than indexing h1
            err1 = torch.empty_like(w1)
            # each column's views made once per block, and every op in place: the loop is Python-bound
            w_rows, h_rows, e_rows, q_rows = w1.unbind(), h1.unbind(), err1.unbind(), codes[i1:i2].unbind()
            for i in range(i2 - i1):
                col = i1 + i
                if col % span == 0:  # a new group starts: grid from its current (error-updated) weights
                    ahead = w1[i:i + span]  # the group's columns: this block's rest, then the next block's
                    if len(ahead) < span:
                        ahead = torch.cat([ahead, wt[i2:i2 + span - len(ahead)]])
                    s, z = self.find_params(ahead.T, spec)
                    g = (int(perm[col]) if perm is not None else col) // span
                    scale[g], zero[g] = s, z
                w, q, err = w_rows[i], q_rows[i], e_rows[i]
                quantize_codes(w, s, z, spec.maxq, out=q)
                torch.sub(q, z, out=err).mul_(s)
                torch.sub(w, err, out=err).div_(diag[i])  # (w - (q - z)·s) / [H⁻¹]ᵢᵢ
                w1[i + 1:].addr_(h_rows[i][i + 1:], err, alpha=-1)
            losses += err1.square().sum(0)  # halved once at the end: exact, as halving is
            wt[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1)  # lazy batch update of the remaining columns
        if perm is not None:
            codes = codes[torch.argsort(perm)]
        losses /= 2
        qw = QuantizedWeight(
            codes=codes.T.to(torch.uint8).cpu(),
            scale=scale.T.contiguous().to(SCALE_DTYPE).cpu(),
            zero=zero.T.contiguous().to(torch.uint8).cpu(),
            spec=spec,
        )
        return qw, losses


@contextmanager
def _one_thread(device: torch.device):
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
