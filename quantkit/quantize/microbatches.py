"""One block forward over every calibration window, run a few windows at a time (micro-batches) that keep in step.

The block's temporaries are what a quantize run's memory peaks on: the MLP's intermediate-wide tensors of every
window at once. Micro-batches bound them. GPTQ's one forward per block solves each Linear at its first call, which
must see every window, so each micro-batch runs as a coroutine (a greenlet), one at a time, and a Linear's first call is a
barrier: a micro-batch that reaches it waits until every other has, the last one in solves the
Linear for all, then they go on in order. What stays in memory is what every micro-batch holds at a barrier (the
Linear's input, the residual) plus one micro-batch's temporaries. The per-window Hessian sums come out in window
order, as in one forward, so the artifact has the one-forward run's bytes wherever a matmul's rows do not depend on
how many rows it gets (MKL's blocking of some deep, narrow products does: then the last bits differ).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import greenlet
import torch

from ..errors import QuantkitError

T = TypeVar("T")
TOKENS = 4096  # tokens per micro-batch: a whole number of windows, at least one
_END = "the end of its forward"


def size(windows: int, seq_len: int) -> int:
    """Windows per micro-batch."""
    return max(1, min(windows, TOKENS // max(seq_len, 1)))


def split(x: torch.Tensor, windows: int) -> list[torch.Tensor]:
    return list(x.split(windows)) if x.shape[0] > windows else [x]


class Output:
    """The block's output over every window, filled micro-batch by micro-batch (no list of parts to concatenate)."""

    def __init__(self, parts: list[torch.Tensor]):
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + p.shape[0])
        self.value: torch.Tensor | None = None

    def put(self, c: int, y: torch.Tensor) -> None:
        if len(self.starts) == 2:  # one micro-batch: its output is the output
            self.value = y
            return
        if self.value is None:
            self.value = y.new_empty((self.starts[-1], *y.shape[1:]))
        self.value[self.starts[c]:self.starts[c + 1]] = y


class InStep:
    """Runs fn(c) for micro-batches c = 0..n-1, each in a greenlet of its own (a coroutine in this thread: torch's
    OpenMP threads and thread-local state stay one), one at a time; `barrier` keeps them in step. With n == 1
    everything runs in the caller."""

    def __init__(self, n: int):
        self.n = n
        self._index: dict = {}  # greenlet -> its micro-batch

    @property
    def index(self) -> int:
        """The micro-batch being run."""
        return self._index.get(greenlet.getcurrent(), 0)

    def run(self, fn: Callable[[int], T]) -> list[T]:
        if self.n == 1:
            return [fn(0)]
        caller = greenlet.getcurrent()
        runs = [greenlet.greenlet(lambda c=c: fn(c), parent=caller) for c in range(self.n)]
        self._index = {g: c for c, g in enumerate(runs)}
        results: list = [None] * self.n
        # torch's grad mode is per thread, and the greenlets share one: each keeps its own across its switches, so
        # a `with torch.no_grad()` left at a barrier does not leak into the next micro-batch or the caller
        own = torch.is_grad_enabled()
        modes = [own] * self.n
        try:
            while True:  # a round: each micro-batch runs up to its next barrier, or to its end
                stops = []
                for c, g in enumerate(runs):
                    torch.set_grad_enabled(modes[c])
                    try:
                        value = g.switch()
                    finally:
                        modes[c] = torch.is_grad_enabled()
                        torch.set_grad_enabled(own)
                    stops.append(_END if g.dead else value)
                    if g.dead:
                        results[c] = value
                if any(stop != stops[0] for stop in stops):
                    c = next(c for c, stop in enumerate(stops) if stop != stops[0])
                    raise QuantkitError(f"calibration: micro-batch {c} reached {stops[c]} where micro-batch 0 reached "
                                        f"{stops[0]}: this block's forward depends on its data")
                if stops[0] is _END:
                    return results
        finally:
            for c, g in enumerate(runs):  # after an error: the others unwind (their finally blocks run)
                if not g.dead:
                    torch.set_grad_enabled(modes[c])
                    g.throw(greenlet.GreenletExit)
            torch.set_grad_enabled(own)
            self._index = {}

    def barrier(self, key: Hashable, action: Callable[[], None]) -> None:
        """Each micro-batch calls this at the same point of its forward (the same keys in the same order): the last
        one runs action(), and none goes on before every one has arrived."""
        if self.n == 1:
            action()
            return
        if self.index == self.n - 1:
            action()
        greenlet.getcurrent().parent.switch(key)
