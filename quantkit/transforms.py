"""Transform stages, run block by block before the weight stage: hooks gather statistics during one float
forward of the block, then scales are folded into its weights. The block's float function is unchanged;
only where the quantization error lands moves.

Each pass plans all blocks up front (so a recipe that cannot apply fails before any work), then offers
`observe(i, block)` (hook handles for that forward), `apply(i, block)` (fold what was observed, return
warnings) and `summary()` (one progress line), plus `notes` about the structure, reported once.
"""

from __future__ import annotations

import torch
from torch import nn

from .algorithms.smoothing import Mapping, fold
from .algorithms.smoothquant import channel_absmax, norm_mappings, smoothing_scale
from .errors import QuantkitError
from .model import matches
from .recipe import SmoothQuant, Stage


class SmoothQuantPass:
    name = "smoothquant"

    def __init__(self, args: SmoothQuant, path: str, prefix: str, blocks: nn.ModuleList):
        self.args, self.path = args, path
        self.mappings: list[list[Mapping]] = []
        self.block_names: list[str] = []
        notes: set[str] = set()
        found = 0
        for i, block in enumerate(blocks):
            where = f"{prefix}.{i}"
            mappings, block_notes = norm_mappings(block)
            found += len(mappings)
            notes.update(block_notes)
            self.mappings.append([m for m in mappings if not self._ignored(where, m)])
            self.block_names.append(where)
        if not found:
            cls = type(blocks[0]).__name__
            raise QuantkitError(f"{path}: no norm -> Linear pair to smooth in {cls} ({'; '.join(sorted(notes))})")
        if not any(self.mappings):
            raise QuantkitError(f"{path}.ignore: every norm -> Linear mapping is ignored; nothing to smooth")
        self.notes = sorted(notes)
        self.absmax: dict[tuple[int, int], torch.Tensor] = {}  # (block, mapping) -> max |x| per channel
        self.smoothed = 0

    def summary(self) -> str:
        return f"{self.name}: {self.smoothed} norm -> Linear mappings smoothed (alpha {self.args.alpha:g})"

    def _ignored(self, where: str, m: Mapping) -> bool:
        return any(matches(f"{where}.{n}", self.args.ignore) for n in [m.prev_name, *m.names])

    def observe(self, i: int, block: nn.Module) -> list:
        def hook(key: tuple[int, int]):
            def pre_hook(module: nn.Module, inputs: tuple) -> None:
                x = channel_absmax(inputs[0])
                self.absmax[key] = x if key not in self.absmax else torch.maximum(self.absmax[key], x)

            return pre_hook

        # the first Linear of a mapping reads exactly the norm's output
        return [m.linears[0].register_forward_pre_hook(hook((i, k))) for k, m in enumerate(self.mappings[i])]

    def apply(self, i: int, block: nn.Module) -> list[str]:
        """Folds the scales; returns a warning for each mapping the calibration data never reached."""
        warnings = []
        for k, m in enumerate(self.mappings[i]):
            where = f"{self.block_names[i]}.{m.prev_name}"
            x = self.absmax.pop((i, k), None)
            if x is None:
                warnings.append(f"{where} was not reached by calibration data; left unsmoothed")
                continue
            s = smoothing_scale(x, [lin.weight for lin in m.linears], self.args.alpha)
            try:
                fold(m, s)
            except ValueError:
                raise QuantkitError(f"{self.path}: non-finite smoothing scale for {where} (activation max "
                                    f"{float(x.max()):.3g}); use dtype: float32") from None
            self.smoothed += 1
        return warnings


PASSES = {"smoothquant": SmoothQuantPass}


def build(stages: list[Stage], prefix: str, blocks: nn.ModuleList) -> list[SmoothQuantPass]:
    return [PASSES[s.name](s.args, f"stages.{i}.{s.name}", prefix, blocks) for i, s in enumerate(stages)]
