"""Granite: a Llama-style block; its embedding, residual, attention and logits multipliers sit outside the folded
pairs (a residual multiplier scales the block's output, not the norm -> Linear paths)."""

from __future__ import annotations

from .family import Family, register
from .llama import llama_style

GRANITE = register(Family(name="Granite", model_types=("granite",), blocks=("GraniteDecoderLayer",),
                          norms=("GraniteRMSNorm",), mappings=llama_style))
