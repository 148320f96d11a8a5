"""Round-to-nearest: the baseline every calibrated method must beat."""

from __future__ import annotations

import torch

from .grid import OBSERVERS, SCALE_DTYPE, GridSpec, QuantizedWeight, quantize_codes


def rtn_quantize(weight: torch.Tensor, spec: GridSpec, observer: str = "minmax") -> QuantizedWeight:
    out, cols = weight.shape
    span, groups = spec.span(cols), spec.groups(cols)
    w = weight.float().reshape(out * groups, span)  # one row per (output row, group)
    scale, zero = OBSERVERS[observer](w, spec)
    codes = quantize_codes(w, scale[:, None], zero[:, None], spec.maxq)
    return QuantizedWeight(
        codes=codes.reshape(out, cols).to(torch.uint8),
        scale=scale.reshape(out, groups).to(SCALE_DTYPE),
        zero=zero.reshape(out, groups).to(torch.uint8),
        spec=spec,
    )
