"""GPTQ's schedules inside the layer-wise run (quantize/pipeline.py): which Linears are solved when, from which
inputs. One forward over every window (`one_forward`), or, when the windows come in several batches, waves over
every batch (`waves`). Both go through one path: the Hessians summed over the ranks (`_reduce`), the `min_tokens`
fallback to RTN for experts that saw too few tokens (`_too_few`), each Linear solved on its owner (`_solve_group`)
and installed on every rank (`_install`). The solve itself is algorithms/gptq.py.

In the one forward a pre-hook on each Linear builds the Hessian of the input it is about to read (q/k/v and gate/up
read the same tensor, so they share one Hessian and one factorization), quantizes the weight and swaps the quantized
weight in before the Linear runs. Every later Linear in the block therefore sees the outputs of already-quantized ones
(true-sequential), and the block's output is the quantized block's output, which feeds the next block.
Mixture-of-experts blocks arrive with per-expert Linears (families/moe.py): each expert's gate/up/down is hooked like
any other Linear, and with calibrate_all_experts every expert first sees every token, so one Hessian serves every
expert's gate/up. W8A8 recipes weigh each Linear's error by its input quantized per token, as it will run.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..algorithms.gptq import GPTQ, Hessian, NotPositiveDefinite
from ..algorithms.fp4 import Fp4Spec, global_scale_for
from ..algorithms.fp8 import Fp8BlockWeight
from ..algorithms.grid import GridSpec
from ..errors import QuantkitError
from ..families import moe
from ..kernels.w8a8 import fake_quantize_input
from ..methods.config import WeightQuant
from ..methods.base import round_linear
from ..progress import Reporter
from ..recipe import MoE
from . import microbatches, parking
from .hidden import HiddenStates
from .capture import Stop, check_hidden_finite
from .distributed import Ranks
from .targets import QuantResult


def one_forward(run, hidden, names: dict[nn.Linear, str], args: WeightQuant, result: QuantResult,
                report: Reporter, ranks: Ranks, groups: dict[str, tuple[str, ...]], block: str,
                moe_args: MoE = MoE(), micro: int | None = None, spill: Path | None = None) -> torch.Tensor:
    """The block's one forward over `hidden` (every window), in micro-batches of `micro` windows that keep in step
    (None: all at once), solving each Linear at its first call. One Hessian and one factorization per input tensor:
    q/k/v and gate/up read one tensor, and so, when every expert sees every token, does every expert's gate/up. The
    last two inputs of each micro-batch are kept (an expert's gate/up input, then its down_proj input, then the
    next expert's gate/up input again).
    groups: Linears that read one input, by name inside the block, for this kind of block (shared_inputs): a
    whole group is solved at its first call, in one GPTQ pass (spread over the ranks), and its factorization freed
    then. At a wide Linear (parking.py) every micro-batch parks its inputs in files under `spill` as it reaches the
    barrier, the Hessian reads them back a window at a time, and they return just before the Linear runs; the
    block's quantized weights wait there until they are read again: the solve meets neither every window's input
    nor the block. An expert Linear whose Hessian saw fewer
    than moe_args.min_tokens tokens (routed-only calibration) gets RTN instead."""
    act = result.info.activations
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
                    qw = result.qweights[n]
                    parked_weights.park(qw.weight if isinstance(qw, Fp8BlockWeight) else qw.codes)
            parked_input.park(hidden)
        with report.timed("hessian+gptq"):
            h = _hessian(module, arrived[0].device, args)
            for c, part in enumerate(parts):
                flat = arrived[c].dim() == 2 and arrived[c].shape[0] == part.shape[0] * window_len  # MoE MLPs
                for xq in parked[c].pieces(arrived[c], window_len if flat else 1):  # flatten the tokens
                    h.add(xq.view(-1, window_len, xq.shape[-1]) if flat else xq)  # per window, as the sum goes
            _reduce(h, ranks)
        st = {"h": h, "solver": None, "rtn": None, "count": h.count}
        if _too_few(h.count, name, moe_args):
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
        check_hidden_finite(x, f"entering {name}")  # else the Hessian is inf/NaN and GPTQ blames its damping
        # W8A8: the Linear will read x quantized per token, so GPTQ weighs the error by that input
        xq = x if act is None else fake_quantize_input(x, act, result.info.act_group, result.input_scales.get(name))
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

    def pre_hook(module: nn.Linear, inputs: tuple) -> tuple | None:
        name, x = names[module], inputs[0]
        if moe.replaying(module):  # an expert's routed call: its tokens were all counted in the first call
            return None if act is None else (
                fake_quantize_input(x, act, result.info.act_group, result.input_scales.get(name)), *inputs[1:])
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
                if st["solver"] is None:  # one factorization of st's Hessian for every Linear that reads its input
                    readers = [name] + [block + m for m in groups.get(name.removeprefix(block), ())]
                    st["solver"] = _solvers(st.pop("h"), args, [n for n in readers if n in by_name], result, report,
                                            name)
                # the float weights are swapped out right after (_install): the solve need not hold them
                _solve_group(todo, lambda: st["solver"], by_name, st["count"], result, ranks, release=True)
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
    unreached(names, args, result, report)
    return out.value


def shared_inputs(run, window: torch.Tensor, names: dict[nn.Linear, str], block: str) -> dict[str, tuple[str, ...]]:
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


def _solvers(h: Hessian, args: WeightQuant, readers: list[str], result: QuantResult, report: Reporter,
             first: str) -> dict[GridSpec, GPTQ]:
    """A factorization of h per grid among the Linears that read its input: one, unless overrides give them several
    grids (a parallel block's attention and MLP, a MoE layer's shared expert beside its experts); then each is
    made from a copy of the Hessian (act-order permutes it by the grid's groups)."""
    specs = list(dict.fromkeys(result.info.spec_for(n) for n in readers))
    if len(specs) == 1:
        return {specs[0]: _solver(h, args, specs[0], report, first)}
    matrix = h.take()
    return {s: _solver(matrix, args, s, report, first) for s in specs}


def _solver(h: Hessian | torch.Tensor, args: WeightQuant, spec: GridSpec, report: Reporter, first: str) -> GPTQ:
    """One factorization of h for the Linears that read its input (first: the one its errors name). The solver
    consumes the Hessian's sum: it holds the only copy of the matrix while it factors it."""
    try:
        return GPTQ(h, spec, args.damp, args.block_size, args.act_order,
                    warn=lambda m: report.warn(f"{first}: {m}"), observer=args.observer,
                    fp8_block=args.block if args.type == "float" else None)
    except NotPositiveDefinite as err:
        raise QuantkitError(f"gptq: {first}: {err}; raise damp") from None


def _few_tokens(module: nn.Linear, name: str, count: int, args: WeightQuant, result: QuantResult, report: Reporter,
                moe_args: MoE) -> None:
    """An expert Linear whose Hessian saw fewer than moe.min_tokens routed tokens: RTN, with a warning."""
    report.warn(f"{name}: only {count} calibration tokens routed to this expert "
                f"(moe.min_tokens {moe_args.min_tokens}); quantized with RTN")
    result.qweights[name], result.losses[name] = round_linear(module, args, result.info.spec_for(name))
    result.tokens[name] = count


def _reduce(h: Hessian, ranks: Ranks) -> Hessian:
    """h summed over every rank's share of the windows: its sum and its token count (one process: unchanged)."""
    if ranks.active:
        ranks.all_reduce(h.sum)
        h.count = int(ranks.all_reduce(torch.tensor([h.count], dtype=torch.float64)).item())
    return h


def _too_few(count: int, name: str, moe_args: MoE) -> bool:
    """An expert Linear whose Hessian saw fewer than moe.min_tokens routed tokens: RTN instead (_few_tokens)."""
    return count < moe_args.min_tokens and _expert(name) is not None


def _solve_group(group: list[str], solvers: Callable[[], dict[GridSpec, GPTQ]], by_name: dict[str, nn.Linear],
                 tokens: int, result: QuantResult, ranks: Ranks, release: bool) -> None:
    """GPTQ of the Linears in group, which read one input: each on its owner rank (a solve costs out x in²), in
    one pass per grid over their rows of solvers()'s factorization for it, then installed on every rank. release:
    the solve may free the float weights as it goes."""
    owner = ranks.owners({n: by_name[n].out_features * by_name[n].in_features ** 2 for n in group})
    mine = [n for n in group if owner[n] == ranks.rank]
    solved = {}
    by_spec: dict[GridSpec, list[str]] = {}
    for n in mine:
        by_spec.setdefault(result.info.spec_for(n), []).append(n)
    made = solvers() if mine else {}
    for spec, names in by_spec.items():  # NVFP4: the fused layers' global scales, from their float weights (before
        gptq = made[spec]  # the solve releases them)
        shared = [global_scale_for(by_name[n], spec) for n in names] if isinstance(spec, Fp4Spec) else None
        solved |= dict(zip(names, gptq.quantize_many([by_name[n].weight.data for n in names], release=release,
                                                     global_scales=shared)))
    _install(group, solved, owner, by_name, tokens, result, ranks)


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


def waves(run, hidden: HiddenStates, names: dict[nn.Linear, str], args: WeightQuant, result: QuantResult,
                 report: Reporter, ranks: Ranks, block: str, micro: int, moe_args: MoE = MoE()) -> None:
    """GPTQ of one block whose windows come in several batches (offloaded activations). A Linear cannot be solved at
    its first call, which sees one batch only, so the block runs over every batch once per wave of Linears: a wave
    sums the Hessian of every not yet quantized Linear whose input depends on quantized Linears only (and on the
    other experts of its MoE MLP, which it does not read), and solves them once every batch is in. The next wave
    sees them quantized, as the one-forward path's later Linears do (true-sequential). A forward stops at the first
    Linear that must wait for this wave. Linears reading one tensor (q/k/v, gate/up, every expert's gate/up when
    every expert sees every token) share one Hessian and one factorization. Each forward runs `micro` windows at a
    time (the Hessians still add window by window, in window order)."""
    act = result.info.activations
    by_name = {n: m for m, n in names.items()}
    while True:
        hessians: dict[str, Hessian] = {}  # wave's groups, by their first member's name
        members: dict[str, list[str]] = {}

        def pre_hook(module: nn.Linear, inputs: tuple) -> tuple | None:
            name, x = names[module], inputs[0]
            xq = x if act is None else fake_quantize_input(x, act, result.info.act_group,
                                                           result.input_scales.get(name))
            passthrough = None if act is None else (xq, *inputs[1:])
            if moe.replaying(module) or name in result.qweights:
                return passthrough
            earlier = forward["unquantized"]  # (name, input) of this forward's float Linears so far
            if any(n == name for n, _ in earlier):  # a Linear called twice in one forward counts its first call
                return passthrough
            if any(r() is not x and not _independent(n, name) for n, r in earlier):
                earlier.append((name, weakref.ref(x)))
                if _expert(name) is None:  # everything after it may read what it computes
                    raise Stop
                return passthrough
            key = next((n for n, r in earlier if r() is x), name)
            earlier.append((name, weakref.ref(x)))
            if key == name:
                if key not in hessians:  # (setdefault would allocate a C x C sum at every call)
                    hessians[key] = _hessian(module, x.device, args)
                check_hidden_finite(x, f"entering {name}")
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
                    except Stop:
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
                h = _reduce(hessians.get(key) or _hessian(by_name[key], by_name[key].weight.device, args), ranks)
                if _too_few(h.count, key, moe_args):
                    for n in group:
                        _few_tokens(by_name[n], n, h.count, args, result, report, moe_args)
                    continue
                _solve_group(group, lambda: _solvers(h, args, group, result, report, group[0]), by_name, h.count, result,
                             ranks, release=False)
    unreached(names, args, result, report)


def unreached(names: dict[nn.Linear, str], args: WeightQuant, result: QuantResult, report: Reporter) -> None:
    for module, name in names.items():  # never called during the forward: no data, fall back to RTN
        if name not in result.qweights:
            report.warn(f"{name} was not reached by calibration data; quantized with RTN")
            result.qweights[name], _ = round_linear(module, args, result.info.spec_for(name))
            result.losses[name] = float("nan")
