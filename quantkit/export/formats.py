"""The format registry that export, the recipe check, the runtime, verify, the card and the engines ask: quantkit's
formats (one module each, registered on import) and any registered later."""

from __future__ import annotations

from ..errors import QuantkitError
from . import awq, compressed_tensors, gptq  # noqa: F401  (each registers its format)
from .registry import FORMATS, Format, register

BUILTIN = ("gptq", "compressed-tensors", "awq")  # the order messages list them in, whatever imported them first

__all__ = ["Format", "register", "names", "find", "get"]


def names() -> list[str]:
    return [*BUILTIN, *(n for n in FORMATS if n not in BUILTIN)]


def find(name: str | None) -> Format | None:
    return FORMATS.get(name)


def get(name: str) -> Format:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise QuantkitError(f"format '{name}' is not one quantkit reads ({', '.join(names())})")
    return fmt
