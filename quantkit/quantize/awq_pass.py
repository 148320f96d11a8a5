"""AWQ's block pass: the scale search per mapping on the float block, folded, then the clip search on the folded
weights (statistics reduced across ranks as quantize/transforms.py says)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..algorithms import awq, fp4
from ..algorithms.gptq import Hessian
from ..algorithms.grid import GridSpec
from ..algorithms.smoothing import Mapping, fold
from ..errors import QuantkitError
from ..export.base import QuantInfo
from ..families import moe
from ..families.mappings import find_mappings
from ..methods.awq import AWQ, MODULE_LOSS_TOKENS  # AWQ memory bounds: see there
from ..model import block_linears, matches
from .distributed import Ranks
from .transforms import plan_mappings, transform_pass


def _rows(obj: Any, rows: torch.Tensor, batch: int) -> Any:
    """obj with every tensor of at least 2 dims whose first dim is the batch reduced to `rows`."""
    if isinstance(obj, torch.Tensor):
        return obj[rows.to(obj.device)] if obj.dim() >= 2 and obj.shape[0] == batch else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_rows(o, rows, batch) for o in obj)
    if isinstance(obj, dict):
        return {k: _rows(v, rows, batch) for k, v in obj.items()}
    return obj


def _windows(x: torch.Tensor, n: int) -> torch.Tensor:
    """A Linear's input as [n windows, tokens, channels] (an expert's reads the block's tokens flattened)."""
    return x.detach().reshape(n, -1, x.shape[-1])


def _replay(module: nn.Module, calls: list[tuple]) -> torch.Tensor:
    """The module's output (a tuple's first element) on the captured calls, one per batch, in window order."""
    outs = [module(*a, **kw) for a, kw in calls]
    outs = [o[0] if isinstance(o, tuple) else o for o in outs]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


