"""compressed-tensors' MXFP8 layout, as its MXFP8QuantizationCompressor writes it (format `mxfp8-quantized`, presets
MXFP8A16 and MXFP8), per quantized Linear `<m>`:
  <m>.weight        float8_e4m3fn [out, in]
  <m>.weight_scale  uint8 [out, in/32]   e8m0 exponent (bias 127) of each group's power-of-two scale
MXFP8's inputs are quantized at run time (input_activations: float, group of 32, uint8 scales, dynamic): nothing
stored. The quantization_config's args are the preset's QuantizationArgs.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP8, MXFP8A16

from ..algorithms.fp8 import FP8_DTYPE
from ..algorithms.mxfp8 import GROUP, Mxfp8Weight
from ..errors import QuantkitError
from .base import QuantInfo
from .layout import Part

FORMAT = "mxfp8-quantized"


def encode_module(qw: Mxfp8Weight) -> dict[str, torch.Tensor]:
    return {"weight": qw.codes.contiguous(), "weight_scale": qw.scale.contiguous()}


def decode_module(t: dict[str, torch.Tensor]) -> Mxfp8Weight:
    q, scale = t["weight"], t["weight_scale"]
    if q.dtype != FP8_DTYPE or scale.dtype != torch.uint8:
        raise QuantkitError(f"weight / weight_scale: {FORMAT} stores float8_e4m3fn / uint8, got {q.dtype} / "
                            f"{scale.dtype}")
    if q.dim() != 2 or list(scale.shape) != [q.shape[0], q.shape[1] // GROUP] or q.shape[1] % GROUP:
        raise QuantkitError(f"weight_scale: {list(scale.shape)} is not one scale per {GROUP} columns of "
                            f"{list(q.shape)}")
    return Mxfp8Weight(q, scale)


def encode(qweights: dict[str, Mxfp8Weight], info: QuantInfo) -> tuple[dict[str, torch.Tensor], QuantizationScheme]:
    """The tensors and the config group (MXFP8's with input_activations, else MXFP8A16's)."""
    tensors = {}
    for name, qw in qweights.items():
        if not isinstance(qw, Mxfp8Weight):
            raise QuantkitError(f"{name}: {FORMAT} needs MXFP8 weights, got {type(qw).__name__}")
        tensors.update({f"{name}.{suffix}": t for suffix, t in encode_module(qw).items()})
    preset = MXFP8 if info.activations == "mxfp8" else MXFP8A16
    weights = preset["weights"].model_copy(update={"actorder": "weight"}) if info.act_order else preset["weights"]
    return tensors, QuantizationScheme(targets=["Linear"], weights=weights,
                                       input_activations=preset.get("input_activations"), format=FORMAT)


PARTS = {"weight": Part((FP8_DTYPE,), lambda d: [[d.out, d.cols]]),
         "weight_scale": Part((torch.uint8,), lambda d: [[d.out, d.groups]])}
