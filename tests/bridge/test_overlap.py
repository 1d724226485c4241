"""Hierarchical delivery's two stages share buckets (no processes): the dependency rule, the caps, the overlap.

A stage-2 move forwards part of its sender's param that stage 1 delivered; ``SyncSession`` packs
bucket b once buckets up to b - 2 are unpacked, so every stage-1 move feeding a stage-2 move of
bucket b must lie in a bucket <= b - 2. The oracle here finds those stage-1 moves from the
params' own elements (which bucket's stage-1 move wrote each element of each rank's param),
not from the scheduler's bookkeeping.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

import bridge
from bridge.plan.bridge_plan import ALIGN
from jreshard.nn import LlamaConfig, fsdp_spec, param_shapes
from tests.bridge import _common as C

LAG = 2  # SyncSession: bucket b is packed once buckets <= b - 2 are unpacked

# name, trainer mesh (shape, axes, ranks, devices per process), inference groups, nodes, bucket bytes
CASES = [
    # The benchmarks' layout: FSDP4 over 4 trainer processes -> 4 TP1 replicas, 2 per node.
    ("fsdp4-tp1x4-two-nodes", ((4,), ("fsdp",), (0, 1, 2, 3), 1), [[4], [5], [6], [7]],
     [[0, 1], [2, 3], [4, 5], [6, 7]], 64 << 10),
    ("tp2x4-two-nodes", ((4,), ("fsdp",), (0, 1), 2), [[2, 3], [4, 5], [6, 7], [8, 9]],
     [[2, 3, 4, 5], [6, 7, 8, 9]], 32 << 10),
    ("four-replicas-one-node", ((4,), ("fsdp",), (0, 1), 2), [[2], [3], [4], [5]], [[2, 3, 4, 5]], 48 << 10),
    # Four replicas per node: stage 2 carries three times stage 1's bytes.
    ("fsdp4-tp1x8-two-nodes-of-four", ((4,), ("fsdp",), (0, 1, 2, 3), 1), [[r] for r in range(4, 12)],
     [[0, 1], [2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], 64 << 10),
    ("replicas-split-across-nodes", ((4,), ("fsdp",), (0, 1), 2), [[2, 3], [4, 5], [6, 7]],
     [[2, 3, 4], [5, 6, 7]], 32 << 10),
]


def _plans(case) -> tuple[bridge.BridgePlan, bridge.BridgePlan]:
    _, (shape, axes, ranks, per), groups, nodes, bucket = case
    cfg = LlamaConfig.load("llama-tiny", vocab_size=C.VOCAB, num_hidden_layers=1)
    src = bridge.Source.build(param_shapes(cfg), bridge.trainer_mesh(shape, axes, list(ranks), per), fsdp_spec)
    pm = bridge.llama_param_map(cfg, src, groups, fused=True, vocab_pad=64, dtype="bfloat16")
    return tuple(bridge.BridgePlan(src, pm, bucket_bytes=bucket, hierarchical=mode, domains=nodes)
                 for mode in ("always", "never"))


def _bucket_of(plan: bridge.BridgePlan) -> dict[int, int]:
    return {i: m.bucket for m in plan.messages for i, _ in m.pieces}


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def plans(request):
    return _plans(request.param)


def test_stage2_forwards_only_what_stage1_delivered_two_buckets_before(plans):
    two, direct = plans
    assert two.two_stage
    bucket = _bucket_of(two)
    assert sorted(bucket) == list(range(len(two.moves)))  # every move in exactly one message
    # Per rank and param: the bucket whose stage-1 move wrote each element (-1: none).
    written = {(q.rank, q.name): np.full(q.shape, -1) for q in two.param_map.params}
    for i, t in enumerate(two.moves):
        if t.stage == 1:
            cells = written[(t.dst, t.param)].reshape(two.view_of(t, t.dst))[two.param_box(t, t.dst)]
            assert (cells == -1).all(), t  # written once
            cells[...] = bucket[i]
    earliest = 0
    for i, t in enumerate(two.moves):
        if t.stage != 2:
            continue
        fed = written[(t.src, t.param)].reshape(two.view_of(t, t.src))[two.param_box(t, t.src)]
        assert fed.min() >= 0, t  # its sender got every element in stage 1
        assert fed.max() <= bucket[i] - LAG, (t, bucket[i], fed.max())
        earliest += fed.max() == bucket[i] - LAG
    assert earliest  # the rule is what limits some stage-2 moves, not a later barrier
    # Still exact: the same weights as direct delivery.
    arrays = C.make_arrays(LlamaConfig.load("llama-tiny", vocab_size=C.VOCAB, num_hidden_layers=1), seed=3)
    got, want = two.reference(arrays), direct.reference(arrays)
    for r in want:
        for name in want[r]:
            np.testing.assert_array_equal(got[r][name], want[r][name], err_msg=f"{name} on rank {r}")


def test_mixed_buckets_keep_every_ranks_send_and_receive_cap(plans):
    two, _ = plans
    sent: dict[tuple[int, int], int] = defaultdict(int)
    received: dict[tuple[int, int], int] = defaultdict(int)
    stages: dict[tuple[int, int], set[int]] = defaultdict(set)
    for m in two.messages:
        assert m.nbytes % ALIGN == 0
        sent[(m.bucket, m.src)] += m.nbytes
        received[(m.bucket, m.dst)] += m.nbytes
        stages[(m.bucket, m.dst)].add(two.moves[m.pieces[0].move].stage)
    assert max(sent.values()) <= two.bucket_bytes and max(received.values()) <= two.bucket_bytes
    mixed = [k for k, s in stages.items() if s == {1, 2}]
    assert mixed  # some rank receives both stages in one bucket
    assert max(received[k] for k in mixed) > two.bucket_bytes // 2  # and the cap still binds there


@pytest.mark.parametrize("case", [c for c in CASES if c[0].startswith("fsdp4-tp1")], ids=lambda c: c[0])
def test_most_of_stage2_travels_beside_stage1(case):
    two, _ = _plans(case)
    bucket = _bucket_of(two)
    last1 = max(bucket[i] for i, t in enumerate(two.moves) if t.stage == 1)
    stage2 = [(bucket[i], t.nbytes) for i, t in enumerate(two.moves) if t.stage == 2]
    beside = sum(n for b, n in stage2 if b <= last1)
    assert min(b for b, _ in stage2) == LAG  # from the third bucket on
    assert beside >= 0.9 * sum(n for _, n in stage2)  # the pipeline's drain: the last buckets' forwards
    assert two.num_buckets <= last1 + 1 + LAG
