"""Mesh and Layout: parsing, shard boxes (against a NumPy slicing oracle), errors."""

from __future__ import annotations

import dataclasses
import pickle
import re

import numpy as np
import pytest

from jreshard import Layout, Mesh


def test_mesh_basics():
    mesh = Mesh(np.array([[3, 1], [0, 2]]), ("dp", "tp"))
    assert mesh.shape == (2, 2)
    assert mesh.device_ids == (3, 1, 0, 2)
    assert mesh.axis_sizes == {"dp": 2, "tp": 2}
    assert mesh.position(0) == 2
    assert 2 in mesh and 7 not in mesh
    assert mesh == Mesh([[3, 1], [0, 2]], ["dp", "tp"])
    assert hash(mesh) == hash(Mesh([[3, 1], [0, 2]], ("dp", "tp")))
    assert mesh != Mesh([[3, 1], [0, 2]], ("x", "tp"))
    assert "dp=2, tp=2" in repr(mesh)
    assert pickle.loads(pickle.dumps(mesh)) == mesh
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'shape'"):
        mesh.shape = (4,)  # frozen


def test_mesh_zero_axes_and_1d_name():
    assert Mesh(5, ()).device_ids == (5,)
    assert Mesh([0, 1, 2], "x").axis_names == ("x",)


def test_shards_uneven_follow_chunk_convention():
    mesh = Mesh(range(4), ("x",))
    layout = Layout((10,), mesh, ("x",))
    # ceil(10/4) = 3: [0,3) [3,6) [6,9) [9,10)
    assert [layout.shard_box(d)[0] for d in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    layout = Layout((5,), Mesh(range(4), ("x",)), ("x",))
    # ceil(5/4) = 2: [0,2) [2,4) [4,5) [5,5) -- the last shard is empty, as torch.chunk does
    assert [layout.shard_box(d)[0] for d in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 5)]


def test_multi_axis_major_to_minor():
    mesh = Mesh(np.arange(8).reshape(2, 2, 2), ("a", "b", "c"))
    layout = Layout((8, 6), mesh, (("c", "a"), "b"))
    # dim 0 is split 4 ways by (c major, a minor): index = c * 2 + a.
    for d in range(8):
        a, b, c = np.unravel_index(d, (2, 2, 2))
        i0, i1 = c * 2 + a, b
        assert layout.shard_box(d) == (slice(2 * i0, 2 * i0 + 2), slice(3 * i1, 3 * i1 + 3))
    assert layout.num_shards == 8 and layout.replication == 1


def test_replicas_and_holders():
    mesh = Mesh([[0, 1], [2, 3]], ("dp", "tp"))
    layout = Layout((4, 4), mesh, (None, "tp"))
    assert layout.replica_groups() == ((0, 2), (1, 3))
    assert layout.holders((slice(0, 4), slice(2, 3))) == (1, 3)
    assert layout.holders((slice(0, 4), slice(1, 3))) == ()
    assert layout.replication == 2


def test_zero_d_and_size_zero():
    mesh = Mesh([0, 1], ("x",))
    scalar = Layout((), mesh, ())
    assert scalar.shard_box(1) == ()
    empty = Layout((0, 3), mesh, ("x",))
    assert empty.shard_box(1) == (slice(0, 0), slice(0, 3))


def test_partition_spec_object_is_accepted():
    jax_sharding = pytest.importorskip("jax.sharding")
    mesh = Mesh([[0, 1], [2, 3]], ("dp", "tp"))
    spec = jax_sharding.PartitionSpec(("dp", "tp"), None)
    assert Layout((8, 2), mesh, spec) == Layout((8, 2), mesh, (("dp", "tp"),))


def test_from_jax_named_sharding():
    jax = pytest.importorskip("jax")
    from jax.sharding import Mesh as JaxMesh, NamedSharding, PartitionSpec as P

    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    sharding = NamedSharding(JaxMesh(devices, ("dp", "tp")), P("tp"))
    layout = Layout.from_jax((8, 4), sharding, dtype="bfloat16")
    assert layout.mesh.device_ids == tuple(d.id for d in devices.ravel())
    assert layout.spec == ("tp", None) and layout.dim_axes == (("tp",), ())
    assert layout.itemsize == 2
    # Each device's box is the one JAX itself assigns.
    for device, index in sharding.devices_indices_map((8, 4)).items():
        want = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, (8, 4), strict=True))
        assert layout.shard_box(device.id) == want


@pytest.mark.parametrize(
    "dtype,itemsize", [("float32", 4), ("bfloat16", 2), (np.int8, 1), ("float8_e4m3fn", 1), (None, 1)]
)
def test_dtypes(dtype, itemsize):
    layout = Layout((3,), Mesh([0], ("x",)), (), dtype=dtype)
    assert layout.itemsize == itemsize
    hash(layout)


