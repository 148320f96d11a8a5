"""Background samplers for the decode loop: resident memory on CPU, GPU utilisation through NVML."""

from __future__ import annotations

import os
import threading

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def reset_peak_rss() -> None:
    """Restart the kernel's high-water mark of this process's resident memory (Linux 4.0+), so `peak_rss_bytes`
    reports the peak from here on rather than since the process began."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then counts from process start, which only overstates it


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return rss_bytes()


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
