"""The GPTQ checkpoint layout of AutoGPTQ / GPTQModel, as vLLM, SGLang and transformers load it.

Per quantized Linear `<m>`:
  <m>.qweight  int32 [in*bits/32, out]   codes packed along the input dim
  <m>.qzeros   int32 [groups, out*bits/32] zero points packed along the output dim
  <m>.scales   fp16  [groups, out]
  <m>.g_idx    int32 [in]                 group of each input column (col // group_size here)
Zero points: format v1 (`gptq`) stores zero-1 and cannot hold a true zero of 0, which asymmetric grids
produce; GPTQModel (and so transformers) also refuses asymmetric v1 from other producers, since old
AutoGPTQ wrote it wrongly. So symmetric grids (zero = 2^(bits-1)) are written as v1, which every loader
reads, and asymmetric ones as `gptq_v2` (zero stored as is), which GPTQModel, transformers and vLLM
(since PR #26092) read.
"""

from __future__ import annotations

import re

import torch

from .. import __version__
from . import packing
from .base import Encoded, GridSpec, QuantInfo, QuantizedWeight, trivial_g_idx
from .layout import F16, I32, Layout, Part, packed
from .registry import Format, register

MARKER = "qweight"


def checkpoint_format(info: QuantInfo) -> str:
    return "gptq" if info.spec.sym else "gptq_v2"


def encode_module(qw: QuantizedWeight, fmt: str) -> dict[str, torch.Tensor]:
    bits = qw.spec.bits
    out, cols = qw.shape
    stored_zero = qw.zero.long() - (1 if fmt == "gptq" else 0)
    return {
        "qweight": packing.pack(qw.codes.T, bits, dim=0),
        "qzeros": packing.pack(stored_zero.T, bits, dim=1),
        "scales": qw.scale.T.contiguous().to(torch.float16),
        "g_idx": (torch.arange(cols) // qw.spec.span(cols)).to(torch.int32),
    }


def decode_module(t: dict[str, torch.Tensor], qcfg: dict) -> QuantizedWeight:
    bits = int(qcfg["bits"])
    v1 = qcfg.get("checkpoint_format", qcfg.get("format", "gptq")) != "gptq_v2"
    scales = t["scales"]
    groups, out = scales.shape
    cols = t["qweight"].shape[0] * 32 // bits
    zero = packing.unpack(t["qzeros"], bits, out, dim=1).T + (1 if v1 else 0)
    group_size = int(qcfg.get("group_size", -1))
    spec = GridSpec(bits, group_size if groups > 1 else -1, bool(qcfg.get("sym", True)))
    g_idx = trivial_g_idx(t.get("g_idx"), spec.span(cols))
    return QuantizedWeight(
        codes=packing.unpack(t["qweight"], bits, cols, dim=0).T.to(torch.uint8),
        scale=scales.T.contiguous(),
        zero=zero.to(torch.uint8),
        spec=spec,
        g_idx=g_idx,
    )


def encode(qweights: dict[str, QuantizedWeight], info: QuantInfo) -> Encoded:
    fmt = checkpoint_format(info)
    tensors = {
        f"{name}.{suffix}": t
        for name, qw in qweights.items()
        for suffix, t in encode_module(qw, fmt).items()
    }
    # Linear layers inside the blocks that stay float: GPTQModel/vLLM's per-module "dynamic" exclusion.
    dynamic = {
        f"-:^{re.escape(name)}$": {}
        for name in info.unquantized_linears
        if name.startswith(info.block_linears_prefix + ".")
    }
    cfg = {
        "quant_method": "gptq",
        "bits": info.spec.bits,
        "group_size": info.spec.group_size,
        # quantkit's act-order is group-aware (GPTQModel's act_group_aware): groups stay contiguous and g_idx trivial,
        # so loaders must not permute by g_idx. desc_act false also keeps vLLM's fast kernels, and its MoE loader
        # (which rejects desc_act checkpoints).
        "desc_act": False,
        "act_group_aware": info.act_order,
        "sym": info.spec.sym,
        "lm_head": False,
        "true_sequential": True,
        "damp_percent": info.damp if info.damp is not None else 0.0,
        "checkpoint_format": fmt,
        "pack_dtype": "int32",
        "meta": {"quantizer": [f"quantkit:{__version__}"], "method": info.method},
    }
    if dynamic:
        cfg["dynamic"] = dynamic
    return Encoded(tensors, cfg, {"quantize_config.json": {k: v for k, v in cfg.items() if k != "quant_method"}})


PARTS = {
    "qweight": Part(I32, lambda d: [[packed(d.cols, d.bits), d.out]]),
    "qzeros": Part(I32, lambda d: [[d.groups, packed(d.out, d.bits)]]),
    "scales": Part(F16, lambda d: [[d.groups, d.out]]),
    "g_idx": Part(I32, lambda d: [[d.cols]], required=False),
}


class Gptq(Format):
    name = "gptq"
    bits = (2, 3, 4, 8)
    loaders = [
        ("vLLM / SGLang", "vllm serve {path}  # gptq / gptq_marlin kernels"),
        ("transformers (with gptqmodel)", "AutoModelForCausalLM.from_pretrained('{path}', device_map='auto')"),
    ]

    def packed_dims(self, out: int, cols: int) -> dict[str, int]:
        return {"in_features": cols, "out_features": out}  # qweight along in, qzeros along out

    def encode(self, qweights, info: QuantInfo, dtype: torch.dtype) -> Encoded:
        self.require_weight_only(info)
        return encode(qweights, info)

    def marker(self, qcfg: dict) -> str:
        return MARKER

    def decode(self, parts: dict[str, torch.Tensor], qcfg: dict) -> QuantizedWeight:
        return decode_module(parts, qcfg)

    def layout(self, qcfg: dict) -> Layout:
        return Layout(self.name, PARTS, int(qcfg["bits"]), int(qcfg["group_size"]))


register(Gptq())
