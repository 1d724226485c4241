"""jreshard.transfer under jax.distributed: 2 processes x 4 simulated CPU devices (gloo).

Direct delivery between the processes (casts, buckets, compiled packing, no recompiles),
and hierarchical delivery: each byte crosses into each process once, counted by the executors.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests._workers.launch import run_two

WORKER = Path(__file__).parent / "_workers" / "transfer_worker.py"
TIMEOUT_S = 180


@pytest.mark.multiprocess
def test_two_processes_move_data_between_processes_and_change_spec():
    results = run_two(WORKER, TIMEOUT_S)
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
