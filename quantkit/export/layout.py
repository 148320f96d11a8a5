"""The packed tensors a format stores per quantized Linear: dtype and shape from the Linear's [out, in] and the
quantization_config. Each format declares its table (`Format.layout`, beside its encoder, whose docstring says the
same in prose); `quantkit verify` checks the files against it: a manifest vouches for bytes, not for what they
mean, so an int32 `qweight` retyped as float32 in its header, or a tensor of the wrong shape, is caught here whoever
re-hashed the files.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Dims:
    out: int
    cols: int  # in_features
    bits: int
    groups: int  # scale rows (GPTQ / AWQ) or columns (compressed-tensors)


@dataclass(frozen=True)
class Part:
    dtypes: tuple[torch.dtype, ...]
    shapes: Callable[[Dims], list[list[int]]]  # the shapes a loader accepts
    required: bool = True


@dataclass(frozen=True)
class Layout:
    name: str  # as messages name it: gptq, awq, pack-quantized, ...
    parts: dict[str, Part]
    bits: int
    group_size: int


def packed(n: int, bits: int) -> int:
    return math.ceil(n * bits / 32)


I32, I64, F16 = (torch.int32,), (torch.int64,), (torch.float16,)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_module(layout: Layout, prefix: str, parts: dict[str, torch.Tensor], out: int, cols: int) -> list[str]:
    """What is wrong with one quantized Linear's stored tensors (its bias is a float tensor, checked elsewhere)."""
    kind, group_size = layout.name, layout.group_size
    dims = Dims(out, cols, layout.bits, math.ceil(cols / group_size) if group_size > 0 else 1)
    problems = [f"{prefix}.{name}: missing ({kind} stores it)" for name, part in layout.parts.items()
                if part.required and name not in parts]
    for name, t in sorted(parts.items()):
        part = layout.parts.get(name)
        if name == "bias":
            continue
        if part is None:
            problems.append(f"{prefix}.{name}: not a tensor of the {kind} layout ({', '.join(layout.parts)})")
            continue
        shapes = part.shapes(dims)
        if t.dtype not in part.dtypes or list(t.shape) not in shapes:
            problems.append(f"{prefix}.{name}: {_name(t.dtype)} {list(t.shape)}; {kind} stores "
                            f"{' or '.join(map(_name, part.dtypes))} {' or '.join(map(str, shapes))} "
                            f"for config.json's Linear [{out}, {cols}]")
    return problems


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
