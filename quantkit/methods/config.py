"""What every method's recipe config is built from: strict pydantic models (one line per error), and the weight
quantization arguments RTN and GPTQ share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from ..algorithms.fp4 import Fp4Spec, spec_for
from ..algorithms.grid import GridSpec
from .presets import PRESETS


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


class Activations(Strict):
    """W8A8: inputs of the quantized Linears quantized per token at run time (vLLM's dynamic schemes)."""

    bits: Literal[8] = 8
    type: Literal["int", "float"] = "int"  # float: FP8 e4m3
    dynamic: Literal[True] = True
    strategy: Literal["token"] = "token"

    @property
    def kind(self) -> str:
        return "int8" if self.type == "int" else "fp8"


class WeightQuant(Strict):
    # a preset (presets.PRESETS) that sets the fields below it names; a field it sets may not be given otherwise
    scheme: str | None = None
    bits: Literal[2, 3, 4, 8] = 4
    group_size: Literal[-1, 16, 32, 64, 128, 256] = 128
    sym: bool = True
    # float: FP8 e4m3, one scale per output channel (RTN only); fp4: e2m1 with group scales (NVFP4 groups of 16,
    # MXFP4 groups of 32), as the NVFP4A16 / MXFP4A16 presets set it
    type: Literal["int", "float", "fp4"] = "int"
    # how each group's scale (and zero) is chosen: its min and max, or the clip of least |w - q|^2.4 (grid.mse_params)
    observer: Literal["minmax", "mse"] = "minmax"
    activations: Activations | None = None  # None: weight-only
    # Module names (or suffixes / regexes with 're:') left in float. Only Linear layers inside
    # decoder blocks are quantized at all, so lm_head and embeddings stay float regardless.
    ignore: list[str] = ["lm_head"]

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("scheme") is None:
            return data
        name = data["scheme"]
        if name not in PRESETS:
            raise error("scheme: {name} is not a preset ({known})", name=repr(name), known=", ".join(PRESETS))
        for key, value in PRESETS[name].items():
            if key in data and data[key] != value:
                raise error("{key}: {name} sets {key}: {value}; drop {key} or the scheme", key=key, name=name,
                            value=str(value).lower() if isinstance(value, bool) else value)
        return data | PRESETS[name]

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
        if self.activations is not None:
            raise error("activations: fp4 weights are written weight-only (NVFP4A16, MXFP4A16); drop activations")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        # a recipe without a preset dumps as before presets existed: its quantkit.json and resume key are unchanged
        data = handler(self)
        return data if self.scheme is not None or not isinstance(data, dict) else \
            {k: v for k, v in data.items() if k != "scheme"}

    @property
    def grid(self) -> GridSpec | Fp4Spec:
        """What the weights are rounded to: the int grid, or the FP4 preset's (its group size tells which)."""
        return spec_for(self.group_size) if self.type == "fp4" else GridSpec(self.bits, self.group_size, self.sym)


def error(message: str, **values: Any) -> PydanticCustomError:
    """A recipe error: one line, its values filled in."""
    return PydanticCustomError("recipe", message, values)
