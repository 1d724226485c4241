"""The simulated cluster of benchmarks/cluster.py: shaped links carry data, teardown leaves nothing.

Needs root and iproute2 (``ip``, ``tc``); skipped with the reason otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests._procs import bench_module

cluster = bench_module("cluster")

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


def _bench():
    """benchmarks/cluster_bench.py as a module (it finds benchmarks/cluster.py next to it)."""
    return bench_module("cluster_bench")


def test_bench_predictions_use_every_measured_input():
    bench = _bench()
    # 400 Mbit/s links, loopback 100 MB/s per stream, copies 0.4 GB/s per process, 100 us per message.
    links = bench.Links(shaped=50e6, loop=800e6, loop_shared=100e6, copy=1.6e9, copy_shared=0.4e9, rtt=20e-6,
                        message=100e-6)
    topo = bench.topology(links, "a", 16 << 20)
    assert (topo.network_GBps, topo.nvlink_GBps, topo.copy_GBps, topo.latency_us) == (0.025, 0.1, 0.4, 100.0)
    assert bench.topology(links, "b", 1, copies=False).nvlink_GBps == 0.4  # stage 2 of transfer: a copy
    args = SimpleNamespace(layers=1, hidden=128, vocab=512, bucket_mb=16, transfer_mb=8)
    pred = bench.predictions(args, links)
    for part in "ab":
        p = pred[part]
        assert p["always_bytes"] * 2 == p["never_bytes"]  # each byte into each node once, not per replica
        for mode in ("never", "always"):
            assert p[mode] > p[mode + "_links"] > 0  # the copies add to the links
    # (b) by hand: each of the 4 receiving devices gets 8 MiB over a 25 MB/s share of its node's link.
    nbytes = 8 * 2**20
    links_only = nbytes / 25e6 + 100e-6 * 4  # one message from each of its four senders
    assert pred["b"]["never_links"] == pytest.approx(links_only, rel=1e-6)
    assert pred["b"]["never"] == pytest.approx(links_only + nbytes / 0.4e9, rel=1e-6)  # plus unpacking them
