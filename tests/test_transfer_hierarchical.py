"""Hierarchical delivery in jreshard.transfer, in one process with the domains given explicitly.

Bit-exact against the host arrays; the bytes the executors count crossing a domain
boundary equal the two-stage plan's figure and the lower bound (each byte once into
each domain that needs it, computed here by NumPy); the cost model's bytes per link
equal the executors' for every case where hierarchical delivery applies.
"""

from __future__ import annotations

import logging
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jreshard
from jreshard import Domains
from jreshard.fleet import cost
from jreshard.fleet.hierarchical import decide, hierarchical_plan
from jreshard.jax_executor import transfer as transfer_module
from jreshard.jax_executor.adapter import parse
from jreshard.jax_executor.transfer import auto_topology, last_transfer_stats

DEVICES = np.array(jax.devices())
NODES = Domains.from_groups([[0, 1, 2, 3], [4, 5, 6, 7]])
TRAIN = jax.sharding.Mesh(DEVICES[:4], ("fsdp",))
BOTH = jax.sharding.Mesh(DEVICES.reshape(2, 4), ("node", "fsdp"))
# TP2 x DP2 in each domain: 4 replicas, 2 per domain.
SERVE = jax.sharding.Mesh(DEVICES.reshape(2, 2, 2), ("node", "dp", "tp"))
# Replicas that span both domains (tp pairs {0, 4}, ...): delivered directly.
SPAN = jax.sharding.Mesh(DEVICES.reshape(2, 4).T, ("dp", "tp"))
# One domain holds 3 replicas, the other 1 (delivered directly).
ODD = jax.sharding.Mesh(DEVICES.reshape(4, 2), ("dp", "tp"))
# TP2 x DP2 in each domain of even and of odd devices.
INTERLEAVED = jax.sharding.Mesh(DEVICES[[0, 2, 4, 6, 1, 3, 5, 7]].reshape(2, 2, 2), ("node", "dp", "tp"))

CASES = {
    # name: (source sharding, target sharding, domains)
    "fsdp-to-tp2dp2-per-node": (NamedSharding(TRAIN, P("fsdp")), NamedSharding(SERVE, P(None, "tp")), NODES),
    "both-nodes-to-tp2dp2-rows": (NamedSharding(BOTH, P(("node", "fsdp"))), NamedSharding(SERVE, P("tp")), NODES),
    "replicated-target": (NamedSharding(TRAIN, P(None, "fsdp")), NamedSharding(SERVE, P()), NODES),
    "three-and-one": (NamedSharding(TRAIN, P("fsdp")), NamedSharding(ODD, P(None, "tp")),
                      Domains.from_groups([[0, 1, 2, 3, 4, 5], [6, 7]])),
    "interleaved-domains": (NamedSharding(TRAIN, P("fsdp")), NamedSharding(INTERLEAVED, P(None, "tp")),
                            Domains.from_groups([[0, 2, 4, 6], [1, 3, 5, 7]])),
    "spanning": (NamedSharding(TRAIN, P("fsdp")), NamedSharding(SPAN, P(None, "tp")), NODES),  # no fan-out
}
HOST = {"w": (np.arange(16 * 12, dtype=np.float32).reshape(16, 12) * 1.25 - 7),
        "b": np.arange(32, dtype=np.int32).reshape(8, 4) - 3}


def _params(src):
    return {k: jax.device_put(v, src) for k, v in HOST.items()}


def _lower_bound(src, dst, domains, itemsize) -> int:
    """Each element once into each domain that needs it and holds no copy (NumPy masks)."""
    total = 0
    for host in HOST.values():
        shape = host.shape
        held, needed = {}, {}
        for sharding, into in ((src, held), (dst, needed)):
            for dev, index in sharding.devices_indices_map(shape).items():
                mask = into.setdefault(domains.domain(dev.id), np.zeros(shape, bool))
                mask[index] = True
        total += sum(int((need & ~held.get(k, np.zeros(shape, bool))).sum()) for k, need in needed.items())
    return total * itemsize


def _plan_link_bytes(tsp) -> Counter:
    """Bytes per (sender, receiver) of both stages of the plan, as the cost model reads them."""
    out: Counter = Counter()
    for p in (tsp.stage1, tsp.stage2):
        if p is not None:
            src, dst, nb, _ = p.move_arrays()
            for s, d, b in zip(src.tolist(), dst.tolist(), nb.tolist(), strict=True):
                if s != d:
                    out[(s, d)] += int(b)
    return out


@pytest.mark.parametrize("case, transport, dtype", [(case, "auto", None) for case in sorted(CASES)] +
                         [("fsdp-to-tp2dp2-per-node", "collective", jnp.bfloat16)])
