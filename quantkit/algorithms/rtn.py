"""Round-to-nearest: the baseline every calibrated method must beat."""

from __future__ import annotations

import torch

from .grid import OBSERVERS, SCALE_DTYPE, GridSpec, QuantizedWeight, quantize_codes, row_steps


def rtn_quantize(weight: torch.Tensor, spec: GridSpec, observer: str = "minmax") -> QuantizedWeight:
    out, cols = weight.shape
    span, groups = spec.span(cols), spec.groups(cols)
    codes = torch.empty(out, cols, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out, groups, dtype=SCALE_DTYPE, device=weight.device)
    zero = torch.empty(out, groups, dtype=torch.uint8, device=weight.device)
    for r in row_steps(out, cols):  # rows are independent: a few MB of float32 at a time
        w = weight[r].float().reshape(-1, span)  # one row per (output row, group)
        s, z = OBSERVERS[observer](w, spec)
        codes[r] = quantize_codes(w, s[:, None], z[:, None], spec.maxq).reshape(-1, cols)
        scale[r], zero[r] = s.reshape(-1, groups), z.reshape(-1, groups)
    return QuantizedWeight(codes=codes, scale=scale, zero=zero, spec=spec)
