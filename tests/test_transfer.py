"""jreshard.transfer on 8 simulated CPU devices: a seeded sweep against the NumPy oracle,
features (casts, donation, plan reuse, the memory cap, no re-tracing) and bad input."""

from __future__ import annotations

import itertools
import math
import os
import random

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreshard
from jreshard import reference
from jreshard.jax_executor import transfer as _transfer

DEVICES = np.array(jax.devices())
TRAIN = jax.sharding.Mesh(DEVICES[:4], ("fsdp",))
SERVE = jax.sharding.Mesh(DEVICES[4:8].reshape(2, 2), ("dp", "tp"))
# Transports, and "/xla": packing with compiled XLA programs (what backends whose
# buffers are not host memory use) instead of NumPy copies.
TRANSPORTS = ("memcpy", "device_put", "collective", "device_put/xla", "collective/xla")
DTYPES = ("float32", "bfloat16", "int8", "int32")


def xfer(params, target, transport="auto", **kwargs):
    """``jreshard.transfer`` with one of TRANSPORTS."""
    name, _, packing = transport.partition("/")
    old = _transfer._HOST_PACKING_BACKENDS
    if packing == "xla":
        _transfer._HOST_PACKING_BACKENDS = frozenset()
    try:
        return jreshard.transfer(params, target, transport=name, **kwargs)
    finally:
        _transfer._HOST_PACKING_BACKENDS = old


def host_array(shape, dtype, rng) -> np.ndarray:
    """Random bits for the dtype (NaN payloads included for floats): copies must keep every bit."""
    dt = np.dtype(getattr(ml_dtypes, dtype)) if dtype == "bfloat16" else np.dtype(dtype)
    raw = rng.integers(0, 256, size=math.prod(shape) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def bits(a) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8)


def assert_matches_oracle(out, params, hosts, target, plan, dtypes=None):
    """Every leaf has exactly its target sharding and every shard equals the NumPy oracle's, bit for bit."""
    flat_out = jax.tree_util.tree_leaves(out)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
    names = list(plan.tensors)
    for name, got, host, sharding in zip(names, flat_out, hosts, target, strict=True):
        assert got.sharding == sharding, name
        tp = plan[name]
        want_dtype = None if dtypes is None else dtypes[name]
        ref = reference.execute(tp, reference.shard(host, tp.src), dtype=want_dtype)
        assert got.dtype == (want_dtype if want_dtype is not None else host.dtype), name
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(bits(shard.data), bits(ref[shard.device.id]), err_msg=f"{name} {shard.device}")


# --------------------------------------------------------------------------- sweep

MESHES = {  # (device ids, shape, axis names)
    "a4": ((0, 1, 2, 3), (4,), ("x",)),
    "b4": ((4, 5, 6, 7), (2, 2), ("dp", "tp")),
    "c4": ((2, 3, 4, 5), (2, 2), ("u", "v")),
    "a8": (tuple(range(8)), (2, 2, 2), ("pp", "fsdp", "tp")),
    "b8": ((7, 6, 5, 4, 3, 2, 1, 0), (4, 2), ("dp", "tp")),
    "a2": ((0, 1), (2,), ("x",)),
}
PAIRS = [  # (source mesh, destination mesh): disjoint halves, overlapping, identical
    ("a4", "b4"), ("b4", "a4"), ("a4", "c4"), ("a8", "b4"), ("a8", "b8"), ("b8", "a8"), ("a4", "a4"), ("a2", "b4"),
    ("b4", "b4"),
]


def jax_mesh(key):
    ids, shape, names = MESHES[key]
    return jax.sharding.Mesh(DEVICES[list(ids)].reshape(shape), names)


@st.composite
def spec_for(draw, names, rank):
    """A PartitionSpec: each mesh axis shards at most one dim, possibly several axes on one dim."""
    entries = [[] for _ in range(rank)]
    for axis in names:
        dim = draw(st.integers(-1, rank - 1)) if rank else -1
        if dim >= 0:
            entries[dim].append(axis)
    return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


