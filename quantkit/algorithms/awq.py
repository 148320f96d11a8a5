"""AWQ (Lin et al., 2023, arXiv:2306.00978): scale salient input channels up before quantizing, folding
the inverse scale into whatever produces the input (smoothing.fold), then optionally clip each group's range.

Reproduces AutoAWQ (casper-hansen/AutoAWQ awq/quantize/quantizer.py `_search_best_scale`,
`_compute_best_scale`, `_search_best_clip`, `_compute_best_clip`; llm-compressor's AWQModifier is the same
search). Candidates are scored with quantkit's own grid (`rtn_quantize`: fp16 scales, zero inside the range),
i.e. with exactly what gets stored, not AutoAWQ's `pseudo_quantize_tensor`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from . import fp4
from .fp4 import Fp4Spec
from .grid import GridSpec, params_from_range, quantize_codes

Loss = Callable[[list[torch.Tensor]], float]  # candidate weights (one per linear, float32) -> error

# AutoAWQ `_search_best_clip` avoid_clipping: "due to qk bmm, it is hard to clip precisely"
CLIP_SKIP = ("q_", "k_", "query", "key", "Wqkv")


class NoFiniteLoss(RuntimeError):
    pass


@dataclass
class ScaleSearch:
    scale: torch.Tensor  # float32 [in]: fold with smoothing.fold(mapping, scale)
    ratio: float  # the chosen exponent α
    losses: list[float]  # loss of ratio i / n_grid, for i in range(n_grid)


@torch.no_grad()
def activation_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ |x| per input channel, float64, x: [windows, tokens, channels]. Each window is summed on its own in fp32,
    the windows in fp64 (as gptq.Hessian does), so shares of the windows on several processes add up to the
    one-process sum."""
    total = torch.zeros(x.shape[-1], dtype=torch.float64, device=x.device)
    for w in x:
        total += w.reshape(-1, x.shape[-1]).abs().float().sum(0)
    return total


