"""What each Linear costs in the artifact's safetensors files at each candidate: the bytes the format's own encoder
writes for it (a stand-in weight of zeros encoded, so the table is the format's, not a formula beside it), and the
bytes of everything no candidate changes (embeddings, norms, Linears left float by the recipe), and the roofline of
a decode step: the bytes of weights it reads per token."""

from __future__ import annotations

import torch
from torch import nn

from ..algorithms.grid import GridSpec, QuantizedWeight
from ..export import formats
from ..export.base import QuantInfo

# a safetensors header entry: {"name":{"dtype":"I32","shape":[a,b],"data_offsets":[x,y]}}, well above its length
HEADER_PER_TENSOR = 96


def linear_bytes(name: str, m: nn.Linear, spec: GridSpec | None, fmt: str, info: QuantInfo,
                 dtype: torch.dtype) -> int:
    """The stored bytes of Linear `name` (its bias excepted: the same at every candidate) with grid `spec`, or left
    float in `dtype` (None), header entries included."""
    out, cols = m.weight.shape
    if spec is None:
        return out * cols * dtype.itemsize + HEADER_PER_TENSOR + len(name)
    qw = QuantizedWeight(codes=torch.zeros(out, cols, dtype=torch.uint8),
                         scale=torch.ones(out, spec.groups(cols), dtype=torch.float16),
                         zero=torch.full((out, spec.groups(cols)), 1 << (spec.bits - 1), dtype=torch.uint8),
                         spec=spec)
    tensors = formats.get(fmt).encode({name: qw}, QuantInfo(info.method, spec, act_order=info.act_order),
                                      dtype).tensors
    return sum(t.numel() * t.element_size() + HEADER_PER_TENSOR + len(k) for k, t in tensors.items())


def fixed_bytes(model: nn.Module, searched: set[str], dtype: torch.dtype) -> int:
    """Bytes of the tensors no candidate changes: every stored tensor but the searched Linears' weights, floats in
    the export dtype (tied copies once, as the writer stores them), plus the file's fixed header."""
    seen: set[int] = set()
    total = 1024
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or name.removesuffix(".weight") in searched and name.endswith(".weight"):
            continue
        seen.add(id(t))
        size = dtype.itemsize if t.is_floating_point() else t.element_size()
        total += t.numel() * size + HEADER_PER_TENSOR + len(name)
    return total


def untied_table(model: nn.Module) -> torch.Tensor | None:
    """The input embedding table where it is not the output one: a decode step reads one row of it. Everything
    else stored is read once per step, which bounds a memory-bound decode (the roofline)."""
    table = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    return None if out is not None and out.weight is table else table


def read_bytes_16bit(model: nn.Module) -> int:
    """The bytes the original reads per decoded token when served in 16-bit: every parameter but an untied input
    embedding table, two bytes each."""
    table = untied_table(model)
    return 2 * (sum(p.numel() for p in model.parameters()) - (0 if table is None else table.numel()))
