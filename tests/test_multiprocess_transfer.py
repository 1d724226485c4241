"""jreshard.transfer under jax.distributed: 2 processes x 4 simulated CPU devices (gloo).

Direct delivery between the processes (casts, buckets, compiled packing, no recompiles),
and hierarchical delivery: each byte crosses into each process once, counted by the executors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "_workers" / "transfer_worker.py"
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_two_processes_move_data_between_processes_and_change_spec():
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT_S))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"worker failed ({p.returncode}):\n{out}\n{err[-4000:]}"
    results = [json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1]) for out, _ in outs]
    for r in results:
        assert r["run0"] and r["run1"], r
        assert r["cast_buckets"] and r["xla_packing"], r
        assert r["compiled0"] > 0 and r["compiled1"] == 0, r  # the second sync compiles nothing
        assert r["network_bytes"] > 0
    # Hierarchical delivery, each process a domain; each process counted what its devices sent.
    domains = results[0]["domains"]
    assert domains == [[0, 1, 2, 3], [4, 5, 6, 7]] or len(domains) == 2, domains
    proc = {d: k for k, group in enumerate(domains) for d in group}

    def crossing(how: str) -> int:
        return sum(b for r in results for s, d, b in r[how]["link_bytes"] if proc[s] != proc[d])

    r0 = results[0]
    assert all(r[how]["ok"] for r in results for how in ("never", "always", "auto")), results
    assert r0["always"]["delivery"] == "hierarchical" and r0["always"]["transports"] == ["collective", "memcpy"]
    assert crossing("always") == r0["plan_cross_bytes"] == r0["lower_bound_bytes"] > 0
    assert crossing("never") > crossing("always")  # direct: once per replica, two replicas per process
    assert all(r["auto"]["delivery"] == r0["auto_decision"] for r in results)
