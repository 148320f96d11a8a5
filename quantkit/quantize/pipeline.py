"""Layer-wise sequential quantization: the loop over the decoder blocks.

The calibration batch is embedded once and the inputs of the first decoder block captured (capture.py). Then,
block by block, only that block sits on the compute device. Transform stages (SmoothQuant, AWQ) add one float
forward of the block, whose hooks gather the statistics they fold into the block's weights. A weight stage that
solves (GPTQ, quantize/gptq.py) quantizes each Linear during the block's own forward, so the block's output is the
quantized block's; one that rounds (RTN, AWQ's own) quantizes each block's Linears and runs the block to feed the
next one, and alone, with no data to read, is one sweep over the weights. The loop asks the stage's method
(quantkit/methods) which of these it is; it names none.
W8A8 recipes also quantize each Linear's input per token (or per group of columns) during those forwards (the grid
Int8Linear / Fp8Linear run), so later blocks calibrate on what will run. Static FP8 inputs (the FP8 preset) first
observe every Linear's input over a forward of the rounded block (algorithms/observers.py, combined over the ranks),
then that forward's inputs are quantized on the scales found. The model keeps float Linears holding the
dequantized weights; `kernels.w8a8.swap_w8a8_linears(model, result.qweights)` makes it the W8A8 model.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from ..errors import QuantkitError
from ..families import moe
from ..algorithms.observers import InputObserver
from ..kernels.w8a8 import fake_quantize_input
from ..model import decoder_blocks
from ..progress import Reporter, fmt_eta
from ..recipe import MoE, Stage
from . import gptq, microbatches
from . import transforms as transform_passes
from .hidden import HiddenStates, Offload
from .calibration import CalibrationSet
from .capture import capture_block_inputs, check_hidden_finite, to_device
from .resume import BlockCheckpoints
from .distributed import Ranks
from .source import InMemory, Streamed
from .targets import QuantResult, plan

__all__ = ["QuantResult", "plan", "quantize"]


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
    observers: Sequence = (),
    overrides: Sequence = (),
) -> QuantResult:
    """stage: the weight stage; transforms: the transform stages before it, in recipe order; checkpoints: where
    the layer-wise run saves each finished block and resumes from (None: no checkpoints); source: where each block's
    weights come from and where a finished block goes (None: `model` is in memory); ranks: the processes sharing
    the calibration (a single one by default); moe_args: how experts are calibrated; offload: where the hidden
    states between blocks live and how many windows a block forward takes; observers: what else the quantized blocks'
    forwards measure for the artifact (observers.py), their tensors added to result.extra_tensors; overrides: the
    recipe's per-layer grids (each Linear is rounded or solved on info.spec_for(its name))."""
    source = source or InMemory()
    prefix, targets, info = plan(model, stage, formats, transforms, overrides)
    # AWQ as the weight stage: its pass scales and clips each block, then the method rounds on its grid (_round_weights)
    own = [stage] if stage.method.transform else []
    passes = transform_passes.build([*transforms, *own], prefix, decoder_blocks(model)[1], ranks,
                                    calib.tokens.shape[0] if calib is not None else 0, info)
    if ranks.active and not moe_args.calibrate_all_experts and moe.experts_of(model):
        raise QuantkitError("moe.calibrate_all_experts: false routes different tokens to each process's experts; "
                            "calibration over several processes needs true")
    for p in passes:
        for note in p.notes:
            report.warn(f"{p.name}: {note}")
    result = QuantResult({}, info)
    if not stage.calibrated and not passes and not observers:  # no data: one sweep over the weights, by block
        with report.timed("rtn"), torch.no_grad():
            for i, block in enumerate(decoder_blocks(model)[1]):
                source.load(i, block, device)
                for name, module in targets.items():
                    if name.startswith(f"{prefix}.{i}."):
                        result.qweights[name], result.losses[name] = stage.method.round(module, stage.weights,
                                                                                        info.spec_for(name))
                source.done(i, block, result.qweights)
        report.info(f"rtn: {len(targets)} Linear layers in {report.timings['rtn']:.1f} s")
    else:
        _layerwise(model, stage, passes, calib, device, prefix, targets, result, report, checkpoints, source, ranks,
                   moe_args, offload, observers)
        for o in observers:
            result.extra_tensors |= o.tensors()
    for p in passes:
        report.info(p.summary())
    result.timings = dict(report.timings)
    return result


