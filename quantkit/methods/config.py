"""What every method's recipe config is built from: strict pydantic models (one line per error), and the weight
quantization arguments RTN and GPTQ share."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


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
    bits: Literal[2, 3, 4, 8] = 4
    group_size: Literal[-1, 32, 64, 128, 256] = 128
    sym: bool = True
    type: Literal["int", "float"] = "int"  # float: FP8 e4m3, one scale per output channel (RTN only)
    # how each group's scale (and zero) is chosen: its min and max, or the clip of least |w - q|^2.4 (grid.mse_params)
    observer: Literal["minmax", "mse"] = "minmax"
    activations: Activations | None = None  # None: weight-only
    # Module names (or suffixes / regexes with 're:') left in float. Only Linear layers inside
    # decoder blocks are quantized at all, so lm_head and embeddings stay float regardless.
    ignore: list[str] = ["lm_head"]


def error(message: str, **values: Any) -> PydanticCustomError:
    """A recipe error: one line, its values filled in."""
    return PydanticCustomError("recipe", message, values)
