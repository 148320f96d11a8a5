"""GPTQ: each Linear quantized at its first call in the block's forward, from the Hessian of the input it reads,
so later Linears see earlier ones quantized (true-sequential). The solve and the Hessian are algorithms/gptq.py;
the schedules that feed them (one forward, or waves over offloaded batches) are quantize/gptq.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..algorithms.gptq import Hessian
from .base import Method, register
from .config import WeightQuant


class GPTQ(WeightQuant):
    act_order: bool = False
    damp: float = Field(0.01, gt=0, le=1)
    block_size: int = Field(128, ge=1)
    # dtype of each window's xᵀx before the fp64 sum. bfloat16 rounds the inputs (a no-op for a bf16 model) and each
    # window's product to bf16: on a CPU with bf16 matmul units the Hessians cost ~3× less, at unchanged perplexity
    # on the SmolLM2 bench (BENCHMARKS.md, GPTQ vs peers).
    hessian_dtype: Literal["float32", "bfloat16"] = "float32"


class GPTQMethod(Method):
    key = "gptq"
    config = GPTQ
    weight = True
    solves = True
    rounds_float = False
    gram = True

    def solver_bytes(self, widest: int, elt: int) -> int:
        # GPTQ on the widest weight: its float32 copy and error, uint8 codes, the int32 words they are packed from
        return widest * (4 + 4 + 1 + 4)


register(GPTQMethod())

__all__ = ["GPTQ", "GPTQMethod", "Hessian"]
