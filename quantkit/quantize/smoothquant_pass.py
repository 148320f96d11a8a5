"""SmoothQuant's block pass: per-channel max |x| of each mapping's input over the block's forward, then the
smoothing scale folded from the norm into the Linears (or inline, inside a solving stage's forward)."""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from ..algorithms.smoothing import Mapping, fold
from ..algorithms.smoothquant import channel_absmax, smoothing_scale
from ..errors import QuantkitError
from ..families import moe
from ..families.mappings import norm_mappings
from ..methods.smoothquant import SmoothQuant
from ..model import matches
from .distributed import Ranks
from .transforms import plan_mappings, transform_pass


@transform_pass
class SmoothQuantPass:
    name = "smoothquant"
    config = SmoothQuant
    counters = ("smoothed",)  # what summary() reports: its resume state, carried across a resume

    def __init__(self, args: SmoothQuant, path: str, prefix: str, blocks: nn.ModuleList, ranks: Ranks = Ranks(),
                 windows: int = 0):
        self.args, self.path, self.ranks = args, path, ranks
        self.mappings, self.block_names, self.notes = plan_mappings(
            path, prefix, blocks, norm_mappings, lambda i, where, m: not self._ignored(where, m),
            "norm -> Linear pair to smooth", "every norm -> Linear mapping is ignored; nothing to smooth")
        self.absmax: dict[tuple[int, int], torch.Tensor] = {}  # (block, mapping) -> max |x| per channel
        self.smoothed = 0

    def summary(self) -> str:
        return f"{self.name}: {self.smoothed} norm -> Linear mappings smoothed (alpha {self.args.alpha:g})"

    def _ignored(self, where: str, m: Mapping) -> bool:
        return any(matches(f"{where}.{n}", self.args.ignore) for n in [m.prev_name, *m.names])

    def observe(self, i: int, block: nn.Module) -> list:
        def hook(key: tuple[int, int]):
            def pre_hook(module: nn.Module, inputs: tuple) -> None:
                if moe.replaying(module):
                    return
                x = channel_absmax(inputs[0])
                self.absmax[key] = x if key not in self.absmax else torch.maximum(self.absmax[key], x)

            return pre_hook

        # the first Linear of a mapping (an MoE MLP's router) reads exactly the norm's output, on every token
        return [m.observe.register_forward_pre_hook(hook((i, k))) for k, m in enumerate(self.mappings[i])]

    def apply(self, i: int, block: nn.Module) -> list[str]:
        """Folds the scales; returns a warning for each mapping the calibration data never reached."""
        warnings = []
        for k, m in enumerate(self.mappings[i]):
            x = self.absmax.pop((i, k), None)
            reached = self.ranks.all_reduce(torch.tensor([float(x is not None)]), "max")
            if not reached.item():
                warnings.append(self._unreached(i, m))
                continue
            if x is None:  # reached on another rank only
                x = torch.zeros(m.linears[0].weight.shape[-1])  # a router is no nn.Linear
            self._fold(i, m, self.ranks.all_reduce(x, "max"))
        return warnings

    def _unreached(self, i: int, m: Mapping) -> str:
        return f"{self.block_names[i]}.{m.prev_name} was not reached by calibration data; left unsmoothed"

    def _fold(self, i: int, m: Mapping, x_absmax: torch.Tensor) -> torch.Tensor:
        s = smoothing_scale(x_absmax, [lin.weight for lin in m.linears], self.args.alpha)
        try:
            fold(m, s)
        except ValueError:
            raise QuantkitError(f"{self.path}: non-finite smoothing scale for {self.block_names[i]}.{m.prev_name} "
                                f"(activation max {float(x_absmax.max()):.3g}); use dtype: float32") from None
        self.smoothed += 1
        return s

    def inline(self, i: int, block: nn.Module) -> tuple[list, Callable[[], list[str]]]:
        """Smoothing inside the weight stage's own forward of block i, which saves the float forward that
        observe() needs: when a mapping's Linears first read the norm's output x, the scale comes from x, is
        folded, and they read x / s instead (what the folded norm would have produced). The q/k/v input is the
        block input's norm, as in observe(); gate/up's comes after the already quantized attention, i.e. from
        what the quantized model feeds them. Returns hook handles and a function giving the warnings for
        mappings never reached."""
        seen: dict[int, dict] = {}

        def hook(k: int, m: Mapping):
            def pre_hook(module: nn.Module, inputs: tuple) -> tuple:
                x, st = inputs[0], seen.setdefault(k, {})
                for other in seen.values():  # x / s lives as long as x: not the attention's through the MLP
                    if "x" in other and other["x"]() is None:
                        del other["x"], other["xs"]
                if "x" not in st or st["x"]() is not x:  # q/k/v (gate/up) read one tensor: one scale, folded once
                    if "s" not in st:
                        st["s"] = self._fold(i, m, self.ranks.all_reduce(channel_absmax(x), "max"))
                    st.update(x=weakref.ref(x), xs=x / st["s"].to(x.device, x.dtype))
                return (st["xs"], *inputs[1:])

            return pre_hook

        handles = [lin.register_forward_pre_hook(hook(k, m))
                   for k, m in enumerate(self.mappings[i]) for lin in m.linears]

        def warnings() -> list[str]:
            missed = [self._unreached(i, m) for k, m in enumerate(self.mappings[i]) if k not in seen]
            seen.clear()
            return missed

        return handles, warnings
