"""Progress lines on stderr (silenced by --quiet; warnings always shown) and wall-clock timings."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager


def fmt_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Reporter:
    def __init__(self, quiet: bool = False, stream=None):
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.timings: dict[str, float] = {}

    def info(self, msg: str) -> None:
        if not self.quiet:
            print(msg, file=self.stream, flush=True)

    def warn(self, msg: str) -> None:
        print(f"warning: {msg}", file=self.stream, flush=True)

    def steps(self, label: str, total: int):
        """Yields i for i in range(total), printing 'label i/total  elapsed  ETA' after each step."""
        start = time.perf_counter()
        for i in range(total):
            yield i
            done = time.perf_counter() - start
            eta = done / (i + 1) * (total - i - 1)
            self.info(f"{label} {i + 1}/{total}  {done:6.1f} s  ETA {fmt_eta(eta)}")

    @contextmanager
    def timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.perf_counter() - start, 3)
