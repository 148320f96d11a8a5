"""Transform stages, run block by block before the weight stage: hooks gather statistics during one float
forward of the block, then scales are folded into its weights. The block's float function is unchanged;
only where the quantization error lands moves.

AwqPass (AWQ) searches a scale per mapping on the float block and folds it, then clips the folded weights;
the weight stage (gptq, or AWQ's own round-to-nearest) quantizes what it leaves.

Each pass plans all blocks up front (so a recipe that cannot apply fails before any work), then offers
`observe(i, block)` (hook handles for that forward), `apply(i, block)` (fold what was observed, return
warnings) and `summary()` (one progress line), plus `notes` about the structure, reported once.
SmoothQuantPass also offers `inline(i, block)`: the same fold done inside the weight stage's forward.

Under several processes (quantize/distributed.py) each rank observes its share of the calibration windows. The
statistics are reduced right before they are used, in forms that add up to the one-process values: max |x| by
max, AWQ's channel sums and Gram matrices per window in fp64, the scale search's squared errors per candidate,
and the clipping samples by their index among all windows. A Linear's clip search runs on one rank.

The passes live in their own modules (smoothquant_pass.py, awq_pass.py) and register here with @transform_pass
under their stage's config class; `build` asks this registry and names no method.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..algorithms.smoothing import Mapping
from ..errors import QuantkitError
from ..export.base import QuantInfo
from ..recipe import Stage
from .distributed import Ranks


def plan_mappings(path: str, prefix: str, blocks: nn.ModuleList,
                  find: Callable[[nn.Module], tuple[list[Mapping], list[str]]],
                  keep: Callable[[int, str, Mapping], bool], what: str, all_ignored: str
                  ) -> tuple[list[list[Mapping]], list[str], list[str]]:
    """Per block, the mappings `find` gives that `keep(i, block_name, mapping)` admits, the blocks' dotted
    names and the structure notes. Fails before any work when no block has a mapping or all are ignored."""
    mappings, names, notes, found = [], [], set(), 0
    for i, block in enumerate(blocks):
        where = f"{prefix}.{i}"
        block_mappings, block_notes = find(block)
        found += len(block_mappings)
        notes.update(block_notes)
        mappings.append([m for m in block_mappings if keep(i, where, m)])
        names.append(where)
    if not found:
        raise QuantkitError(f"{path}: no {what} in {type(blocks[0]).__name__} ({'; '.join(sorted(notes))})")
    if not any(mappings):
        raise QuantkitError(f"{path}.ignore: {all_ignored}")
    return mappings, names, sorted(notes)


PASSES: dict[type, type] = {}  # a transform stage's config class -> its block pass (registered by @transform_pass)


def transform_pass(cls: type) -> type:
    PASSES[cls.config] = cls
    return cls


def build(stages: list[Stage], prefix: str, blocks: nn.ModuleList, ranks: Ranks = Ranks(),
          windows: int = 0, info: QuantInfo | None = None) -> list:
    """ranks: the processes sharing the calibration; windows: how many calibration windows all of them have;
    info: the weight stage's plan, for a pass that searches on its grids (AWQ, `takes_plan`)."""
    return [PASSES[type(s.args)](s.args, f"stages.{i}.{s.name}", prefix, blocks, ranks, windows,
                                 **({"info": info} if getattr(PASSES[type(s.args)], "takes_plan", False) else {}))
            for i, s in enumerate(stages)]


def check(stages: list[Stage]) -> None:
    """Before any work: every transform stage's method has a block pass registered with @transform_pass."""
    for i, s in enumerate(stages):
        if s.method.transform and type(s.args) not in PASSES:
            raise QuantkitError(f"stages.{i}.{s.name}: a transform method needs a block pass registered with "
                                f"quantize.transforms.transform_pass for {type(s.args).__name__}")
