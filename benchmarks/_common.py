"""Shared by the benchmark scripts: machine and version banner, best-of timing."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable

import numpy as np

import jreshard


def banner(title: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{title}\nmachine: {cpu}, {os.cpu_count()} cores visible, one thread (OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')})\nversions: python {sys.version.split()[0]}, "
            f"numpy {np.__version__}, jreshard {jreshard.__version__}")


def timed(fn: Callable[[], object], repeat: int = 1) -> tuple[float, object]:
    """Best wall time of ``repeat`` calls, and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out