def _layerwise(model, stage, passes, calib, device, prefix, targets, result: QuantResult, report: Reporter,
               checkpoints: BlockCheckpoints | None, source: "InMemory | Streamed", ranks: Ranks,
               moe_args: MoE, offload: Offload, observers: Sequence) -> None:
    _, blocks = decoder_blocks(model)
    tokens = ranks.share(calib.tokens)
    if tokens.shape[0] == 0:
        raise QuantkitError(f"calibration.num_samples: {calib.tokens.shape[0]} windows for {ranks.world} processes; "
                            "every process needs at least one")
    hidden = HiddenStates(offload.where, device, tokens.shape[0], offload.batch_size or tokens.shape[0],
                         offload.folder)
    # an observer's max reads the states' last bits, which depend on how many rows a matmul gets (microbatches.py):
    # one window per forward, so in-memory, batched and multi-process runs observe the same bits
    micro = 1 if observers else microbatches.size(tokens.shape[0], tokens.shape[1])
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
            # groups (gptq.shared_inputs)
            learn = {1} if stage.method.solves and hidden.one_batch else set()
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
                moe_args, hidden, calls, micro, observers)
    except BaseException:
        if checkpoints is not None:
            checkpoints.salvage()
        raise
    finally:
        hidden.close()


def _blocks(model, blocks, stage, passes, device, prefix, targets, result: QuantResult, report: Reporter,
            checkpoints: BlockCheckpoints | None, source: "InMemory | Streamed", ranks: Ranks, moe_args: MoE,
            hidden: HiddenStates, calls: dict, micro: int, observers: Sequence) -> None:
    """micro: windows per micro-batch (microbatches.py): every forward of a block runs a few windows at a time."""
    # Linears (by name inside a block) that read one input, for each kind of block (its Linears' names), learned
    # from one window through the first block of that kind (gptq.shared_inputs)
    groups: dict[frozenset[str], dict[str, tuple[str, ...]]] = {}
    first = 0
    if checkpoints is not None and checkpoints.state["done"] >= 0:
        losses, extra = checkpoints.restore(blocks, source.restore, result.qweights, hidden)
        result.losses |= losses
        for p, counters in zip(passes, extra.get("passes", [])):
            for k, v in counters.items():
                setattr(p, k, v)
        for o, state in zip(observers, extra.get("observers", [])):
            o.restore(state)
        first = checkpoints.state["done"] + 1
        report.info(f"resuming after block {first}/{len(blocks)} from {checkpoints.folder}")
    start = time.perf_counter()

    def observing(i: int, block: nn.Module) -> list:
        """The observers' hooks, for the forward whose output is the next block's input (the quantized block's)."""
        return [h for o in observers for h in o.attach(f"{prefix}.{i}.", block)]

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
                check_hidden_finite(out, f"after {prefix}.{i}")
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

        if stage.method.solves and hidden.one_batch:  # one window through the first float block of each kind,
            # before any pass or smoothing hook sees it
            kind = groups.setdefault(frozenset(n.removeprefix(f"{prefix}.{i}.") for n in names.values()), {})
            if not kind:
                kind.update(gptq.shared_inputs(run, hidden.read(0)[:1], names, f"{prefix}.{i}."))
        # SmoothQuant right before gptq smooths inside gptq's forward, one forward less per block (rtn rounds
        # every weight before its forward, so it needs the scales folded first; several batches need every batch's
        # statistics before the fold)
        # (not with an observe pass before gptq, which would run the block with the fold half made)
        inline = passes[-1] if stage.method.solves and passes and hidden.one_batch and \
            hasattr(passes[-1], "inline") and not result.info.calibrated_inputs else None
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
            if stage.method.solves and result.info.calibrated_inputs:  # NVFP4: GPTQ's Hessian weighs inputs
                with report.timed("observe"):  # quantized on their global scale, observed on the float block
                    _observe_inputs(in_micro_batches(run), hidden, names, stage, result, ranks)
            if stage.method.solves and hidden.one_batch:
                # in step only where every micro-batch calls the same Linears (no experts) and no smoothing folds
                # a scale inside the forward
                # (all windows at once otherwise: then an observer's max may differ in its last bits between runs
                # of different process counts)
                step = micro if not experts and inline is None else None
                handles = [*handles, *observing(i, block)]
                run_all(lambda x: gptq.one_forward(run, x, names, stage.args, result, report, ranks, kind,
                                              f"{prefix}.{i}.", moe_args, step, hidden.spill))
            else:
                if stage.method.solves:
                    with report.timed("forward+quantize"):
                        gptq.waves(run, hidden, names, stage.args, result, report, ranks, f"{prefix}.{i}.", micro,
                                     moe_args)
                else:
                    _round_weights(names, stage, result, report)
                    if result.info.calibrated_inputs:
                        with report.timed("observe"):
                            _observe_inputs(in_micro_batches(run), hidden, names, stage, result, ranks)
                handles = [*handles, *observing(i, block)]
                with report.timed("forward"):
                    run_all(in_micro_batches(_act_quant_hooks(run, names, result)))
        finally:
            for handle in handles:
                handle.remove()
        for warning in inline_warnings():
            report.warn(warning)
        for name in names.values():  # the static input scales go with the weights (checkpoint, export)
            if name in result.input_scales:
                result.qweights[name] = replace(result.qweights[name], input_scale=result.input_scales.pop(name))
        for o in observers:
            o.close(f"{prefix}.{i}.", ranks)
        block.to("cpu")
        if checkpoints is not None:
            with report.timed("checkpoint"):
                extra = {"passes": [{k: getattr(p, k) for k in p.counters} for p in passes]}
                if observers:
                    extra["observers"] = [o.state() for o in observers]
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


