"""The memory a quantize run will need, worked out from config.json and the recipe before any work, and checked
against what is free: a run that cannot fit stops at once with one line naming the option to change, instead of
being OOM-killed an hour in.

The parts (bytes on top of the process as it starts):
  weights      in memory: the whole model in the compute dtype, plus the codes of every quantized weight;
               streamed: the largest block plus the largest module outside the blocks, plus one block's codes
  artifact     the shard being filled, per format: min(export.max_shard_size, the artifact's estimated size)
  activations  the hidden states entering and leaving a block (num_samples x seq_len x hidden), and the block's
               largest intermediate tensors during its forward (the MLP's and the attention's)
  solver       quantizing and packing the widest weight (float32 copies, codes, packed words); GPTQ adds the
               Hessian of the widest input with its damped copy and factors
  runtime      a fixed allowance for what the allocator keeps after a free, Python objects and lazily loaded code
On CUDA the block, activations and solver sit on the device and the rest on the host.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..errors import QuantkitError
from ..recipe import parse_size

GiB = 1 << 30
RUNTIME = 64 << 20  # measured: 20-40 MiB of allocator slack over a 16-block streamed GPTQ run


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


def host_available() -> int:
    """MemAvailable, capped by the cgroup's limit where one is set (containers, CI)."""
    free = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    free = free if free is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        used = int(open("/sys/fs/cgroup/memory.current").read())
        if limit != "max":
            free = min(free, int(limit) - used)
    except (OSError, ValueError):
        pass
    return free


@dataclass
class MemoryPlan:
    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    advice: dict[str, str] = field(default_factory=dict)  # part -> the option that shrinks it

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    def describe(self) -> str:
        parts = lambda d: ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.items() if v)  # noqa: E731
        line = f"memory plan: host {fmt_bytes(self.host_total)} ({parts(self.host)})"
        if self.device:
            line += f"; device {fmt_bytes(self.device_total)} ({parts(self.device)})"
        return line

    def check(self, host_free: int, device_free: int | None) -> None:
        for where, need, free, parts in (("host", self.host_total, host_free, self.host),
                                         ("device", self.device_total, device_free, self.device)):
            if free is not None and need > free:
                biggest = max((k for k in parts if k != "runtime"), key=parts.get)  # the fixed part is no lever
                raise QuantkitError(
                    f"memory plan: the run needs {fmt_bytes(need)} of {where} memory and {fmt_bytes(free)} is free; "
                    f"the largest part is {biggest} ({fmt_bytes(parts[biggest])}): {self.advice[biggest]}")

    def as_dict(self) -> dict:
        return asdict(self) | {"host_total": self.host_total, "device_total": self.device_total}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def plan(model: nn.Module, blocks: nn.ModuleList, targets: dict[str, nn.Linear], recipe, streamed: bool,
         device: torch.device) -> MemoryPlan:
    """model: the skeleton (meta device is fine: only shapes and dtypes are read); targets: the Linears to quantize."""
    cfg = model.config
    weight_stage = recipe.stage.args
    bits = getattr(weight_stage, "bits", 8)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block_bytes = max(_nbytes(b.parameters()) for b in blocks)
    outer = [m for m in model.modules() if any(id(p) not in in_blocks for p in m.parameters(recurse=False))]
    outer_bytes = max((_nbytes(m.parameters(recurse=False)) for m in outer), default=0)
    total_bytes = _nbytes({id(p): p for p in model.parameters()}.values())
    by_block: dict[str, int] = {}
    for name, m in targets.items():
        by_block[_block_of(name)] = by_block.get(_block_of(name), 0) + m.weight.numel()
    quantized = sum(by_block.values())
    # uint8 codes, plus scales and zeros (at least one per 32 weights, 2-4 bytes each)
    codes, block_codes = quantized * 9 // 8, max(by_block.values(), default=0) * 9 // 8
    est_artifact = quantized * bits // 8 + quantized // 16 + (total_bytes - quantized * _elt(model))
    shard = min(parse_size(recipe.export.max_shard_size), est_artifact) * len(recipe.export.formats)

    p = MemoryPlan()
    on_device = device.type == "cuda"
    weights = block_bytes + outer_bytes + block_codes if streamed else total_bytes + codes
    p.host["weights"] = weights
    p.advice["weights"] = ("one block is this large: use a machine with more memory" if streamed else
                           "set load: stream (safetensors checkpoints) to hold one block at a time")
    p.host["artifact"] = shard
    p.advice["artifact"] = "lower export.max_shard_size"
    p.host["runtime"] = RUNTIME
    acts = solver = 0
    if recipe.needs_calibration:  # RTN alone reads no data
        c = recipe.calibration
        tokens = c.num_samples * c.seq_len
        elt = _elt(model)
        hidden = cfg.hidden_size
        inter = max((m.out_features for m in targets.values()), default=hidden)
        heads = getattr(cfg, "num_attention_heads", 1)
        attn = c.num_samples * heads * c.seq_len * c.seq_len * elt if \
            getattr(cfg, "_attn_implementation", "eager") == "eager" else 0
        # in + out of the block, the MLP's two widest activations and one hidden-sized temporary, the attention
        acts = tokens * elt * (2 * hidden + 3 * inter + hidden) + attn
        if any(s.name in ("awq", "smoothquant") for s in recipe.stages):
            acts += 2 * tokens * hidden * elt  # the block's cached inputs that AWQ's search replays
        widest_in = max((m.in_features for m in targets.values()), default=hidden)
        if any(s.name == "awq" for s in recipe.stages):  # freed before the weight stage's Hessians exist
            solver = widest_in * widest_in * (8 + 4)  # the Gram matrix of up -> down: fp64 sum + a window's fp32
        if recipe.stage.name == "gptq":
            # the fp64 Hessian sum and one window's fp32 term while it accumulates; then its fp32 value and two of
            # its factors at a time (algorithms/gptq.py frees each as the next is made), plus act-order's permuted copy
            solver = max(solver, 4 * widest_in * widest_in * 4)
    # quantizing and packing the widest weight: a float32 copy, its error / dequantized copy, uint8 codes and
    # the int32 words they are packed from
    solver += max((m.weight.numel() for m in targets.values()), default=0) * (4 + 4 + 1 + 4)
    p.advice["activations"] = "lower calibration.num_samples or calibration.seq_len"
    p.advice["solver"] = "the widest Linear's Hessian: use a device with more memory"
    where = p.device if on_device else p.host
    where["activations"] = acts
    where["solver"] = solver
    if on_device:
        p.device["block"] = block_bytes
        p.advice["block"] = "one block is this large: use a device with more memory"
    return p


def _block_of(name: str) -> str:
    """'model.layers.3.mlp.up_proj' -> 'model.layers.3' (the block a target Linear sits in)."""
    parts = name.split(".")
    idx = next(i for i, s in enumerate(parts) if s.isdigit())
    return ".".join(parts[: idx + 1])


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _elt(model: nn.Module) -> int:
    return torch.finfo(_dtype(model)).bits // 8
