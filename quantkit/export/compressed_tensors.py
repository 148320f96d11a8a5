"""compressed-tensors: the layouts llm-compressor writes and vLLM / transformers load.

`pack-quantized` (weight-only int, W4A16 / W8A16), per quantized Linear `<m>`:
  <m>.weight_packed      int32 [out, in*bits/32]  signed codes + 2^(bits-1), packed along the input dim
  <m>.weight_scale       [out, groups]            (channel strategy: [out, 1])
  <m>.weight_zero_point  int32 [out*bits/32, groups]  asymmetric only: signed zero + 2^(bits-1), packed along out
  <m>.weight_shape       int64 [2]
`int-quantized` (W8A8 int8) and `float-quantized` (W8A8 FP8 e4m3), per quantized Linear `<m>`:
  <m>.weight        int8 (signed code) | float8_e4m3fn  [out, in]
  <m>.weight_scale  [out, 1]  (FP8: float32)
  Activations are quantized per token at run time (dynamic), so no input scale is stored.
`nvfp4-pack-quantized` / `mxfp4-pack-quantized` (NVFP4A16 / MXFP4A16): export/ct_fp4.py.
The quantization_config is produced by compressed-tensors' own pydantic classes.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from ..algorithms.grid import INT8_CHANNEL
from ..errors import QuantkitError
from ..algorithms.scheme import QuantizedTensor
from . import ct_fp4, packing
from .base import Encoded, Fp8Weight, GridSpec, QuantInfo, QuantizedWeight, trivial_g_idx
from .layout import FLOATS, I32, I64, Layout, Part, packed
from .registry import Format, register

PACKED, INT, FLOAT = "pack-quantized", "int-quantized", "float-quantized"
MARKERS = {PACKED: "weight_packed", INT: "weight_scale", FLOAT: "weight_scale"}  # the tensor a quantized module has
MARKERS |= {fmt: "weight_packed" for fmt in ct_fp4.PRESET}  # FP4: export/ct_fp4.py
MARKER = MARKERS[PACKED]
W8A8_FORMATS = {"int8": INT, "fp8": FLOAT}  # QuantInfo.activations -> format


def encode_module(qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    # codes and zeros are unsigned 0..2^bits-1 here; compressed-tensors' signed value + 2^(bits-1) is the
    # same number, so they pack unchanged.
    t = {
        "weight_packed": packing.pack(qw.codes, qw.spec.bits, dim=1),
        "weight_scale": qw.scale.to(scale_dtype).contiguous(),
        "weight_shape": torch.tensor(list(qw.shape), dtype=torch.int64),
    }
    if not qw.spec.sym:
        t["weight_zero_point"] = packing.pack(qw.zero, qw.spec.bits, dim=0)
    return t


def format_of(qcfg: dict) -> str:
    fmt = qcfg.get("format") or PACKED
    if fmt not in MARKERS:
        raise QuantkitError(f"quantization_config.format: '{fmt}' is not one quantkit reads ({', '.join(MARKERS)})")
    return fmt


def marker(qcfg: dict) -> str:
    """The tensor suffix that marks a quantized module in a checkpoint of this config's format."""
    return MARKERS[format_of(qcfg)]


def encode_int_module(qw: QuantizedWeight, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "weight": (qw.codes.to(torch.int16) - 128).to(torch.int8).contiguous(),  # vLLM's signed int8
        "weight_scale": qw.scale.to(scale_dtype).reshape(-1, 1).contiguous(),
    }


def encode_float_module(fw: Fp8Weight) -> dict[str, torch.Tensor]:
    return {"weight": fw.weight.contiguous(), "weight_scale": fw.scale.float().reshape(-1, 1).contiguous()}


def _channel_scale(t: dict[str, torch.Tensor]) -> torch.Tensor:
    # llm-compressor also writes per-tensor scales ([1]) in these formats; vLLM broadcasts them the same way
    out, scale = t["weight"].shape[0], t["weight_scale"]
    if scale.numel() not in (1, out):
        raise QuantkitError(f"weight_scale: {tuple(scale.shape)} is neither per-channel nor per-tensor for {out} rows")
    if "weight_zero_point" in t:
        raise QuantkitError("weight_zero_point: asymmetric W8A8 weights are not supported (vLLM runs symmetric ones)")
    return scale.reshape(-1, 1).expand(out, 1).contiguous()