def test_layout_value_semantics():
    mesh = Mesh([0, 1], ("x",))
    a = Layout((4, 2), mesh, ("x", None), "float32")
    b = Layout([4, 2], mesh, ["x"], np.float32)
    assert a == b and hash(a) == hash(b)
    assert repr(a) == "Layout((4, 2), float32, P('x'), Mesh(x=2; devices [0, 1]))"
    assert pickle.loads(pickle.dumps(a)) == a


def _mesh2():
    return Mesh([[0, 1], [2, 3]], ("dp", "tp"))


ERROR_CASES = [
    # (case name, callable, exception type, message pattern)
    ("axis not in mesh", lambda: Layout((4,), _mesh2(), ("fsdp",)), ValueError,
     r"names axis 'fsdp'.*axes are \('dp', 'tp'\)"),
    ("axis used twice", lambda: Layout((4, 4), _mesh2(), ("tp", "tp")), ValueError, r"uses axis 'tp' twice"),
    ("axis twice in a tuple", lambda: Layout((4,), _mesh2(), (("tp", "tp"),)), ValueError, r"uses axis 'tp' twice"),
    ("spec longer than rank", lambda: Layout((4,), _mesh2(), ("dp", "tp")), ValueError,
     r"2 entries but the tensor has 1 dims"),
    ("spec entry of wrong type", lambda: Layout((4,), _mesh2(), (3,)), TypeError, r"spec entry 3 for dim 0"),
    ("spec of wrong type", lambda: Layout((4,), _mesh2(), "tp"), TypeError, r"spec must be a tuple"),
    ("float device id", lambda: Mesh([0.0, 1.0], ("x",)), TypeError, r"integer device ids"),
    ("string device id", lambda: Mesh([[0, "a"]], ("x", "y")), TypeError, r"integer device ids"),
    ("bool device id", lambda: Mesh([True, False], ("x",)), TypeError, r"integer device ids"),
    ("duplicate device id", lambda: Mesh([0, 1, 1], ("x",)), ValueError, r"distinct, got \[1\]"),
    ("negative device id", lambda: Mesh([0, -2], ("x",)), ValueError, r"non-negative ids, got -2"),
    ("devices rank != axis names", lambda: Mesh([[0, 1]], ("x",)), ValueError, r"rank 2 .* 1 names"),
    ("duplicate axis names", lambda: Mesh([[0, 1]], ("x", "x")), ValueError, r"axis_names must be distinct"),
    ("axis name not a string", lambda: Mesh([0, 1], (1,)), TypeError, r"non-empty strings"),
    ("empty mesh", lambda: Mesh([], ("x",)), ValueError, r"at least one device"),
    ("negative dim", lambda: Layout((4, -1), _mesh2(), ()), ValueError, r"non-negative dims, got -1"),
    ("float dim", lambda: Layout((4.0,), _mesh2(), ()), TypeError, r"shape must hold ints"),
    ("mesh of wrong type", lambda: Layout((4,), [0, 1], ()), TypeError, r"mesh must be a jreshard.Mesh"),
    ("unknown dtype", lambda: Layout((4,), _mesh2(), (), dtype="float13"), TypeError, r"dtype must be .*'float13'"),
    ("device not in mesh", lambda: Layout((4,), _mesh2(), ()).shard_box(9), ValueError, r"device 9 is not in the mesh"),
]


@pytest.mark.parametrize("name,fn,exc,pattern", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_input(name, fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_error_messages_show_the_fix():
    with pytest.raises(ValueError) as info:
        Layout((4, 4), _mesh2(), ("tp", "tp"))
    assert re.search(r"a mesh axis may shard at most one dim", str(info.value))


def test_numpy_integers_are_ints():
    mesh = Mesh(np.array([[0, 1], [2, 3]], dtype=np.int32), ("dp", "tp"))
    layout = Layout((np.int64(6), np.int32(4)), mesh, (None, "tp"))
    assert layout.shape == (6, 4) and all(type(n) is int for n in layout.shape)
    assert layout.shard_box(np.int64(3)) == (slice(0, 6), slice(2, 4))
    assert layout.holders((slice(np.int64(0), np.int64(6)), slice(0, 2))) == (0, 2)


def test_byte_count_must_fit_int64():
    mesh = Mesh([0], ("x",))
    assert Layout((1 << 30, 1 << 30), mesh, (), "float32").nbytes == 1 << 62
    too_many = r"shape \(4294967296, 4294967296\) holds 73786976294838206464 bytes, more than the 2\*\*63 - 1"
    with pytest.raises(ValueError, match=too_many):
        Layout((1 << 32, 1 << 32), mesh, (), "float32")
    with pytest.raises(ValueError, match=r"more than the 2\*\*63 - 1 the planner can count"):
        Layout((1 << 31, 1 << 31), mesh, ()).with_dtype("float16")


def test_ndim_and_dim_axes():
    layout = Layout((8, 4, 2), _mesh2(), (("dp", "tp"),))
    assert layout.ndim == 3 and layout.dim_axes == (("dp", "tp"), (), ())
