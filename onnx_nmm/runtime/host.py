"""The machine numbers are measured on: what it is, and how much memory this process holds (Linux /proc)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe_machine() -> str:
    """One line saying what the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    memory = ""
    total = _status_kib("/proc/meminfo", "MemTotal")
    if total is not None:
        memory = f", {total / 2**20:.0f} GiB RAM"
    return f"{cpu}, {os.cpu_count()} cores{memory}, Python {platform.python_version()}"


def peak_resident_bytes() -> int | None:
    """The most memory this process has held (VmHWM), or None where /proc does not say."""
    kib = _status_kib("/proc/self/status", "VmHWM")
    return None if kib is None else kib * 1024


def _status_kib(path: str, key: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None