def decode_int_module(t: dict[str, torch.Tensor]) -> QuantizedWeight:
    q = t["weight"]
    if q.dtype != torch.int8:
        raise QuantkitError(f"weight: int-quantized weights are int8, got {q.dtype}")
    return QuantizedWeight(
        codes=(q.to(torch.int16) + 128).to(torch.uint8),
        scale=_channel_scale(t),
        zero=torch.full((q.shape[0], 1), 128, dtype=torch.uint8),
        spec=INT8_CHANNEL,
    )


def decode_float_module(t: dict[str, torch.Tensor]) -> Fp8Weight:
    if t["weight"].dtype != torch.float8_e4m3fn:
        raise QuantkitError(f"weight: float-quantized weights are float8_e4m3fn, got {t['weight'].dtype}")
    return Fp8Weight(t["weight"], _channel_scale(t).float())


def decode_module(t: dict[str, torch.Tensor], qcfg: dict) -> QuantizedTensor:
    fmt = format_of(qcfg)
    if fmt == INT:
        return decode_int_module(t)
    if fmt == FLOAT:
        return decode_float_module(t)
    if fmt in ct_fp4.PRESET:
        return ct_fp4.decode_module(t, fmt)
    # quantkit (and llm-compressor's W4A16 presets) write a single config group targeting Linear
    w = next(iter(qcfg["config_groups"].values()))["weights"]
    bits, sym = int(w["num_bits"]), bool(w["symmetric"])
    out, cols = (int(x) for x in t["weight_shape"])
    scale = t["weight_scale"]
    groups = scale.shape[1]
    offset = 1 << (bits - 1)
    if sym:
        zero = torch.full((out, groups), offset, dtype=torch.uint8)
    else:
        zero = packing.unpack(t["weight_zero_point"], bits, out, dim=0).to(torch.uint8)
    spec = GridSpec(bits, int(w.get("group_size") or -1) if groups > 1 else -1, sym)
    return QuantizedWeight(
        codes=packing.unpack(t["weight_packed"], bits, cols, dim=1).to(torch.uint8),
        scale=scale,
        zero=zero,
        spec=spec,
        g_idx=trivial_g_idx(t.get("weight_g_idx"), spec.span(cols)),
    )


def encode_w8a8(qweights: dict[str, QuantizedTensor], info: QuantInfo, scale_dtype: torch.dtype) -> Encoded:
    """int-quantized (int8 weights) or float-quantized (FP8 weights), activations dynamic per token: llm-compressor's
    W8A8 and FP8_DYNAMIC presets, the schemes vLLM runs as CompressedTensorsW8A8Int8 / CompressedTensorsW8A8Fp8."""
    fmt = W8A8_FORMATS.get(info.activations)
    if fmt is None:
        raise QuantkitError(f"activations: '{info.activations}' is not one of {', '.join(W8A8_FORMATS)}")
    tensors = {}
    for name, qw in qweights.items():
        if fmt == INT and getattr(qw, "spec", None) != INT8_CHANNEL:
            got = getattr(qw, "spec", type(qw).__name__)
            raise QuantkitError(f"{name}: int-quantized needs 8-bit symmetric per-channel int weights, got {got}")
        if fmt == FLOAT and qw.scheme.kind != "float":
            raise QuantkitError(f"{name}: float-quantized needs FP8 weights, got {type(qw).__name__}")
        parts = encode_int_module(qw, scale_dtype) if fmt == INT else encode_float_module(qw)
        tensors.update({f"{name}.{suffix}": t for suffix, t in parts.items()})
    kind = "int" if fmt == INT else "float"
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type=kind, symmetric=True, strategy="channel", observer="minmax"),
        input_activations=QuantizationArgs(num_bits=8, type=kind, symmetric=True, strategy="token", dynamic=True),
        format=fmt,
    )
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        ignore=sorted(info.unquantized_linears),
        format=fmt,
        quantization_status="compressed",
    )
    return Encoded(tensors, config.model_dump(mode="json", exclude_none=False))