@st.composite
def cases(draw):
    src_key, dst_key = draw(st.sampled_from(PAIRS))
    src_mesh, dst_mesh = jax_mesh(src_key), jax_mesh(dst_key)
    leaves = {}
    for k in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(0, 3))
        shape = tuple(8 * draw(st.integers(1, 2)) for _ in range(rank))  # divisible by any axis product
        leaves[f"t{k}"] = (shape, draw(st.sampled_from(DTYPES)), draw(spec_for(src_mesh.axis_names, rank)),
                           draw(spec_for(dst_mesh.axis_names, rank)))
    transport = draw(st.sampled_from(TRANSPORTS))
    cap = draw(st.sampled_from([_transfer.DEFAULT_MAX_BYTES_IN_FLIGHT, 96]))
    return src_mesh, dst_mesh, leaves, transport, cap, draw(st.integers(0, 2**31))


# A fixed small number of examples in CI (every example compiles programs); the
# "thorough" profile (JRESHARD_HYPOTHESIS_PROFILE=thorough) runs the profile's count.
SWEEP_EXAMPLES = 24 if os.environ.get("JRESHARD_HYPOTHESIS_PROFILE", "ci") == "ci" else settings().max_examples


@settings(max_examples=SWEEP_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_sweep_bit_exact_against_oracle(case):
    src_mesh, dst_mesh, leaves, transport, cap, seed = case
    rng = np.random.default_rng(seed)
    hosts, params, target = [], {}, {}
    for name, (shape, dtype, sspec, dspec) in leaves.items():
        host = host_array(shape, dtype, rng)
        hosts.append(host)
        params[name] = jax.device_put(host, NamedSharding(src_mesh, sspec))
        target[name] = NamedSharding(dst_mesh, dspec)
    plan = jreshard.plan(params, target)
    out = xfer(params, target, plan=plan, transport=transport, max_bytes_in_flight=cap)
    assert_matches_oracle(out, params, hosts, [target[k] for k in leaves], plan)


# --------------------------------------------------------------------------- features


@pytest.fixture
def model():
    rng = np.random.default_rng(0)
    hosts = {
        "embed": host_array((64, 16), "float32", rng),
        "layers": [{"wq": host_array((16, 32), "bfloat16", rng), "norm": host_array((16,), "float32", rng)}
                   for _ in range(2)],
        "step": np.array(7, np.int32),
    }
    params = jax.tree_util.tree_map(lambda h: jax.device_put(h, NamedSharding(TRAIN, P("fsdp") if h.ndim else P())),
                                    hosts)
    return hosts, params


def _target(params):
    def spec(x):
        return NamedSharding(SERVE, P(None, "tp") if x.ndim == 2 else P())

    return jax.tree_util.tree_map(spec, params)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pytree_of_mixed_leaves_with_one_sharding_per_leaf(model, transport):
    hosts, params = model
    target = _target(params)
    out = xfer(params, target, transport=transport)
    plan = jreshard.plan(params, target)
    assert_matches_oracle(out, params, jax.tree_util.tree_leaves(hosts), jax.tree_util.tree_leaves(target), plan)
    s = plan.stats()
    assert s.network_bytes == s.lower_bound_bytes


@pytest.mark.parametrize("transport", ["collective", "device_put/xla", "collective/xla"])
def test_second_sync_does_not_retrace(model, transport):
    _, params = model
    target = _target(params)
    xfer(params, target, transport=transport)
    before = _transfer._TRACES
    jax.block_until_ready(xfer(params, target, transport=transport))
    assert _transfer._TRACES == before


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dtype_cast_as_pytree_moves_only_cast_bytes(model, transport):
    hosts, params = model
    target = _target(params)
    dtype = {"embed": jnp.bfloat16, "layers": [{"wq": None, "norm": "bfloat16"}, None], "step": None}
    out = xfer(params, target, dtype=dtype, transport=transport)
    assert out["embed"].dtype == jnp.bfloat16 and out["layers"][0]["norm"].dtype == jnp.bfloat16
    assert out["layers"][1]["norm"].dtype == jnp.float32 and out["step"].dtype == jnp.int32
    want = np.asarray(jnp.asarray(hosts["embed"]).astype(jnp.bfloat16))  # XLA's rounding
    np.testing.assert_array_equal(bits(out["embed"]), bits(want))
    np.testing.assert_array_equal(bits(out["layers"][1]["wq"]), bits(hosts["layers"][1]["wq"]))
    cast_plan = jreshard.plan(params, target, dtype=dtype)
    plain_plan = jreshard.plan(params, target)
    assert cast_plan["embed"].stats().network_bytes * 2 == plain_plan["embed"].stats().network_bytes


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_donate_deletes_sources_once_sent(model, transport):
    hosts, params = model
    out = xfer(params, _target(params), donate=True, transport=transport)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(params))
    np.testing.assert_array_equal(bits(out["embed"]), bits(hosts["embed"]))