def test_hierarchical_transfer_is_exact_and_counts_each_byte_once_per_domain(case, transport, dtype):
    src, dst, domains = CASES[case]
    params = _params(src)
    out = jreshard.transfer(params, dst, hierarchical="always", domains=domains, transport=transport, dtype=dtype)
    stats = last_transfer_stats()
    for name, host in HOST.items():
        want = host if dtype is None else host.astype(dtype)
        assert out[name].sharding == dst and out[name].dtype == want.dtype
        for shard in out[name].addressable_shards:
            assert np.array_equal(np.asarray(shard.data).view(np.uint8),
                                  np.ascontiguousarray(want[shard.index]).view(np.uint8)), (name, shard.device)
    assert stats.delivery == ("direct" if case == "spanning" else "hierarchical") and stats.domains == domains
    # The counts are the executors' own; the plan's figure and the NumPy lower bound agree with them.
    leaves = parse(params, dst, dtype=dtype)
    tsp = hierarchical_plan(dict(zip(leaves.names, leaves.src, strict=True)),
                            dict(zip(leaves.names, leaves.dst, strict=True)), domains)
    itemsize = 2 if dtype is not None else 4
    assert stats.cross_domain_bytes == tsp.cross_domain_bytes()
    if case != "spanning":  # replicas that span domains each need their bytes: no bound to reach
        assert stats.cross_domain_bytes == _lower_bound(src, dst, domains, itemsize)
    # The cost model and the executors agree on the bytes of every link.
    assert stats.link_bytes == _plan_link_bytes(tsp)
    assert sum(stats.transport_bytes.values()) == stats.sent_bytes and stats.received_bytes == 0
    assert len(stats.transports) == (1 if stats.delivery == "direct" else 2)
    topo = cost.Topology(1, nvlink_GBps=100, network_GBps=10, latency_us=0, device_domains=domains)
    predicted = cost.predict_two_stage(tsp, topo)
    assert predicted.network_bytes == stats.cross_domain_bytes
    assert predicted.nvlink_bytes == stats.sent_bytes - stats.cross_domain_bytes
    direct = jreshard.transfer(params, dst, hierarchical="never", domains=domains, transport=transport, dtype=dtype)
    never = last_transfer_stats()
    assert never.delivery == "direct" and never.cross_domain_bytes >= stats.cross_domain_bytes
    assert all(np.array_equal(np.asarray(direct[k]), np.asarray(out[k])) for k in HOST)


def test_auto_takes_the_cost_models_decision_and_logs_it(caplog):
    src, dst, domains = CASES["fsdp-to-tp2dp2-per-node"]
    params = _params(src)
    leaves = parse(params, dst)
    layouts = (dict(zip(leaves.names, leaves.src, strict=True)), dict(zip(leaves.names, leaves.dst, strict=True)))
    with caplog.at_level(logging.INFO, logger="jreshard"):
        jreshard.transfer(params, dst, domains=domains)
    assert last_transfer_stats().delivery == decide(*layouts, auto_topology("cpu", domains)).delivery
    assert "hierarchical delivery" in caplog.text or "direct delivery" in caplog.text
    # With the links of a topology where copies inside a domain are slow, "auto" stays direct.
    slow_inside = cost.Topology(1, nvlink_GBps=0.001, network_GBps=100, latency_us=0)
    jreshard.transfer(params, dst, domains=domains, topology=slow_inside)
    assert last_transfer_stats().delivery == decide(*layouts, slow_inside.with_domains(domains)).delivery == "direct"
    # One process is one domain by default: nothing crosses a boundary, and "auto" delivers directly.
    jreshard.transfer(params, dst)
    stats = last_transfer_stats()
    assert stats.delivery == "direct" and stats.cross_domain_bytes == 0 and stats.domains.size == 1
    donated = _params(src)
    out = jreshard.transfer(donated, dst, hierarchical="always", domains=domains, donate=True)
    assert all(v.is_deleted() for v in donated.values()) and np.array_equal(np.asarray(out["w"]), HOST["w"])


def test_progress_bar_counts_the_bytes_sent(capsys, monkeypatch):
    src, dst, domains = CASES["fsdp-to-tp2dp2-per-node"]
    jreshard.transfer(_params(src), dst, hierarchical="always", domains=domains, progress=True)
    sent = last_transfer_stats().sent_bytes
    assert f"jreshard transfer process 0:   0%|          | 0.00/{sent / 1e3:.2f}k" in capsys.readouterr().err

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

        def close(self):
            pass

    bar, totals = Bar(), []
    monkeypatch.setattr(transfer_module, "progress_bar",
                        lambda on, total, desc: totals.append(total) or (bar if on else None))
    jreshard.transfer(_params(src), dst, hierarchical="always", domains=domains, progress=True)
    assert bar.n == totals[0] == sent  # both stages' sends, as they happened


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"hierarchical": "sometimes"}, ValueError, "hierarchical must be 'auto', 'always' or 'never'"),
    ({"domains": "nodes"}, TypeError, "domains must be a jreshard.Domains"),
    ({"domains": [[0, 1], [1, 2]]}, ValueError, r"device 1 is in groups\[0\] and groups\[1\]"),
    ({"domains": [[0, 1, 2, 3]], "hierarchical": "always"}, ValueError, "device 4 lies in no domain"),
    ({"progress": 1}, TypeError, "progress must be True, False or None"),
    ({"topology": "dgx-h100"}, TypeError, "topology must be a jreshard.fleet.hardware.Topology"),
])
def test_bad_arguments(kwargs, exc, match):
    src, dst, _ = CASES["fsdp-to-tp2dp2-per-node"]
    with pytest.raises(exc, match=match):
        jreshard.transfer(_params(src), dst, **kwargs)
