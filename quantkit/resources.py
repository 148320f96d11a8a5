"""What this process and this host have: resident memory now and at its peak (Linux /proc), and the memory
available to use: what the quantize run checks its memory plan against and reports, what bench samples, and
what eval's choice to stream a model reads."""

from __future__ import annotations

import os

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
