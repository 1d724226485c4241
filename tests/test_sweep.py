"""A seeded sweep of layouts and plans against the oracle in tests/helpers.py.

The oracle shares no code with jreshard: shards come from mesh coordinates, plans run by NumPy
slicing. Meshes of 1-3 axes with shuffled device ids, dims split by several axes, uneven and
empty shards, 0-3 dims, five dtypes, replicated sources. More examples:
``JRESHARD_HYPOTHESIS_PROFILE=thorough``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jreshard
from tests.helpers import (
    LayoutCase,
    assert_plan_ok,
    bounds,
    execute_moves,
    lower_bound,
    sender_load_limit,
)

AXIS_NAMES = ("a", "b", "c")
DTYPES = (None, "float32", "bfloat16", "int8", "float64", "bool")


@st.composite
def layout_cases(draw, shape: tuple[int, ...], first_device: int, dtype: str | None) -> LayoutCase:
    """A mesh of 1-3 axes (at most 16 devices, ids shuffled) and a spec for ``shape``."""
    sizes: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        room = 16 // math.prod(sizes)
        sizes.append(draw(st.sampled_from([s for s in (2, 3, 1, 4) if s <= room])))
    n = math.prod(sizes)
    ids = draw(st.permutations(range(first_device, first_device + n)))
    names = AXIS_NAMES[: len(sizes)]
    free = list(draw(st.permutations(names)))
    spec: list[object] = []
    for _ in shape:
        k = draw(st.sampled_from([k for k in (2, 1, 0, 3) if k <= len(free)]))
        axes, free = tuple(free[:k]), free[k:]
        # Every way a user may write an entry: None or (), "a" or ("a",), ("a", "b").
        spec.append(draw(st.sampled_from([None, ()])) if k == 0 else
                    draw(st.sampled_from([axes[0], axes])) if k == 1 else axes)
    while spec and spec[-1] in (None, ()) and draw(st.booleans()):
        spec.pop()  # trailing dims left out are not split
    return LayoutCase(shape, np.array(ids, dtype=np.int64).reshape(sizes), names, tuple(spec), dtype)


@st.composite
def case_pairs(draw) -> tuple[LayoutCase, LayoutCase]:
    shape = tuple(draw(st.integers(0, 9)) for _ in range(draw(st.sampled_from([2, 1, 3, 0]))))
    dtype = draw(st.sampled_from(DTYPES))
    # Mostly the same dtype on both sides; sometimes a cast.
    dst_dtype = draw(st.sampled_from((dtype,) * 12 + DTYPES))
    src = draw(layout_cases(shape, 0, dtype))
    first = draw(st.sampled_from([0, 16, draw(st.integers(1, 8))]))  # same ids, disjoint, overlapping
    dst = draw(layout_cases(shape, first, dst_dtype))
    return src, dst


def assert_shards_match(case: LayoutCase) -> None:
    got = {d: bounds(box) for d, box in case.layout().shards().items()}
    assert got == case.shards(), f"{case}"


@given(case_pairs())
def test_layout_shards_match_the_oracle(pair):
    for case in pair:
        assert_shards_match(case)


@given(case_pairs())
def test_plan_matches_the_oracle_and_balances_senders(pair):
    src, dst = pair
    tp = jreshard.plan(src.layout(), dst.layout())
    assert_plan_ok(tp, src, dst)
    limit = sender_load_limit(src, dst)
    assert tp.stats().max_send_bytes <= limit, f"largest sender load {tp.stats().max_send_bytes} > {limit}"


@given(st.lists(case_pairs(), min_size=1, max_size=5))
@settings(max_examples=max(10, settings().max_examples // 4))
def test_pytree_plan_matches_the_oracle(pairs):
    p = jreshard.plan([s.layout() for s, _ in pairs], [d.layout() for _, d in pairs])
    tensors = list(p.tensors.values())
    assert len(tensors) == len(pairs)
    sent = 0
    for (src, dst), tp in zip(pairs, tensors, strict=True):
        sent += sum(execute_moves(tp.moves, src, dst).values())
    assert sent == p.stats().network_bytes == sum(lower_bound(s, d) for s, d in pairs)


# --------------------------------------------------------------------------- the oracle itself

MESH_2X2 = np.array([[0, 1], [2, 3]])


@pytest.mark.parametrize("spec,device,want", [
    # P(('a', 'b')): a-major, so mesh position (a=0, b=1) holds the second quarter.
    ((("a", "b"),), 1, ((2, 4),)),
    ((("a", "b"),), 2, ((4, 6),)),
    ((("b", "a"),), 1, ((4, 6),)),
    ((("b", "a"),), 2, ((2, 4),)),
    (("b",), 3, ((4, 8),)),
    ((), 3, ((0, 8),)),
])
def test_oracle_on_hand_cases(spec, device, want):
    case = LayoutCase((8,), MESH_2X2, ("a", "b"), spec)
    assert case.shards()[device] == want
    assert_shards_match(case)


def test_oracle_chunks_like_torch():
    torch = pytest.importorskip("torch")
    for n in range(0, 12):
        for k in range(1, 6):
            case = LayoutCase((n,), np.arange(k), ("x",), ("x",))
            chunks = torch.arange(n).chunk(k) if n else ()
            want = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
            got = [case.shards()[i][0] for i in range(k)]
            assert [b for b in got if b[1] > b[0]] == want, (n, k)


@given(st.data())
@settings(max_examples=max(10, settings().max_examples // 10))
def test_oracle_agrees_with_jax_on_even_shardings(data):
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = jax.devices()
    n_dims = data.draw(st.integers(1, 3))
    case = data.draw(layout_cases((0,) * n_dims, 0, None).filter(lambda c: c.devices.size <= len(devices)))
    # An even shape: every dim a multiple of the number of shards it is split into.
    sizes = dict(zip(case.axis_names, case.devices.shape, strict=True))
    shape = tuple(math.prod(sizes[a] for a in axes) * data.draw(st.integers(1, 3)) for axes in case.axes_per_dim())
    case = LayoutCase(shape, case.devices, case.axis_names, case.spec)
    by_id = {d.id: d for d in devices}
    mesh = Mesh(np.vectorize(by_id.__getitem__, otypes=[object])(case.devices), case.axis_names)
    index_map = NamedSharding(mesh, PartitionSpec(*case.spec)).devices_indices_map(shape)
    got = {d.id: tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True)) for d, index in index_map.items()}
    assert got == case.shards()


def test_balance_limit_rejects_an_unbalanced_plan():
    # Four replicas of one shard feeding four disjoint receivers: without balancing, the first
    # replica sends everything.
    src = LayoutCase((8, 8), np.arange(4), ("x",), ())
    dst = LayoutCase((8, 8), np.arange(4, 8), ("x",), ("x",))
    lazy = jreshard.plan(src.layout(), dst.layout(), balance=False)
    limit = sender_load_limit(src, dst)
    assert lazy.stats().max_send_bytes > limit
    assert jreshard.plan(src.layout(), dst.layout()).stats().max_send_bytes <= limit