@torch.no_grad()
def weight_mean(weights: list[torch.Tensor], spec: GridSpec | list[GridSpec]) -> torch.Tensor:
    """AutoAWQ's w_mean: |W| of the concatenated linears divided by each group's max, averaged over rows. spec: the
    grid of every weight, or of each (mixed precision: each weight's groups are its own grid's)."""
    specs = spec if isinstance(spec, list) else [spec] * len(weights)
    if len(set(specs)) > 1:
        rows = sum(w.shape[0] for w in weights)
        return sum(weight_mean([w], s) * (w.shape[0] / rows) for w, s in zip(weights, specs))
    spec = specs[0]
    w = torch.cat([w.float() for w in weights])
    span = spec.span(w.shape[1])
    groups = w.reshape(-1, span).abs()
    return (groups / (groups.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)


def candidate_scale(x_mean: torch.Tensor, w_mean: torch.Tensor | None, ratio: float) -> torch.Tensor:
    """s = x_mean^α, or with duo scaling (w_mean given) x_mean^α / w_mean^(1-α); clamped at 1e-4 and
    normalised by sqrt(max·min) so it is centred around 1. Non-finite entries become 1, as in AutoAWQ."""
    s = x_mean.pow(ratio)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - ratio) + 1e-4)
    s = s.clamp(min=1e-4)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def quantize_dequantize(w: torch.Tensor, spec: GridSpec | Fp4Spec, lo: torch.Tensor | None = None,
                        hi: torch.Tensor | None = None, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """rtn_quantize(w, spec).dequantize() of a float32 [rows, cols] w, bit for bit, without building the
    QuantizedWeight (no uint8 / fp16 round trips; in-place steps); fp4_rtn(w, spec, global_scale)'s for an FP4
    grid (NVFP4's global scale: from all of w when not given). lo / hi: each (row, group)'s min and max when the
    caller knows them (clipping), else computed."""
    rows, cols = w.shape
    g = w.reshape(-1, spec.span(cols))
    if lo is None or hi is None:
        lo, hi = torch.aminmax(g, dim=1)
    if isinstance(spec, Fp4Spec):
        gs = fp4.global_scale_of(w, spec) if global_scale is None else global_scale
        scale = fp4.scales_of_range(lo.reshape(-1), hi.reshape(-1), spec, gs)[:, None]
        return fp4.round_values(g, scale).mul_(scale).view(rows, cols)
    scale, zero = params_from_range(lo.reshape(-1), hi.reshape(-1), spec)
    scale, zero = scale[:, None], zero[:, None]
    q = quantize_codes(g, scale, zero, spec.maxq)
    return q.sub_(zero).mul_(scale).view(rows, cols)


def fake_quantize(weight: torch.Tensor, s: torch.Tensor, spec: GridSpec | Fp4Spec) -> torch.Tensor:
    """Q(W·s)/s in float32: the weight the float block sees once s is folded and W·s quantized."""
    return quantize_dequantize(weight.float() * s, spec).div_(s)


@torch.no_grad()
def search_scale(
    x_mean: torch.Tensor,
    weights: list[torch.Tensor],
    spec: GridSpec | Fp4Spec | list[GridSpec],
    loss: Loss,
    n_grid: int = 20,
    duo_scaling: bool = True,
) -> ScaleSearch:
    """Grid search over α = i/n_grid, i < n_grid (AutoAWQ `_compute_best_scale`): each candidate s
    quantizes every W·s, divides back by s and is scored by `loss` (see `linear_loss`, `module_loss`).
    weights: the linears that read the same input (q/k/v, gate/up, or one linear), unfolded; spec: their grid, or
    each one's (mixed precision). NVFP4's global scale is taken over all of them, as the export fuses q/k/v's and
    gate/up's (and llm-compressor's AWQ its fused observers)."""
    ws = [w.float() for w in weights]
    x_mean = x_mean.float().flatten().to(ws[0].device)
    w_mean = weight_mean(ws, spec) if duo_scaling else None
    specs = spec if isinstance(spec, list) else [spec] * len(ws)
    w_all = torch.cat(ws)  # rows quantize independently: one call for q/k/v (or gate/up) per candidate
    rows = [w.shape[0] for w in ws]
    losses: list[float] = []
    best: tuple[float, torch.Tensor, float] | None = None
    for i in range(n_grid):
        ratio = i / n_grid
        s = candidate_scale(x_mean, w_mean, ratio)
        if len(set(specs)) == 1:
            value = loss(list(fake_quantize(w_all, s, specs[0]).split(rows)))
        else:  # each weight on its own grid
            value = loss([fake_quantize(w, s, g) for w, g in zip(ws, specs)])
        losses.append(value)
        if math.isfinite(value) and (best is None or value < best[0]):
            best = (value, s, ratio)
    if best is None:
        raise NoFiniteLoss(f"no finite loss on the AWQ scale grid: {losses}")
    return ScaleSearch(best[1], best[2], losses)


def linear_loss(gram: torch.Tensor, weights: list[torch.Tensor]) -> Loss:
    """Mean squared error of the linears' own outputs x·Wᵀ over every output element, for mappings whose
    inspected module is the linear itself (v->o, up->down, fc1->fc2, OPT's fc1). gram = xᵀx/n of their
    input (GPTQ's Hessian / 2, so it can be accumulated in shards the same way): the error x·ΔWᵀ is then
    Σ (ΔW·G)∘ΔW / rows, in²·out per candidate instead of n·in·out, never subtracting two large outputs.
    Biases cancel."""
    gram = gram.float()
    refs = [w.to(gram.device, torch.float32) for w in weights]
    rows = sum(w.shape[0] for w in refs)

    def loss(candidates: list[torch.Tensor]) -> float:
        total = torch.zeros((), device=gram.device)
        for w, c in zip(refs, candidates):
            d = c.to(gram.device, torch.float32) - w
            total += ((d @ gram) * d).sum()
        return float(total) / rows

    return loss


def module_loss(run: Callable[[], torch.Tensor] | None, linears: list[nn.Linear],
                reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Loss:
    """Mean squared error of a module's output (e.g. self_attn for q/k/v, mlp for gate/up) with candidate
    weights swapped into `linears`, against its float output. `run` evaluates the module on the calibration
    input (a tuple output counts by its first element, as attention returns (output, weights)); the reference
    output is computed once, here. reduce sums [squared error, elements] (float64) over the processes that share
    the calibration; run None: this process holds none of the scored input."""

    def output() -> torch.Tensor:
        out = run()
        return (out[0] if isinstance(out, tuple) else out).float()

    with torch.no_grad():
        ref = output() if run is not None else None

    @torch.no_grad()
    def loss(candidates: list[torch.Tensor]) -> float:
        part = torch.zeros(2, dtype=torch.float64)
        if run is not None:
            saved = [lin.weight.data for lin in linears]
            try:
                for lin, c in zip(linears, candidates):
                    lin.weight.data = c.to(lin.weight.device, lin.weight.dtype)
                out = output()
            finally:
                for lin, w in zip(linears, saved):
                    lin.weight.data = w
            part[0], part[1] = (out - ref).square().sum(dtype=torch.float64).cpu(), out.numel()
        total = reduce(part)
        return float(total[0] / total[1])

    return loss


def clip_applies(name: str) -> bool:
    """False for the query/key projections AutoAWQ never clips."""
    leaf = name.rsplit(".", 1)[-1]
    return not any(tag in leaf for tag in CLIP_SKIP)


@torch.no_grad()
def search_clip(
    weight: torch.Tensor,
    x: torch.Tensor,
    spec: GridSpec | Fp4Spec,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    n_tokens: int = 512,
    rows_per_batch: int = 1024,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """AutoAWQ `_compute_best_clip`: for each output row and group, try max|w| shrunk by 1 - i/n_grid,
    i < max_shrink·n_grid, clamp the group to ±that, quantize it, and keep the shrink with the smallest
    mean squared error of that group's partial output x_g·w_gᵀ over a strided sample of about n_tokens
    tokens. Returns the clamped weight; the stored grid is then the usual min-max of it.

    weight and x are taken after folding (W·s and x/s, as AutoAWQ clips after `apply_scale`). The
    per-group error uses each group's Gram matrix, so memory per row batch is a few weight-sized tensors. On an
    FP4 grid each group's scale comes from its clipped range over NVFP4's global scale (default: the weight's)."""
    out, cols = weight.shape
    span, groups = spec.span(cols), spec.groups(cols)
    x = x.reshape(-1, cols)
    x = x[:: max(1, x.shape[0] // n_tokens)].float().to(weight.device)
    xg = x.reshape(-1, groups, span).transpose(0, 1)  # [groups, tokens, span]
    gram = xg.transpose(1, 2) @ xg / x.shape[0]  # [groups, span, span]
    w = weight.float()
    if isinstance(spec, Fp4Spec) and global_scale is None:
        global_scale = fp4.global_scale_of(w, spec)
    clipped = torch.empty_like(w)
    for r in range(0, out, rows_per_batch):
        wb = w[r : r + rows_per_batch].reshape(-1, groups, span)
        lo, hi = torch.aminmax(wb, dim=-1)  # [rows, groups]
        org_max = torch.maximum(lo.abs(), hi)  # = max |w| of the group
        best_max = org_max.clone()
        best_err = torch.full(org_max.shape, float("inf"), device=w.device)
        for i in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i / n_grid)
            # min / max of the clamped group are the clamped min / max: no reduction per candidate
            clamped = wb.clamp(-max_val[..., None], max_val[..., None])
            q = quantize_dequantize(clamped.view(-1, cols), spec, lo.clamp(-max_val, max_val),
                                    hi.clamp(-max_val, max_val), global_scale).view_as(wb)
            d = q.sub_(wb).transpose(0, 1)  # [groups, rows, span]
            err = ((d @ gram) * d).sum(-1).T  # [rows, groups]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, max_val, best_max)
        clipped[r : r + rows_per_batch] = wb.clamp(-best_max[..., None], best_max[..., None]).reshape(-1, cols)
    return clipped.to(weight.dtype)
