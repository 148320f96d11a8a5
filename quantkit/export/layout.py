"""The packed tensors each format stores per quantized Linear: dtype and shape from the Linear's [out, in] and the
quantization_config. One table for every format (the encoders' docstrings say the same in prose), read by
`quantkit verify`: a manifest vouches for bytes, not for what they mean, so an int32 `qweight` retyped as float32
in its header, or a tensor of the wrong shape, is caught here whoever re-hashed the files.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import compressed_tensors as ct


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


def _packed(n: int, bits: int) -> int:
    return math.ceil(n * bits / 32)


I32, I64, F16 = (torch.int32,), (torch.int64,), (torch.float16,)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ROW_SCALE = Part(FLOATS, lambda d: [[d.out, 1], [1]])  # W8A8: per channel, or per tensor as llm-compressor writes

LAYOUTS: dict[str, dict[str, Part]] = {
    "gptq": {
        "qweight": Part(I32, lambda d: [[_packed(d.cols, d.bits), d.out]]),
        "qzeros": Part(I32, lambda d: [[d.groups, _packed(d.out, d.bits)]]),
        "scales": Part(F16, lambda d: [[d.groups, d.out]]),
        "g_idx": Part(I32, lambda d: [[d.cols]], required=False),
    },
    "awq": {
        "qweight": Part(I32, lambda d: [[d.cols, _packed(d.out, d.bits)]]),
        "qzeros": Part(I32, lambda d: [[d.groups, _packed(d.out, d.bits)]]),
        "scales": Part(F16, lambda d: [[d.groups, d.out]]),
    },
    ct.PACKED: {
        "weight_packed": Part(I32, lambda d: [[d.out, _packed(d.cols, d.bits)]]),
        "weight_scale": Part(FLOATS, lambda d: [[d.out, d.groups]]),
        "weight_zero_point": Part(I32, lambda d: [[_packed(d.out, d.bits), d.groups]], required=False),
        "weight_shape": Part(I64, lambda d: [[2]]),
        "weight_g_idx": Part(I32, lambda d: [[d.cols]], required=False),
    },
    ct.INT: {"weight": Part((torch.int8,), lambda d: [[d.out, d.cols]]), "weight_scale": _ROW_SCALE},
    ct.FLOAT: {"weight": Part((torch.float8_e4m3fn,), lambda d: [[d.out, d.cols]]),
               "weight_scale": Part((torch.float32,), _ROW_SCALE.shapes)},
}


def layout_of(fmt: str, qcfg: dict) -> tuple[str, int, int]:
    """(LAYOUTS key, bits, group_size) a quantization_config describes; KeyError / ValueError when it lacks them."""
    if fmt == "gptq":
        return fmt, int(qcfg["bits"]), int(qcfg["group_size"])
    if fmt == "awq":
        return fmt, int(qcfg.get("bits", qcfg.get("w_bit", 4))), int(qcfg["group_size"])
    kind = ct.format_of(qcfg)
    if kind != ct.PACKED:
        return kind, 8, -1
    w = next(iter(qcfg["config_groups"].values()))["weights"]
    return kind, int(w["num_bits"]), int(w.get("group_size") or -1)


def check_module(kind: str, bits: int, group_size: int, prefix: str, parts: dict[str, torch.Tensor],
                 out: int, cols: int) -> list[str]:
    """What is wrong with one quantized Linear's stored tensors (its bias is a float tensor, checked elsewhere)."""
    layout = LAYOUTS[kind]
    dims = Dims(out, cols, bits, math.ceil(cols / group_size) if group_size > 0 else 1)
    problems = [f"{prefix}.{name}: missing ({kind} stores it)" for name, part in layout.items()
                if part.required and name not in parts]
    for name, t in sorted(parts.items()):
        part = layout.get(name)
        if name == "bias":
            continue
        if part is None:
            problems.append(f"{prefix}.{name}: not a tensor of the {kind} layout ({', '.join(layout)})")
            continue
        shapes = part.shapes(dims)
        if t.dtype not in part.dtypes or list(t.shape) not in shapes:
            problems.append(f"{prefix}.{name}: {_name(t.dtype)} {list(t.shape)}; {kind} stores "
                            f"{' or '.join(map(_name, part.dtypes))} {' or '.join(map(str, shapes))} "
                            f"for config.json's Linear [{out}, {cols}]")
    return problems


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
