"""The YAML recipe: what to load, how to calibrate, which stages to apply, where to write.

Validated with pydantic; every error becomes one line naming the field path and what was accepted.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from .data import domain_name, expand
from .errors import QuantkitError, first_line
from .export import formats
from .export.base import scheme_of
from .methods import METHODS, Method
from .methods.awq import AWQ  # noqa: F401  (the stage configs, importable from the recipe as before)
from .methods.config import Activations, WeightQuant  # noqa: F401
from .methods.config import Strict as _Strict
from .methods.config import activation_label, check_weight_args
from .methods.config import error as _error
from .methods.gptq import GPTQ  # noqa: F401
from .methods.rtn import RTN  # noqa: F401
from .methods.smoothquant import SmoothQuant  # noqa: F401
from .overrides import Override, check as check_overrides
# the release and gates sections (importable from the recipe as before)
from .recipe_release import FormatName, Gates, QualityGates, Release, ReleaseBench, ReleaseEval, TaskGate  # noqa: F401


class CalibrationPart(_Strict):
    dataset: str  # a bundled domain (wikitext2, fiction, code, chat, math), self, or a file path
    weight: float = Field(gt=0)  # share of num_samples, relative to the other parts
    text_field: str = "text"


class Calibration(_Strict):
    # a bundled domain's calibration split, `mixture` (data.MIXTURE), `self` (text the model writes), a file path,
    # or a weighted list of those
    dataset: str | list[CalibrationPart] = "wikitext2"
    text_field: str = "text"
    chat_template: bool | None = None  # conversations in the tokenizer's chat template; None: when it has one
    num_samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=8)
    seed: int = 0
    # where the hidden states between blocks live (quantize/hidden.py); auto: the device when the memory plan
    # fits there, else host memory, else files in the output folder
    offload: Literal["auto", "device", "cpu", "disk"] = "auto"
    # windows per block forward; None: all of them when they fit, else the most that fit (the memory plan's choice)
    batch_size: int | None = Field(None, ge=1)


class MoE(_Strict):
    """Mixture-of-experts calibration (ignored by dense models)."""

    # every calibration token also runs through every expert, so each expert's statistics are full; the block's
    # output still comes from the routed experts only
    calibrate_all_experts: bool = True
    # routed-only calibration: an expert that received fewer tokens is rounded with RTN instead of GPTQ, with a warning
    min_tokens: int = Field(16, ge=1)


class KVCache(_Strict):
    """An FP8 (e4m3) KV cache: keys and values stored in 8 bits with static scales, amax / 448 over the calibration
    windows, per tensor or per KV head (kernels/kv_cache.py); compressed-tensors' kv_cache_scheme."""

    bits: Literal[8] = 8
    type: Literal["float"] = "float"
    strategy: Literal["tensor", "head"] = "tensor"


# A recipe is zero or more transform stages (they rewrite the float weights, the model function unchanged),
# then exactly one weight stage. A kind may be both (AWQ: a transform before gptq, or the weight stage alone).
# The kinds are the registered methods (quantkit/methods), one optional field each: Stage has those registered at
# import; parse_recipe validates with a model that has those registered now (_recipe_model).


class _StageBase(_Strict):
    @model_validator(mode="after")
    def _one_kind(self) -> "Stage":
        if sum(getattr(self, k) is not None for k in type(self).model_fields) != 1:
            raise PydanticCustomError("stage", "a stage is exactly one of: {kinds}",
                                      {"kinds": ", ".join(type(self).model_fields)})
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        # a kind registered after import is written only where used, so a recipe's dump (quantkit.json, the resume
        # fingerprint) is the same whatever extensions are loaded
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k in _IMPORTED_KEYS}

    @property
    def name(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)

    @property
    def args(self) -> Any:
        return getattr(self, self.name)

    @property
    def method(self) -> Method:
        return METHODS[self.name]

    @property
    def calibrated(self) -> bool:
        """Reads calibration data: its method does, or it calibrates static input scales (FP8, NVFP4)."""
        act = getattr(self.args, "activations", None)
        return self.method.calibrated or (act is not None and act.calibrated)

    @property
    def weights(self) -> WeightQuant:
        """As the weight stage: the grid it rounds to and the Linears it quantizes."""
        return self.method.weights(self.args)


