"""Box and the dtype resolver: value semantics, geometry, splitting, errors."""

from __future__ import annotations

import itertools
import pickle

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

from jreshard import Box, Layout, Mesh
from jreshard.core.box import split_box
from jreshard.core.dtypes import canonical_dtype, itemsize_of, numpy_dtype


def test_box_is_a_tuple_of_slices():
    box = Box([(1, 3), slice(0, 4)])
    assert box == (slice(1, 3), slice(0, 4))
    assert repr(box) == "(slice(1, 3, None), slice(0, 4, None))"
    assert str(box) == "[1:3, 0:4]"
    assert np.arange(20).reshape(5, 4)[box].tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert (box.lo, box.hi, box.shape, box.size) == ((1, 0), (3, 4), (2, 4), 8)
    assert box.slices() == (slice(1, 3), slice(0, 4)) and type(box.slices()) is tuple
    assert box.bounds() == ((1, 3), (0, 4))


def test_box_value_semantics():
    a = Box.from_bounds((np.int64(0), 2), (4, np.int32(5)))
    b = Box([(0, 4), (2, 5)])
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    assert a != Box([(0, 4), (2, 6)])
    assert all(type(s.start) is int and type(s.stop) is int for s in a)
    restored = pickle.loads(pickle.dumps(a))
    assert restored == a and type(restored) is Box
    assert Box() == () and Box().size == 1 and not Box().empty


def test_layout_boxes_are_boxes():
    layout = Layout((6, 4), Mesh([[0, 1], [2, 3]], ("dp", "tp")), (None, "tp"))
    assert all(type(b) is Box for b in layout.shards().values())
    assert type(layout.shard_box(3)) is Box and str(layout.shard_box(3)) == "[0:6, 2:4]"


def test_intersect_contains_relative_to():
    a = Box([(0, 6), (2, 4)])
    assert a.intersect(Box([(4, 8), (0, 3)])) == Box([(4, 6), (2, 3)])
    miss = a.intersect(Box([(7, 9), (0, 4)]))
    assert miss.empty and miss.size == 0 and miss.lo[0] == miss.hi[0] == 7
    assert a.contains(Box([(1, 2), (2, 4)])) and not a.contains(Box([(1, 2), (1, 4)]))
    assert Box([(4, 6), (3, 4)]).relative_to(a) == Box([(4, 6), (1, 2)])
    with pytest.raises(ValueError, match=r"box \[4:7, 3:4\] does not lie inside \[0:6, 2:4\]"):
        Box([(4, 7), (3, 4)]).relative_to(a)


BOX_ERRORS = [
    ("not a sequence", lambda: Box(3), TypeError, r"box must be a sequence of slices"),
    ("string", lambda: Box("ab"), TypeError, r"box must be a sequence of slices"),
    ("entry of wrong kind", lambda: Box([3]), TypeError, r"box dim 0 must be a slice or a \(lo, hi\) pair"),
    ("float bound", lambda: Box([(0, 2.0)]), TypeError, r"box dim 0 upper bound must be an int, got float"),
    ("bool bound", lambda: Box([(True, 2)]), TypeError, r"box dim 0 lower bound must be an int, got bool"),
    ("open slice", lambda: Box([slice(None, 3)]), ValueError, r"box dim 0 is slice\(None, 3, None\); give both bounds"),
    ("step", lambda: Box([slice(0, 4, 2)]), ValueError, r"box dim 0 has step 2"),
    ("lo above hi", lambda: Box([(0, 1), (3, 2)]), ValueError,
     r"box dim 1 is \[3, 2\); bounds must satisfy 0 <= lo <= hi"),
    ("negative", lambda: Box([(-1, 2)]), ValueError, r"box dim 0 is \[-1, 2\)"),
    ("bounds of unequal length", lambda: Box.from_bounds((0,), (1, 2)), ValueError, r"one bound per dim"),
    ("intersect other ndim", lambda: Box([(0, 1)]).intersect(Box([(0, 1), (0, 1)])), ValueError,
     r"1-dim box with a 2-dim box"),
    ("split limit", lambda: split_box(Box([(0, 4)]), 4, 0), ValueError, r"positive byte counts, got 4 and 0"),
    ("split itemsize type", lambda: split_box(Box([(0, 4)]), 4.0, 8), TypeError, r"itemsize must be an int"),
]


@pytest.mark.parametrize("name,fn,exc,pattern", BOX_ERRORS, ids=[c[0] for c in BOX_ERRORS])
def test_box_bad_input(name, fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


@given(
    st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), max_size=4),
    st.sampled_from([1, 2, 4, 8]),
    st.integers(1, 200),
)
def test_split_box_covers_once_contiguously_under_the_limit(dims, itemsize, limit):
    box = Box([(lo, lo + n) for lo, n in dims])
    parts = split_box(box, itemsize, limit)
    # Element flat indices (row-major inside the box) of each part, in order.
    grid = np.arange(box.size).reshape(box.shape)
    flat = [grid[part.relative_to(box).slices()].ravel() for part in parts]
    covered = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    np.testing.assert_array_equal(covered, np.arange(box.size))  # once, in row-major order
    for part, idx in zip(parts, flat, strict=True):
        assert box.contains(part)
        assert part.size * itemsize <= limit or part.size == 1 or box.empty
        if len(idx):
            assert idx[-1] - idx[0] == len(idx) - 1  # contiguous
    if box.size * itemsize <= limit or box.empty:
        assert parts == [box]


def test_split_box_takes_runs_of_whole_rows():
    parts = split_box(Box([(0, 5), (0, 2), (0, 3)]), 1, 12)
    assert [str(p) for p in parts] == ["[0:2, 0:2, 0:3]", "[2:4, 0:2, 0:3]", "[4:5, 0:2, 0:3]"]
    parts = split_box(Box([(0, 2), (0, 3)]), 8, 4)  # elements above the limit stand alone
    assert [p.bounds() for p in parts] == [((i, i + 1), (j, j + 1)) for i, j in itertools.product(range(2), range(3))]


@pytest.mark.parametrize("dtype,name,itemsize", [
    ("float32", "float32", 4), (np.float16, "float16", 2), (np.dtype("int8"), "int8", 1), ("bool", "bool", 1),
    ("bfloat16", "bfloat16", 2), (ml_dtypes.float8_e4m3fn, "float8_e4m3fn", 1), ("complex64", "complex64", 8),
])
def test_dtype_resolution(dtype, name, itemsize):
    assert canonical_dtype(dtype) == name
    assert itemsize_of(dtype) == itemsize == itemsize_of(name)
    assert numpy_dtype(dtype) == np.dtype(getattr(ml_dtypes, name, None) or name)
    assert canonical_dtype(None) is None and numpy_dtype(None) is None and itemsize_of(None) == 1


@pytest.mark.parametrize("dtype,pattern", [
    ("float13", r"dtype at 'w' must be a NumPy or ml_dtypes dtype or its name, got 'float13'"),
    (object, r"dtype at 'w' must be a numeric dtype .* got object"),
    ("U4", r"dtype at 'w' must be a numeric dtype .* got <U4"),
    ("datetime64[s]", r"dtype at 'w' must be a numeric dtype .* got datetime64\[s\]"),
])
def test_dtype_refuses_non_numeric(dtype, pattern):
    with pytest.raises(TypeError, match=pattern):
        canonical_dtype(dtype, arg="dtype at 'w'")
