"""GPTQ (Frantar et al., 2022): quantize a weight column by column, spreading each column's rounding
error over the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

One `GPTQ` object holds one prepared Hessian (damped, permuted, inverted, Cholesky-factored) and can
quantize every weight that reads the same input -- q/k/v or gate/up share it.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import contextmanager

import torch

from .fp4 import Fp4Spec, Fp4Weight, codes_of, effective, global_scale_of, group_scales, round_values, store
from .fp8 import FP8_DTYPE, FP8_MAX, Fp8BlockWeight, fp8_block_quantize
from .grid import OBSERVERS, SCALE_DTYPE, GridSpec, QuantizedWeight, quantize_codes
from .mxfp8 import Mxfp8Grid, Mxfp8Spec
from .scheme import QuantizedTensor


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

    def value(self) -> torch.Tensor:
        """H = 2/n · the summed matrix, whole and symmetric, in fp32; the sum is kept (take() consumes it)."""
        scale = 2.0 / max(self.count, 1)
        out = torch.empty(self.columns, self.columns, device=self.sum.device)
        for (r0, r1), band in zip(self.bands, self._views):
            rows = (band * scale).float()
            out[r0:r1, r0:] = rows
            out[r1:, r0:r1] = rows[:, r1 - r0:].T
        return out

    @classmethod
    def nbytes(cls, columns: int) -> int:
        """The sum's bytes, which are also the most a solver that takes it holds at once."""
        return 8 * sum((min(columns, r0 + cls.BAND) - r0) * (columns - r0) for r0 in range(0, columns, cls.BAND))

    def take(self, scale: float | None = None) -> torch.Tensor:
        """value() (scale · the sum, where scale is given), made in the sum's own storage, which is then gone: the fp64
        upper triangle holds at least as many bytes as the fp32 square, so no second C x C matrix exists. Row bands
        are read in order; band b's fp32 rows end at byte 4·C·r1, never past where band b+1's fp64 rows start
        (8·r1·(C - r0/2) bytes in), so each band is read before it is written over. Then the upper triangle is
        mirrored below the diagonal."""
        scale, cols = 2.0 / max(self.count, 1) if scale is None else scale, self.columns
        h = self.sum.view(torch.float32)[:cols * cols].view(cols, cols)
        for (r0, r1), band in zip(self.bands, self._views):
            h[r0:r1, r0:] = (band * scale).float()
        for r0, r1 in self.bands:
            h[r1:, r0:r1] = h[r0:r1, r1:].T
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


def _upper_inverse_cholesky(h: torch.Tensor, damp: float, warn: Callable[[str], None]):
    """The upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹, made in H's own storage: LAPACK factors and inverts
    in place, so the solver never holds a second C x C matrix (a 28k-wide down_proj's is 3.3 GB). A failed
    factorization leaves H overwritten, so H first goes to a temporary file, read back only to retry with more
    damping (rare)."""
    diag = h.diagonal().clone()
    mean_diag = diag.mean()
    f = h.T  # column-major, the layout LAPACK works in; H is symmetric, so the same matrix
    info = torch.empty((), dtype=torch.int32, device=h.device)
    with tempfile.TemporaryFile() as backup:
        _spill(h, backup)
        for attempt in range(4):
            if attempt:
                _restore(h, backup)
            h.diagonal().copy_(diag).add_(damp * mean_diag)
            torch.linalg.cholesky_ex(f, out=(f, info))
            if info == 0:
                torch.cholesky_inverse(f, out=f)
                torch.linalg.cholesky_ex(f, upper=True, out=(f, info))  # rounding can leave H⁻¹ indefinite
                if info == 0:
                    return f, damp
            warn(f"Hessian not positive definite at damp={damp:g}; retrying with damp={damp * 10:g}")
            damp *= 10
    raise NotPositiveDefinite(f"Hessian not positive definite even at damp={damp / 10:g}")


_CHUNK_ROWS = 256  # rows per copy, spill or permutation step: a few MB in transit, from the host or a GPU


def _spill(h: torch.Tensor, file) -> None:
    for rows in h.split(_CHUNK_ROWS):
        file.write(rows.cpu().numpy().tobytes())