def _stage_model(kinds: tuple[tuple[str, type[BaseModel]], ...]) -> type[_StageBase]:
    return create_model("Stage", __base__=_StageBase,
                        **{k: (config | None, None) for k, config in kinds})  # type: ignore[call-overload]


def _kinds() -> tuple[tuple[str, type[BaseModel]], ...]:
    return tuple((k, m.config) for k, m in METHODS.items())


Stage = _stage_model(_kinds())


class Export(_Strict):
    output: str
    formats: list[FormatName] = Field(["compressed-tensors"], min_length=1)
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
    # memory: load the whole model; stream: read a safetensors checkpoint one block at a time (same artifact bytes);
    # auto: stream a local safetensors checkpoint unless the recipe needs the whole model (calibration on `self`)
    load: Literal["auto", "memory", "stream"] = "auto"
    calibration: Calibration | None = None
    moe: MoE = MoE()
    stages: list[Stage] = Field(min_length=1)
    overrides: list[Override] = []  # per-layer grids (quantkit/overrides.py); later ones win
    kv_cache: KVCache | None = None
    export: Export
    release: Release = Release()
    gates: Gates = Gates()

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        # no kv_cache, no overrides: left out, so the dump of a recipe without them (quantkit.json, the resume key)
        # is as before
        data = handler(self)
        if isinstance(data, dict):
            for key, unset in (("kv_cache", None), ("overrides", [])):
                if key in data and data[key] == unset:
                    del data[key]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Recipe":
        self._check_order()
        for stage in self.stages:
            if stage.calibrated and self.calibration is None:
                raise _error("calibration: required by the {stage} stage", stage=stage.name)
        self._check_weights()
        self._check_kv_cache()
        self._check_release()
        return self

    def _check_kv_cache(self) -> None:
        if self.kv_cache is None:
            return
        if self.calibration is None:
            raise _error("kv_cache: its k / v scales are calibrated; add a calibration section")
        for fmt in self.export.formats:
            if not formats.get(fmt).kv_cache:
                raise _error("export.formats: {fmt} cannot carry an FP8 KV cache's k / v scales; a recipe with "
                             "kv_cache is written as compressed-tensors only", fmt=fmt)

    def _check_release(self) -> None:
        r, g = self.release, self.gates
        if r.format is not None and r.format not in self.export.formats:
            raise _error("release.format: {fmt} is not one of export.formats", fmt=r.format)
        for task in g.tasks:
            if task not in r.eval.tasks:
                raise _error("gates.tasks.{task}: the task is not evaluated (add it to release.eval.tasks)",
                             task=_path_part(task))
        evaluated = [domain_name(d) for d in expand(r.eval.datasets)]
        for domain in g.per_domain:
            if domain not in evaluated:
                raise _error("gates.per_domain.{domain}: the domain is not evaluated (release.eval.datasets gives "
                             "{evaluated})", domain=_path_part(domain), evaluated=", ".join(evaluated))
        speed = [k for k in ("decode_speedup_min", "prefill_speedup_min", "weight_bytes_ratio_max")
                 if getattr(g, k) is not None]
        if speed and not r.bench.enabled:
            raise _error("gates.{key}: needs the bench (release.bench.enabled is false)", key=speed[0])
        if speed and g.speed_batch not in r.bench.batches:
            raise _error("gates.speed_batch: {b} is not one of release.bench.batches", b=g.speed_batch)

    def _check_order(self) -> None:
        last = len(self.stages) - 1
        if not self.stages[last].method.weight:
            weight = next((i for i, s in enumerate(self.stages) if s.method.weight), None)
            if weight is None:
                raise _error("stages: the last stage quantizes the weights ({kinds}); {name} only transforms them",
                             kinds=", ".join(k for k, m in METHODS.items() if m.weight),
                             name=self.stages[last].name)
            raise _error("stages.{i}.{name}: transform stages go before the weight stage (stages.{w}.{weight})",
                         i=last, name=self.stages[last].name, w=weight, weight=self.stages[weight].name)
        for i, stage in enumerate(self.stages[:last]):
            if not stage.method.transform:
                raise _error("stages.{i}.{name}: one weight-quantizing stage per recipe, the last one "
                             "(stages.{last} is {other}); only {transforms} may come before it",
                             i=i, name=stage.name, last=last, other=self.stages[last].name,
                             transforms=", ".join(k for k, m in METHODS.items() if m.transform))
        for i, stage in enumerate(self.stages[:last]):  # rules between a transform and what follows it
            stage.method.check_order(i, self.stages, last)

    def _check_weights(self) -> None:
        stage = self.stage
        args, path = stage.weights, f"stages.{len(self.stages) - 1}.{stage.name}"
        act = args.activations
        check_weight_args(args, path, stage.method.rounds_float)
        if act is not None:
            for fmt in formats.names():
                if fmt in self.export.formats and formats.get(fmt).weight_only:
                    raise _error("export.formats: {fmt} stores weight-only quantization; {what} is "
                                 "written as compressed-tensors only", fmt=fmt, what=activation_label(args))
        scheme = scheme_of(args.grid, act and act.kind, args.block)
        for fmt in self.export.formats:
            problem = formats.get(fmt).check_scheme(scheme)
            if problem:
                raise _error("{path}.{field}: {problem}", path=path, field=problem[0], problem=problem[1])
        check_overrides(self.overrides, args, path, stage.method.rounds_float, self.export.formats)

    @property
    def stage(self) -> Stage:
        """The weight-quantizing stage (always the last)."""
        return self.stages[-1]

    @property
    def transforms(self) -> list[Stage]:
        return self.stages[:-1]

    @property
    def needs_calibration(self) -> bool:
        return self.kv_cache is not None or any(s.calibrated for s in self.stages)


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            try:
                size = int(float(t[: -len(unit)]) * mult)
            except (ValueError, OverflowError):  # 'xGB', 'nanGB' / 'infGB'
                break
            if size > 0:
                return size
            break
    raise PydanticCustomError("size", "max_shard_size: {t} is not a size like 2GB or 500MB", {"t": repr(text)})


