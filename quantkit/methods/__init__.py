"""Quantization methods, one module each, behind one interface (base.Method) and one registry keyed by the recipe
key. Each holds its recipe config, what the layer-wise loop needs to know of it and its memory terms; the tensor
math stays in algorithms/, the loop in quantize/.

Registration order is the order recipe errors list the kinds in."""

from . import gptq, rtn, smoothquant, awq  # noqa: F401  (each registers itself)
from .base import METHODS, Method, get, register

__all__ = ["METHODS", "Method", "get", "register"]
