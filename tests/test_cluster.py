"""The simulated cluster of benchmarks/cluster.py: shaped links carry data, teardown leaves nothing.

Needs root and iproute2 (``ip``, ``tc``); skipped with the reason otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).parents[1] / "benchmarks" / "cluster.py"
_spec = importlib.util.spec_from_file_location("jreshard_bench_cluster", _PATH)
assert _spec is not None and _spec.loader is not None
cluster = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cluster
_spec.loader.exec_module(cluster)

REASON = cluster.unavailable()
needs_namespaces = pytest.mark.skipif(REASON is not None, reason=f"no simulated cluster here: {REASON}")


def _namespaces() -> list[str]:
    return [line.split(" ")[0] for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                          check=True).stdout.splitlines()]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@needs_namespaces
def test_shaped_link_carries_data_at_its_rate_and_teardown_leaves_nothing():
    prefix = f"jrs-{os.getpid()}-t"
    with cluster.Cluster(2, rate_mbit=100, latency_ms=1, prefix=prefix) as c:
        assert {c.ns(0), c.ns(1), c.switch} <= set(_namespaces())
        sleeper = c.popen(1, ["sleep", "60"])
        shaped = cluster.stream_rate(c, 0, 1, seconds=0.5) * 8 / 1e6  # Mbit/s
        loop = cluster.stream_rate(c, 1, 1, seconds=0.3) * 8 / 1e6
        hosts = Path(f"/etc/netns/{c.ns(1)}/hosts").read_text()
    # Token bucket at 100 Mbit/s: a TCP stream gets most of it and never much more.
    assert 50 < shaped < 110, shaped
    assert loop > 3 * shaped, (loop, shaped)
    assert "10.213.0.2" in hosts
    assert sleeper.poll() is not None  # processes started in a node end with it
    assert not [n for n in _namespaces() if n.startswith(prefix)]
    assert not Path(f"/etc/netns/{prefix}-node0").exists()
    # The machine's own namespace never gets an address of the simulated network.
    assert "10.213." not in subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout


@needs_namespaces
def test_cleanup_removes_what_a_dead_run_left():
    prefix = f"jrs-{_dead_pid()}"
    c = cluster.Cluster(1, prefix=prefix).up()
    cluster._LIVE.remove(c)  # as if the process had been killed before its teardown
    for sig, old in c._old_handlers.items():
        cluster.signal.signal(sig, old)
    assert c.ns(0) in cluster.leftovers()
    assert set(cluster.cleanup()) >= {c.ns(0), c.switch}
    assert not [n for n in _namespaces() if n.startswith(prefix + "-")]
    assert not Path(f"/etc/netns/{c.ns(0)}").exists()


def test_bad_arguments_name_the_argument():
    with pytest.raises(TypeError, match="nodes must be an int"):
        cluster.Cluster("2")
    with pytest.raises(ValueError, match="nodes must be between 1 and 250"):
        cluster.Cluster(0)
    with pytest.raises(ValueError, match="rate_mbit must be > 0"):
        cluster.Cluster(2, rate_mbit=0)


@needs_namespaces
def test_a_terminated_run_tears_its_cluster_down():
    code = ("import sys, time; sys.path.insert(0, 'benchmarks'); from cluster import Cluster; "
            "c = Cluster(1).up(); print(c.prefix, flush=True); time.sleep(60)")
    with subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[1], stdout=subprocess.PIPE,
                          text=True) as p:
        try:
            assert p.stdout is not None
            prefix = p.stdout.readline().strip()
            assert f"{prefix}-node0" in _namespaces()
            p.terminate()
            assert p.wait(timeout=20) == 128 + signal.SIGTERM
        finally:
            if p.poll() is None:
                p.kill()
    assert not [n for n in _namespaces() if n.startswith(prefix + "-")]
