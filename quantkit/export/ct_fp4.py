"""compressed-tensors' FP4 layouts, as its NVFP4PackedCompressor / MXFP4PackedCompressor write them
(formats `nvfp4-pack-quantized`, `mxfp4-pack-quantized`), per quantized Linear `<m>`:
  <m>.weight_packed        uint8 [out, in/2]   two e2m1 codes a byte, the even column in the low nibble
  <m>.weight_scale         [out, in/group]     float8_e4m3fn (NVFP4, groups of 16) | uint8 e8m0 exponent (MXFP4, 32)
  <m>.weight_global_scale  float32 [1]         NVFP4 only: the group scales are divided by it
  <m>.input_global_scale   float32 [1]         NVFP4 with quantized inputs (W4A4) only: its inputs' global scale
MXFP4's quantized inputs keep no tensor (dynamic); the config's input_activations are the NVFP4 / MXFP4 preset's
(the observer named as chosen).
The nibbles are pack_fp4_to_uint8's, packed from the codes directly (its CPU path rounds the values again with eight
masked writes: minutes on a 7B model); tests/test_fp4.py checks the bytes against compressed-tensors' compressors
and the codes against unpack_fp4_from_uint8. The quantization_config is its preset's QuantizationArgs.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.quant_scheme import MXFP4, NVFP4

from ..algorithms.fp4 import SPECS, Fp4Spec, Fp4Weight
from ..errors import QuantkitError
from .base import STATIC_OBSERVERS, QuantInfo
from .layout import Part

FORMAT = {"NVFP4A16": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized"}  # preset -> format
PRESET = {fmt: preset for preset, fmt in FORMAT.items()}
# the weight-only preset -> the input args of its W4A4 twin
INPUT_ARGS = {"NVFP4A16": NVFP4["input_activations"], "MXFP4A16": MXFP4["input_activations"]}


def encode_module(qw: Fp4Weight) -> dict[str, torch.Tensor]:
    packed = qw.codes[:, 0::2] | (qw.codes[:, 1::2] << 4)
    t = {"weight_packed": packed, "weight_scale": qw.scale.contiguous()}
    if qw.global_scale is not None:
        t["weight_global_scale"] = qw.global_scale.float().reshape(1)
    if qw.input_scale is not None:
        t["input_global_scale"] = qw.input_scale.float().reshape(1)
    return t


def decode_module(t: dict[str, torch.Tensor], fmt: str) -> Fp4Weight:
    spec = SPECS[PRESET[fmt]]
    packed, scale = t["weight_packed"], t["weight_scale"]
    if packed.dtype != torch.uint8 or scale.dtype != spec.scale_dtype:
        raise QuantkitError(f"weight_packed / weight_scale: {fmt} stores uint8 / {spec.scale_dtype}, got "
                            f"{packed.dtype} / {scale.dtype}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return Fp4Weight(codes, scale, spec, t.get("weight_global_scale"), t.get("input_global_scale"))


def encode(qweights: dict[str, Fp4Weight], info: QuantInfo) -> tuple[dict[str, torch.Tensor], QuantizationScheme]:
    """The tensors and the config group; compressed_tensors.encode wraps the group in the quantization_config."""
    spec: Fp4Spec = info.spec
    fmt = FORMAT[spec.preset]
    tensors = {}
    for name, qw in qweights.items():
        if not isinstance(qw, Fp4Weight) or qw.spec != spec:
            raise QuantkitError(f"{name}: {fmt} needs {spec.preset} weights, got {type(qw).__name__}")
        tensors.update({f"{name}.{suffix}": t for suffix, t in encode_module(qw).items()})
    # act-order GPTQ with static groups: no g_idx, as the int groups say it
    weights = spec.args.model_copy(update={"actorder": "weight"}) if info.act_order else spec.args
    inputs = None
    if info.activations is not None:
        inputs = INPUT_ARGS[spec.preset]
        if spec.global_scale:
            inputs = inputs.model_copy(update={"observer": STATIC_OBSERVERS[info.act_observer]})
    return tensors, QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs, format=fmt)


def input_kind(act: dict, fmt: str) -> str | None:
    """"fp4" for the inputs NVFP4 / MXFP4 quantize (e2m1 on the weights' groups), None for weight-only; other inputs
    beside FP4 weights (compressed-tensors' MXFP4xFP8: FP8 per 128) are refused in one line."""
    if not act:
        return None
    group = SPECS[PRESET[fmt]].group_size
    if (act.get("num_bits"), act.get("type"), act.get("group_size")) != (4, "float", group):
        raise QuantkitError(f"input_activations: quantkit runs {fmt} with e2m1 inputs per {group} columns (NVFP4, "
                            f"MXFP4); got {act.get('num_bits')}-bit {act.get('type')} per {act.get('group_size')}")
    return "fp4"


def parts(fmt: str) -> dict[str, Part]:
    spec = SPECS[PRESET[fmt]]
    p = {"weight_packed": Part((torch.uint8,), lambda d: [[d.out, d.cols // 2]]),
         "weight_scale": Part((spec.scale_dtype,), lambda d: [[d.out, d.groups]])}
    if spec.global_scale:
        p["weight_global_scale"] = Part((torch.float32,), lambda d: [[1]])
        p["input_global_scale"] = Part((torch.float32,), lambda d: [[1]], required=False)
    return p
