"""The AutoAWQ GEMM checkpoint layout (WQLinear_GEMM), as AutoAWQ, vLLM / SGLang (awq, awq_marlin) and
transformers (through GPTQModel) load it.

Per quantized Linear `<m>`:
  <m>.qweight  int32 [in, out/8]      4-bit codes packed along the output dim: nibble k (bits 4k..4k+3) of
                                       word c holds output column 8c + [0,2,4,6,1,3,5,7][k]
  <m>.qzeros   int32 [groups, out/8]  zero points, packed the same way
  <m>.scales   fp16  [groups, out]
(AutoAWQ awq/modules/linear/gemm.py `from_linear`, awq/utils/packing_utils.py `dequantize_gemm`.)
Zero points: AutoAWQ writes zero_point=false only for its GEMV variants. WQLinear_GEMM.from_linear requires
zeros, and the GEMM readers (AutoAWQ, vLLM awq / awq_marlin, GPTQModel) all dequantize (q - zero)·scale from
qzeros. So symmetric grids are written as GEMM with zero_point true and every zero 2^(bits-1) = 8: exact in
every loader, and the sym flag survives only in `meta`.
"""

from __future__ import annotations

import torch

from .. import __version__
from ..errors import QuantkitError
from . import packing
from .base import Encoded, GridSpec, QuantInfo, QuantizedWeight, trivial_g_idx
from .layout import F16, I32, Layout, Part, packed
from .registry import Format, register

MARKER = "qweight"
BITS = 4
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # column of each nibble within a word
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # nibble of each column


def _permute8(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Reorder each run of 8 columns of values [rows, cols]."""
    return values.reshape(values.shape[0], -1, 8)[..., order].reshape(values.shape[0], -1)


def _check(qw: QuantizedWeight, name: str) -> None:
    out, cols = qw.shape
    if qw.spec.bits != BITS:
        raise QuantkitError(f"export.formats: awq (AutoAWQ GEMM) stores only 4-bit weights, {name} has bits: "
                            f"{qw.spec.bits}")
    if trivial_g_idx(qw.g_idx, qw.spec.span(cols)) is not None:
        raise QuantkitError(f"export.formats: awq has no g_idx; {name} has act-order groups that are not "
                            "contiguous (g_idx != col // group_size)")
    if out % 8:
        raise QuantkitError(f"export.formats: awq packs 8 output channels per int32, {name} has out_features={out}")


def encode_module(qw: QuantizedWeight, name: str = "weight") -> dict[str, torch.Tensor]:
    _check(qw, name)
    return {
        "qweight": packing.pack(_permute8(qw.codes.T, AWQ_ORDER), BITS, dim=1),
        "qzeros": packing.pack(_permute8(qw.zero.T, AWQ_ORDER), BITS, dim=1),
        "scales": qw.scale.T.contiguous().to(torch.float16),
    }


def decode_module(t: dict[str, torch.Tensor], qcfg: dict) -> QuantizedWeight:
    bits = int(qcfg.get("bits", qcfg.get("w_bit", BITS)))
    if bits != BITS:
        raise QuantkitError(f"quantization_config.bits: awq GEMM checkpoints are 4-bit, this one says {bits}")
    scales = t["scales"]
    out = scales.shape[1]
    group_size = int(qcfg.get("group_size", qcfg.get("q_group_size", -1)))
    sym = bool((qcfg.get("meta") or {}).get("sym", not qcfg.get("zero_point", True)))

    def unpack(words: torch.Tensor) -> torch.Tensor:
        return _permute8(packing.unpack(words, BITS, out, dim=1), AWQ_REVERSE_ORDER).T.to(torch.uint8)

    return QuantizedWeight(
        codes=unpack(t["qweight"]),
        scale=scales.T.contiguous(),
        zero=unpack(t["qzeros"]),
        spec=GridSpec(BITS, group_size, sym),
    )


def encode(qweights: dict[str, QuantizedWeight], info: QuantInfo) -> Encoded:
    tensors = {
        f"{name}.{suffix}": t
        for name, qw in qweights.items()
        for suffix, t in encode_module(qw, name).items()
    }
    # Linear layers inside the blocks that stay float; lm_head and embeddings are never converted by AWQ loaders.
    skipped = sorted(n for n in info.unquantized_linears if n.startswith(info.block_linears_prefix + "."))
    # -1 (one group per row) is written as AutoAWQ writes it; vLLM's non-Marlin awq layer sizes its scales
    # by in_features // group_size and so needs a positive group size.
    group_size = info.spec.group_size
    cfg = {
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
        "group_size": group_size,
        "bits": BITS,
        "modules_to_not_convert": skipped,
        "meta": {"quantizer": [f"quantkit:{__version__}"], "method": info.method, "sym": info.spec.sym},
    }
    # AutoAWQ's from_quantized reads quant_config.json (its AwqConfig.to_dict keys exactly) and falls back
    # to group 128 without it.
    autoawq = {"zero_point": True, "q_group_size": group_size, "w_bit": BITS, "version": "GEMM",
               "modules_to_not_convert": skipped}
    return Encoded(tensors, cfg, {"quant_config.json": autoawq})


PARTS = {
    "qweight": Part(I32, lambda d: [[d.cols, packed(d.out, d.bits)]]),
    "qzeros": Part(I32, lambda d: [[d.groups, packed(d.out, d.bits)]]),
    "scales": Part(F16, lambda d: [[d.groups, d.out]]),
}


class Awq(Format):
    name = "awq"
    bits = (BITS,)
    loaders = [
        ("vLLM / SGLang", "vllm serve {path}  # awq / awq_marlin kernels"),
        ("transformers (AWQ)", "AutoModelForCausalLM.from_pretrained('{path}', device_map='auto')"),
    ]

    def packed_dims(self, out: int, cols: int) -> dict[str, int]:
        return {"out_features": out}

    def encode(self, qweights, info: QuantInfo, dtype: torch.dtype) -> Encoded:
        self.require_weight_only(info)
        return encode(qweights, info)

    def marker(self, qcfg: dict) -> str:
        return MARKER  # gptq's too: quant_method tells them apart

    def decode(self, parts: dict[str, torch.Tensor], qcfg: dict) -> QuantizedWeight:
        return decode_module(parts, qcfg)

    def layout(self, qcfg: dict) -> Layout:
        return Layout(self.name, PARTS, int(qcfg.get("bits", qcfg.get("w_bit", 4))), int(qcfg["group_size"]))


register(Awq())