def _path_part(key: str | int) -> str:
    """A key as written in a field path: user-chosen keys (task names) quoted unless plain, so a path is one line."""
    plain = isinstance(key, int) or re.fullmatch(r"[\w\[\]-]+", key)  # '[key]': pydantic's marker for a dict key
    return str(key) if plain else repr(key)


def format_validation_error(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = ".".join(map(_path_part, e["loc"]))
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list)) or got is None else f" (got {got!r})"
    where = f"{loc}: " if loc and not e["msg"].startswith(loc) else ""
    return f"{source}: {where}{e['msg']}{shown}"


@functools.cache
def _recipe_model(kinds: tuple[tuple[str, type[BaseModel]], ...]) -> type[Recipe]:
    """Recipe, or for methods registered after import (an extension's) a subclass whose stages accept them too.
    Keyed by key and config, so a key registered again with another config gets a new model."""
    if kinds == _IMPORTED:
        return Recipe
    return create_model("Recipe", __base__=Recipe, stages=(list[_stage_model(kinds)], Field(min_length=1)))


_IMPORTED = _kinds()
_IMPORTED_KEYS = {k for k, _ in _IMPORTED}


def parse_recipe(data: Any, source: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise QuantkitError(f"{source}: expected a mapping with keys model, calibration, stages, export")
    try:
        return _recipe_model(_kinds()).model_validate(data)
    except ValidationError as err:
        raise QuantkitError(format_validation_error(err, source)) from None


class _RecipeLoader(yaml.SafeLoader):
    """safe_load that refuses what a recipe never needs and could hide: a key given twice (YAML would keep the
    last one silently) and anchors / aliases (a few lines of them expand to gigabytes)."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise yaml.composer.ComposerError(None, None, f"anchor or alias '{event.anchor}' (not accepted in a "
                                              "recipe; write the value out)", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first on line {seen[key] + 1})", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_recipe(path: str | Path) -> Recipe:
    return parse_recipe(read_yaml(path), str(path))


def read_yaml(path: str | Path) -> Any:
    """A recipe file's YAML, read as _RecipeLoader allows; every problem one line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise QuantkitError(f"{path}: recipe file not found")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_RecipeLoader)
    except UnicodeDecodeError as err:
        raise QuantkitError(f"{path}: byte {err.start} is not UTF-8; expected a YAML text file") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or first_line(err)  # a ReaderError has none: its text is two lines
        raise QuantkitError(f"{path}:{where} invalid YAML: {problem}") from None
    except RecursionError:
        raise QuantkitError(f"{path}: invalid YAML: nested too deeply") from None
    return data
