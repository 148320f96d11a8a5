"""Per-channel scale folding, shared by AWQ and SmoothQuant.

A mapping is a module `prev` whose output channels feed a set of Linear layers. Multiplying the Linears'
input columns by s and dividing prev's output channels by s leaves the float block unchanged, and moves
quantization difficulty between activations and weights. Which pairs are valid is family knowledge
(families/mappings.py); this module only does the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

@dataclass
class Mapping:
    prev: nn.Module  # a norm or a Linear whose output channels are the linears' input channels
    prev_name: str
    linears: list[nn.Module]  # Linears (and routers: any module with an [out, in] weight) reading prev's output
    names: list[str]
    inspect: nn.Module  # whose output measures the error: self_attn for q/k/v, mlp for gate/up, else the linear
    inspect_name: str
    rows: slice | None = None  # prev Linear's output rows the linears read (Phi-3's up half of gate_up_proj)
    offset: bool = False  # prev is a norm computing (1 + weight) * normalize(x) (Gemma): fold into (1 + weight)

    @property
    def observe(self) -> nn.Module:
        """A module whose first input is prev's output on every token (the router of an MoE MLP, not an expert)."""
        return self.linears[0]


@torch.no_grad()
def fold(mapping: Mapping, s: torch.Tensor) -> None:
    """In place: each linear's weight columns times s, prev's output channels divided by s (a norm's
    weight and bias, Gemma's (1 + weight), or a prev Linear's weight rows and bias, only `rows` of them if set).
    The float block function is unchanged. Computed in float32 and rounded once to each parameter's dtype."""
    s = s.detach().float().flatten()
    if not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
        raise ValueError("fold: scales must be positive and finite")
    prev = mapping.prev
    rows = mapping.rows if mapping.rows is not None else slice(None)
    width = len(range(prev.weight.shape[0])[rows]) if isinstance(prev, nn.Linear) else prev.weight.numel()
    if s.numel() != width or any(lin.weight.shape[1] != width for lin in mapping.linears):
        raise ValueError(f"fold: {s.numel()} scales for {mapping.prev_name} ({width} channels)")

    def update(p: torch.Tensor, value: torch.Tensor) -> None:
        p.copy_(value.to(p.dtype))

    for lin in mapping.linears:
        update(lin.weight, lin.weight.float() * s.to(lin.weight.device))
    s = s.to(prev.weight.device)
    if isinstance(prev, nn.Linear):
        update(prev.weight[rows], prev.weight[rows].float() / s[:, None])
    elif mapping.offset:
        update(prev.weight, (1 + prev.weight.float()) / s - 1)
    else:
        update(prev.weight, prev.weight.float() / s)
    if getattr(prev, "bias", None) is not None:
        update(prev.bias[rows], prev.bias[rows].float() / s)
