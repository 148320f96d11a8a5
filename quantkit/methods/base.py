"""The Method interface and its registry: what the recipe, the layer-wise loop and the memory plan ask a method,
so that none of them names one."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import ClassVar

import torch
from pydantic import BaseModel
from torch import nn

from ..algorithms.fp4 import Fp4Spec, fp4_rtn, global_scale_for
from ..algorithms.fp8 import fp8_block_quantize, fp8_quantize
from ..algorithms.grid import STEP, GridSpec, row_steps
from ..algorithms.mxfp8 import mxfp8_rtn
from ..algorithms.rtn import rtn_quantize
from ..algorithms.scheme import QuantizedTensor
from .config import WeightQuant


class Method:
    """One recipe stage kind. Subclasses set the class attributes and override what differs; one instance of each
    is registered under its recipe key."""

    key: ClassVar[str]  # the recipe key: `stages: [{KEY: {...}}]`
    config: ClassVar[type[BaseModel]]  # its arguments in the recipe
    weight: ClassVar[bool] = False  # may be the last stage, which quantizes the weights
    transform: ClassVar[bool] = False  # may come before the weight stage: rewrites the float weights only
    calibrated: ClassVar[bool] = True  # reads calibration data
    # the weight stage quantizes each Linear at its first call in the block's one forward, from the Hessian of its
    # input (GPTQ); otherwise it rounds the block's weights before the block's forward
    solves: ClassVar[bool] = False
    rounds_float: ClassVar[bool] = True  # may write FP8 (type: float) weights, which are rounded to nearest
    # as a transform right before a solving weight stage: folds its scales inside that stage's forward
    folds_inline: ClassVar[bool] = False
    gram: ClassVar[bool] = False  # holds a matrix of the widest Linear input's size (Hessian, Gram)

    def weights(self, args: BaseModel) -> BaseModel:
        """As the weight stage, the grid and Linears it quantizes to (a WeightQuant's fields)."""
        return args

    def round(self, module: nn.Linear, args: WeightQuant, spec: GridSpec | Fp4Spec) -> tuple[QuantizedTensor, float]:
        """As a weight stage that does not solve, quantize one Linear to `args` (self.weights of the stage's
        arguments): its weight becomes the dequantized result; returns the codes (on the host) and the loss.
        Round-to-nearest unless a method rounds otherwise."""
        return round_linear(module, args, spec)

    def check_order(self, i: int, stages: list, last: int) -> None:
        """Rules between this transform (stages[i]) and the stages after it; raises a recipe error."""

    def activation_bytes(self, args: BaseModel, num_samples: int, seq_len: int, batch: int, per_window: int,
                         block_inputs: int, elt: int) -> int:
        """What this stage keeps on top of a block forward's temporaries (memory plan's `activations`).
        per_window: one window's hidden states in bytes; block_inputs: the input channels of a block's targets."""
        return 0

    def solver_bytes(self, widest: int, elt: int) -> int:
        """As the weight stage, quantizing and packing the widest weight (`widest` elements): round-to-nearest, loss
        and packing go a few rows at a time (grid.row_steps): the codes, the dequantized copy in the weight's dtype,
        the packed words, and one step's float32 / int64 temporaries."""
        return widest * (1 + elt + 1) + min(STEP, widest) * (4 + 4 + 8 + 8)


def round_linear(module: nn.Linear, args: WeightQuant, spec: GridSpec | Fp4Spec) -> tuple[QuantizedTensor, float]:
    """Round-to-nearest (FP8 for type: float, FP4 for type: fp4, MXFP8 for type: mxfp8) swapped into the Linear; the loss is the weight's mean
    squared error."""
    if args.type == "float" and args.block is not None:
        qw = fp8_block_quantize(module.weight.data, args.block)
    elif args.type == "float":
        qw = fp8_quantize(module.weight.data, args.per_tensor)
    elif isinstance(spec, Fp4Spec):
        qw = fp4_rtn(module.weight.data, spec, global_scale_for(module, spec))
    elif args.type == "mxfp8":
        qw = mxfp8_rtn(module.weight.data)
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


METHODS: dict[str, Method] = {}  # recipe key -> method, in registration order (the order errors list them in)


def register(method: Method) -> Method:
    if method.key in METHODS:
        raise ValueError(f"method {method.key!r} is registered already")
    METHODS[method.key] = method
    return method


def get(key: str) -> Method:
    return METHODS[key]
