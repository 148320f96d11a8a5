"""What every format encoder consumes and produces."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..algorithms.fp4 import Fp4Spec, Fp4Weight
from ..algorithms.fp8 import Fp8BlockWeight, Fp8Weight
from ..algorithms.grid import GridSpec, QuantizedWeight
from ..algorithms.mxfp8 import Mxfp8Spec, Mxfp8Weight
from ..algorithms.scheme import ActivationScheme, Scheme


@dataclass
class QuantInfo:
    """How the weights were quantized, as the formats' configs need to say it."""

    method: str  # the recipe's stages joined by '+': gptq | rtn | smoothquant+gptq | ...
    spec: GridSpec | Fp4Spec | Mxfp8Spec  # the int grid, the FP4 preset's or MXFP8's; unused by FP8 weights
    act_order: bool = False
    damp: float | None = None
    unquantized_linears: list[str] = field(default_factory=list)  # full names of Linear layers left float
    block_linears_prefix: str = "model.layers"  # where the decoder blocks live
    # None: weight-only; int8 | fp8: W8A8 (W4AFP8 with int4 weights), activations quantized per token at run time;
    # mxfp8: MXFP8's, per token and group of 32 columns; fp4: NVFP4's / MXFP4's, per token and group of act_group
    activations: str | None = None
    block: tuple[int, int] | None = None  # FP8 weights: one scale per [rows, cols] block
    per_tensor: bool = False  # FP8 weights: one scale per weight
    act_strategy: str = "token"  # token | group (act_group columns per scale), both at run time | tensor (static)
    act_group: int | None = None
    act_observer: str = "minmax"  # how static input scales were chosen (algorithms/observers.py)
    kv_cache: str | None = None  # None: a 16-bit KV cache; tensor | head: FP8 with k / v scales of that strategy
    # Linear name -> its grid where it differs from spec (the recipe's overrides; empty for a uniform recipe)
    overrides: dict[str, GridSpec] = field(default_factory=dict)
    linears: list[str] = field(default_factory=list)  # the quantized Linears' full names, in model order
    floated: list[str] = field(default_factory=list)  # Linears the overrides leave float (in unquantized_linears)

    def spec_for(self, name: str) -> GridSpec | Fp4Spec:
        """The grid Linear `name` is rounded to."""
        return self.overrides.get(name, self.spec)

    @property
    def calibrated_inputs(self) -> bool:
        """Each Linear keeps a static input scale calibrated from the data: FP8's (strategy tensor), or NVFP4's
        input global scale."""
        return self.act_strategy == "tensor" or (self.activations == "fp4" and self.spec.global_scale)

    @property
    def scheme(self) -> Scheme:
        return scheme_of(self.spec, self.activations, self.block, self.act_strategy, self.act_group)


# the observer a static input scale came from, as the config names it (llm-compressor's name for minmax's)
STATIC_OBSERVERS = {"minmax": "static_minmax", "mse": "mse", "percentile": "percentile"}


@dataclass
class Encoded:
    tensors: dict[str, torch.Tensor]  # full tensor names -> packed tensors (replacing `<module>.weight`)
    quantization_config: dict
    extra_files: dict[str, dict] = field(default_factory=dict)  # file name -> JSON body


def scheme_of(spec: GridSpec | Fp4Spec | Mxfp8Spec, activations: str | None, block: tuple[int, int] | None = None,
              act_strategy: str = "token", act_group: int | None = None) -> Scheme:
    """The Scheme of a recipe's weight stage: its int grid, FP8 weights with FP8 activations (W8A8 fp8), int4 weights
    with FP8 activations (W4AFP8), an FP4 preset's grid, or MXFP8's (with MX activations or none)."""
    if isinstance(spec, Fp4Spec):  # NVFP4 / MXFP4 inputs: the weights' grid, per token
        act = None if activations is None else ActivationScheme("fp4", 4, strategy="group", group_size=spec.group_size)
        return replace(spec.scheme, activations=act)
    if isinstance(spec, Mxfp8Spec):
        return spec.scheme(activations is not None)
    if activations is None:
        return Scheme("int", spec.bits, spec.group_size, spec.sym)
    act_kind = "float" if activations == "fp8" else "int"
    act = ActivationScheme(act_kind, dynamic=act_strategy != "tensor", strategy=act_strategy, group_size=act_group)
    if spec.bits == 4:  # W4AFP8: the int4 grid, FP8 inputs
        return Scheme("int", 4, spec.group_size, spec.sym, activations=act)
    kind = act_kind
    return Scheme(kind, spec.bits, spec.group_size, spec.sym, torch.float32 if kind == "float" else torch.float16,
                  block=block, activations=act)


def split_by_module(tensors: dict[str, torch.Tensor], marker: str) -> dict[str, dict[str, torch.Tensor]]:
    """{module prefix: {suffix: tensor}} for every module that has a `marker` tensor."""
    prefixes = {name[: -len(marker) - 1] for name in tensors if name.endswith("." + marker)}
    out: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    for name, t in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix in out:
            out[prefix][suffix] = t
    return out


def trivial_g_idx(g_idx: torch.Tensor | None, span: int) -> torch.Tensor | None:
    """None when g_idx is just col // span (contiguous groups), else g_idx itself."""
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(g_idx.numel()) // span):
        return None
    return g_idx.long()


__all__ = ["QuantInfo", "Encoded", "QuantizedWeight", "Fp8Weight", "Fp8BlockWeight", "Fp4Weight", "Fp4Spec",
           "Mxfp8Spec", "Mxfp8Weight", "GridSpec", "Scheme", "scheme_of", "split_by_module", "trivial_g_idx"]