@transform_pass
class AwqPass:
    """AWQ for one recipe stage (a transform before gptq, or the weight stage before its own RTN).

    One float forward of the block captures, per mapping (families/mappings.find_mappings), the mean |x| of the
    input channels, and either the input's Gram matrix (one Linear scored on its own output) or the
    inspected module's call (q/k/v scored on self_attn, gate/up on the MLP); and per quantized Linear a
    strided subsample of its input for clipping. apply() searches every mapping's scale on the float block
    (as AutoAWQ does), folds them all, then clips each Linear's folded weight against its input / s."""

    name = "awq"
    config = AWQ
    counters = ("ratios", "clipped")  # what summary() reports: its resume state
    takes_plan = True  # built with the weight stage's plan (transforms.build's info)

    def __init__(self, args: AWQ, path: str, prefix: str, blocks: nn.ModuleList, ranks: Ranks = Ranks(),
                 windows: int = 0, info: QuantInfo | None = None):
        """ranks: the processes sharing the calibration; windows: how many calibration windows all of them have;
        info: the weight stage's plan: the scales and clips are searched on each Linear's grid (a recipe's
        overrides), and a Linear left float is neither searched for nor clipped."""
        self.args, self.path, self.ranks = args, path, ranks
        self.mine = ranks.windows(windows)  # this process's windows, by their index among all
        self.current = self.mine  # those of the batch the block is running on (hidden.HiddenStates)
        self.called: set = set()  # what ran in this batch's forward
        self.total = windows
        self.spec = args.weight_grid
        self.grids: dict[str, GridSpec] = {}  # full name -> a Linear's grid where it is not self.spec
        floated = set() if info is None else set(info.floated)
        self.targets: list[dict[str, nn.Linear]] = []  # per block: short name -> Linear that gets quantized
        for i, block in enumerate(blocks):
            where = f"{prefix}.{i}"
            targets = {n: m for n, m in block_linears(block).items()
                       if not matches(f"{where}.{n}", args.ignore) and f"{where}.{n}" not in floated}
            for n, m in targets.items():
                if info is not None and f"{where}.{n}" in info.overrides:
                    self.grids[f"{where}.{n}"] = info.overrides[f"{where}.{n}"]  # the plan checked its groups
                elif self.spec.group_size != -1 and m.in_features % self.spec.group_size:
                    raise QuantkitError(f"{path}.group_size: {args.group_size} does not divide in_features "
                                        f"{m.in_features} of {where}.{n}")
            self.targets.append(targets)
        self.mappings, self.block_names, self.notes = plan_mappings(
            path, prefix, blocks, find_mappings, lambda i, where, m: any(n in self.targets[i] for n in m.names),
            "mapping to scale", "every Linear of every mapping is ignored; nothing to scale")
        self.stats: dict[tuple[int, int], dict] = {}  # (block, mapping) -> sums / gram / captured call
        # (block, linear) -> (indices among all calibration tokens, those tokens of its input)
        self.inputs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.ratios: list[float] = []
        self.clipped = 0

    def summary(self) -> str:
        mean = sum(self.ratios) / len(self.ratios) if self.ratios else float("nan")
        return (f"{self.name}: {len(self.ratios)} mappings scaled (mean alpha {mean:.2f}, grid {self.args.grid}, "
                f"duo_scaling {str(self.args.duo_scaling).lower()}), {self.clipped} Linear layers clipped")

    def batch(self, rows: slice) -> None:
        """The next forward runs on this process's windows `rows` (several batches: calibration.batch_size)."""
        self.current, self.called = self.mine[rows], set()

    def _grid(self, i: int, name: str) -> GridSpec:
        return self.grids.get(f"{self.block_names[i]}.{name}", self.spec)

    def _quantized(self, i: int, m: Mapping) -> tuple[list[nn.Linear], list[str]]:
        kept = [(lin, n) for lin, n in zip(m.linears, m.names) if n in self.targets[i]]
        return [lin for lin, _ in kept], [n for _, n in kept]

    def observe(self, i: int, block: nn.Module) -> list:
        handles = []

        def keep_input(name: str):
            def pre_hook(module: nn.Module, inputs: tuple) -> None:
                if moe.replaying(module):  # an expert's routed tokens, already seen with all the others
                    return
                if (i, name) in self.called:
                    raise QuantkitError(f"{self.path}: {self.block_names[i]}.{name} ran twice in one block forward; "
                                        "AWQ cannot clip it")
                self.called.add((i, name))
                t, x = self._clip_sample(_windows(inputs[0], len(self.current)))
                if (i, name) in self.inputs:  # an earlier batch's sample: the tokens stay in order
                    t0, x0 = self.inputs[(i, name)]
                    t, x = torch.cat([t0, t]), torch.cat([x0, x])
                self.inputs[(i, name)] = (t, x)

            return pre_hook

        def statistics(key: tuple[int, int], gram: bool):
            def pre_hook(module: nn.Module, inputs: tuple) -> None:
                if moe.replaying(module):
                    return
                x = _windows(inputs[0], len(self.current))
                st = self.stats.setdefault(key, {"sum": 0, "count": 0})
                st["sum"] = st["sum"] + awq.activation_sum(x)
                st["count"] += x.shape[0] * x.shape[1]
                if gram:
                    if "gram" not in st:
                        st["gram"] = Hessian(x.shape[-1], x.device)
                    st["gram"].add(x)

            return pre_hook

        def call(key: tuple[int, int]):
            def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                x = args[0] if args else kwargs.get("hidden_states")
                if ("call", key) in self.called:
                    raise QuantkitError(f"{self.path}: {module.__class__.__name__} ran twice in one block "
                                        "forward; AWQ cannot score it")
                self.called.add(("call", key))
                if x is not None and x.dim() >= 2 and self.total * x.shape[1] > MODULE_LOSS_TOKENS:
                    # evenly spaced windows among all of them; a process (a batch) scores those it holds
                    keep = max(1, MODULE_LOSS_TOKENS // x.shape[1])
                    chosen = torch.linspace(0, self.total - 1, keep).round().long().unique()
                    rows = torch.nonzero(torch.isin(self.current, chosen)).flatten()
                    batch = x.shape[0]
                    if not len(rows):
                        return
                    args, kwargs = _rows(args, rows, batch), _rows(kwargs, rows, batch)
                self.stats.setdefault(key, {"sum": 0, "count": 0}).setdefault("calls", []).append((args, kwargs))

            return pre_hook

        for name, lin in self.targets[i].items():
            handles.append(lin.register_forward_pre_hook(keep_input(name)))
        for k, m in enumerate(self.mappings[i]):
            single = len(m.linears) == 1 and m.inspect is m.linears[0]
            handles.append(m.observe.register_forward_pre_hook(statistics((i, k), single)))
            if not single:
                handles.append(m.inspect.register_forward_pre_hook(call((i, k)), with_kwargs=True))
        return handles

    def _clip_sample(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every k-th of all calibration tokens, about clip_tokens of them (the same ones under any split of the
        windows over processes and batches): their indices among all tokens and their rows of x [windows, tokens,
        channels]. k is coprime to the window length, so the sample walks through the positions."""
        per, wanted = x.shape[1], self.args.clip_tokens
        stride = max(1, self.total * per // wanted)
        # AutoAWQ's k (all tokens / 512) shares factors with the window length L in the usual shapes, and then
        # samples only positions that are multiples of gcd(k, L): in 128 x 512 windows 0, 128, 256, 384, a quarter
        # of them the first token, where the attention sink's massive activations sway every clip range; in
        # 512 x 128 the first token alone, which made AWQ+GPTQ worse in those windows on every domain (BENCHMARKS.md,
        # "AWQ's clip sample and the window length")
        while stride > 1 and math.gcd(stride, per) > 1:
            stride -= 1
        t = (self.current[:, None] * per + torch.arange(per)).flatten()
        keep = (t % stride == 0) & (t // stride < wanted)
        return t[keep], x.reshape(-1, x.shape[-1])[keep.to(x.device)].clone()

    def _gathered(self, i: int, name: str) -> torch.Tensor | None:
        """Linear `name`'s clip sample from every process, in the order of the tokens."""
        parts = [p for p in self.ranks.all_gather(self.inputs.pop((i, name), None)) if p is not None]
        if not parts:
            return None
        t = torch.cat([p[0] for p in parts])
        x = torch.cat([p[1].to(parts[0][1].device) for p in parts])
        return x[torch.argsort(t).to(x.device)]

    def _reduced(self, i: int, k: int, m: Mapping) -> dict | None:
        """Mapping k's statistics summed over the processes (None: no calibration token reached it)."""
        st = self.stats.pop((i, k), None) or {"sum": 0, "count": 0}
        count = int(self.ranks.all_reduce(torch.tensor([float(st["count"])], dtype=torch.float64)).item())
        if not count:
            return None
        channels = m.linears[0].weight.shape[-1]  # a router (its first Linear) is no nn.Linear
        total = st["sum"] if st["count"] else torch.zeros(channels, dtype=torch.float64)
        st["mean"] = (self.ranks.all_reduce(total) / count).float()
        if len(m.linears) == 1 and m.inspect is m.linears[0]:
            gram = st.get("gram") or Hessian(channels, total.device)
            self.ranks.all_reduce(gram.sum)
            st["gram"] = gram.take(1.0 / count)
        return st

    def apply(self, i: int, block: nn.Module) -> list[str]:
        """Searches every mapping's scale on the float block, folds them, clips; returns a warning for each
        mapping the calibration data never reached."""
        warnings, found = [], []
        for k, m in enumerate(self.mappings[i]):
            where = f"{self.block_names[i]}.{m.prev_name}"
            st = self._reduced(i, k, m)
            if st is None:
                warnings.append(f"{where} -> {','.join(m.names)} was not reached by calibration data; left unscaled")
                continue
            linears, names = self._quantized(i, m)
            weights = [lin.weight.detach() for lin in linears]
            grids = [self._grid(i, n) for n in names]
            if "gram" in st:
                loss = awq.linear_loss(st["gram"], weights)
            else:
                calls = st.get("calls", [])  # none: this process's share held none of the scored windows
                run = (lambda f=m.inspect, c=calls: _replay(f, c)) if calls else None
                loss = awq.module_loss(run, linears, self.ranks.all_reduce)
            try:
                res = awq.search_scale(st["mean"], weights, grids if self.grids else self.spec, loss, self.args.grid,
                                       self.args.duo_scaling)
            except awq.NoFiniteLoss:
                raise QuantkitError(f"{self.path}: no finite AWQ loss for {where} (activation overflow?); "
                                    "use dtype: float32") from None
            found.append((m, res.scale))
            self.ratios.append(res.ratio)
        for m, s in found:  # all searched on the float block first, as AutoAWQ does
            try:
                fold(m, s)
            except ValueError:
                raise QuantkitError(f"{self.path}: non-finite AWQ scale for {self.block_names[i]}.{m.prev_name}; "
                                    "use dtype: float32") from None
            for name in m.names:  # what the Linear reads from now on: x / s
                if (i, name) in self.inputs:
                    t, x = self.inputs[(i, name)]
                    self.inputs[(i, name)] = (t, x / s.to(x.device, x.dtype))
        inputs = {name: self._gathered(i, name) for name in self.targets[i]}
        if self.args.clip:
            todo = {n: lin for n, lin in self.targets[i].items() if inputs[n] is not None and awq.clip_applies(n)}
            owner = self.ranks.owners({n: lin.out_features * lin.in_features for n, lin in todo.items()})
            with torch.no_grad():
                for name, lin in todo.items():  # each on its owner; the clipped weight to every process
                    grid = self._grid(i, name)
                    # NVFP4: the global scale the weight stage rounds with (a fused layer's, from its members now)
                    gs = fp4.global_scale_for(lin, grid) if isinstance(grid, fp4.Fp4Spec) else None
                    mine = None if owner[name] != self.ranks.rank else \
                        awq.search_clip(lin.weight.detach(), inputs[name], grid, n_tokens=self.args.clip_tokens,
                                        global_scale=gs)
                    lin.weight.copy_(self.ranks.broadcast(mine, owner[name]))
                    self.clipped += 1
        return warnings
