"""Domains (which devices share fast links) and two-stage plans over any grouping, against the oracle."""

from __future__ import annotations

import numpy as np
import pytest

from jreshard import Layout, Mesh
from jreshard.core import reference
from jreshard.core.domains import Domains
from jreshard.core.hierarchical import hierarchical_plan, stage_parts
from jreshard.fleet.hardware import Topology
from jreshard.fleet.hierarchical import hierarchical_plan as fleet_hierarchical_plan


def test_groups_and_blocks():
    d = Domains.from_groups([[5, 4], [0, 2]])
    assert d.groups == ((4, 5), (0, 2)) and d.size == 2
    assert d.of([[0, 5], [2, 4]]).tolist() == [[1, 0], [1, 0]] and d.members(0) == (4, 5)
    assert Domains.contiguous(4).of(np.arange(9)).tolist() == [0] * 4 + [1] * 4 + [2]
    assert Domains.contiguous(4) == Topology(4, 100, 10, 0).domains and hash(Domains.from_groups([[0]]))
    assert Topology(4, 100, 10, 0, device_domains=d).domain([0, 5]).tolist() == [1, 0]


@pytest.mark.parametrize("make, exc, match", [
    (lambda: Domains.from_groups([[0, 1], [1, 2]]), ValueError, r"device 1 is in groups\[0\] and groups\[1\]"),
    (lambda: Domains.from_groups([[0], []]), ValueError, r"groups\[1\] is empty"),
    (lambda: Domains.from_groups([]), ValueError, "groups is empty"),
    (lambda: Domains.from_groups("01"), TypeError, "groups must be a list of lists"),
    (lambda: Domains.from_groups([[0, 1.5]]), TypeError, r"groups\[0\] device id must be an int, got float"),
    (lambda: Domains.from_groups([3]), TypeError, r"groups\[0\] must be a list of device ids"),
    (lambda: Domains.contiguous(0), ValueError, "n .devices per domain. must be a positive int"),
    (lambda: Domains.contiguous(True), TypeError, "must be an int, got bool"),
    (lambda: Domains(), ValueError, "either groups or a block size"),
    (lambda: Domains.from_groups([[0, 1]]).domain(7), ValueError, "device 7 lies in no domain"),
    (lambda: Domains.from_groups([[0, 1]]).members(1), ValueError, "domain 1 does not exist"),
    (lambda: Domains.contiguous(2).domain(-1), ValueError, "device must be an int >= 0"),
    (lambda: Topology(4, 100, 10, 0, device_domains=[[0]]), TypeError, "device_domains must be"),
    (lambda: stage_parts(Layout((4,), Mesh([0], "x"), ()), 4), TypeError, "domains must be a jreshard"),
])
def test_bad_inputs(make, exc, match):
    with pytest.raises(exc, match=match):
        make()


INTERLEAVED = Domains.from_groups([[0, 2, 4, 6], [1, 3, 5, 7]])  # not blocks: the planner must not assume them


# Each domain needs the whole 192-byte tensor and holds half of it (device 0 rows 0:4, device 1 rows 4:8):
# hierarchical delivery brings 96 bytes into each, once. In the first case each device needs rows its domain holds.
@pytest.mark.parametrize("dst_mesh, dim_axes, parts, crossing", [
    (Mesh([[0, 1], [2, 3], [4, 5], [6, 7]], ("dp", "tp")), ("tp",), ["direct"], 0),  # tp pairs span both; all local
    (Mesh([[0, 2], [4, 6], [1, 3], [5, 7]], ("dp", "tp")), ("tp",), ["domain0", "domain1"], 2 * 96),
    (Mesh([[0, 2], [4, 6], [1, 5]], ("dp", "tp")), (None, "tp"), ["direct", "domain0"], 2 * 96),
])
def test_two_stage_plan_over_any_grouping_is_exact(dst_mesh, dim_axes, parts, crossing):
    src = Layout((8, 6), Mesh([0, 1], "fsdp"), ("fsdp",), "float32")
    dst = Layout((8, 6), dst_mesh, dim_axes, "float32")
    tsp = hierarchical_plan({"w": src}, {"w": dst}, INTERLEAVED)
    assert [p.part for p in stage_parts(dst, INTERLEAVED)] == parts
    x = np.arange(48, dtype=np.float32).reshape(8, 6)
    held = {}
    for name, tp in tsp.stage1.tensors.items():
        held[name] = reference.execute(tp, reference.shard(x, src))
    if tsp.stage2 is not None:
        for name, tp in tsp.stage2.tensors.items():
            held[name] = reference.execute(tp, held[name])
            assert (INTERLEAVED.of(tp.move_src) == INTERLEAVED.of(tp.move_dst)).all()  # fan-out stays inside
    final = {d: s for shards in held.values() for d, s in shards.items()}
    want = reference.shard(x, dst)
    assert set(final) >= set(want) and all(np.array_equal(final[d], want[d]) for d in want)
    assert tsp.cross_domain_bytes() == crossing
    assert fleet_hierarchical_plan({"w": src}, {"w": dst}, Topology(1, 100, 10, 0, device_domains=INTERLEAVED)) == tsp
