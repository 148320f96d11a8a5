"""Mixed precision: per-layer overrides of the weight stage's int grid (the recipe's `overrides`).

An override picks quantized Linears by name (exact, dotted suffix, a containing module, or 're:' full match) and
decoder block index, and gives them other bits / group_size / sym, or leaves them float. Later overrides win. The
Linears a loader fuses (q/k/v, gate/up, MLA's q_a / kv_a, w1 / w3, every expert of one MoE layer) run as one
matmul or kernel with one scheme, so an override that splits one is refused (`fused_groups`, `resolve`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .algorithms.fp4 import FUSED
from .algorithms.grid import GridSpec
from .errors import QuantkitError
from .export import formats
from .export.base import scheme_of
from .methods.config import Strict, WeightQuant, check_weight_args, error


class Override(Strict):
    targets: list[str] = Field(min_length=1)  # names, dotted suffixes, containing modules, 're:' regexes (matches)
    layers: list[int] | str | None = None  # decoder block indices, or a range "0-3" (both ends included)
    bits: Literal[2, 3, 4, 8] | None = None
    group_size: Literal[-1, 16, 32, 64, 128, 256] | None = None
    sym: bool | None = None
    unquantized: bool = False  # left float, as the stage's ignore leaves a Linear

    @field_validator("layers")
    @classmethod
    def _range(cls, layers: list[int] | str | None) -> list[int] | str | None:
        if isinstance(layers, str):
            m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", layers)
            if m is None or int(m[1]) > int(m[2]):
                raise error("a list of block indices or a range like \"0-3\" (first <= last), got {v}", v=repr(layers))
        elif layers is not None and (not layers or min(layers) < 0):
            raise error("block indices are >= 0, at least one")
        return layers

    @model_validator(mode="after")
    def _float_or_grid(self) -> "Override":
        given = [k for k in ("bits", "group_size", "sym") if getattr(self, k) is not None]
        if self.unquantized and given:
            raise error("unquantized: a Linear left float takes no {keys}", keys=" / ".join(given))
        if not self.unquantized and not given:
            raise error("targets: an override gives bits, group_size or sym, or unquantized: true")
        return self

    @property
    def blocks(self) -> set[int] | None:
        if isinstance(self.layers, str):
            first, last = (int(x) for x in self.layers.split("-"))
            return set(range(first, last + 1))
        return None if self.layers is None else set(self.layers)

    def grid(self, stage: WeightQuant) -> WeightQuant:
        """The stage's arguments with this override's grid fields."""
        return stage.model_copy(update={k: getattr(self, k) for k in ("bits", "group_size", "sym")
                                        if getattr(self, k) is not None})


def check(overrides: list[Override], stage: WeightQuant, path: str, rounds_float: bool,
          export_formats: list[str]) -> None:
    """Each override's grid, checked as the weight stage's is, before any model is read (a recipe error)."""
    if not overrides:
        return
    if stage.type != "int" or stage.activations is not None:
        kind = "W8A8" if stage.activations is not None else {"float": "FP8", "fp4": "FP4"}[stage.type]
        raise error("overrides: per-layer overrides change an int weight-only grid; {path} is {kind} (mixing kinds "
                    "of schemes in one artifact is not supported yet)", path=path, kind=kind)
    for fmt in export_formats:
        if not formats.get(fmt).mixed:
            mixed = " or ".join(n for n in formats.names() if formats.get(n).mixed)
            raise error("export.formats: {fmt} stores one grid; a recipe with overrides is written as {mixed}",
                        fmt=fmt, mixed=mixed)
    for i, o in enumerate(overrides):
        if o.unquantized:
            continue
        args = o.grid(stage)
        check_weight_args(args, f"overrides.{i}", rounds_float)
        for fmt in export_formats:
            problem = formats.get(fmt).check_scheme(scheme_of(args.grid, None))
            if problem:
                raise error("overrides.{i}.{field}: {problem}", i=i, field=problem[0], problem=problem[1])


def matches(name: str, target: str) -> bool:
    """name is target or ends with '.' + target, lies inside a module that is or ends with target ('mlp',
    'model.layers.3.mlp.experts'), or fully matches 're:' + regex."""
    if target.startswith("re:"):
        return re.fullmatch(target[3:], name) is not None
    return name == target or name.endswith("." + target) or f".{target}." in f".{name}"


def block_index(name: str, prefix: str) -> int | None:
    head, sep, rest = name.partition(prefix + ".")
    index = rest.partition(".")[0]
    return int(index) if sep and not head and index.isdigit() else None


def _fused_key(name: str) -> tuple[str, ...]:
    """What a Linear shares its scheme with: its MoE layer's experts, its fused siblings, or nothing."""
    head, sep, tail = name.rpartition(".experts.")
    if sep and tail.partition(".")[0].isdigit():
        return ("experts", head)
    parent, _, leaf = name.rpartition(".")
    for i, names in enumerate(FUSED):
        if leaf in names:
            return ("fused", parent, str(i))
    return ("one", name)


def fused_groups(names: Iterable[str]) -> list[tuple[str, ...]]:
    """The quantized Linear names partitioned into the groups that must share a scheme (a fused layer's members,
    every expert of one MoE layer; singletons for the rest), in model order."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in names:
        groups.setdefault(_fused_key(name), []).append(name)
    return [tuple(g) for g in groups.values()]


def _shown(group: tuple[str, ...]) -> str:
    """model.layers.0.self_attn.{q_proj,k_proj,v_proj}; model.layers.1.mlp.experts.* for a MoE layer's experts."""
    if _fused_key(group[0])[0] == "experts":
        return group[0].rpartition(".experts.")[0] + ".experts.*"
    parent = group[0].rpartition(".")[0]
    return f"{parent}.{{{','.join(n.rpartition('.')[2] for n in group)}}}"


def resolve(overrides: list[Override], stage: WeightQuant, names: list[str], prefix: str, blocks: int
            ) -> tuple[dict[str, GridSpec], set[str], dict[str, int]]:
    """Each targeted Linear's grid where an override changes it, the Linears overrides leave float, and which
    override decided each Linear an override matched."""
    base = stage.grid
    chosen: dict[str, tuple[int, GridSpec | None]] = {}  # name -> (the last override that matched, its grid)
    for i, o in enumerate(overrides):
        wanted = o.blocks
        if wanted is not None and max(wanted) >= blocks:
            raise QuantkitError(f"overrides.{i}.layers: block {max(wanted)} is not a decoder block (the model has "
                                f"{blocks}: 0-{blocks - 1})")
        hit = [n for n in names if any(matches(n, t) for t in o.targets)
               and (wanted is None or block_index(n, prefix) in wanted)]
        if not hit:
            raise QuantkitError(f"overrides.{i}.targets: matches no quantized Linear (e.g. {names[0]})")
        spec = None if o.unquantized else o.grid(stage).grid
        for n in hit:
            chosen[n] = (i, spec)
    for group in fused_groups(names):
        got = {chosen[n][1] if n in chosen else base for n in group}
        if len(got) > 1:
            culprit = max(chosen[n][0] for n in group if n in chosen)
            why = ("vLLM runs a MoE layer's experts as one kernel with one scheme" if len(group) > 1 and
                   _fused_key(group[0])[0] == "experts" else "vLLM runs them as one matmul with one scheme")
            raise QuantkitError(f"overrides.{culprit}: splits the fused layer {_shown(group)}: {why}; target all "
                                "of them")
    specs = {n: s for n, (_, s) in chosen.items() if s is not None and s != base}
    return specs, {n for n, (_, s) in chosen.items() if s is None}, {n: i for n, (i, _) in chosen.items()}
