"""What every method's recipe config is built from: strict pydantic models (one line per error), and the weight
quantization arguments RTN and GPTQ share."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from ..algorithms.fp4 import Fp4Spec, spec_for
from ..algorithms.grid import GridSpec
from ..algorithms.mxfp8 import MX8, Mxfp8Spec
from . import presets


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            accepted = list(cls.model_fields)
            for key in data:
                if key not in accepted:
                    raise PydanticCustomError(
                        "unknown_key", "unknown key {key} (accepted: {accepted})",
                        {"key": repr(key), "accepted": ", ".join(accepted)},  # repr: one line, quotes shown
                    )
        return data


class OmitDefaults(Strict):
    """Keys added after recipes were first recorded are left out of a dump while at their default, so quantkit.json
    (and the resume fingerprint) of a recipe that does not use them stays byte for byte what it was."""

    _omit: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        data = handler(self)
        return {k: v for k, v in data.items()
                if k not in self._omit or v != type(self).model_fields[k].default}


class Activations(OmitDefaults):
    """W8A8: inputs of the quantized Linears quantized at run time per token (or per group of columns), or with one
    static scale per Linear calibrated from the calibration windows (FP8 only)."""

    _omit = ("group_size", "observer")
    bits: Literal[4, 8] = 8  # 4: fp4 inputs only
    # float: FP8 e4m3; mxfp8: e4m3 with e8m0 scales per 32 columns; fp4: e2m1 per group of 16 (NVFP4: e4m3 scales over a
    # static global scale calibrated like a static FP8 one) or 32 (MXFP4: e8m0 scales)
    type: Literal["int", "float", "mxfp8", "fp4"] = "int"
    dynamic: bool = True  # false: one static input scale per Linear (strategy: tensor)
    strategy: Literal["token", "group", "tensor"] = "token"
    group_size: int | None = Field(None, ge=1)  # strategy: group: columns per scale
    # static scales: max|x| / 448 over the calibration (minmax), the clip of least squared FP8 error (mse), or the
    # 99.99th percentile of |x| (percentile); algorithms/observers.py
    observer: Literal["minmax", "mse", "percentile"] = "minmax"

    @property
    def kind(self) -> str:
        return {"int": "int8", "float": "fp8"}.get(self.type, self.type)

    @property
    def calibrated(self) -> bool:
        """A static scale per Linear comes from the calibration data: FP8's (dynamic: false), NVFP4's global."""
        return not self.dynamic or (self.type == "fp4" and self.group_size == 16)


Positive = Annotated[int, Field(ge=1)]


class WeightQuant(OmitDefaults):
    _omit = ("scheme", "block", "per_tensor")
    # a compressed-tensors preset name (methods/presets.py); keys beside it override it (an FP4 one's may not differ)
    scheme: str | None = None
    bits: Literal[2, 3, 4, 8] = 4
    group_size: Literal[-1, 16, 32, 64, 128, 256] = 128
    sym: bool = True
    # float: FP8 e4m3, one scale per output channel (RTN only); fp4: e2m1 with group scales (NVFP4 groups of 16,
    # MXFP4 groups of 32), as the NVFP4A16 / MXFP4A16 presets set it; mxfp8: e4m3 with e8m0 scales per 32 columns
    # (MXFP8A16, MXFP8)
    type: Literal["int", "float", "fp4", "mxfp8"] = "int"
    # how each group's scale (and zero) is chosen: its min and max, or the clip of least |w - q|^2.4 (grid.mse_params)
    observer: Literal["minmax", "mse"] = "minmax"
    activations: Activations | None = None  # None: weight-only
    block: tuple[Positive, Positive] | None = None  # FP8 weights: one scale per [rows, cols] block (FP8_BLOCK)
    per_tensor: bool = False  # FP8 weights: one scale for the whole weight (the FP8 preset)
    # Module names (or suffixes / regexes with 're:') left in float. Only Linear layers inside
    # decoder blocks are quantized at all, so lm_head and embeddings stay float regardless.
    ignore: list[str] = ["lm_head"]

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        return presets.expand(data)

    @field_validator("scheme")
    @classmethod
    def _known_preset(cls, name: str | None) -> str | None:
        return presets.check_name(name)

    @model_validator(mode="after")
    def _fp4(self) -> "WeightQuant":
        if self.type != "fp4":
            return self
        for key, want, why in (("bits", 4, "e2m1 is 4 bits"), ("sym", True, "e2m1 is symmetric")):
            if getattr(self, key) != want:
                raise error("{key}: fp4 weights need {key}: {want} ({why})", key=key,
                            want=str(want).lower(), why=why)
        if self.group_size not in (16, 32):
            raise error("group_size: fp4 weights need group_size: 16 (NVFP4A16) or 32 (MXFP4A16), got {g}",
                        g=self.group_size)
        if self.observer != "minmax":
            raise error("observer: fp4 group scales are compressed-tensors' min-max ones; drop observer: {o}",
                        o=self.observer)
        act = self.activations
        preset = "NVFP4" if self.group_size == 16 else "MXFP4"
        if act is not None and (act.type, act.bits, act.strategy, act.group_size, act.dynamic) != (
                "fp4", 4, "group", self.group_size, True):
            raise error("activations: fp4 weights take no inputs or {preset}'s (type: fp4, bits: 4, strategy: group, "
                        "group_size: {g}, dynamic: true)", preset=preset, g=self.group_size)
        if act is not None and preset == "MXFP4" and act.observer != "minmax":
            raise error("activations.observer: MXFP4's inputs are quantized at run time; drop activations.observer")
        if act is not None and act.observer == "mse":  # observers.py's mse clip weighs FP8 error, not FP4's
            raise error("activations.observer: NVFP4's input global scale is calibrated by minmax or percentile, "
                        "got mse")
        return self

    @model_validator(mode="after")
    def _mxfp8(self) -> "WeightQuant":
        act = self.activations
        if self.type != "mxfp8":
            for kind, preset in (("mxfp8", "MXFP8"), ("fp4", "NVFP4, MXFP4")):
                if act is not None and act.type == kind and self.type != kind:
                    raise error("activations.type: {k} inputs go with {k} weights ({p}), got type: {t}", k=kind,
                                p=preset, t=self.type)
            if act is not None and (act.bits == 4) != (act.type == "fp4"):
                raise error("activations.bits: 4-bit inputs are fp4 (NVFP4, MXFP4), other types 8-bit")
            return self
        for key, want in (("bits", 8), ("group_size", 32), ("sym", True), ("observer", "minmax")):
            if getattr(self, key) != want:
                raise error("{key}: mxfp8 weights are e4m3 with a power-of-two scale per 32 columns (MXFP8A16, "
                            "MXFP8): {key}: {want}", key=key, want=str(want).lower() if want is True else want)
        if act is not None and (act.type, act.strategy, act.group_size, act.dynamic) != ("mxfp8", "group", 32, True):
            raise error("activations: mxfp8 weights take no inputs or MXFP8's (type: mxfp8, strategy: group, "
                        "group_size: 32, dynamic: true)")
        return self

    @property
    def grid(self) -> GridSpec | Fp4Spec | Mxfp8Spec:
        """What the weights are rounded to: the int grid, the FP4 preset's (its group size tells which), or MXFP8's."""
        if self.type == "mxfp8":
            return MX8
        return spec_for(self.group_size) if self.type == "fp4" else GridSpec(self.bits, self.group_size, self.sym)


def error(message: str, **values: Any) -> PydanticCustomError:
    """A recipe error: one line, its values filled in."""
    return PydanticCustomError("recipe", message, values)


def check_weight_args(args: WeightQuant, path: str, rounds_float: bool) -> None:
    """What FP8 weights and quantized activations need of the weight stage's other arguments (path: its field)."""
    act = args.activations
    if args.type == "float":
        if not rounds_float and args.block is None:  # GPTQ solves on FP8 blocks (its scales fixed before)
            raise error("{path}.type: float (FP8) weights are solved on blocks only (block: [rows, cols], FP8_BLOCK); "
                        "per-channel or per-tensor FP8 is rounded to nearest: use rtn with type: float", path=path)
        if not rounds_float and getattr(args, "act_order", False):
            raise error("{path}.act_order: FP8 block weights are solved in column order; act_order: false",
                        path=path)
        if not rounds_float and act is not None and not act.dynamic:
            raise error("{path}.activations.dynamic: static input scales are calibrated after rounding to nearest; "
                        "use rtn (or dynamic inputs)", path=path)
        for key, want, why in (("bits", 8, "FP8 e4m3 is 8 bits"), ("group_size", -1, "one scale per output "
                               "channel, tensor or block"), ("sym", True, "FP8 is symmetric")):
            if getattr(args, key) != want:
                raise error("{path}.{key}: float (FP8) weights need {key}: {want} ({why})",
                            path=path, key=key, want=str(want).lower(), why=why)
        if act is None:
            raise error("{path}.activations: float (FP8) weights are written as W8A8 only; add "
                        "activations: {type: float}", path=path)
        if args.block is not None and args.per_tensor:
            raise error("{path}.per_tensor: one scale per tensor or per block (block), not both", path=path)
    else:
        for key in ("block", "per_tensor"):
            if getattr(args, key):
                raise error("{path}.{key}: FP8 weights only (type: float)", path=path, key=key)
    if act is None or args.type in ("mxfp8", "fp4"):  # their inputs: WeightQuant._mxfp8 / _fp4
        return
    if args.type == "int" and act.type == "float" and args.bits != 8:  # W4AFP8 (int8 weights: W8A8's rules)
        _check_w4afp8(args, path)
        return
    for key, want, why in (("bits", 8, "8-bit weights"), ("group_size", -1, "one scale per output channel"),
                           ("sym", True, "symmetric weights, the only ones vLLM runs")):
        if getattr(args, key) != want:
            raise error("{path}.{key}: W8A8 (activations) needs {why}: {key}: {want}",
                        path=path, key=key, want=str(want).lower(), why=why)
    if act.type != args.type:
        raise error("{path}.activations.type: {act} activations need {act} weights (type: {act}), got type: {w}",
                    path=path, act=act.type, w=args.type)
    if act.strategy != "token" and act.type != "float":
        raise error("{path}.activations.strategy: {s} is for FP8 activations (type: float); int8 ones are per token",
                    path=path, s=act.strategy)
    if (act.strategy == "group") != (act.group_size is not None):
        raise error("{path}.activations.group_size: needed by strategy: group, and only by it", path=path)
    if act.dynamic == (act.strategy == "tensor"):
        raise error("{path}.activations.dynamic: {want} for strategy: {s} (static inputs have one scale per "
                    "tensor, calibrated)", path=path, want=str(act.strategy != "tensor").lower(), s=act.strategy)
    # the runtime's FP8 layers run group inputs with block weights only (kernels/w8a8.py), as compressed-tensors pairs them
    if act.type == "float" and (args.block is not None) != (act.strategy == "group"):
        raise error("{path}.activations.strategy: FP8 block weights take inputs per group of columns (strategy: group) "
                    "and only they do; got strategy: {s} {w}", path=path, s=act.strategy,
                    w="with block" if args.block is not None else "without block")


