"""Which (prev -> Linears) pairs of a decoder block can fold a per-channel scale (AWQ, SmoothQuant): the block's
family (family_of: by block class, else the structural fallback) lists them through a `Pairs`, which keeps each pair
only where the module structure confirms it and notes each pair skipped."""

from __future__ import annotations

from torch import nn

from ..algorithms.smoothing import Mapping
from .family import Pairs, family_of


def find_mappings(block: nn.Module) -> tuple[list[Mapping], list[str]]:
    """The foldable (prev -> linears) pairs of one decoder block, and a note for each pair skipped."""
    pairs = Pairs(block)
    family_of(block).mappings(pairs)
    return pairs.mappings, pairs.notes


def norm_mappings(block: nn.Module) -> tuple[list[Mapping], list[str]]:
    """find_mappings restricted to pairs whose inputs a norm produces, with the notes about them."""
    mappings, notes = find_mappings(block)
    linear_names = {n for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    kept = [m for m in mappings if not isinstance(m.prev, nn.Linear)]
    return kept, [n for n in notes if n.split(" -> ", 1)[0] not in linear_names]
