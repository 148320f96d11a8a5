"""FP8 (e4m3) weights with one float32 scale per output channel: llm-compressor's FP8_DYNAMIC weights.

scale = max|w_row| / 448 is compressed-tensors' `calculate_qparams` for a symmetric float type (amax over
half of e4m3's [-448, 448] range); the weight is w / scale clamped to that range and cast to float8_e4m3fn,
so w ≈ weight · scale with e4m3's 3-bit mantissa (relative rounding error at most 2^-4 above 2^-6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheme import QuantizedTensor, Scheme

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_DTYPE = torch.float32  # what vLLM allocates for FP8 weight scales


@dataclass
class Fp8Weight(QuantizedTensor):
    kind = "fp8"
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out, 1]

    @property
    def scheme(self) -> Scheme:
        return Scheme("float", 8, -1, True, SCALE_DTYPE)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scale": self.scale}

    def meta(self) -> dict:
        return {"kind": self.kind}

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict) -> Fp8Weight:
        return cls(tensors["weight"], tensors["scale"])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.float()).to(dtype)


def fp8_quantize(weight: torch.Tensor) -> Fp8Weight:
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    # an all-zero row: compressed-tensors replaces its zero scale by the scale dtype's eps
    scale = torch.where(scale == 0, torch.finfo(SCALE_DTYPE).eps, scale)
    # amax / (amax / 448) may round a hair above 448; e4m3fn has no inf, so clamp before the cast
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(q, scale.to(SCALE_DTYPE))
