"""RTN: round each weight to nearest on its grid (FP8 e4m3 for type: float). Needs no data: alone it is one sweep
over the weights; after a transform each block is rounded before its forward feeds the next block."""

from __future__ import annotations

from dataclasses import fields, replace

import torch
from torch import nn

from ..algorithms.fp8 import fp8_quantize
from ..algorithms.grid import GridSpec, row_steps
from ..algorithms.scheme import QuantizedTensor
from ..algorithms.rtn import rtn_quantize
from .base import Method, register
from .config import WeightQuant


class RTN(WeightQuant):
    pass


def round_linear(module: nn.Linear, args: WeightQuant, spec: GridSpec) -> tuple[QuantizedTensor, float]:
    """Round-to-nearest (FP8 for type: float) swapped into the Linear; the loss is the weight's mean squared error."""
    if args.type == "float":
        qw = fp8_quantize(module.weight.data)
    else:
        qw = rtn_quantize(module.weight.data, spec, args.observer)
    deq = qw.dequantize(module.weight.dtype).to(module.weight.device)
    w = module.weight.data
    squares = sum(float((deq[r].float() - w[r].float()).square().sum(dtype=torch.float64))
                  for r in row_steps(*w.shape))  # a few MB of float32 at a time
    module.weight.data = deq
    # on the host, as GPTQ's results are: the packers and the memory plan hold codes there
    return replace(qw, **{f.name: getattr(qw, f.name).cpu() for f in fields(qw)
                          if isinstance(getattr(qw, f.name), torch.Tensor)}), squares / w.numel()


class RTNMethod(Method):
    key = "rtn"
    config = RTN
    weight = True
    calibrated = False


register(RTNMethod())
