"""Layer-wise sequential quantization.

The calibration batch is embedded once and the inputs of the first decoder block captured. Then, block
by block, only that block sits on the compute device and one forward pass over the whole batch does
everything: a pre-hook on each Linear builds the Hessian of the input it is about to read (q/k/v and
gate/up read the same tensor, so they share one Hessian and one factorization), quantizes the weight
with GPTQ and swaps the quantized weight in before the Linear runs. Every later Linear in the block
therefore sees the outputs of already-quantized ones (true-sequential), and the block's output is the
quantized block's output, which feeds the next block. One forward per block, not two.

Transform stages (SmoothQuant, AWQ) add one float forward of the block before that, whose hooks gather the
statistics they fold into the block's weights. RTN needs no data: alone it quantizes every Linear in one
sweep; after a transform it quantizes each block's Linears and runs the block to feed the next one. AWQ as
the weight stage is its transform pass followed by that RTN step on the AWQ grid.
Mixture-of-experts blocks arrive with per-expert Linears (families/moe.py): each expert's gate/up/down is hooked like any
other Linear, and with calibrate_all_experts every expert first sees every token, so one Hessian serves every
expert's gate/up.
W8A8 recipes also quantize each Linear's input per token during those forwards (the grid Int8Linear / Fp8Linear
run), so later blocks calibrate on what will run. The model keeps float Linears holding the
dequantized weights; `kernels.w8a8.swap_w8a8_linears(model, result.qweights)` makes it the W8A8 model.
"""

from __future__ import annotations

import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..algorithms.fp8 import fp8_quantize
from ..algorithms.gptq import GPTQ, Hessian, NotPositiveDefinite
from ..algorithms.grid import GridSpec, row_steps
from ..algorithms.rtn import rtn_quantize
from ..algorithms.scheme import QuantizedTensor
from ..errors import QuantkitError
from ..export import formats as format_registry
from ..export.base import QuantInfo, scheme_of
from ..families import ROUTERS, moe
from ..kernels.w8a8 import fake_quantize_tokens
from ..model import block_linears, check_supported, decoder_blocks, matches
from ..progress import Reporter, fmt_eta
from ..recipe import MoE, Stage, WeightQuant
from . import microbatches, parking
from . import transforms as transform_passes
from .calibration import CalibrationSet
from .activations import Activations, Offload
from .checkpoint import BlockCheckpoints
from .distributed import Ranks
from .source import InMemory, Streamed


@dataclass
class QuantResult:
    qweights: dict[str, QuantizedTensor]
    info: QuantInfo
    losses: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)  # calibration tokens each GPTQ Hessian summed
    timings: dict[str, float] = field(default_factory=dict)


def plan(
    model: nn.Module, stage: Stage, formats: list[str], transforms: Sequence[Stage] = ()
) -> tuple[str, dict[str, nn.Linear], QuantInfo]:
    """Which Linear layers get quantized, checked against the grid and the formats before any work.
    transforms: the stages before the weight stage (its position in error messages, the method's name)."""
    args, path = stage.args, f"stages.{len(transforms)}.{stage.name}"
    spec = GridSpec(args.bits, args.group_size, args.sym)
    scheme = scheme_of(spec, None if args.activations is None else args.activations.kind)
    prefix, blocks = decoder_blocks(model)
    check_supported(model, blocks)
    in_blocks = {  # MoE routers stay float
        f"{prefix}.{i}.{name}": m for i, block in enumerate(blocks) for name, m in block_linears(block).items()
        if name.rpartition(".")[2] not in ROUTERS
    }
    targets = {n: m for n, m in in_blocks.items() if not matches(n, args.ignore)}
    if not targets:
        raise QuantkitError(f"{path}.ignore: every Linear layer is ignored; nothing to quantize")
    for name, m in targets.items():
        if args.group_size != -1 and m.in_features % args.group_size:
            divisors = [g for g in (32, 64, 128, 256) if m.in_features % g == 0]
            raise QuantkitError(
                f"{path}.group_size: {args.group_size} does not divide in_features "
                f"{m.in_features} of {name}; use {' or '.join(map(str, divisors + [-1]))}"
            )
        for fmt in formats:
            problem = format_registry.get(fmt).check_linear(scheme, name, m.out_features, m.in_features)
            if problem:
                raise QuantkitError(problem)
    # float Linears, and MoE routers (some are not nn.Linear) so that no loader quantizes them
    unquantized = sorted(n for n, m in model.named_modules() if n not in targets and (
        isinstance(m, nn.Linear) or (n.rpartition(".")[2] in ROUTERS and getattr(m, "weight", None) is not None
                                     and m.weight.dim() == 2)))
    info = QuantInfo(
        method="+".join(s.name for s in [*transforms, stage]),
        spec=spec,
        act_order=getattr(args, "act_order", False),
        damp=getattr(args, "damp", None),
        unquantized_linears=unquantized,
        block_linears_prefix=prefix,
        activations=None if args.activations is None else args.activations.kind,
    )
    return prefix, targets, info