def _restore(h: torch.Tensor, file) -> None:
    file.seek(0)
    for rows in h.split(_CHUNK_ROWS):
        data = bytearray(file.read(rows.numel() * rows.element_size()))
        rows.copy_(torch.frombuffer(data, dtype=rows.dtype).view(rows.shape))


def _permute_(h: torch.Tensor, perm: torch.Tensor) -> None:
    """h[perm][:, perm], in place: rows along the permutation's cycles (one row in hand), then each band of rows'
    columns (one band in hand)."""
    order, done = perm.tolist(), [False] * len(perm)
    for start in range(len(order)):
        if done[start] or order[start] == start:
            continue
        held, i = h[start].clone(), start
        while True:
            done[i] = True
            j = order[i]
            if j == start:
                h[i] = held
                break
            h[i] = h[j]
            i = j
    for rows in h.split(_CHUNK_ROWS):
        rows.copy_(rows[:, perm])


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
        fp8_block: tuple[int, int] | None = None,
    ):
        """hessian: a matrix (copied), or a Hessian, whose sum is consumed: the solver then owns the only copy.
        fp8_block: round to FP8 e4m3 instead of spec's grid, one scale per [rows, cols] block, each block's scale
        fixed from the weight before the solve (as llm-compressor's GPTQ takes its observer's block scales)."""
        h = hessian.take() if isinstance(hessian, Hessian) else hessian.float().clone()
        self.spec, self.block_size, self.find_params = spec, block_size, OBSERVERS[observer]
        self.fp8_block = fp8_block
        self.dead = torch.diag(h) == 0  # inputs that never fired: their weights cannot matter
        h[self.dead, self.dead] = 1
        cols = h.shape[0]
        self.perm = act_order_permutation(torch.diag(h), spec.span(cols)) if act_order else None
        if self.perm is not None:
            _permute_(h, self.perm)
        with _one_thread(h.device):  # LAPACK's potri scales badly across CPU threads (10x slower on 2)
            self.hinv, self.damp = _upper_inverse_cholesky(h, damp, warn)

    @torch.no_grad()
    def quantize(self, weight: torch.Tensor) -> tuple[QuantizedTensor, float]:
        """Returns the quantized weight (original column order) and GPTQ's loss Σ (w-q)²/(2·[H⁻¹]ᵢᵢ²)."""
        return self.quantize_many([weight])[0]

    @torch.no_grad()
    def quantize_many(self, weights: list[torch.Tensor], release: bool = False,
                      global_scales: list[torch.Tensor | None] | None = None) -> list[tuple[QuantizedTensor, float]]:
        """quantize() of each weight, in one pass over their stacked rows: GPTQ treats rows independently, so the
        codes and scales are each weight's own (bit-identical, tested), at the cost of one column loop.
        release: nothing reads the weights afterwards (the caller swaps the quantized ones in): each one's storage is
        emptied as soon as it is copied, where the storage is the weight's own, so the solve does not hold it.
        global_scales: NVFP4's, per weight (default: each from its own values)."""
        if self.fp8_block is not None:
            grid = None
        elif isinstance(self.spec, Fp4Spec):
            grid = _Fp4Grid(self.spec, weights, global_scales)
        elif isinstance(self.spec, Mxfp8Spec):
            grid = Mxfp8Grid()
        else:
            grid = _IntGrid(self.spec, self.find_params)
        with _one_thread(self.hinv.device):  # thousands of tiny ops: CPU threads add only sync overhead
            solved = self._quantize(weights, grid, release)
        if grid is None:
            return self._split_fp8(weights, *solved)
        codes, scale, zero, losses = solved
        out, start = [], 0
        for i, w in enumerate(weights):
            rows = slice(start, start + w.shape[0])
            # each weight's codes in a buffer of their own, as one weight's are: freed, or parked, on their own
            mine = codes[rows] if len(weights) == 1 else codes[rows].clone()
            out.append((grid.result(i, mine, scale[rows], zero[rows]), float(losses[rows].sum())))
            start += w.shape[0]
        return out

    def _split_fp8(self, weights: list[torch.Tensor], qw: Fp8BlockWeight, losses: torch.Tensor
                   ) -> list[tuple[QuantizedTensor, float]]:
        """Each weight's rows of the stacked FP8 block result (its rows are whole blocks: plan() checks they tile)."""
        out, start, r = [], 0, self.fp8_block[0]
        for w in weights:
            rows = slice(start, start + w.shape[0])
            out.append((Fp8BlockWeight(qw.weight[rows].clone(), qw.scale[start // r:rows.stop // r].clone(), qw.block),
                        float(losses[rows].sum())))
            start += w.shape[0]
        return out

    def _stacked_transpose(self, weights: list[torch.Tensor], release: bool = False) -> torch.Tensor:
        """[W₁; W₂; …]ᵀ in fp32, its rows in act-order: a weight column is then a contiguous row, and the rank-1
        updates are BLAS ger calls. Written into one buffer a few rows at a time, with no stacked, converted or
        permuted copy beside it (a 70B down_proj's would add 0.47 GB in bf16 or 0.94 GB in fp32 at GPTQ's peak)."""
        cols = self.hinv.shape[0]
        wt = torch.empty(cols, sum(w.shape[0] for w in weights), device=self.hinv.device)
        r0 = 0
        for w in weights:
            order = None if self.perm is None else self.perm.to(w.device)
            for k in range(0, cols, _CHUNK_ROWS):
                src = w.T[k:k + _CHUNK_ROWS] if order is None else w.T[order[k:k + _CHUNK_ROWS]]
                wt[k:k + _CHUNK_ROWS, r0:r0 + w.shape[0]].copy_(src)
            r0 += w.shape[0]
            storage = w.untyped_storage()
            if release and storage.resizable() and storage.nbytes() == w.nbytes:  # not a mapped file's, nor shared
                storage.resize_(0)
        return wt

    def _quantize(self, weights: list[torch.Tensor], grid, release: bool = False):
        """The column loop over the stacked weights: codes [rows, cols], the grid's stored scale and zero
        [rows, groups] (float32) and each row's loss."""
        spec, hinv, perm = self.spec, self.hinv, self.perm
        wt = self._stacked_transpose(weights, release)
        wt[self.dead if perm is None else self.dead[perm]] = 0
        if self.fp8_block is not None:
            return self._quantize_fp8(wt)
        cols, rows = wt.shape
        span = spec.span(cols)
        # in the original column order (act-order's column i1 + i is column perm[i1 + i]): no reordered copy beside it
        codes = torch.empty(cols, rows, dtype=torch.uint8, device=wt.device)  # a block's codes stay float until done
        scale = torch.empty(spec.groups(cols), rows, device=wt.device)
        zero = torch.empty_like(scale)
        losses = torch.zeros(rows, device=wt.device)
        s = z = None
        for i1 in range(0, cols, self.block_size):
            i2 = min(i1 + self.block_size, cols)
            w1, h1 = wt[i1:i2].clone(), hinv[i1:i2, i1:i2]
            diag = h1.diagonal().tolist()  # Python floats: one op less per column than indexing h1
            err1, q1 = torch.empty_like(w1), torch.empty_like(w1)
            # each column's views made once per block, and every op in place: the loop is Python-bound
            w_rows, h_rows, e_rows, q_rows = w1.unbind(), h1.unbind(), err1.unbind(), q1.unbind()
            for i in range(i2 - i1):
                col = i1 + i
                if col % span == 0:  # a new group starts: grid from its current (error-updated) weights
                    ahead = w1[i:i + span]  # the group's columns: this block's rest, then the next block's
                    if len(ahead) < span:
                        ahead = torch.cat([ahead, wt[i2:i2 + span - len(ahead)]])
                    s, z, stored = grid.params(ahead.T)
                    g = (int(perm[col]) if perm is not None else col) // span
                    scale[g], zero[g] = stored, z
                w, q, err = w_rows[i], q_rows[i], e_rows[i]
                grid.round(w, s, z, out=q)
                torch.sub(q, z, out=err).mul_(s)
                torch.sub(w, err, out=err).div_(diag[i])  # (w - (q - z)·s) / [H⁻¹]ᵢᵢ
                w1[i + 1:].addr_(h_rows[i][i + 1:], err, alpha=-1)
            codes[slice(i1, i2) if perm is None else perm[i1:i2]] = grid.codes(q1)
            losses += err1.square().sum(0)  # halved once at the end: exact, as halving is
            wt[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1)  # lazy batch update of the remaining columns
        losses /= 2
        return codes.T.cpu(), scale.T.contiguous().cpu(), zero.T.contiguous().cpu(), losses


    def _quantize_fp8(self, wt: torch.Tensor) -> tuple[Fp8BlockWeight, torch.Tensor]:
        """GPTQ's column loop on the FP8 grid of fixed block scales (wt: [cols, rows], no act-order)."""
        hinv, (br, bc) = self.hinv, self.fp8_block
        cols, rows = wt.shape
        scale = fp8_block_quantize(wt.T, (br, bc)).scale.to(wt.device)  # [rows / br, cols / bc], from the weight
        col_scale = scale.repeat_interleave(br, 0).T.contiguous()  # [cols / bc, rows]: a column's scale per row
        q8 = torch.empty(cols, rows, dtype=FP8_DTYPE, device=wt.device)
        losses = torch.zeros(rows, device=wt.device)
        for i1 in range(0, cols, self.block_size):
            i2 = min(i1 + self.block_size, cols)
            w1, h1 = wt[i1:i2].clone(), hinv[i1:i2, i1:i2]
            err1 = torch.empty_like(w1)
            for i in range(i2 - i1):
                s = col_scale[(i1 + i) // bc]
                q8[i1 + i] = (w1[i] / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                err1[i] = (w1[i] - q8[i1 + i].float() * s) / h1[i, i]
                w1[i + 1:].addr_(h1[i, i + 1:], err1[i], alpha=-1)
            losses += err1.square().sum(0)
            wt[i2:].addmm_(hinv[i1:i2, i2:].T, err1, alpha=-1)
        return Fp8BlockWeight(q8.T.contiguous().cpu(), scale.cpu(), (br, bc)), losses / 2


class _IntGrid:
    """GPTQ's integer grid: codes (float until a block is done) with a scale and zero per group."""

    def __init__(self, spec: GridSpec, find_params):
        self.spec, self.find_params = spec, find_params

    def params(self, group: torch.Tensor):
        s, z = self.find_params(group, self.spec)
        return s, z, s

    def round(self, w, s, z, out):
        quantize_codes(w, s, z, self.spec.maxq, out=out)

    def codes(self, q: torch.Tensor) -> torch.Tensor:
        return q.to(torch.uint8)

    def result(self, i: int, codes, scale, zero) -> QuantizedWeight:
        return QuantizedWeight(codes=codes, scale=scale.to(SCALE_DTYPE), zero=zero.to(torch.uint8), spec=self.spec)


class _Fp4Grid:
    """The e2m1 grid: q holds e2m1 values (zero 0), each group's scale from calculate_qparams of its current
    (error-updated) columns, over each weight's global scale taken from original values (NVFP4)."""

    def __init__(self, spec: Fp4Spec, weights: list[torch.Tensor], global_scales: list | None):
        self.spec = spec
        # on the host with the codes and scales (a weight's own global scale sits on its device)
        self.globals = [None if g is None else g.float().cpu()
                        for g in (global_scales or [global_scale_of(w, spec) for w in weights])]
        self.rows = None if not spec.global_scale else torch.cat(
            [g.expand(w.shape[0]) for g, w in zip(self.globals, weights)])

    def params(self, group: torch.Tensor):
        rows = None if self.rows is None else self.rows.to(group.device)
        stored = store(group_scales(group, self.spec, rows), self.spec)
        s = effective(stored, rows)
        return s, torch.zeros_like(s), effective(stored, None)

    def round(self, w, s, z, out):
        out.copy_(round_values(w, s))

    def codes(self, q: torch.Tensor) -> torch.Tensor:
        return codes_of(q)

    def result(self, i: int, codes, scale, zero) -> Fp4Weight:
        return Fp4Weight(codes, store(scale, self.spec), self.spec, self.globals[i])


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
