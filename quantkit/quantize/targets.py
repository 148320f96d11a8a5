"""What a run quantizes: the Linear layers of the decoder blocks the weight stage targets, checked against the
grid and the formats before any work, and the result the layer-wise run fills in."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..algorithms.fp4 import fuse
from ..algorithms.scheme import QuantizedTensor
from ..errors import QuantkitError
from ..export import formats as format_registry
from ..export.base import QuantInfo, scheme_of
from ..families import pooled
from ..model import block_linears, check_supported, decoder_blocks, matches
from ..overrides import Override, fused_groups, resolve
from ..recipe import Stage

__all__ = ["QuantResult", "fused_groups", "plan"]


@dataclass
class QuantResult:
    qweights: dict[str, QuantizedTensor]
    info: QuantInfo
    losses: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # calibration tokens each GPTQ Hessian summed
    timings: dict[str, float] = field(default_factory=dict)
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # the observers' (KV cache scales), by name
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # a block's static input scales, by Linear


def plan(
    model: nn.Module, stage: Stage, formats: list[str], transforms: Sequence[Stage] = (),
    overrides: Sequence[Override] = (),
) -> tuple[str, dict[str, nn.Linear], QuantInfo]:
    """Which Linear layers get quantized, on which grid, checked against the grids and the formats before any work.
    transforms: the stages before the weight stage (its position in error messages, the method's name); overrides:
    the recipe's per-layer grids (checked against the stage by the recipe)."""
    args, path = stage.weights, f"stages.{len(transforms)}.{stage.name}"
    spec = args.grid
    act = args.activations
    scheme = scheme_of(spec, None if act is None else act.kind, args.block, "token" if act is None else act.strategy,
                       None if act is None else act.group_size)
    routers = pooled("routers")  # asked now: a family registered after import may add router names
    prefix, blocks = decoder_blocks(model)
    check_supported(model, blocks)
    in_blocks = {  # MoE routers stay float
        f"{prefix}.{i}.{name}": m for i, block in enumerate(blocks) for name, m in block_linears(block).items()
        if name.rpartition(".")[2] not in routers
    }
    targets = {n: m for n, m in in_blocks.items() if not matches(n, args.ignore)}
    if not targets:
        raise QuantkitError(f"{path}.ignore: every Linear layer is ignored; nothing to quantize")
    specs, left_float, origin = resolve(list(overrides), args, list(targets), prefix, len(blocks))
    targets = {n: m for n, m in targets.items() if n not in left_float}
    if not targets:
        raise QuantkitError("overrides: every Linear layer is left unquantized; nothing to quantize")
    for name, m in targets.items():
        own = specs.get(name)
        group_size, where = (args.group_size, path) if own is None else (own.group_size, f"overrides.{origin[name]}")
        if args.type in ("fp4", "mxfp8") and m.in_features % args.group_size:
            preset = spec.preset if args.type == "fp4" else args.scheme or "MXFP8"
            raise QuantkitError(f"{path}.scheme: {preset} needs in_features a multiple of {args.group_size} "
                                f"(its group size); {name} has {m.in_features}")
        if group_size != -1 and m.in_features % group_size:
            divisors = [g for g in (32, 64, 128, 256) if m.in_features % g == 0]
            raise QuantkitError(
                f"{where}.group_size: {group_size} does not divide in_features "
                f"{m.in_features} of {name}; use {' or '.join(map(str, divisors + [-1]))}"
            )
        if args.block is not None and (m.out_features % args.block[0] or m.in_features % args.block[1]):
            raise QuantkitError(f"{path}.block: {list(args.block)} does not tile {name} [{m.out_features}, "
                                f"{m.in_features}]; expected a block whose rows divide {m.out_features} and columns "
                                f"divide {m.in_features} (or ignore it)")
        if act is not None and act.group_size and m.in_features % act.group_size:
            raise QuantkitError(f"{path}.activations.group_size: {act.group_size} does not divide in_features "
                                f"{m.in_features} of {name}")
        for fmt in formats:
            own_scheme = scheme if own is None else scheme_of(own, None)
            problem = format_registry.get(fmt).check_linear(own_scheme, name, m.out_features, m.in_features)
            if problem:
                raise QuantkitError(problem)
    if getattr(spec, "global_scale", False):
        fuse(targets)  # NVFP4: q/k/v and gate/up share a global scale, as vLLM's fused layers need
    # float Linears, and MoE routers (some are not nn.Linear) so that no loader quantizes them
    unquantized = sorted(n for n, m in model.named_modules() if n not in targets and (
        isinstance(m, nn.Linear) or (n.rpartition(".")[2] in routers and getattr(m, "weight", None) is not None
                                     and m.weight.dim() == 2)))
    info = QuantInfo(
        method="+".join(s.name for s in [*transforms, stage]),
        spec=spec,
        act_order=getattr(args, "act_order", False),
        damp=getattr(args, "damp", None),
        unquantized_linears=unquantized,
        block_linears_prefix=prefix,
        activations=None if act is None else act.kind,
        block=args.block,
        per_tensor=args.per_tensor,
        act_strategy="token" if act is None else act.strategy,
        act_group=None if act is None else act.group_size,
        act_observer="minmax" if act is None else act.observer,
        overrides=specs,
        linears=list(targets),
        floated=sorted(left_float),
    )
    return prefix, targets, info
