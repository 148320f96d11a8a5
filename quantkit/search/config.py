"""The recipe's `search:` block: the candidates each fused group of Linears may take, the budget, and the text the
search scores on. `quantkit quantize` ignores the block; `quantkit search` reads it here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..algorithms.grid import GridSpec
from ..errors import QuantkitError
from ..methods.config import Strict, check_weight_args
from ..recipe import parse_size

UNQUANTIZED = "unquantized"


class Grid(Strict):
    """An int weight grid; fields left out come from the recipe's weight stage."""

    bits: int | None = None
    group_size: int | None = None
    sym: bool | None = None


class Budget(Strict):
    """Exactly one: the artifact's safetensors bytes (a size or a number), the mean stored bits per weight of the
    quantized Linears (scales and zeros counted), the bytes the artifact has with every group at one candidate, or
    a decode speedup over the original served in 16-bit, by the roofline of a memory-bound decode step (the bytes of
    weights it reads per token; sizes.read_bytes): an estimate, not a measurement."""

    weight_bytes: int | str | None = None
    bits_per_weight: float | None = Field(None, gt=0)
    same_bytes_as: Grid | None = None
    decode_speedup: float | None = Field(None, gt=1)

    @model_validator(mode="after")
    def _one(self) -> Budget:
        given = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError("budget", "give exactly one of weight_bytes, bits_per_weight, same_bytes_as, "
                                      "decode_speedup")
        if isinstance(self.weight_bytes, str):
            self.weight_bytes = parse_size(self.weight_bytes)
        elif self.weight_bytes is not None and self.weight_bytes <= 0:
            raise PydanticCustomError("budget", "weight_bytes: expected a positive size")
        return self


class Search(Strict):
    candidates: list[Grid | Literal["unquantized"]] = Field(min_length=2)
    budget: Budget
    # the domains scored (bundled names, self, suite, or text files): the worst one's KLD is the objective
    domains: list[str] = Field(["suite"], min_length=1)
    tokens: int = Field(128, ge=16)  # scored tokens per domain (from its calibration split; self: fresh text)
    seq_len: int = Field(128, ge=8)
    # the first this many of the recipe's calibration windows give the sensitivity pass its Hessians (None: all);
    # the chosen mix is then quantized on all of them
    calibration_samples: int | None = Field(128, ge=1)
    # after the chosen mix is measured, each domain's predicted KLD is rescaled by measured / predicted (the groups'
    # increases do not add up alike on every domain) and the allocation re-run, this many times; each new mix is
    # quantized and measured, and the best measured one is kept
    refine: int = Field(0, ge=0, le=3)
    # the candidate every group's KLD increase is measured at: the lossiest (largest Hessian-weighted output error);
    # the others are scaled from it by their error, and `checks` groups are measured at every candidate to show how
    # well that scaling agrees (search.json). measure: all measures every group at every candidate.
    measure: Literal["lossiest", "all"] = "lossiest"
    checks: int = Field(6, ge=0)


def check_words(block, path: str) -> None:
    """A candidate written as a word other than unquantized (fp8, ...): one line, before pydantic's union error."""
    cands = block.get("candidates") if isinstance(block, dict) else None
    for i, c in enumerate(cands if isinstance(cands, list) else []):
        if isinstance(c, str) and c != UNQUANTIZED:
            raise QuantkitError(f"{path}: search.candidates.{i}: {c!r} is not a candidate; expected a grid "
                                "({bits, group_size, sym}) or unquantized")


def grid_of(candidate: Grid | str, stage_args, path: str) -> GridSpec | None:
    """A candidate's int grid, its unset fields from the weight stage's; None for unquantized."""
    if candidate == UNQUANTIZED:
        return None
    data = stage_args.model_dump() | {k: v for k, v in candidate.model_dump().items() if v is not None}
    try:
        args = type(stage_args).model_validate(data)
        check_weight_args(args, path, False)
    except ValidationError as err:
        raise QuantkitError(f"{path}: {err.errors()[0]['msg']}") from None
    except PydanticCustomError as err:
        raise QuantkitError(err.message()) from None
    if args.type != "int" or args.activations is not None:
        raise QuantkitError(f"{path}: candidates are int weight-only grids (bits, group_size, sym) or unquantized; "
                            "the weight stage here is not one")
    return GridSpec(args.bits, args.group_size, args.sym)


def label(spec: GridSpec | None) -> str:
    if spec is None:
        return "float"
    return f"w{spec.bits}{'pc' if spec.group_size == -1 else f'g{spec.group_size}'}{'' if spec.sym else 'a'}"