def _check_w4afp8(args: WeightQuant, path: str) -> None:
    """int4 weights with FP8 inputs per token at run time (W4AFP8): the weights a W4A16 grid, symmetric, as
    compressed-tensors' preset and vLLM's W4A8-FP8 kernel take them."""
    act = args.activations
    for key, want, why in (("bits", 4, "4-bit weights"), ("sym", True, "symmetric weights")):
        if getattr(args, key) != want:
            raise error("{path}.{key}: W4AFP8 (int weights, FP8 activations) needs {why}: {key}: {want}",
                        path=path, key=key, want=str(want).lower(), why=why)
    if act.strategy != "token" or not act.dynamic:
        raise error("{path}.activations.strategy: W4AFP8 quantizes its inputs per token at run time (strategy: "
                    "token, dynamic: true), got strategy: {s}", path=path, s=act.strategy)


def activation_label(args: WeightQuant) -> str:
    """How messages name a weight stage with quantized inputs."""
    if args.type == "mxfp8":
        return "MXFP8 (MX activations)"
    if args.type == "fp4":
        return f"{'NVFP4' if args.group_size == 16 else 'MXFP4'} (FP4 activations)"
    w4afp8 = args.type == "int" and args.activations.type == "float" and args.bits != 8
    return "W4AFP8 (FP8 activations)" if w4afp8 else "W8A8 (activations)"