def _round_weights(names: dict[nn.Linear, str], stage: Stage, result: QuantResult, report: Reporter) -> None:
    with report.timed("rtn"), torch.no_grad():
        for module, name in names.items():
            result.qweights[name], result.losses[name] = stage.method.round(module, stage.weights,
                                                                            result.info.spec_for(name))


def _observe_inputs(run, hidden: HiddenStates, names: dict[nn.Linear, str], stage: Stage, result: QuantResult,
                    ranks: Ranks) -> None:
    """Each Linear's static input scale, from its inputs over every window of every rank (the block's weights
    rounded, or float before GPTQ; its inputs not yet quantized), in result.input_scales until its quantized weight
    keeps it."""
    observers = {m: InputObserver(stage.weights.activations.observer) for m in names}
    # an expert's second, routed call re-reads tokens its all-experts call counted (moe.replaying)
    def observe(m: nn.Module, inputs: tuple) -> None:
        if not moe.replaying(m):
            observers[m].update(inputs[0])

    handles = [m.register_forward_pre_hook(observe) for m in names]
    try:
        for k in range(len(hidden)):
            run(hidden.read(k))
    finally:
        for handle in handles:
            handle.remove()
    for m, name in names.items():
        observers[m].reduce(ranks)
        result.input_scales[name] = observers[m].scale(result.info.activations)


def _act_quant_hooks(run, names: dict[nn.Linear, str], result: QuantResult):
    """The block's forward as the quantized model runs it: W8A8 Linears read their input quantized per token, per
    group of columns, or on their static scale."""
    info = result.info
    last: dict = {}  # the last input quantized: q/k/v and gate/up read one tensor, on one static scale

    def quantizer(name: str):
        scale = result.input_scales.get(name)

        def hook(_, inputs: tuple) -> tuple:
            x = inputs[0]
            same = last and last["x"]() is x and (scale is None) == (last["scale"] is None) and (
                scale is None or torch.equal(scale, last["scale"]))
            if not same:
                last.update(x=weakref.ref(x), scale=scale,
                            xq=fake_quantize_input(x, info.activations, info.act_group, scale))
            return (last["xq"], *inputs[1:])
        return hook

    def forward(x: torch.Tensor) -> torch.Tensor:
        handles = [] if info.activations is None else [
            m.register_forward_pre_hook(quantizer(name)) for m, name in names.items()]
        try:
            return run(x)
        finally:
            last.clear()
            for handle in handles:
                handle.remove()

    return forward
