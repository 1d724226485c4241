"""Trainers on other nodes: ``vllm serve`` in one node of the simulated cluster, two JAX trainers in two others.

``benchmarks/cluster.py`` builds three network namespaces joined by shaped links (1 Gbit/s, 1 ms):
node 0 runs ``python -m bridge.engines.vllm.serve`` (TP2) on its own address, nodes 1 and 2 one JAX
trainer process each (trainer rank 0 hosts jax's coordinator and the sync group's store on node 1's
address). The trainers drive the server over HTTP and send over gloo across the links (nodes are
hosts apart, so no shared memory), with ``pause="commit"``. After each of two syncs the server's
greedy tokens equal ``transformers`` on the trainers' weights, every worker received exactly its
planned bytes, and the bytes each trainer node put on its link during the sync are its planned bytes
plus the protocol's overhead. The test's own process cannot reach the nodes' addresses, so the
server is asked from inside its node (``tests/vllm/http_probe.py``). Where namespaces cannot be made
(not root, no iproute2) the test is skipped with the reason; ``tests/vllm/test_serve_live.py`` runs
the same syncs on loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
pytest.importorskip("jax")

from tests._procs import bench_module, kill_all  # noqa: E402
from tests.vllm import _common as C  # noqa: E402
from tests.vllm._live import (  # noqa: E402
    ENGINE_START,
    assert_matches,
    engine_env,
    finish,
    logs,
    oracle,
    serve_command,
    start_trainers,
    wait_ready,
    wait_sync,
    write_model,
)

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

cluster = bench_module("cluster")
REASON = cluster.unavailable()
SERVED, PORT = "qwen3-test", 8000  # a port of the server's own namespace: nothing else listens there
PROBE = str(C.HERE / "http_probe.py")
# Bytes on a trainer node's link beyond its planned payload during one sync: TCP/IP headers (about 3%
# at gloo's segment sizes) and the control messages (headers, votes, reports, HTTP calls).
OVERHEAD, SLACK = 0.06, 256 << 10


def _probe(c, *args: str, timeout: float = 120.0) -> object:
    done = c.run(0, [C.python(), PROBE, *args], capture_output=True, text=True, timeout=timeout, cwd=C.ROOT,
                 env=dict(os.environ, PYTHONPATH=str(C.ROOT)))
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _link_bytes(c, node: int) -> dict[str, int]:
    """The bytes ``node`` sent and received on its link so far (its veth's counters)."""
    out = {}
    for way in ("tx", "rx"):
        done = c.run(node, ["cat", f"/sys/class/net/eth0/statistics/{way}_bytes"], capture_output=True, text=True,
                     check=True)
        out[way] = int(done.stdout)
    return out


@pytest.mark.skipif(REASON is not None, reason=f"no simulated cluster here ({REASON}); "
                                               "tests/vllm/test_serve_live.py runs the same syncs on loopback")
def test_trainers_on_two_other_nodes_sync_a_served_engine_over_the_shaped_links(tmp_path):
    model = write_model(tmp_path, "dense")
    out = tmp_path / "run"
    with cluster.Cluster(3, rate_mbit=1000, latency_ms=1, prefix=f"jrs-{os.getpid()}-v") as c:
        url = f"http://{c.addr(0)}:{PORT}"
        log_path = tmp_path / "server.log"
        with open(log_path, "w") as log:
            server = c.popen(0, serve_command(tmp_path / "model", c.addr(0), PORT, SERVED), cwd=C.ROOT,
                             env=engine_env(), stdout=log, stderr=subprocess.STDOUT)
        procs: list[subprocess.Popen] = []
        try:
            _probe(c, "health", url, str(ENGINE_START), timeout=ENGINE_START + 60)
            assert_matches(_probe(c, "generate", url, SERVED, json.dumps(C.PROMPTS), str(C.MAX_TOKENS)),
                           C.hf_greedy(model, C.PROMPTS, C.MAX_TOKENS))
            engine = {"url": url, "served": SERVED, "client": "http", "address": (c.addr(0), PORT),
                      "model": tmp_path / "model", "kind": "dense"}
            procs = start_trainers(engine, out, "1,2", pause="commit", gate=True, host=c.addr(1),
                                   place=lambda rank, argv: c.command(1 + rank, argv))
            for v in (1, 2):
                wait_ready(out, procs, v)
                before = {k: _link_bytes(c, k) for k in range(3)}
                (out / f"start_v{v}").touch()
                rec = wait_sync(out, procs, 0, v)
                moved = {k: {w: n - before[k][w] for w, n in _link_bytes(c, k).items()} for k in range(3)}
                assert rec["ok"], rec
                got = _probe(c, "generate", url, SERVED, json.dumps(C.PROMPTS), str(C.MAX_TOKENS))
                assert_matches(got, oracle(engine, out, v))
                assert _probe(c, "version", url) == str(v)
                workers = [str(r) for r in range(C.TRAINERS, C.TRAINERS + C.TP)]
                for r in workers:  # exactly the planned slices, all over sockets (the nodes are hosts apart)
                    assert rec["bytes_received"][r] == rec["plan_recv"][r] == rec["region_bytes"][r]
                    assert rec["transport_bytes"][r] == {"gloo": rec["bytes_received"][r]}, rec["transport_bytes"]
                for rank in range(C.TRAINERS):  # what each trainer node put on its link: its plan and overhead
                    planned, sent = rec["plan_send"][str(rank)], moved[1 + rank]["tx"]
                    assert planned <= sent <= planned * (1 + OVERHEAD) + SLACK, (rank, planned, sent, moved)
                planned = sum(rec["plan_send"][str(rank)] for rank in range(C.TRAINERS))
                assert planned <= moved[0]["rx"] <= planned * (1 + OVERHEAD) + 2 * SLACK, (planned, moved)
                (out / f"go_v{v}").touch()
            assert finish(procs, out) == [0, 0], logs(out)
        except BaseException:
            print(f"--- vllm serve\n{log_path.read_text()[-6000:]}\n{logs(out) if out.exists() else ''}")
            raise
        finally:
            kill_all([*procs, server])
    assert not Path(f"/etc/netns/{c.ns(0)}").exists()