def test_unchanged_leaf_is_returned_as_is_and_kept_when_donating(model):
    _, params = model
    same = NamedSharding(TRAIN, P("fsdp"))
    out = jreshard.transfer({"e": params["embed"]}, same, donate=True)
    assert out["e"] is params["embed"] and not params["embed"].is_deleted()


def test_same_shard_on_same_device_is_reused_without_copy():
    mesh = jax.sharding.Mesh(DEVICES[:4].reshape(2, 2), ("a", "b"))
    x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("a")))
    other = jax.sharding.Mesh(DEVICES[:4].reshape(2, 2), ("c", "d"))  # same devices, other names
    out = jreshard.transfer(x, NamedSharding(other, P("c")))
    src = {s.device.id: s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    assert all(s.data.unsafe_buffer_pointer() == src[s.device.id] for s in out.addressable_shards)


@pytest.mark.parametrize("transport", ["memcpy", "device_put", "collective"])
def test_output_blocks_are_recycled_only_after_their_arrays_are_gone(transport):
    import gc

    jreshard.release_transfer_buffers()
    rng = np.random.default_rng(7)
    hosts = [host_array((64, 48), "float32", rng) for _ in range(3)]
    src, dst = NamedSharding(TRAIN, P("fsdp")), NamedSharding(SERVE, P("dp", "tp"))
    first = xfer(jax.device_put(hosts[0], src), dst, transport=transport)
    pointers = {s.data.unsafe_buffer_pointer() for s in first.addressable_shards}
    # While `first` lives, a second sync must not write into its memory.
    second = xfer(jax.device_put(hosts[1], src), dst, transport=transport)
    assert pointers.isdisjoint(s.data.unsafe_buffer_pointer() for s in second.addressable_shards)
    np.testing.assert_array_equal(bits(first), bits(hosts[0]))
    np.testing.assert_array_equal(bits(second), bits(hosts[1]))
    # Once it is gone its blocks are refilled by the next sync of the same shapes.
    del first
    gc.collect()
    free, _ = _transfer._OUTPUTS.stats()
    assert free >= hosts[0].nbytes
    third = xfer(jax.device_put(hosts[2], src), dst, transport=transport)
    assert pointers == {s.data.unsafe_buffer_pointer() for s in third.addressable_shards}
    np.testing.assert_array_equal(bits(third), bits(hosts[2]))
    np.testing.assert_array_equal(bits(second), bits(hosts[1]))
    jreshard.release_transfer_buffers()
    assert _transfer._OUTPUTS.stats()[0] == 0
    del second, third
    gc.collect()
    assert _transfer._OUTPUTS.stats()[0] == 0  # released: blocks in use are dropped, not kept


def test_a_numpy_view_of_one_output_shard_keeps_its_block_out_of_the_pool():
    import gc

    jreshard.release_transfer_buffers()
    rng = np.random.default_rng(9)
    hosts = [host_array((64, 48), "float32", rng) for _ in range(2)]
    src, dst = NamedSharding(TRAIN, P("fsdp")), NamedSharding(SERVE, P("dp", "tp"))
    out = jreshard.transfer(jax.device_put(hosts[0], src), dst)
    view = np.asarray(out.addressable_shards[0].data)  # zero-copy on CPU
    want = view.copy()
    del out
    gc.collect()
    again = jreshard.transfer(jax.device_put(hosts[1], src), dst)
    assert view.ctypes.data not in {s.data.unsafe_buffer_pointer() for s in again.addressable_shards}
    np.testing.assert_array_equal(view, want)
    np.testing.assert_array_equal(bits(again), bits(hosts[1]))


def test_donating_an_output_to_a_jitted_function_keeps_its_result_safe_from_the_pool():
    import gc

    rng = np.random.default_rng(10)
    hosts = [host_array((64, 48), "int32", rng) for _ in range(2)]
    src, dst = NamedSharding(TRAIN, P("fsdp")), NamedSharding(SERVE, P("dp", "tp"))
    out = jreshard.transfer(jax.device_put(hosts[0], src), dst)
    y = jax.jit(lambda a: a + 1, donate_argnums=0)(out)
    gc.collect()
    again = jreshard.transfer(jax.device_put(hosts[1], src), dst)
    assert {s.data.unsafe_buffer_pointer() for s in y.addressable_shards}.isdisjoint(
        s.data.unsafe_buffer_pointer() for s in again.addressable_shards)
    np.testing.assert_array_equal(np.asarray(y), hosts[0] + 1)
    np.testing.assert_array_equal(bits(again), bits(hosts[1]))


def test_output_pool_keeps_at_most_one_sync_of_free_blocks():
    import gc

    jreshard.release_transfer_buffers()
    rng = np.random.default_rng(8)
    host = host_array((32, 16), "int32", rng)
    x = jax.device_put(host, NamedSharding(TRAIN, P("fsdp")))
    outs = [jreshard.transfer(x, NamedSharding(SERVE, P("dp", "tp"))) for _ in range(4)]
    assert _transfer._OUTPUTS.stats()[1] >= 4 * host.nbytes  # every live output is its own block
    del outs
    gc.collect()
    free, used = _transfer._OUTPUTS.stats()
    assert (free, used) == (host.nbytes, 0)  # one sync's output (four distinct shards) is kept, the rest freed


def test_plan_from_shape_dtype_structs_is_reused_and_refused_when_it_does_not_match(model):
    hosts, params = model
    target = _target(params)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    plan = jreshard.plan(abstract, target)
    assert plan is jreshard.plan(params, target)  # the same plan, cached
    out = jreshard.transfer(params, target, plan=plan)
    assert_matches_oracle(out, params, jax.tree_util.tree_leaves(hosts), jax.tree_util.tree_leaves(target), plan)
    other = jreshard.plan(params, NamedSharding(SERVE, P()))
    with pytest.raises(ValueError, match=r"plan does not match params/target: for tensor 'embed' the plan's destination"):
        jreshard.transfer(params, target, plan=other)
    with pytest.raises(ValueError, match="plan does not match params: it covers tensors"):
        jreshard.transfer({"x": params["embed"]}, NamedSharding(SERVE, P()), plan=other)
    with pytest.raises(ValueError, match="plan does not match"):
        jreshard.transfer(params, target, plan=jreshard.plan(params, target, dtype=jnp.bfloat16))


@pytest.mark.parametrize("transport", ["device_put", "collective", "collective/xla"])
def test_tensor_larger_than_the_cap_arrives_intact_in_waves(transport):
    rng = np.random.default_rng(1)
    host = host_array((32, 16), "float32", rng)  # 2 KiB; each device receives 1 KiB
    x = jax.device_put(host, NamedSharding(TRAIN, P("fsdp")))
    target = NamedSharding(SERVE, P(None, "tp"))
    cap = 400
    out = xfer(x, target, max_bytes_in_flight=cap, transport=transport)
    np.testing.assert_array_equal(bits(out), bits(host))
    assert out.sharding == target
    ex = next(reversed(_transfer._EXECUTORS.values()))
    assert len(ex.waves) > 1
    for w in ex.waves:
        load = {}
        for bufs in w.rounds:
            for b in bufs:
                load[b.src] = load.get(b.src, 0) + b.nbytes
                load[b.dst] = load.get(b.dst, 0) + b.nbytes
        assert max(load.values()) <= cap


def test_partition_spec_target_with_mesh_and_prefix_targets(model):
    hosts, params = model
    out = jreshard.transfer(params, {"embed": P("tp"), "layers": P(), "step": P()}, mesh=SERVE)
    assert out["embed"].sharding == NamedSharding(SERVE, P("tp"))
    assert out["layers"][1]["wq"].sharding == NamedSharding(SERVE, P())
    np.testing.assert_array_equal(bits(out["layers"][1]["wq"]), bits(hosts["layers"][1]["wq"]))
    mesh = jreshard.Mesh([[4, 5], [6, 7]], ("dp", "tp"))  # a jreshard.Mesh is looked up by device id
    out2 = jreshard.transfer(params["embed"], P(None, "tp"), mesh=mesh)
    np.testing.assert_array_equal(bits(out2), bits(hosts["embed"]))


def test_auto_uses_memcpy_on_cpu_in_one_process(model):
    _, params = model
    jreshard.transfer(params, _target(params))
    assert next(reversed(_transfer._EXECUTORS.values())).transport == "memcpy"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_empty_and_scalar_leaves(transport):
    empty = jax.device_put(np.zeros((0, 8), np.float32), NamedSharding(TRAIN, P(None, "fsdp")))
    scalar = jax.device_put(np.float32(3.5), NamedSharding(TRAIN, P()))
    out = xfer({"e": empty, "s": scalar}, NamedSharding(SERVE, P()), transport=transport)
    assert out["e"].shape == (0, 8) and out["e"].sharding == NamedSharding(SERVE, P())
    assert float(out["s"]) == 3.5 and out["s"].sharding == NamedSharding(SERVE, P())


# --------------------------------------------------------------------------- schedule pieces


def test_edge_colouring_uses_max_degree_rounds_and_each_round_is_a_matching():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        pairs = sorted({(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 40))} - {(i, i) for i in range(n)})
        if not pairs:
            continue
        colours = _transfer._colour(pairs)
        degree = max(max(sum(1 for p in pairs if p[0] == s) for s, _ in pairs),
                     max(sum(1 for p in pairs if p[1] == t) for _, t in pairs))
        assert max(colours) + 1 == degree
        for c in set(colours):
            members = [p for p, k in zip(pairs, colours, strict=True) if k == c]
            assert len({s for s, _ in members}) == len(members) == len({t for _, t in members})


