"""MXFP8: float8_e4m3 values with a power-of-two scale per 32 columns, stored as an e8m0 exponent (uint8, bias 127):
compressed-tensors' MXFP8A16 (weight-only) and MXFP8 (inputs quantized the same way, per token and group of 32
columns, at run time) presets. Their weight arguments are the same.

A group's scale is compressed-tensors' calculate_qparams of its min and max (its generate_mx_scales: the max rounded
to a power of two, over 2^8, the e4m3 grid's largest power of two), fed in float32 as llm-compressor's observer
feeds it the weight; the values are w / scale clamped to ±448 and cast to e4m3 (its fake_quantize). Dividing by a
power of two is exact, so a bfloat16 or float32 weight gives compressed-tensors' values bit for bit
(tests/test_mxfp8.py). The e8m0 conversions are compressed-tensors' compress_mx_scale / decompress_mx_scale, as for
MXFP4 (algorithms/fp4.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from compressed_tensors.compressors.mx_utils import compress_mx_scale, decompress_mx_scale
from compressed_tensors.quantization.quant_scheme import MXFP8 as _PRESET
from compressed_tensors.quantization.utils.helpers import calculate_qparams

from .fp8 import FP8_DTYPE, FP8_MAX
from .grid import row_steps
from .scheme import ActivationScheme, QuantizedTensor, Scheme

ARGS = _PRESET["weights"]  # MXFP8A16's are the same
INPUT_ARGS = _PRESET["input_activations"]
GROUP = 32


@dataclass(frozen=True)
class Mxfp8Spec:
    """The MXFP8 grid; bits, group_size and sym read as a GridSpec's do (formats and messages ask them)."""

    group_size: int = GROUP
    bits: int = 8
    sym: bool = True
    scale_dtype: torch.dtype = torch.uint8

    def span(self, in_features: int) -> int:
        return self.group_size

    def groups(self, in_features: int) -> int:
        return in_features // self.group_size

    def scheme(self, activations: bool = False) -> Scheme:
        act = ActivationScheme("mxfp8", strategy="group", group_size=GROUP) if activations else None
        return Scheme("mxfp8", 8, GROUP, True, torch.uint8, activations=act)


MX8 = Mxfp8Spec()


@dataclass
class Mxfp8Weight(QuantizedTensor):
    kind = "mxfp8"
    codes: torch.Tensor  # float8_e4m3fn [out, in]
    scale: torch.Tensor  # uint8 [out, in / 32]: e8m0 exponents

    @property
    def spec(self) -> Mxfp8Spec:
        return MX8

    @property
    def scheme(self) -> Scheme:
        return MX8.scheme()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scale": self.scale}

    def meta(self) -> dict:
        return {"kind": self.kind}

    @classmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict) -> Mxfp8Weight:
        return cls(tensors["codes"], tensors["scale"])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, cols = self.codes.shape
        w = torch.empty(out, cols, dtype=dtype, device=self.codes.device)
        for r in row_steps(out, cols):
            scale = decompress_mx_scale(self.scale[r]).float()
            w[r] = (self.codes[r].float().view(-1, scale.shape[1], GROUP) * scale[..., None]).view(-1, cols).to(dtype)
        return w


def group_scales(groups: torch.Tensor, args=ARGS) -> torch.Tensor:
    """calculate_qparams' power-of-two scale (float32) of each row of groups [..., 32]."""
    lo, hi = torch.aminmax(groups.float(), dim=-1)
    scale, _ = calculate_qparams(lo, hi, args)
    return scale


def round_values(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e4m3 values of w / scale, as compressed-tensors' quantize makes them (clamped to ±448, cast)."""
    return (w.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def mxfp8_rtn(weight: torch.Tensor) -> Mxfp8Weight:
    out, cols = weight.shape
    codes = torch.empty(out, cols, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(out, cols // GROUP, dtype=torch.uint8, device=weight.device)
    for r in row_steps(out, cols):
        w = weight[r].reshape(-1, cols // GROUP, GROUP)
        s = group_scales(w)
        codes[r] = round_values(w, s[..., None]).reshape(-1, cols)
        scale[r] = compress_mx_scale(s, torch.uint8)
    return Mxfp8Weight(codes, scale)


def fake_quantize_mx(x: torch.Tensor) -> torch.Tensor:
    """x with each group of 32 columns of each token quantized and dequantized as MXFP8's inputs are at run time
    (compressed-tensors' dynamic group quantization with the preset's input arguments), in x's dtype."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    s = group_scales(groups, INPUT_ARGS)[..., None]
    return (round_values(groups, s).float() * s).flatten(-2).to(x.dtype)


class Mxfp8Grid:
    """GPTQ's column loop on the MX grid (algorithms/gptq.py): q holds e4m3 values (zero 0), each group's scale from
    calculate_qparams of its current (error-updated) columns; the codes are the e4m3 bytes."""

    def params(self, group: torch.Tensor):
        s = group_scales(group)
        return s, torch.zeros_like(s), s

    def round(self, w, s, z, out):
        out.copy_(round_values(w, s))

    def codes(self, q: torch.Tensor) -> torch.Tensor:
        return q.to(FP8_DTYPE).view(torch.uint8)  # exact: q holds e4m3 values

    def result(self, i: int, codes, scale, zero) -> Mxfp8Weight:
        return Mxfp8Weight(codes.view(FP8_DTYPE), compress_mx_scale(scale, torch.uint8))
