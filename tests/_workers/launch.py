"""Starts the two ``jax.distributed`` worker processes of a multi-process test and collects their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests._procs import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_two(worker: Path, timeout: float) -> list[dict[str, Any]]:
    """Runs ``worker RANK PORT`` for ranks 0 and 1 (one thread each, their own device flags), kills what
    outlives ``timeout`` seconds, and returns each worker's last line of JSON; a failed worker fails the test."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)  # each worker sets its own device count before importing jax
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{out}\n{err[-4000:]}"
    return [json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) for out, _ in outs]
