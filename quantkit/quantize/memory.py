"""The memory a quantize run will need, worked out from config.json and the recipe before any work, and checked
against what is free: a run that cannot fit stops at once with one line naming the option to change, instead of
being OOM-killed an hour in.

The parts (bytes on top of the process as it starts):
  weights        in memory: the whole model in the compute dtype, the pages of its weight files (transformers
                 maps safetensors and GGUF files and keeps them mapped; the pages a run touches stay resident),
                 plus the codes of every quantized weight;
                 streamed: the largest block plus the largest module outside the blocks, plus one block's codes
  load           in memory, from GGUF: what loading holds beyond the run's other parts (each tensor's float32
                 dequantization temporaries), when that is more
  hidden_states  the hidden states entering and leaving a block (num_samples x seq_len x hidden): on the device,
                 in host memory or on disk (calibration.offload; disk: host memory holds the batch in transit)
  activations    the block's largest intermediate tensors during the forward of one batch of windows (the MLP's
                 and the attention's; calibration.batch_size). It runs in micro-batches (microbatches.py): one
                 micro-batch's temporaries, plus, in GPTQ's one forward, what every window holds at once (on a CPU,
                 a wide Linear's input is parked on disk instead: parking.py); where SmoothQuant folds inside that
                 forward, or experts route by the data, every window's temporaries at once
  solver         quantizing and packing the widest weight (float32 copies, codes, packed words); GPTQ adds the
                 Hessian of the widest input and its factors
  runtime        a fixed allowance for what the allocator keeps after a free, Python objects and lazily loaded code
  checkpoint     (disk) the hidden states each finished block saves to resume from
  parked         (disk) what GPTQ parks at a wide Linear's barrier on a CPU: every window's inputs, the block
  artifact       (disk) every format's artifact, and the spool of the shard being written (export/artifact.py)
On CUDA the block, activations and solver sit on the device and the rest on the host.
`choose` tries the offloads in order (device, cpu, disk) and, for each, batches from every window down to one, and
takes the first plan that fits.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..algorithms.gptq import Hessian
from ..errors import QuantkitError
from ..families import moe
from ..model import resolve_model_path
from ..recipe import parse_size
from . import microbatches, parking
from .hidden import OFFLOADS, Offload

GiB = 1 << 30
RUNTIME = 64 << 20  # measured: 20-40 MiB of allocator slack over a 16-block streamed GPTQ run


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / (1 << 20):.1f} MiB"


@dataclass
class MemoryPlan:
    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)  # under export.output
    advice: dict[str, str] = field(default_factory=dict)  # part -> the option that shrinks it
    offload: str = "device"
    batch_size: int | None = None

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def disk_total(self) -> int:
        return sum(self.disk.values())

    def describe(self) -> str:
        parts = lambda d: ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.items() if v)  # noqa: E731
        line = f"memory plan: host {fmt_bytes(self.host_total)} ({parts(self.host)})"
        if self.device:
            line += f"; device {fmt_bytes(self.device_total)} ({parts(self.device)})"
        if self.disk_total:
            line += f"; disk {fmt_bytes(self.disk_total)} ({parts(self.disk)})"
        return line + f"; hidden states on {self.offload}" + (f", {self.batch_size} windows per forward"
                                                              if self.batch_size else "")

    def fits(self, host_free: int, device_free: int | None, disk_free: int | None) -> bool:
        try:
            self.check(host_free, device_free, disk_free)
        except QuantkitError:
            return False
        return True

    def check(self, host_free: int, device_free: int | None, disk_free: int | None = None) -> None:
        for where, need, free, parts in (("host", self.host_total, host_free, self.host),
                                         ("device", self.device_total, device_free, self.device),
                                         ("disk", self.disk_total, disk_free, self.disk)):
            if free is not None and need > free:
                biggest = max((k for k in parts if k != "runtime"), key=parts.get)  # the fixed part is no lever
                what = "disk space under export.output" if where == "disk" else f"{where} memory"
                raise QuantkitError(
                    f"memory plan: the run needs {fmt_bytes(need)} of {what} and {fmt_bytes(free)} is free; "
                    f"the largest part is {biggest} ({fmt_bytes(parts[biggest])}): {self.advice[biggest]}")

    def as_dict(self) -> dict:
        return asdict(self) | {"host_total": self.host_total, "device_total": self.device_total,
                               "disk_total": self.disk_total}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def disk_available(path: str | Path) -> int:
    """Free bytes on the file system that holds `path` (or would: its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def choose(plan_for, recipe, host_free: int, device_free: int | None, disk_free: int | None
           ) -> tuple[Offload, MemoryPlan]:
    """The first (offload, batch) whose plan fits: calibration.offload (auto: device, then cpu, then disk) and
    calibration.batch_size (None: every window, then halves down to one). plan_for(offload) -> MemoryPlan. When none
    fits, the last one tried says why."""
    c = recipe.calibration
    if not recipe.needs_calibration:  # no activations to place
        p = plan_for(Offload())
        p.check(host_free, device_free, disk_free)
        return Offload(), p
    wheres = OFFLOADS if c.offload == "auto" else (c.offload,)
    sizes = [c.batch_size] if c.batch_size else sorted({max(1, c.num_samples >> k) for k in range(64)}, reverse=True)
    for where in wheres:
        for b in sizes:
            offload = Offload(where, None if b >= c.num_samples else b)
            p = plan_for(offload)
            if p.fits(host_free, device_free, disk_free):
                return offload, p
    p.check(host_free, device_free, disk_free)
    raise AssertionError("unreachable: a plan that does not fit fails its check")


def plan(model: nn.Module, blocks: nn.ModuleList, targets: dict[str, nn.Linear], recipe, streamed: bool,
         device: torch.device, offload: Offload = Offload(), files: tuple[int | None, bool] | None = None
         ) -> MemoryPlan:
    """model: the skeleton (meta device is fine: only shapes and dtypes are read); targets: the Linears to quantize;
    offload: where the hidden states between blocks live and how many windows a forward takes; files: the model's
    weight_files (None: looked up from recipe.model)."""
    cfg = model.config
    method, weight_stage = recipe.stage.method, recipe.stage.weights
    bits = max([weight_stage.bits] + [o.bits for o in recipe.overrides if o.bits])  # overrides: the widest grid
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    block_bytes = max(_nbytes(b.parameters()) for b in blocks)
    outer = [m for m in model.modules() if any(id(p) not in in_blocks for p in m.parameters(recurse=False))]
    outer_bytes = max((_nbytes(m.parameters(recurse=False)) for m in outer), default=0)
    total_bytes = _nbytes({id(p): p for p in model.parameters()}.values())
    by_block: dict[str, int] = {}  # quantized weights per block
    inputs_by_block: dict[str, int] = {}  # their input channels (AWQ keeps a clip sample of each input)
    for name, m in targets.items():
        by_block[_block_of(name)] = by_block.get(_block_of(name), 0) + m.weight.numel()
        inputs_by_block[_block_of(name)] = inputs_by_block.get(_block_of(name), 0) + m.in_features
    quantized = sum(by_block.values())
    # uint8 codes, plus scales and zeros (at least one per 32 weights, 2-4 bytes each)
    codes, block_codes = quantized * 9 // 8, max(by_block.values(), default=0) * 9 // 8
    est_artifact = quantized * bits // 8 + quantized // 16 + (total_bytes - quantized * _elt(model))
    shard = min(parse_size(recipe.export.max_shard_size), est_artifact)

    p = MemoryPlan(offload=offload.where, batch_size=offload.batch_size)
    on_device = device.type == "cuda"
    files, gguf = (0, False) if streamed else files or weight_files(*resolve_model_path(recipe.model))
    weights = block_bytes + outer_bytes + block_codes if streamed else total_bytes + (files or total_bytes) + codes
    if streamed and recipe.needs_calibration:  # the last block, held by its checkpoint's write while the next loads
        weights += block_bytes + block_codes
    p.host["weights"] = weights
    p.advice["weights"] = ("one block is this large: use a machine with more memory" if streamed else
                           "set load: stream (safetensors checkpoints) to hold one block at a time")
    # every format's artifact, and the spool of the shard each one is filling (written out from it when full)
    p.disk["artifact"] = (est_artifact + shard) * len(recipe.export.formats)
    p.advice["artifact"] = "free disk space under export.output, or write fewer export.formats"
    p.host["runtime"] = RUNTIME
    acts = hidden = solver = 0
    if recipe.needs_calibration:  # RTN alone reads no data
        c = recipe.calibration
        batch = offload.batch_size or c.num_samples
        elt = _elt(model)
        per_window = c.seq_len * cfg.hidden_size * elt  # one window's hidden states
        inter = max((m.out_features for m in targets.values()), default=cfg.hidden_size)
        widest_in = max((m.in_features for m in targets.values()), default=cfg.hidden_size)
        heads = getattr(cfg, "num_attention_heads", 1)
        attn = batch * heads * c.seq_len * c.seq_len * elt if \
            getattr(cfg, "_attn_implementation", "eager") == "eager" else 0
        # during a micro-batch's forward: the MLP's three widest activations and one hidden-sized temporary, the
        # attention. GPTQ's one forward over every window keeps its micro-batches in step, or, where a scale is folded
        # inside it (SmoothQuant right before gptq) or experts route by the data, runs every window at once. Either
        # way every window holds the residual and the MLP's input at once, with their copies: W8A8's quantized one,
        # and the smoothed one; in step, each also holds the widest Linear's input (and its W8A8 copy) at a barrier,
        # unless that is parked on disk
        micro = microbatches.size(batch, c.seq_len)
        w8a8 = int(weight_stage.activations is not None)
        smoothed = int(bool(recipe.transforms) and recipe.transforms[-1].method.folds_inline and method.solves)
        one_forward = method.solves and offload.batch_size is None
        if one_forward and (smoothed or moe.experts_of(model)):
            micro = batch
        attn = attn * micro // batch
        acts = micro * c.seq_len * elt * (3 * inter + cfg.hidden_size) + attn
        if one_forward:
            parked = parking.worth_it(widest_in, device)
            barrier = 0 if micro == batch or parked else (1 + w8a8) * inter
            acts += batch * c.seq_len * elt * (barrier + (2 + w8a8 + smoothed) * cfg.hidden_size)
            if parked:  # every window's input to it (W8A8: and its quantized copy) and to the MLP, and the block
                p.disk["parked"] = batch * c.seq_len * elt * ((1 + w8a8) * widest_in + cfg.hidden_size) + block_bytes
                p.advice["parked"] = "free disk space under export.output, or lower calibration.num_samples"
        hidden = 2 * c.num_samples * per_window  # every window entering and leaving the block
        if offload.where != "device":
            acts += 2 * batch * per_window  # the batch being read and the one being written, on the device
        if offload.where == "disk":  # on disk; host memory holds the batch in transit between files and device
            p.disk["hidden_states"], hidden = hidden, 2 * batch * per_window
        p.disk["checkpoint"] = c.num_samples * per_window
        p.advice["checkpoint"] = "lower calibration.num_samples or calibration.seq_len"
        for s in recipe.stages:  # what each stage keeps beyond the forward's temporaries
            acts += s.method.activation_bytes(s.args, c.num_samples, c.seq_len, batch, per_window,
                                              max(inputs_by_block.values(), default=0), elt)
        # a stage's matrix of the widest input (AWQ's Gram matrix of up -> down, freed before the weight stage's
        # Hessians exist; GPTQ's Hessian): the fp64 upper triangle, then the fp32 matrix made and factored in its
        # storage (gptq.py)
        if any(s.method.gram for s in recipe.stages):
            solver = Hessian.nbytes(widest_in)
        grids = 1 + sum(not o.unquantized for o in recipe.overrides)
        if method.solves and grids > 1:  # readers of one input on several grids: a factorization per grid, each
            solver += grids * widest_in ** 2 * 4  # from a float32 copy of the Hessian (gptq.py _solvers)
    widest = max((m.weight.numel() for m in targets.values()), default=0)
    solver += method.solver_bytes(widest, _elt(model))
    p.advice["activations"] = ("set calibration.batch_size lower, or calibration.offload: auto to pick one"
                               if offload.batch_size else "set calibration.batch_size (windows per forward) or "
                               "calibration.offload: auto")
    p.advice["hidden_states"] = ("lower calibration.num_samples or calibration.seq_len" if offload.where == "disk" else
                                 "set calibration.offload: disk, or lower calibration.num_samples or seq_len")
    p.advice["solver"] = ("the widest Linear's Hessian: use a device with more memory" if method.solves
                          else "the widest Linear: use a machine with more memory")
    where = p.device if on_device else p.host
    where["activations"] = acts
    where["solver"] = solver
    if hidden:
        (where if offload.where == "device" else p.host)["hidden_states"] = hidden
        if on_device and offload.where == "device":  # block 0's inputs are captured on the host, and each block's
            p.host["hidden_states"] = hidden // 2  # checkpoint copies its inputs there
    if on_device:
        p.device["block"] = block_bytes
        p.advice["block"] = "one block is this large: use a device with more memory"
    if gguf:  # a tensor's float32 values, their copy and the cast (measured: 0.33 GiB over SmolLM2's 0.50 GiB)
        largest = max(t.numel() for t in model.parameters())
        p.host["load"] = max(0, total_bytes + files + 3 * 4 * largest + RUNTIME - p.host_total)
        p.advice["load"] = p.advice["weights"]
    return p


def weight_files(folder: str, gguf: str | None) -> tuple[int | None, bool]:
    """(bytes of the weight files a whole-model load maps, or None for a hub id; whether it is a GGUF file), for a
    resolved model reference (model.resolve_model_path)."""
    if gguf:
        return (Path(folder) / gguf).stat().st_size, True
    if not Path(folder).is_dir():
        return None, False
    return sum(f.stat().st_size for f in Path(folder).iterdir() if f.suffix in (".safetensors", ".bin")), False


def _block_of(name: str) -> str:
    """'model.layers.3.mlp.up_proj' -> 'model.layers.3' (the block a target Linear sits in)."""
    parts = name.split(".")
    idx = next(i for i, s in enumerate(parts) if s.isdigit())
    return ".".join(parts[: idx + 1])


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _elt(model: nn.Module) -> int:
    return torch.finfo(_dtype(model)).bits // 8
