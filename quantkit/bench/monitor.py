"""Background samplers for the decode loop: resident memory on CPU, GPU utilisation through NVML."""

from __future__ import annotations

import threading


class Sampler:
    """Calls `probe` every `interval` seconds on a thread between start() and stop(); keeps every value."""

    def __init__(self, probe, interval: float):
        self.probe, self.interval = probe, interval
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.values.append(self.probe())
            self._stop.wait(self.interval)

    def start(self) -> Sampler:
        self.values, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.values.append(self.probe())
        return self.values


def gpu_utilization_probe(index: int):
    """A probe returning the GPU's utilisation in % (NVML's 'percent of time a kernel was running'), or None when
    NVML is not importable (pip install nvidia-ml-py)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except pynvml.NVMLError:
        return None
    return lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
