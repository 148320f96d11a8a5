"""compressed-tensors `pack-quantized`: the layout llm-compressor writes and vLLM / transformers load.

Per quantized Linear `<m>`:
  <m>.weight_packed      int32 [out, in*bits/32]  signed codes + 2^(bits-1), packed along the input dim
  <m>.weight_scale       [out, groups]            (channel strategy: [out, 1])
  <m>.weight_zero_point  int32 [out*bits/32, groups]  asymmetric only: signed zero + 2^(bits-1), packed along out
  <m>.weight_shape       int64 [2]
The quantization_config is produced by compressed-tensors' own pydantic classes.
"""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from . import packing
from .base import Encoded, GridSpec, QuantInfo, QuantizedWeight, trivial_g_idx

MARKER = "weight_packed"


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


def decode_module(t: dict[str, torch.Tensor], qcfg: dict) -> QuantizedWeight:
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


def encode(qweights: dict[str, QuantizedWeight], info: QuantInfo, scale_dtype: torch.dtype) -> Encoded:
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
