"""What a checkpoint format is (`Format`) and where formats register; export/formats.py is the registry's face
(built-ins loaded), which callers ask.

A format owns every fact about its files: which schemes it stores (`check_scheme`, `check_linear`), how quantized
weights become its tensors and quantization_config (`encode`), the tensor that marks a quantized module (`marker`),
how those tensors become weights again (`decode`), the dtypes and shapes it stores (`layout`, for verify), whether
its Linears take quantized activations (`activations`) and which loaders read it (`loaders`, for the model card).
Export, the recipe check, the runtime, verify, the card and the engines ask the registry, so a new format plugs in
with `formats.register(MyFormat())` and nothing else (tests/test_extension_format.py does it from a test file).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from ..algorithms.scheme import QuantizedTensor, Scheme
from ..errors import QuantkitError
from .base import Encoded, QuantInfo
from .layout import Layout


class Format(ABC):
    name: ClassVar[str]  # export.formats and quantization_config.quant_method
    bits: ClassVar[tuple[int, ...]]  # weight widths it stores
    kinds: ClassVar[tuple[str, ...]] = ("int",)  # Scheme.kind values it stores
    weight_only: ClassVar[bool] = True  # False: also W8A8 (quantized activations)
    kv_cache: ClassVar[bool] = False  # True: carries an FP8 KV cache's k / v scales (QuantInfo.kv_cache)
    mixed: ClassVar[bool] = False  # True: stores Linears of different int grids (QuantInfo.overrides)
    loaders: ClassVar[list[tuple[str, str]]] = []  # (who, how with '{path}') for the model card

    def check_scheme(self, scheme: Scheme) -> tuple[str, str] | None:
        """(the weight stage's field, why) this format cannot store the scheme's weights, or None. Activations are
        `weight_only`'s question, which the recipe asks first of every format."""
        if scheme.kind not in self.kinds:
            return "type", f"{scheme.kind} weights cannot be stored in {self.name} (it stores {', '.join(self.kinds)})"
        if scheme.bits not in self.bits:
            stored = ", ".join(map(str, self.bits))
            return "bits", f"{scheme.bits} bits cannot be stored in {self.name} (it stores {stored})"
        return None

    def packed_dims(self, out: int, cols: int) -> dict[str, int]:
        """The dimensions its int32 words pack along (each must hold whole values)."""
        return {"in_features": cols}

    def check_linear(self, scheme: Scheme, name: str, out: int, cols: int) -> str | None:
        """Why it cannot store Linear `name` [out, cols] in this scheme, or None."""
        if not scheme.weight_only:
            return None  # W8A8 weights are stored one int8 / FP8 value per element: nothing to pack
        for dim, size in self.packed_dims(out, cols).items():
            if (size * scheme.bits) % 32:
                return (f"export.formats: {self.name} cannot pack {scheme.bits}-bit {name} ({dim}={size} is not a "
                        f"multiple of {32 // math.gcd(32, scheme.bits)})")
        return None

    def require_weight_only(self, info: QuantInfo) -> None:
        if info.activations is not None:
            raise QuantkitError(f"export.formats: {self.name} stores weight-only quantization, not "
                                f"{info.activations} W8A8")

    @abstractmethod
    def encode(self, qweights: dict[str, QuantizedTensor], info: QuantInfo, dtype: torch.dtype) -> Encoded:
        """Packed tensors of `qweights` (any subset: each module is encoded on its own) and the quantization_config,
        which depends on `info` only. dtype: the artifact's float dtype."""

    @abstractmethod
    def marker(self, qcfg: dict) -> str:
        """The tensor suffix that marks a quantized module in a checkpoint of this quantization_config."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], qcfg: dict) -> QuantizedTensor:
        """A `mixed` format's takes a third argument, `module`: the Linear's name, whose grid it reads."""

    @abstractmethod
    def layout(self, qcfg: dict) -> Layout:
        """KeyError / ValueError / QuantkitError when the quantization_config lacks what it needs. A `mixed`
        format's takes `module` too."""

    def decode_of(self, parts: dict[str, torch.Tensor], qcfg: dict, module: str) -> QuantizedTensor:
        """decode() of Linear `module`, on its own grid where the checkpoint stores several."""
        return self.decode(parts, qcfg, module) if self.mixed else self.decode(parts, qcfg)  # type: ignore[call-arg]

    def layout_of(self, qcfg: dict, module: str) -> Layout:
        return self.layout(qcfg, module) if self.mixed else self.layout(qcfg)  # type: ignore[call-arg]

    def activations(self, qcfg: dict) -> str | None:
        """int8 | fp8 when the checkpoint's Linears quantize their inputs (W8A8 layers), else None."""
        return None

    def input_group(self, qcfg: dict) -> int | None:
        """Columns per scale where the W8A8 Linears quantize their inputs per group of columns, else None."""
        return None

    def weight_only_int(self, qcfg: dict) -> bool:
        """Whether vLLM runs its quantized Linears as weight-only integer (cpu_gemm_wna16 on CPU)."""
        return True


FORMATS: dict[str, Format] = {}  # name -> format


def register(fmt: Format) -> Format:
    FORMATS[fmt.name] = fmt
    return fmt