@pytest.mark.parametrize("shape,limit", [((10, 7), 28), ((10, 7), 5), ((3, 4, 5), 4), ((9,), 100), ((2, 3), 1)])
def test_split_box_covers_the_box_once_in_pieces_under_the_limit(shape, limit):
    lo = tuple(0 for _ in shape)
    pieces = _transfer._split_box(lo, shape, 1, limit)
    count = np.zeros(shape, np.int32)
    for plo, phi in pieces:
        assert math.prod(b - a for a, b in zip(plo, phi, strict=True)) <= limit
        count[tuple(slice(a, b) for a, b in zip(plo, phi, strict=True))] += 1
    assert (count == 1).all()


# --------------------------------------------------------------------------- bad input

X = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(TRAIN, P("fsdp")))
T = NamedSharding(SERVE, P(None, "tp"))

ERRORS = [
    # (name, args, kwargs, exception, message pattern)
    ("target of another structure", ({"a": X, "b": X}, {"a": T}), {}, ValueError, r"target must be .* pytree prefix of params"),
    ("target rank too long", ({"a": X}, NamedSharding(SERVE, P(None, None, "tp"))), {}, ValueError,
     r"target at 'a' .* does not fit the array of shape \(8, 4\)"),
    ("target does not divide", ({"a": X}, NamedSharding(jax.sharding.Mesh(DEVICES[:3], ("t",)), P("t"))), {}, ValueError,
     r"target at 'a' .* does not fit the array of shape \(8, 4\)"),
    ("non-jax leaf", ({"a": np.ones(4)}, T), {}, TypeError, r"params leaf at 'a' must be a jax.Array, got ndarray"),
    ("abstract leaf", ({"a": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=X.sharding)}, T), {}, TypeError,
     r"params leaf at 'a' must be a jax.Array, got ShapeDtypeStruct"),
    ("spec without mesh", ({"a": X}, P("tp")), {}, TypeError, r"target at 'a' is a PartitionSpec .* no mesh="),
    ("sharding with mesh", ({"a": X}, T), {"mesh": SERVE}, TypeError, r"pass mesh= only with PartitionSpec targets"),
    ("spec naming a missing axis", ({"a": X}, P("nope")), {"mesh": SERVE}, ValueError, r"target at 'a' P\('nope',\) does not fit mesh .*nope"),
    ("devices not present", ({"a": X}, P("tp")), {"mesh": jreshard.Mesh([[4, 5], [6, 99]], ("dp", "tp"))}, ValueError,
     r"mesh .* names devices \[99\] that jax does not have"),
    ("target of wrong kind", ({"a": X}, "tp"), {}, TypeError, r"target at 'a' must be a jax.sharding.Sharding"),
    ("bad dtype", ({"a": X}, T), {"dtype": "float33"}, TypeError, r"dtype at 'a' must be a NumPy or ml_dtypes dtype"),
    ("dtype of another structure", ({"a": X, "b": X}, T), {"dtype": {"z": "bfloat16"}}, ValueError, r"dtype must be a dtype"),
    ("donate not bool", ({"a": X}, T), {"donate": 1}, TypeError, r"donate must be True or False, got 1"),
    ("unknown transport", ({"a": X}, T), {"transport": "rdma"}, ValueError, r"transport must be one of"),
    ("cap not int", ({"a": X}, T), {"max_bytes_in_flight": 1.5}, TypeError, r"max_bytes_in_flight must be an int"),
    ("cap too small", ({"a": X}, T), {"max_bytes_in_flight": 0}, ValueError, r"max_bytes_in_flight must be at least"),
    ("plan of wrong kind", ({"a": X}, T), {"plan": "p"}, TypeError, r"plan must be a jreshard.Plan or TensorPlan"),
    ("empty params", ({}, T), {}, ValueError, r"params is an empty pytree"),
]