def to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


class _Stop(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for a decoder block during one model forward: records what the block would receive."""

    def __init__(self, index: int, last: bool, store: dict):
        super().__init__()
        self.index, self.last, self.store = index, last, store

    def forward(self, hidden_states, *args, **kwargs):
        if self.index == 0:
            self.store["hidden"] = hidden_states
        self.store["calls"][self.index] = (args, kwargs)
        if self.last:
            raise _Stop
        return hidden_states


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: nn.ModuleList, tokens: torch.Tensor):
    """Hidden states entering block 0 and each block's call arguments (masks, rotary embeddings...)."""
    store: dict = {"calls": {}}
    real = list(blocks)
    for i in range(len(blocks)):
        blocks[i] = _Recorder(i, i == len(blocks) - 1, store)
    try:
        model(input_ids=tokens, use_cache=False)
    except _Stop:
        pass
    finally:
        for i, block in enumerate(real):
            blocks[i] = block
    return store["hidden"], [store["calls"][i] for i in range(len(blocks))]


def _check_finite(hidden: torch.Tensor, where: str) -> None:
    # an inf or NaN anywhere makes the sum non-finite. Sums in fp32 (fp16's range could overflow), a few rows at a
    # time: sum(dtype=float32) of a bf16 / fp16 tensor first makes a float32 copy of all of it
    rows = hidden.reshape(-1, hidden.shape[-1])
    if not all(torch.isfinite(part.sum(dtype=torch.float32)) for part in rows.split(256)):
        raise QuantkitError(
            f"calibration: non-finite activations {where} (fp16 overflow?); use dtype: bfloat16 or float32"
        )


def _rtn(module: nn.Linear, args: WeightQuant, spec: GridSpec) -> tuple[QuantizedTensor, float]:
    """Round-to-nearest (FP8 for type: float) swapped into the Linear; the loss is the weight's mean squared error."""
    if args.type == "float":
        qw = fp8_quantize(module.weight.data)
    else:  # AWQ's arguments have no observer: its clip search is its own
        qw = rtn_quantize(module.weight.data, spec, getattr(args, "observer", "minmax"))
    deq = qw.dequantize(module.weight.dtype).to(module.weight.device)
    w = module.weight.data
    squares = sum(float((deq[r].float() - w[r].float()).square().sum(dtype=torch.float64))
                  for r in row_steps(*w.shape))  # a few MB of float32 at a time
    module.weight.data = deq
    # on the host, as GPTQ's results are: the packers and the memory plan hold codes there
    return replace(qw, **{f.name: getattr(qw, f.name).cpu() for f in fields(qw)
                          if isinstance(getattr(qw, f.name), torch.Tensor)}), squares / w.numel()


def quantize(
    model: nn.Module,
    stage: Stage,
    calib: CalibrationSet | None,
    device: torch.device,
    formats: list[str],
    report: Reporter,
    transforms: Sequence[Stage] = (),
    checkpoints: BlockCheckpoints | None = None,
    source: "InMemory | Streamed | None" = None,
    ranks: Ranks = Ranks(),
    moe_args: MoE = MoE(),
    offload: Offload = Offload(),
) -> QuantResult:
    """stage: the weight stage; transforms: the transform stages before it, in recipe order; checkpoints: where
    the layer-wise run saves each finished block and resumes from (None: no checkpoints); source: where each block's
    weights come from and where a finished block goes (None: `model` is in memory); ranks: the processes sharing
    the calibration (a single one by default); moe_args: how experts are calibrated; offload: where the hidden
    states between blocks live and how many windows a block forward takes."""
    source = source or InMemory()
    prefix, targets, info = plan(model, stage, formats, transforms)
    # AWQ as the weight stage: its pass scales and clips each block, then RTN rounds on its grid (_rtn_weights)
    own = [stage] if stage.name in transform_passes.PASSES else []
    passes = transform_passes.build([*transforms, *own], prefix, decoder_blocks(model)[1], ranks,
                                    calib.tokens.shape[0] if calib is not None else 0)
    if ranks.active and not moe_args.calibrate_all_experts and moe.experts_of(model):
        raise QuantkitError("moe.calibrate_all_experts: false routes different tokens to each process's experts; "
                            "calibration over several processes needs true")
    for p in passes:
        for note in p.notes:
            report.warn(f"{p.name}: {note}")
    result = QuantResult({}, info)
    if stage.name == "rtn" and not passes:  # no data needed: one sweep over the weights, block by block
        with report.timed("rtn"), torch.no_grad():
            for i, block in enumerate(decoder_blocks(model)[1]):
                source.load(i, block, device)
                for name, module in targets.items():
                    if name.startswith(f"{prefix}.{i}."):
                        result.qweights[name], result.losses[name] = _rtn(module, stage.rtn, info.spec)
                source.done(i, block, result.qweights)
        report.info(f"rtn: {len(targets)} Linear layers in {report.timings['rtn']:.1f} s")
    else:
        _layerwise(model, stage, passes, calib, device, prefix, targets, result, report, checkpoints, source, ranks,
                   moe_args, offload)
    for p in passes:
        report.info(p.summary())
    result.timings = dict(report.timings)
    return result


PASS_COUNTERS = ("ratios", "clipped", "smoothed")  # what each pass's summary() reports, carried across a resume


def _layerwise(model, stage, passes, calib, device, prefix, targets, result: QuantResult, report: Reporter,
               checkpoints: BlockCheckpoints | None, source: "InMemory | Streamed", ranks: Ranks,
               moe_args: MoE, offload: Offload) -> None:
    _, blocks = decoder_blocks(model)
    tokens = ranks.share(calib.tokens)
    if tokens.shape[0] == 0:
        raise QuantkitError(f"calibration.num_samples: {calib.tokens.shape[0]} windows for {ranks.world} processes; "
                            "every process needs at least one")
    hidden = Activations(offload.where, device, tokens.shape[0], offload.batch_size or tokens.shape[0],
                         offload.folder)
    micro = microbatches.size(tokens.shape[0], tokens.shape[1])
    try:
        with report.timed("capture"), source.capture():
            calls = {}  # windows in a batch -> each block's call arguments (masks, rotary embeddings) at that size
            for k, rows in enumerate(hidden.rows):
                x, calls_k = capture_block_inputs(model, blocks, tokens[rows])
                if x.device.type == "meta":
                    raise QuantkitError("model: capturing block 0's inputs used a weight outside the blocks that no "
                                        "module call loads; use load: memory")
                calls.setdefault(x.shape[0], calls_k)
                hidden.write(k, x)
                del x  # captured on the host: on a GPU, a copy of every window that _blocks would keep alive
            hidden.advance()
            # a micro-batch's call arguments at its size; GPTQ: one window's, for the forward that learns a block's
            # groups (_shared_inputs)
            learn = {1} if stage.name == "gptq" and hidden.one_batch else set()
            for size in learn | {len(c) for k in range(len(hidden)) for c in microbatches.split(tokens[hidden.rows[k]],
                                                                                                micro)}:
                if size not in calls:  # a micro-batch's call arguments, at its size
                    calls[size] = capture_block_inputs(model, blocks, tokens[:size])[1]
        report.info(
            f"{result.info.method}: {len(blocks)} blocks, {calib.tokens.shape[0]}x{calib.tokens.shape[1]} calibration "
            f"tokens, device {device}" + (f", {result.info.activations} activations" if result.info.activations else "")
            + (f", {ranks.world} processes ({tokens.shape[0]} windows on rank {ranks.rank})" if ranks.active else "")
            + ("" if hidden.one_batch and offload.where == "device" else f", {offload.describe(tokens.shape[0])}")
        )
        _blocks(model, blocks, stage, passes, device, prefix, targets, result, report, checkpoints, source, ranks,
                moe_args, hidden, calls, micro)
    except BaseException:
        if checkpoints is not None:
            checkpoints.salvage()
        raise
    finally:
        hidden.close()


def _blocks(model, blocks, stage, passes, device, prefix, targets, result: QuantResult, report: Reporter,
            checkpoints: BlockCheckpoints | None, source: "InMemory | Streamed", ranks: Ranks, moe_args: MoE,
            hidden: Activations, calls: dict, micro: int) -> None:
    """micro: windows per micro-batch (microbatches.py): every forward of a block runs a few windows at a time."""
    # Linears (by name inside a block) that read one input, for each kind of block (its Linears' names), learned
    # from one window through the first block of that kind (_shared_inputs)
    groups: dict[frozenset[str], dict[str, tuple[str, ...]]] = {}
    first = 0
    if checkpoints is not None and checkpoints.state["done"] >= 0:
        losses, extra = checkpoints.restore(blocks, source.restore, result.qweights, hidden)
        result.losses |= losses
        for p, counters in zip(passes, extra.get("passes", [])):
            for k, v in counters.items():
                setattr(p, k, v)
        first = checkpoints.state["done"] + 1
        report.info(f"resuming after block {first}/{len(blocks)} from {checkpoints.folder}")
    start = time.perf_counter()
    for i, block in enumerate(blocks):
        if i < first:
            continue
        t0 = time.perf_counter()
        source.load(i, block, device)
        names = {m: n for n, m in targets.items() if n.startswith(f"{prefix}.{i}.")}
        block_calls = {size: to_device(c[i], device) for size, c in calls.items()}
        experts = [e for _, e in moe.experts_of(block)]

        def run(x: torch.Tensor) -> torch.Tensor:
            # calibration forwards only: AWQ's scale search re-runs modules for their output alone
            call_args, call_kwargs = block_calls[x.shape[0]]
            with torch.no_grad(), moe.calibrating(experts, moe_args.calibrate_all_experts):
                out = block(x, *call_args, **call_kwargs)
            return out[0] if isinstance(out, tuple) else out

        def run_all(forward) -> None:
            """The block over every batch (forward(x): the block's output on batch x), its output as the next block's
            input."""
            for k in range(len(hidden)):
                out = forward(hidden.read(k))
                _check_finite(out, f"after {prefix}.{i}")
                hidden.write(k, out)
            hidden.advance()

        def in_micro_batches(forward):
            def run_parts(x: torch.Tensor) -> torch.Tensor:
                parts = microbatches.split(x, micro)
                out = microbatches.Output(parts)
                for c, part in enumerate(parts):
                    out.put(c, forward(part))
                return out.value
            return run_parts

        if stage.name == "gptq" and hidden.one_batch:  # one window through the first float block of each kind,
            # before any pass or smoothing hook sees it
            kind = groups.setdefault(frozenset(n.removeprefix(f"{prefix}.{i}.") for n in names.values()), {})
            if not kind:
                kind.update(_shared_inputs(run, hidden.read(0)[:1], names, f"{prefix}.{i}."))
        # SmoothQuant right before gptq smooths inside gptq's forward, one forward less per block (rtn rounds
        # every weight before its forward, so it needs the scales folded first; several batches need every batch's
        # statistics before the fold)
        inline = passes[-1] if stage.name == "gptq" and passes and hidden.one_batch and \
            isinstance(passes[-1], transform_passes.SmoothQuantPass) else None
        for p in passes:
            if p is inline:
                continue
            with report.timed(p.name):
                handles = p.observe(i, block)
                try:
                    for k in range(len(hidden)):
                        row = hidden.rows[k].start
                        for part in microbatches.split(hidden.read(k), micro):
                            if hasattr(p, "batch"):  # AWQ keeps its samples by their window
                                p.batch(slice(row, row + len(part)))
                            row += len(part)
                            run(part)  # float block: only the hooks' statistics matter
                finally:
                    for handle in handles:
                        handle.remove()
                for warning in p.apply(i, block):
                    report.warn(warning)
        handles, inline_warnings = inline.inline(i, block) if inline else ([], list)
        try:
            if stage.name == "gptq" and hidden.one_batch:
                # in step only where every micro-batch calls the same Linears (no experts) and no smoothing folds
                # a scale inside the forward
                step = micro if not experts and inline is None else None
                run_all(lambda x: _gptq_block(run, x, names, stage.args, result, report, ranks, kind,
                                              f"{prefix}.{i}.", moe_args, step, hidden.spill))
            else:
                if stage.name == "gptq":
                    with report.timed("forward+quantize"):
                        _gptq_passes(run, hidden, names, stage.args, result, report, ranks, f"{prefix}.{i}.", micro,
                                     moe_args)
                else:
                    _rtn_weights(names, stage.args, result, report)
                with report.timed("forward"):
                    run_all(in_micro_batches(_act_quant_hooks(run, names, result.info.activations)))
        finally:
            for handle in handles:
                handle.remove()
        for warning in inline_warnings():
            report.warn(warning)
        block.to("cpu")
        if checkpoints is not None:
            with report.timed("checkpoint"):
                extra = {"passes": [{k: getattr(p, k) for k in PASS_COUNTERS if hasattr(p, k)} for p in passes]}
                # not kept in a local: the block's codes would stay alive through the next block
                checkpoints.save(i, block, {n: result.qweights[n] for n in names.values()},
                                 {n: result.losses[n] for n in names.values()}, hidden, extra)
        source.done(i, block, result.qweights)
        elapsed = time.perf_counter() - start
        eta = elapsed / (i + 1 - first) * (len(blocks) - i - 1)
        losses = "  ".join(
            f"{n.rsplit('.', 1)[-1]}={result.losses[n]:.3g}" for n in names.values()
        )
        report.info(f"block {i + 1}/{len(blocks)}  {time.perf_counter() - t0:5.1f} s  "
                    f"ETA {fmt_eta(eta)}  loss {losses}")
    if checkpoints is not None:
        with report.timed("checkpoint"):
            checkpoints.flush()


def _rtn_weights(names: dict[nn.Linear, str], args: WeightQuant, result: QuantResult, report: Reporter) -> None:
    with report.timed("rtn"), torch.no_grad():
        for module, name in names.items():
            result.qweights[name], result.losses[name] = _rtn(module, args, result.info.spec)


def _act_quant_hooks(run, names: dict[nn.Linear, str], act: str | None):
    """The block's forward as the quantized model runs it: W8A8 Linears read their input quantized per token."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        handles = [] if act is None else [
            m.register_forward_pre_hook(lambda _, inputs: (fake_quantize_tokens(inputs[0], act), *inputs[1:]))
            for m in names
        ]
        try:
            return run(x)
        finally:
            for handle in handles:
                handle.remove()

    return forward


def _gptq_block(run, hidden, names: dict[nn.Linear, str], args: WeightQuant, result: QuantResult,
                report: Reporter, ranks: Ranks, groups: dict[str, tuple[str, ...]], block: str,
                moe_args: MoE = MoE(), micro: int | None = None, spill: Path | None = None) -> torch.Tensor:
    """The block's one forward over `hidden` (every window), in micro-batches of `micro` windows that keep in step
    (None: all at once), solving each Linear at its first call. One Hessian and one factorization per input tensor:
    q/k/v and gate/up read one tensor, and so, when every expert sees every token, does every expert's gate/up. The
    last two inputs of each micro-batch are kept (an expert's gate/up input, then its down_proj input, then the
    next expert's gate/up input again).
    groups: Linears that read one input, by name inside the block, for this kind of block (_shared_inputs): a
    whole group is solved at its first call, in one GPTQ pass (spread over the ranks), and its factorization freed
    then. At a wide Linear (parking.py) every micro-batch parks its inputs in files under `spill` as it reaches the
    barrier, the Hessian reads them back a window at a time, and they return just before the Linear runs; the
    block's quantized weights wait there until they are read again: the solve meets neither every window's input
    nor the block. An expert Linear whose Hessian saw fewer
    than moe_args.min_tokens tokens (routed-only calibration) gets RTN instead."""
    spec, act = result.info.spec, result.info.activations
    by_name = {n: m for m, n in names.items()}
    parts = [hidden] if micro is None else microbatches.split(hidden, micro)
    step = microbatches.InStep(len(parts))
    # per micro-batch, id(input) -> (a weak reference to it, what the Linear reads (W8A8: quantized), its entry)
    seen_inputs: list[OrderedDict[int, tuple]] = [OrderedDict() for _ in parts]
    # each micro-batch's inputs on disk while a wide Linear is solved, and the block's quantized weights (its forward
    # is past them)
    parked = [parking.Parked(spill) for _ in parts]
    parked_weights = parking.Parked(spill)
    parked_input = parking.Parked(spill)  # and the block's input (every window), until the forward goes on
    arrived: list = [None] * len(parts)  # each micro-batch's input at the barrier
    made: dict = {}  # the entry the last barrier made
    window_len = hidden.shape[1]

    def new_entry(module: nn.Linear, name: str) -> None:
        """At a barrier: the Hessian of every micro-batch's input, in window order (a parked one is read back for
        its term, one at a time: the Hessian never meets every input in memory)."""
        if parking.worth_it(module.in_features, arrived[0].device):
            for n, m in by_name.items():
                if n in result.qweights:  # its dequantized weight and its codes: read again only by a second
                    parked_weights.park(m.weight)  # call (restored then) and by the block's checkpoint and export
                    parked_weights.park(result.qweights[n].codes)
            parked_input.park(hidden)
        with report.timed("hessian+gptq"):
            h = _hessian(module, arrived[0].device, args)
            for c, part in enumerate(parts):
                flat = arrived[c].dim() == 2 and arrived[c].shape[0] == part.shape[0] * window_len  # MoE MLPs
                for xq in parked[c].pieces(arrived[c], window_len if flat else 1):  # flatten the tokens
                    h.add(xq.view(-1, window_len, xq.shape[-1]) if flat else xq)  # per window, as the sum goes
            if ranks.active:  # the sums and token counts of every rank's share
                ranks.all_reduce(h.sum)
                h.count = int(ranks.all_reduce(torch.tensor([h.count], dtype=torch.float64)).item())
        st = {"h": h, "solver": None, "rtn": None, "count": h.count}
        if h.count < moe_args.min_tokens and ".experts." in name:
            st.update(h=None, rtn=h.count)
        made["entry"] = st

    def entry_for(module: nn.Linear, x: torch.Tensor, name: str) -> tuple[torch.Tensor, dict]:
        c = step.index
        known = seen_inputs[c].get(id(x))
        if known is not None and known[0]() is x:
            seen_inputs[c].move_to_end(id(x))
            return (x if act is None else known[1]), known[2]
        for gone in [k for k, (ref, _, _) in seen_inputs[c].items() if ref() is None]:  # W8A8: no x, no use for
            del seen_inputs[c][gone]  # its quantized copy (the attention's, through the MLP)
        _check_finite(x, f"entering {name}")  # else the Hessian is inf/NaN and GPTQ blames its damping
        # W8A8: the Linear will read x quantized per token, so GPTQ weighs the error by that input
        xq = x if act is None else fake_quantize_tokens(x, act)
        arrived[c] = xq
        if parking.worth_it(module.in_features, xq.device):  # until this micro-batch's Linear runs, with the
            earlier = [t for ref, q, _ in seen_inputs[c].values() for t in (ref(), q) if t is not None]  # inputs
            for t in {id(t): t for t in (x, xq, *earlier)}.values():  # of its earlier Linears still alive
                parked[c].park(t)
        step.barrier(name, lambda: new_entry(module, name))
        arrived[c] = None
        st = made["entry"]
        seen_inputs[c][id(x)] = (weakref.ref(x), None if act is None else xq, st)
        if len(seen_inputs[c]) > 2:
            seen_inputs[c].popitem(last=False)
        return xq, st

    def solve(st: dict, todo: list[str], first: str) -> dict:
        """GPTQ of the Linears in todo, which share st's Hessian: one factorization, one pass over their rows."""
        if st["solver"] is None:
            st["solver"] = _solver(st.pop("h"), args, spec, report, first)
        if not todo:
            return {}
        # the float weights are swapped out right after (_install): the solve need not hold them
        return dict(zip(todo, st["solver"].quantize_many([by_name[n].weight.data for n in todo], release=True)))

    def pre_hook(module: nn.Linear, inputs: tuple) -> tuple | None:
        name, x = names[module], inputs[0]
        if moe.replaying(module):  # an expert's routed call: its tokens were all counted in the first call
            return None if act is None else (fake_quantize_tokens(x, act), *inputs[1:])
        if parked_weights.holds(module.weight):  # a quantized Linear called again
            parked_weights.restore()
        try:
            return solved(module, name, x, inputs)
        finally:  # the Linear reads its input next, and a parallel block (attention and MLP side by side) the
            parked[step.index].restore()  # block's input after it
            parked_input.restore()

    def solved(module: nn.Linear, name: str, x: torch.Tensor, inputs: tuple) -> tuple | None:
        xq, st = entry_for(module, x, name)
        if name not in result.qweights:  # a Linear called twice in one forward is quantized once
            with report.timed("hessian+gptq"):
                if st.get("rtn") is not None:  # too few routed tokens for a Hessian worth solving
                    _few_tokens(module, name, st["rtn"], args, result, report, moe_args)
                    return None if act is None else (xq, *inputs[1:])
                todo = [name] + [block + m for m in groups.get(name.removeprefix(block), ())
                                 if block + m != name and block + m in by_name and block + m not in result.qweights]
                owner = ranks.owners({n: by_name[n].out_features * by_name[n].in_features ** 2 for n in todo})
                mine = solve(st, [n for n in todo if owner[n] == ranks.rank], name)
                _install(todo, mine, owner, by_name, st["count"], result, ranks)
                group = groups.get(name.removeprefix(block))
                if group is not None and all(block + m in result.qweights for m in group if block + m in by_name):
                    st["solver"] = None  # no other Linear of this kind of block reads this input: H⁻¹ can go now
        return None if act is None else (xq, *inputs[1:])

    out = microbatches.Output(parts)
    handles = [m.register_forward_pre_hook(pre_hook) for m in names]
    try:
        with report.timed("forward+quantize"):
            step.run(lambda c: out.put(c, run(parts[c])))
    finally:
        for handle in handles:
            handle.remove()
        seen_inputs.clear()
        made.clear()
        parked_weights.restore()
        parked_input.restore()
    _unreached(names, args, result, report)
    return out.value


def _shared_inputs(run, window: torch.Tensor, names: dict[nn.Linear, str], block: str) -> dict[str, tuple[str, ...]]:
    """Which Linears read one input tensor (q/k/v, gate/up, every expert's gate/up when every expert sees every
    token), by name inside the block: one window through the float block, each Linear's input compared by identity.
    A block's code is the same for every window, so the groups are the whole forward's."""
    readers: dict[int, list[str]] = {}
    inputs = []  # alive until the end, so that no id is reused

    def hook(module: nn.Linear, args: tuple) -> None:
        if moe.replaying(module):
            return
        inputs.append(args[0])
        group = readers.setdefault(id(args[0]), [])
        if names[module].removeprefix(block) not in group:
            group.append(names[module].removeprefix(block))

    handles = [m.register_forward_pre_hook(hook) for m in names]
    try:
        run(window)
    finally:
        for handle in handles:
            handle.remove()
    return {m: tuple(g) for g in readers.values() for m in g}


def _hessian(module: nn.Linear, device: torch.device, args: WeightQuant) -> Hessian:
    return Hessian(module.in_features, device, getattr(torch, args.hessian_dtype))


def _solver(h: Hessian, args: WeightQuant, spec: GridSpec, report: Reporter, first: str) -> GPTQ:
    """One factorization of h for the Linears that read its input (first: the one its errors name). The solver
    consumes the Hessian's sum: it holds the only copy of the matrix while it factors it."""
    try:
        return GPTQ(h, spec, args.damp, args.block_size, args.act_order,
                    warn=lambda m: report.warn(f"{first}: {m}"), observer=args.observer)
    except NotPositiveDefinite as err:
        raise QuantkitError(f"gptq: {first}: {err}; raise damp") from None


def _few_tokens(module: nn.Linear, name: str, count: int, args: WeightQuant, result: QuantResult, report: Reporter,
                moe_args: MoE) -> None:
    """An expert Linear whose Hessian saw fewer than moe.min_tokens routed tokens: RTN, with a warning."""
    report.warn(f"{name}: only {count} calibration tokens routed to this expert "
                f"(moe.min_tokens {moe_args.min_tokens}); quantized with RTN")
    result.qweights[name], result.losses[name] = _rtn(module, args, result.info.spec)
    result.tokens[name] = count


def _install(todo: list[str], solved: dict, owner: dict[str, int], by_name: dict[str, nn.Linear], tokens: int,
             result: QuantResult, ranks: Ranks) -> None:
    """Each solved Linear's result, from its owner to every rank (one process: the one solve), swapped in."""
    for n in todo:
        qw, loss = ranks.broadcast(solved.get(n), owner[n])
        target = by_name[n]
        target.weight.data = qw.dequantize(target.weight.dtype).to(target.weight.device)
        result.qweights[n], result.losses[n] = qw, loss
        result.tokens[n] = tokens


def _expert(name: str) -> tuple[str, str] | None:
    """'...mlp.experts.3.down_proj' -> ('...mlp', '3'): the experts module and the expert a Linear belongs to."""
    head, sep, tail = name.rpartition(".experts.")
    return (head, tail.partition(".")[0]) if sep else None


def _independent(a: str, b: str) -> bool:
    """Two Linears of different experts of one MoE MLP: neither reads what the other computes."""
    ea, eb = _expert(a), _expert(b)
    return ea is not None and eb is not None and ea[0] == eb[0] and ea[1] != eb[1]


def _gptq_passes(run, hidden: Activations, names: dict[nn.Linear, str], args: WeightQuant, result: QuantResult,
                 report: Reporter, ranks: Ranks, block: str, micro: int, moe_args: MoE = MoE()) -> None:
    """GPTQ of one block whose windows come in several batches (offloaded activations). A Linear cannot be solved at
    its first call, which sees one batch only, so the block runs over every batch once per wave of Linears: a wave
    sums the Hessian of every not yet quantized Linear whose input depends on quantized Linears only (and on the
    other experts of its MoE MLP, which it does not read), and solves them once every batch is in. The next wave
    sees them quantized, as the one-forward path's later Linears do (true-sequential). A forward stops at the first
    Linear that must wait for this wave. Linears reading one tensor (q/k/v, gate/up, every expert's gate/up when
    every expert sees every token) share one Hessian and one factorization. Each forward runs `micro` windows at a
    time (the Hessians still add window by window, in window order)."""
    spec, act = result.info.spec, result.info.activations
    by_name = {n: m for m, n in names.items()}
    while True:
        hessians: dict[str, Hessian] = {}  # wave's groups, by their first member's name
        members: dict[str, list[str]] = {}

        def pre_hook(module: nn.Linear, inputs: tuple) -> tuple | None:
            name, x = names[module], inputs[0]
            xq = x if act is None else fake_quantize_tokens(x, act)
            passthrough = None if act is None else (xq, *inputs[1:])
            if moe.replaying(module) or name in result.qweights:
                return passthrough
            earlier = forward["unquantized"]  # (name, input) of this forward's float Linears so far
            if any(n == name for n, _ in earlier):  # a Linear called twice in one forward counts its first call
                return passthrough
            if any(r() is not x and not _independent(n, name) for n, r in earlier):
                earlier.append((name, weakref.ref(x)))
                if _expert(name) is None:  # everything after it may read what it computes
                    raise _Stop
                return passthrough
            key = next((n for n, r in earlier if r() is x), name)
            earlier.append((name, weakref.ref(x)))
            if key == name:
                if key not in hessians:  # (setdefault would allocate a C x C sum at every call)
                    hessians[key] = _hessian(module, x.device, args)
                _check_finite(x, f"entering {name}")
                rows = xq
                if rows.dim() == 2 and rows.shape[0] == forward["windows"] * forward["len"]:  # MoE flattens tokens
                    rows = rows.view(forward["windows"], forward["len"], -1)
                hessians[key].add(rows)
            group = members.setdefault(key, [])
            if name not in group:
                group.append(name)
            return passthrough

        handles = [m.register_forward_pre_hook(pre_hook) for m in names]
        try:
            for k in range(len(hidden)):
                for x in microbatches.split(hidden.read(k), micro):
                    forward = {"unquantized": [], "windows": x.shape[0], "len": x.shape[1]}
                    try:
                        run(x)
                    except _Stop:
                        pass
        finally:
            for handle in handles:
                handle.remove()
        if ranks.active:  # the same groups on every rank (one forward's structure), in one order
            union: dict[str, list[str]] = {}
            for theirs in ranks.all_gather(members):
                for key, group in theirs.items():
                    union.setdefault(key, [])
                    union[key] += [n for n in group if n not in union[key]]
            members = {k: union[k] for k in sorted(union)}
        if not members:
            break
        for key, group in members.items():
            with report.timed("hessian+gptq"):
                h = hessians.get(key) or _hessian(by_name[key], by_name[key].weight.device, args)
                if ranks.active:
                    ranks.all_reduce(h.sum)
                    h.count = int(ranks.all_reduce(torch.tensor([h.count], dtype=torch.float64)).item())
                if h.count < moe_args.min_tokens and _expert(key) is not None:
                    for n in group:
                        _few_tokens(by_name[n], n, h.count, args, result, report, moe_args)
                    continue
                owner = ranks.owners({n: by_name[n].out_features * by_name[n].in_features ** 2 for n in group})
                mine = [n for n in group if owner[n] == ranks.rank]
                solved = {}
                if mine:
                    solver = _solver(h, args, spec, report, group[0])
                    solved = dict(zip(mine, solver.quantize_many([by_name[n].weight.data for n in mine])))
                _install(group, solved, owner, by_name, h.count, result, ranks)
    _unreached(names, args, result, report)


def _unreached(names: dict[nn.Linear, str], args: WeightQuant, result: QuantResult, report: Reporter) -> None:
    for module, name in names.items():  # never called during the forward: no data, fall back to RTN
        if name not in result.qweights:
            report.warn(f"{name} was not reached by calibration data; quantized with RTN")
            result.qweights[name], _ = _rtn(module, args, result.info.spec)
            result.losses[name] = float("nan")
