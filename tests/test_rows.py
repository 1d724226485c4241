"""The compact row sets a plan keeps per group: what each tensor reads back from them equals the oracle, and
the plan's arrays equal the sum of its tensors'."""

from __future__ import annotations

import numpy as np
import pytest

from jreshard import Layout, Mesh, plan
from jreshard.core.rows import ArrayRows, PairRows, TiledRows
from tests.helpers import assert_plan_ok


def _tree(layers: int, spec_src, spec_dst, shape=(64,)):
    src_mesh = Mesh(np.arange(16).reshape(4, 4), ("fsdp", "tp"))
    dst_mesh = Mesh(np.arange(16, 24).reshape(2, 4), ("dp", "tp"))
    src = {f"l{i}": Layout(shape, src_mesh, spec_src, "bfloat16") for i in range(layers)}
    dst = {f"l{i}": Layout(shape, dst_mesh, spec_dst, "float32" if i % 2 else "bfloat16") for i in range(layers)}
    return src, dst


@pytest.mark.parametrize("spec_src, spec_dst, shape, kind", [
    # replicated over tp at the source, whole on every destination: senders chosen per row, rows in order
    (("fsdp",), (), (64,), TiledRows),
    # one overlap per destination, not in order: rows of its own, gathered in sorted order
    (("fsdp",), ("tp",), (64,), ArrayRows),
    # senders fixed by the meshes: one row set per mesh pair
    (("fsdp", "tp"), (None, "tp"), (16, 32), PairRows),
])
def test_each_tensor_of_a_group_equals_the_oracle(spec_src, spec_dst, shape, kind):
    src, dst = _tree(6, spec_src, spec_dst, shape)
    p = plan(src, dst)
    assert {type(g) for g in p._groups} == {kind}
    for tp in p.tensors.values():
        assert_plan_ok(tp)
        if kind is not ArrayRows:  # shared between tensors: read only
            assert not tp.move_src.flags.writeable and not tp.move_lo.flags.writeable
    rows = p.move_arrays()
    got = np.zeros((24, 24), np.int64)
    np.add.at(got, (rows.src, rows.dst), rows.nbytes)
    want = np.zeros((24, 24), np.int64)
    for tp in p.tensors.values():
        ma = tp.move_arrays()
        np.add.at(want, (ma.src, ma.dst), ma.nbytes)
    np.testing.assert_array_equal(got, want)
    assert rows.moves.sum() == sum(len(tp.move_src) for tp in p.tensors.values())


def test_rows_out_of_order_are_sorted_and_kept_whole():
    """Where the chosen senders would leave a tensor's rows out of (dst, src, box) order, the group keeps
    sorted rows of its own (ArrayRows), and every tensor still equals the oracle."""
    mesh = Mesh(np.array([[3, 2], [1, 0]]), ("a", "b"))  # the upper rows' senders above the lower rows'
    src = {f"t{i}": Layout((8, 8), mesh, ("a",), "float32") for i in range(4)}
    dst = {f"t{i}": Layout((8, 8), Mesh([4, 5], "x"), (None, "x"), "float32") for i in range(4)}
    p = plan(src, dst)
    for tp in p.tensors.values():
        assert_plan_ok(tp)
        order = np.lexsort([tp.move_lo[:, 1], tp.move_lo[:, 0], tp.move_src, tp.move_dst])
        assert (order == np.arange(len(order))).all()
        assert tp.move_lo[:, 0].tolist() == [4, 0, 4, 0]  # the lower rows first: their sender's id is lower
    assert {type(g) for g in p._groups} == {ArrayRows}


def test_each_group_keeps_its_leaves_bounds_as_arrays_and_the_plan_sums_them():
    src, dst = _tree(6, ("fsdp",), ("tp",), (64,))
    src["w"] = Layout((16, 32), Mesh(np.arange(16).reshape(4, 4), ("fsdp", "tp")), ("fsdp", "tp"), "bfloat16")
    dst["w"] = Layout((16, 32), Mesh(np.arange(16, 24).reshape(2, 4), ("dp", "tp")), (None, "tp"), "bfloat16")
    p = plan(src, dst)
    assert len(p._groups) == 2
    tensors = list(p.tensors.values())
    assert p.stats().lower_bound_bytes == sum(t.lower_bound_bytes for t in tensors)
    assert p.stats().naive_bytes == sum(t.naive_bytes for t in tensors)
    bounds = p._groups[0].lower
    assert not bounds.leaves.flags.writeable and not bounds.nbytes.flags.writeable
    missing = next(i for i in range(len(tensors)) if i not in bounds.leaves.tolist())
    with pytest.raises(KeyError):
        bounds[missing]