@pytest.mark.parametrize("name,args,kwargs,exc,pattern", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_is_refused_clearly_and_changes_nothing(name, args, kwargs, exc, pattern):
    kwargs = dict(kwargs)
    kwargs.setdefault("donate", True)
    with pytest.raises(exc, match=pattern):
        jreshard.transfer(*args, **kwargs)
    assert not X.is_deleted()


def test_deleted_input_is_refused():
    y = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(TRAIN, P("fsdp")))
    y.delete()
    with pytest.raises(ValueError, match=r"params leaf at 'a' has been deleted"):
        jreshard.transfer({"a": y}, T)


def test_all_layout_pairs_of_a_small_mesh_pair_exhaustively():
    """Spec pairs of a 2-D tensor between FSDP4 and TP2xDP2, collective transport with XLA packing."""
    host = np.arange(8 * 8, dtype=np.int32).reshape(8, 8)
    src_specs = [P(), P("fsdp"), P(None, "fsdp")]
    dst_specs = [P(), P(None, "tp"), P("tp", "dp"), P(None, ("tp", "dp"))]
    params = {f"s{i}": jax.device_put(host, NamedSharding(TRAIN, s)) for i, s in enumerate(src_specs)}
    for j, d in enumerate(dst_specs):
        target = NamedSharding(SERVE, d)
        out = xfer(params, target, transport="collective/xla")
        for i in range(len(src_specs)):
            assert out[f"s{i}"].sharding == target
            np.testing.assert_array_equal(np.asarray(out[f"s{i}"]), host, err_msg=f"{src_specs[i]} -> {d}")
    assert len(list(itertools.product(src_specs, dst_specs))) == 12


