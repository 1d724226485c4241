"""Process helpers of the multi-process tests: free ports, killing and waiting for worker process groups, and
the benchmarks' modules that start processes (``bench_module``).

Standard library only: worker processes import it before choosing a side (jax, torch or vLLM).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that were free a moment ago.

    The sockets stay bound until all ``n`` are picked: two ``free_port()`` calls in a row may return the
    same port (the first was closed before the second was bound), and two services of one test (a
    jax.distributed coordinator and a sync group's store) would then collide on it.
    """
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def kill_all(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILLs the process group of every process still running (each started with start_new_session)."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it exited in between
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def wait_all(procs: Iterable[subprocess.Popen], limit: float) -> None:
    """Waits for every process within one deadline ``limit`` seconds away, then kills what is left."""
    procs = list(procs)
    deadline = time.monotonic() + limit
    try:
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        kill_all(procs)


def bench_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (``jreshard_bench_<name>``), loaded once (the benchmarks are scripts)."""
    key = f"jreshard_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]
