"""FP8 (e4m3) weights with float32 scales: one per output channel (llm-compressor's FP8_DYNAMIC), one per tensor
(its FP8 preset) or one per [rows, cols] block (FP8_BLOCK).

scale = max|w_row| / 448 is compressed-tensors' `calculate_qparams` for a symmetric float type (amax over
half of e4m3's [-448, 448] range); the weight is w / scale clamped to that range and cast to float8_e4m3fn,
so w ≈ weight · scale with e4m3's 3-bit mantissa (relative rounding error at most 2^-4 above 2^-6). A block's or a
tensor's scale is the same formula over its elements.
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
    scale: torch.Tensor  # float32 [out, 1], or [1, 1]: one scale per tensor
    # float32 [1]: the static scale of the Linear's input (calibrated, algorithms/observers.py); None: dynamic inputs
    input_scale: torch.Tensor | None = None

    @property
    def scheme(self) -> Scheme:
        return Scheme("float", 8, -1, True, SCALE_DTYPE)

    @property
    def per_tensor(self) -> bool:
        return self.scale.numel() == 1

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        t = {"weight": self.weight, "scale": self.scale}
        return t if self.input_scale is None else t | {"input_scale": self.input_scale}

    def meta(self) -> dict:
        return {"kind": self.kind}

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict) -> Fp8Weight:
        return cls(tensors["weight"], tensors["scale"], tensors.get("input_scale"))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale.float()).to(dtype)


@dataclass
class Fp8BlockWeight(QuantizedTensor):
    """FP8 weights with one float32 scale per [rows, cols] block (compressed-tensors' block strategy)."""

    kind = "fp8-block"
    weight: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # float32 [out / rows, in / cols]
    block: tuple[int, int]

    @property
    def scheme(self) -> Scheme:
        return Scheme("float", 8, -1, True, SCALE_DTYPE, block=self.block)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight, "scale": self.scale}

    def meta(self) -> dict:
        return {"kind": self.kind, "block": list(self.block)}

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict) -> Fp8BlockWeight:
        return cls(tensors["weight"], tensors["scale"], tuple(meta["block"]))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        rows, cols = self.block
        scale = self.scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        return (self.weight.float() * scale).to(dtype)


def _scaled(w: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = amax / FP8_MAX
    # an all-zero row or block: compressed-tensors replaces its zero scale by the scale dtype's eps
    scale = torch.where(scale == 0, torch.finfo(SCALE_DTYPE).eps, scale)
    # amax / (amax / 448) may round a hair above 448; e4m3fn has no inf, so clamp before the cast
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.to(SCALE_DTYPE)


def fp8_quantize(weight: torch.Tensor, per_tensor: bool = False) -> Fp8Weight:
    w = weight.float()
    amax = w.abs().amax().reshape(1, 1) if per_tensor else w.abs().amax(dim=1, keepdim=True)
    return Fp8Weight(*_scaled(w, amax))


def fp8_block_quantize(weight: torch.Tensor, block: tuple[int, int]) -> Fp8BlockWeight:
    """Blocks must tile the weight (plan() refuses a Linear they do not divide)."""
    (out, cols), (rows, width) = weight.shape, block
    w = weight.float().reshape(out // rows, rows, cols // width, width)
    q, scale = _scaled(w, w.abs().amax(dim=(1, 3), keepdim=True))
    return Fp8BlockWeight(q.reshape(out, cols), scale.reshape(out // rows, cols // width), tuple(block))
