"""The integer grid every weight format here shares: per-group scale (fp16) and zero point.

Codes are unsigned, 0..2^bits-1; w ≈ (code - zero) * scale. Symmetric grids fix zero at 2^(bits-1)
and use scale = 2·max|w| / (2^bits - 1), as the GPTQ reference and llm-compressor do. Scales are rounded
to fp16 *before* codes are chosen, so what GPTQ compensates for is exactly what the artifact stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheme import QuantizedTensor, Scheme

SCALE_DTYPE = torch.float16
# weights per step of the row-wise loops below: their float32 temporaries stay ~16 MB, whatever the Linear's size
# (a streamed 8192-wide MLP weight would otherwise hold three 64 MB float32 copies at once)
STEP = 1 << 22


def row_steps(rows: int, cols: int) -> list[slice]:
    step = max(1, STEP // max(cols, 1))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


@dataclass(frozen=True)
class GridSpec:
    bits: int
    group_size: int  # -1: one group per output row
    sym: bool

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def span(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


# W8A8 int8 weights (llm-compressor's W8A8 preset): per output channel, symmetric; codes - 128 are vLLM's int8
INT8_CHANNEL = GridSpec(bits=8, group_size=-1, sym=True)


@dataclass
class QuantizedWeight(QuantizedTensor):
    """Integer codes on a GridSpec: what GPTQ, RTN and AWQ produce, and W8A8 int8 weights."""

    kind = "int"
    codes: torch.Tensor  # uint8 [out, in]
    scale: torch.Tensor  # fp16 [out, groups]
    zero: torch.Tensor  # uint8 [out, groups]
    spec: GridSpec
    g_idx: torch.Tensor | None = None  # group of each input column, when not col // group_size

    @property
    def scheme(self) -> Scheme:
        return Scheme("int", self.spec.bits, self.spec.group_size, self.spec.sym, SCALE_DTYPE)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        t = {"codes": self.codes, "scale": self.scale, "zero": self.zero}
        return t if self.g_idx is None else t | {"g_idx": self.g_idx}

    def meta(self) -> dict:
        return {"kind": self.kind, "bits": self.spec.bits, "group_size": self.spec.group_size, "sym": self.spec.sym}

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict) -> QuantizedWeight:
        return cls(tensors["codes"], tensors["scale"], tensors["zero"],
                   GridSpec(meta["bits"], meta["group_size"], meta["sym"]), tensors.get("g_idx"))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g_idx = None if self.g_idx is None else self.g_idx.long()
        out, cols = self.codes.shape
        groups = self.scale.shape[1]
        w = torch.empty(out, cols, dtype=dtype, device=self.codes.device)
        for r in row_steps(out, cols):  # each row on its own: the same values as all at once
            codes, zero, scale = self.codes[r].float(), self.zero[r].float(), self.scale[r].float()
            if g_idx is None:  # contiguous groups: broadcast per group instead of gathering (same values, faster)
                codes = codes.reshape(-1, groups, cols // groups)
                w[r] = ((codes - zero[..., None]) * scale[..., None]).reshape(-1, cols).to(dtype)
            else:
                w[r] = ((codes - zero[:, g_idx]) * scale[:, g_idx]).to(dtype)
        return w


def find_params(w: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Min-max scale and zero for each row of w [rows, cols] (one group). Returns float32 scale, zero."""
    xmin, xmax = torch.aminmax(w.float(), dim=1)
    return params_from_range(xmin, xmax, spec)


def mse_params(w: torch.Tensor, spec: GridSpec, grid: int = 100, max_shrink: float = 0.8,
               norm: float = 2.4) -> tuple[torch.Tensor, torch.Tensor]:
    """find_params with a clip search, as the GPTQ reference's `mse=True` and llm-compressor's mse observer do:
    each row's range shrunk by p = 1, 1 - 1/grid, ... (max_shrink·grid steps), keeping the p whose round trip
    has the least Σ|w - q|^norm. Never worse than min-max on that error (p = 1 is tried first)."""
    w = w.float()
    xmin, xmax = torch.aminmax(w, dim=1)
    scale = zero = best = None
    for i in range(int(max_shrink * grid)):
        p = 1 - i / grid
        s, z = params_from_range(p * xmin, p * xmax, spec)
        err = ((quantize_codes(w, s[:, None], z[:, None], spec.maxq) - z[:, None]) * s[:, None] - w).abs_()
        err = err.pow_(norm).sum(1)
        if best is None:
            scale, zero, best = s, z, err
            continue
        better = err < best
        scale, zero, best = torch.where(better, s, scale), torch.where(better, z, zero), torch.where(better, err, best)
    return scale, zero


OBSERVERS = {"minmax": find_params, "mse": mse_params}  # recipe `observer:` -> how a group's grid is chosen


def params_from_range(xmin: torch.Tensor, xmax: torch.Tensor, spec: GridSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """find_params from each row's float32 min and max (so callers that know them skip the reductions)."""
    zeros = torch.zeros_like(xmin)
    xmin = torch.minimum(xmin, zeros)
    xmax = torch.maximum(xmax, zeros)
    if spec.sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin[empty], xmax[empty] = -1.0, 1.0
    scale = ((xmax - xmin) / spec.maxq).to(SCALE_DTYPE).float()
    scale[scale == 0] = torch.finfo(SCALE_DTYPE).tiny  # fp16 underflow of a tiny group
    if spec.sym:
        zero = torch.full_like(scale, float((spec.maxq + 1) // 2))
    else:
        zero = torch.round(-xmin / scale).clamp(0, spec.maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Codes for w [rows, cols] given per-row (or broadcastable) scale and zero, as float; out: where to write them
    (GPTQ's column loop fills its codes row by row). One temporary, then in-place steps."""
    return torch.div(w, scale, out=out).round_().add_(zero).clamp_(0, maxq)
