"""The vLLM head rule against hand-computed cases."""

from __future__ import annotations

import doctest

import pytest

from jreshard.core import heads
from jreshard.core.heads import HeadSplit, head_range, split_heads

# 8 KV heads of 128 rows (1024 rows) at each TP degree: (local rows, replicas, rows of ranks 0..3).
KV8 = {
    1: (1024, 1, [(0, 1024)]),
    2: (512, 1, [(0, 512), (512, 1024)]),
    4: (256, 1, [(0, 256), (256, 512), (512, 768), (768, 1024)]),
    8: (128, 1, [(0, 128), (128, 256), (256, 384), (384, 512)]),
    16: (128, 2, [(0, 128), (0, 128), (128, 256), (128, 256)]),
    32: (128, 4, [(0, 128), (0, 128), (0, 128), (0, 128)]),
}


@pytest.mark.parametrize("tp", sorted(KV8))
def test_kv_heads_8(tp):
    local, replicas, first = KV8[tp]
    s = split_heads(8, 128, tp, replicate=True)
    assert (s.local_size, s.replicas, s.shards) == (local, replicas, tp // replicas)
    assert list(s.ranges()[:4]) == first
    assert len(s.ranges()) == tp
    # Every row is held, by exactly `replicas` ranks.
    held = [0] * 1024
    for lo, hi in s.ranges():
        for i in range(lo, hi):
            held[i] += 1
    assert held == [replicas] * 1024


def test_kv_heads_16_last_ranks():
    assert head_range(14, 16, 8, 128, replicate=True) == (896, 1024)
    assert head_range(15, 16, 8, 128, replicate=True) == (896, 1024)
    assert head_range(31, 32, 8, 128, replicate=True) == (896, 1024)


def test_query_heads_64_tp8():
    s = split_heads(64, 128, 8)
    assert s == HeadSplit(64, 128, 8, 1)
    assert s.heads_per_rank == 8
    assert s.ranges() == tuple((r * 1024, (r + 1) * 1024) for r in range(8))


def test_without_replication_tp_above_heads_refuses():
    with pytest.raises(ValueError, match="16 tensor-parallel ranks for 8 heads, which are not replicated; use a TP"):
        split_heads(8, 128, 16)


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((40, 128, 16), {}, ValueError, "16 tensor-parallel ranks for 40 heads: a head would be cut"),
    ((40, 128, 16), {"replicate": True}, ValueError, "a head would be cut; use a TP degree dividing 40"),
    ((12, 64, 8), {"replicate": True}, ValueError, "a head would be cut"),
    ((8, 128, 12), {"replicate": True}, ValueError, "8 heads cannot be replicated evenly over 12"),
    ((0, 128, 2), {}, ValueError, "num_heads must be a positive int"),
    ((8, 0, 2), {}, ValueError, "head_dim must be a positive int"),
    ((8, 128, 0), {}, ValueError, "tp must be a positive int"),
    ((8, 128, 2.0), {}, TypeError, "tp must be an int"),
    ((True, 128, 2), {}, TypeError, "num_heads must be an int"),
])
def test_errors(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        split_heads(*args, **kwargs)


def test_what_names_the_tensor():
    with pytest.raises(ValueError, match=r"^k_proj: 16 tensor-parallel ranks for 8 heads"):
        split_heads(8, 128, 16, what="k_proj")


@pytest.mark.parametrize("rank, exc, match", [(16, ValueError, "0 <= rank < 16"), (-1, ValueError, "not a TP rank"),
                                              ("0", TypeError, "rank must be an int")])
def test_bad_rank(rank, exc, match):
    with pytest.raises(exc, match=match):
        split_heads(8, 128, 16, replicate=True).rows(rank)


def test_doctests_run():
    result = doctest.testmod(heads, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
