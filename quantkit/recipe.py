"""The YAML recipe: what to load, how to calibrate, which stages to apply, where to write.

Validated with pydantic; every error becomes one line naming the field path and what was accepted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .errors import QuantkitError

FORMAT_BITS = {"gptq": (2, 3, 4, 8), "compressed-tensors": (4, 8)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            accepted = list(cls.model_fields)
            for key in data:
                if key not in accepted:
                    raise PydanticCustomError(
                        "unknown_key", "unknown key '{key}' (accepted: {accepted})",
                        {"key": key, "accepted": ", ".join(accepted)},
                    )
        return data


class Calibration(_Strict):
    dataset: str = "wikitext2"  # alias for the bundled WikiText-2 validation split, or a file path
    text_field: str = "text"
    num_samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=8)
    seed: int = 0


class WeightQuant(_Strict):
    bits: Literal[2, 3, 4, 8] = 4
    group_size: Literal[-1, 32, 64, 128, 256] = 128
    sym: bool = True
    # Module names (or suffixes / regexes with 're:') left in float. Only Linear layers inside
    # decoder blocks are quantized at all, so lm_head and embeddings stay float regardless.
    ignore: list[str] = ["lm_head"]


class RTN(WeightQuant):
    pass


class GPTQ(WeightQuant):
    act_order: bool = False
    damp: float = Field(0.01, gt=0, le=1)
    block_size: int = Field(128, ge=1)


class Stage(_Strict):
    gptq: GPTQ | None = None
    rtn: RTN | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> "Stage":
        if sum(v is not None for v in (self.gptq, self.rtn)) != 1:
            raise PydanticCustomError("stage", "a stage is exactly one of: gptq, rtn")
        return self

    @property
    def name(self) -> str:
        return "gptq" if self.gptq is not None else "rtn"

    @property
    def args(self) -> WeightQuant:
        return self.gptq if self.gptq is not None else self.rtn


class Export(_Strict):
    output: str
    formats: list[Literal["gptq", "compressed-tensors"]] = Field(["compressed-tensors"], min_length=1)
    max_shard_size: str = "2GB"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # of the tensors left unquantized

    @model_validator(mode="after")
    def _unique(self) -> "Export":
        if len(set(self.formats)) != len(self.formats):
            raise PydanticCustomError("dup", "formats: each format once")
        parse_size(self.max_shard_size)
        return self


class Recipe(_Strict):
    model: str
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    calibration: Calibration | None = None
    stages: list[Stage] = Field(min_length=1)
    export: Export

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        if len(self.stages) > 1:
            raise PydanticCustomError("stages", "stages: one weight-quantizing stage (gptq or rtn) per recipe")
        stage = self.stages[0]
        if stage.name == "gptq" and self.calibration is None:
            raise PydanticCustomError("calib", "calibration: required by the gptq stage")
        for fmt in self.export.formats:
            if stage.args.bits not in FORMAT_BITS[fmt]:
                raise PydanticCustomError(
                    "bits", "stages.0.{stage}.bits: {bits} bits cannot be stored in {fmt} (it stores {ok})",
                    {"stage": stage.name, "bits": stage.args.bits, "fmt": fmt,
                     "ok": ", ".join(map(str, FORMAT_BITS[fmt]))},
                )
        return self

    @property
    def stage(self) -> Stage:
        return self.stages[0]


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            try:
                return int(float(t[: -len(unit)]) * mult)
            except ValueError:
                break
    raise PydanticCustomError("size", "max_shard_size: '{t}' is not a size like 2GB or 500MB", {"t": text})


def format_validation_error(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    where = f"{loc}: " if loc and not e["msg"].startswith(loc) else ""
    return f"{source}: {where}{e['msg']}{shown}"


def parse_recipe(data: Any, source: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise QuantkitError(f"{source}: expected a mapping with keys model, calibration, stages, export")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise QuantkitError(format_validation_error(err, source)) from None


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"{path}: recipe file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise QuantkitError(f"{path}:{where} invalid YAML: {getattr(err, 'problem', err)}") from None
    return parse_recipe(data, str(path))