def test_docstring_example_runs():
    import doctest

    result = doctest.testmod(_transfer, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_assemble_concatenates_guillotine_tilings_and_refuses_others():
    def piece(start, shape):
        return (start, jnp.full(shape, len(start) + start[0] * 10 + start[1], jnp.uint32))

    grid = [piece((0, 0), (2, 3)), piece((0, 3), (2, 1)), piece((2, 0), (1, 4))]
    out = _transfer._assemble(grid, (3, 4))
    want = np.zeros((3, 4), np.uint32)
    for start, v in grid:
        want[start[0]:start[0] + v.shape[0], start[1]:start[1] + v.shape[1]] = np.asarray(v)
    np.testing.assert_array_equal(np.asarray(out), want)
    # A pinwheel has no guillotine cut; a partial cover is not a tiling: both fall back.
    pinwheel = [piece((0, 0), (2, 1)), piece((0, 1), (1, 2)), piece((1, 2), (2, 1)), piece((2, 0), (1, 2)),
                piece((1, 1), (1, 1))]
    assert _transfer._assemble(pinwheel, (3, 3)) is None
    assert _transfer._assemble(grid[:2], (3, 4)) is None


@pytest.mark.parametrize("transport", ["memcpy", "collective", "collective/xla"])
def test_complex_dtypes_move_exactly_or_are_refused_clearly(transport):
    host = (np.arange(64).reshape(8, 8) + 1j * np.arange(64).reshape(8, 8)[::-1]).astype(np.complex64)
    x = jax.device_put(host, NamedSharding(TRAIN, P("fsdp")))
    if transport.endswith("/xla") and not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="has dtype complex64, which this backend's compiled packing cannot move"):
            xfer(x, T, transport=transport)
        return
    np.testing.assert_array_equal(np.asarray(xfer(x, T, transport=transport)), host)
