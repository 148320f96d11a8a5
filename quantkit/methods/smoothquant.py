"""SmoothQuant: a transform that moves activation outliers into the weights (s = max|X|^alpha / max|W|^(1-alpha)),
folded into each norm -> Linear mapping. Its block pass is quantize/smoothquant_pass.SmoothQuantPass."""

from __future__ import annotations

from pydantic import Field

from .base import Method, register
from .config import Strict


class SmoothQuant(Strict):
    alpha: float = Field(0.8, gt=0, lt=1)  # migration strength: s = max|X|^alpha / max|W|^(1-alpha)
    # Mappings whose norm or any of whose Linear layers matches (names, dotted suffixes, 're:') stay unsmoothed.
    ignore: list[str] = []


class SmoothQuantMethod(Method):
    key = "smoothquant"
    config = SmoothQuant
    transform = True
    folds_inline = True


register(SmoothQuantMethod())
