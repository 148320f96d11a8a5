"""What a Linear's weight (and its input) become, and the one result type every method returns.

`Scheme` describes it: the value kind (int codes, float8, fp4), bits, how scales are shared (per output
channel, per group of columns, per 2-D block), symmetry, the scale dtype, whether a global scale sits above the
group scales (NVFP4), and the activation scheme (None: weight-only). Formats decide from a Scheme whether they can
store it (export/formats.py); kernels pick a layer by its kind.

`QuantizedTensor` is what GPTQ, RTN and FP8 produce: `dequantize()` gives the weight they stand for, and
`to_tensors()` / `from_tensors()` round-trip it bit for bit (resume checkpoints, and the per-kind registry here
lets a new kind round-trip without editing the checkpoint code).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class ActivationScheme:
    """How a quantized Linear's inputs are quantized at run time (today: dynamic per token)."""

    kind: str  # int | float
    bits: int = 8
    dynamic: bool = True
    strategy: str = "token"  # token | tensor | group (with group_size)
    group_size: int | None = None


@dataclass(frozen=True)
class Scheme:
    kind: str  # int | float (e4m3) | fp4 (e2m1: NVFP4, MXFP4)
    bits: int
    group_size: int = -1  # columns per scale; -1: one scale per output channel
    sym: bool = True
    scale_dtype: torch.dtype = torch.float16
    block: tuple[int, int] | None = None  # [rows, cols] per scale (FP8 block), instead of group_size
    global_scale: bool = False  # one float32 scale over the group scales (NVFP4)
    activations: ActivationScheme | None = None  # None: weight-only

    @property
    def weight_only(self) -> bool:
        return self.activations is None


class QuantizedTensor(ABC):
    """A quantized [out, in] weight in original column order. Subclasses register a `kind` so that
    `from_tensors` can rebuild them from `to_tensors()` and `meta()` alone."""

    kind: ClassVar[str]
    KINDS: ClassVar[dict[str, type[QuantizedTensor]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        QuantizedTensor.KINDS[cls.kind] = cls

    @property
    @abstractmethod
    def scheme(self) -> Scheme: ...

    @property
    @abstractmethod
    def shape(self) -> tuple[int, int]: ...

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...

    @abstractmethod
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors, unchanged (names are the kind's own)."""

    @abstractmethod
    def meta(self) -> dict:
        """The JSON-able rest that from_tensors needs besides the tensors; carries `kind`."""

    @classmethod
    @abstractmethod
    def restore(cls, tensors: dict[str, torch.Tensor], meta: dict) -> QuantizedTensor: ...

    @staticmethod
    def from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> QuantizedTensor:
        kind = meta.get("kind")
        if kind not in QuantizedTensor.KINDS:
            raise KeyError(f"quantized tensor kind {kind!r} is not one of {', '.join(QuantizedTensor.KINDS)}")
        return QuantizedTensor.KINDS[kind].restore(tensors, meta)