def encode(qweights: dict[str, QuantizedTensor], info: QuantInfo, scale_dtype: torch.dtype) -> Encoded:
    if info.activations is not None:
        return encode_w8a8(qweights, info, scale_dtype)
    if info.scheme.kind == "fp4":
        return ct_fp4.encode(qweights, info)
    tensors = {
        f"{name}.{suffix}": t
        for name, qw in qweights.items()
        for suffix, t in encode_module(qw, scale_dtype).items()
    }
    spec = info.spec
    args = QuantizationArgs(
        num_bits=spec.bits,
        type="int",
        symmetric=spec.sym,
        strategy="channel" if spec.group_size == -1 else "group",
        group_size=None if spec.group_size == -1 else spec.group_size,
        actorder="weight" if info.act_order else None,  # static groups: no g_idx needed
        observer="minmax",
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")},
        ignore=sorted(info.unquantized_linears),
        format="pack-quantized",
        quantization_status="compressed",
    )
    return Encoded(tensors, config.model_dump(mode="json", exclude_none=False))


_ROW_SCALE = Part(FLOATS, lambda d: [[d.out, 1], [1]])  # W8A8: per channel, or per tensor as llm-compressor writes
PARTS = {
    PACKED: {
        "weight_packed": Part(I32, lambda d: [[d.out, packed(d.cols, d.bits)]]),
        "weight_scale": Part(FLOATS, lambda d: [[d.out, d.groups]]),
        "weight_zero_point": Part(I32, lambda d: [[packed(d.out, d.bits), d.groups]], required=False),
        "weight_shape": Part(I64, lambda d: [[2]]),
        "weight_g_idx": Part(I32, lambda d: [[d.cols]], required=False),
    },
    INT: {"weight": Part((torch.int8,), lambda d: [[d.out, d.cols]]), "weight_scale": _ROW_SCALE},
    FLOAT: {"weight": Part((torch.float8_e4m3fn,), lambda d: [[d.out, d.cols]]),
            "weight_scale": Part((torch.float32,), _ROW_SCALE.shapes)},
}


class CompressedTensors(Format):
    name = "compressed-tensors"
    bits = (4, 8)
    kinds = ("int", "float", "fp4")
    weight_only = False
    loaders = [
        ("vLLM / SGLang", "vllm serve {path}"),
        ("transformers (with compressed-tensors)", "AutoModelForCausalLM.from_pretrained('{path}')"),
    ]

    def encode(self, qweights, info: QuantInfo, dtype: torch.dtype) -> Encoded:
        # int scales are kept in the model's float dtype (FP8 scales stay float32); fp16-rounded values are exact in
        # float32 and float16 (bfloat16 would round them again, so those models get fp16 scales).
        return encode(qweights, info, torch.float32 if dtype == torch.float32 else torch.float16)

    def marker(self, qcfg: dict) -> str:
        return marker(qcfg)

    def decode(self, parts: dict[str, torch.Tensor], qcfg: dict) -> QuantizedTensor:
        return decode_module(parts, qcfg)

    def layout(self, qcfg: dict) -> Layout:
        kind = format_of(qcfg)
        if kind in ct_fp4.PRESET:
            return Layout(kind, ct_fp4.parts(kind), 4, ct_fp4.SPECS[ct_fp4.PRESET[kind]].group_size)
        if kind != PACKED:
            return Layout(kind, PARTS[kind], 8, -1)
        w = next(iter(qcfg["config_groups"].values()))["weights"]
        return Layout(kind, PARTS[kind], int(w["num_bits"]), int(w.get("group_size") or -1))

    def activations(self, qcfg: dict) -> str | None:
        return {v: k for k, v in W8A8_FORMATS.items()}.get(format_of(qcfg))

    def weight_only_int(self, qcfg: dict) -> bool:
        """Groups of integer weights whose inputs stay unquantized."""
        return any(isinstance(g, dict) and (g.get("weights") or {}).get("type") == "int"
                   and not g.get("input_activations") for g in qcfg.get("config_groups", {}).values())


register(CompressedTensors())
