"""jreshard.transfer on 8 simulated CPU devices: a seeded sweep checked against jax's own
shard indices on the host arrays, features (casts, donation, plan reuse, the memory cap, no
recompilation), the schedule and bad input."""

from __future__ import annotations

import logging
import math
import os
import random
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

import jreshard
from jreshard.core.schedule import edge_colouring, schedule
from jreshard.jax_executor import programs, transfer as _transfer
from jreshard.jax_executor.adapter import parse
from jreshard.jax_executor.host import OUTPUTS

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


def expected(host: np.ndarray, dtype=None) -> np.ndarray:
    """The host array as transfer must deliver it: cast with XLA's rounding where a dtype is asked."""
    return host if dtype is None else np.asarray(jnp.asarray(host).astype(dtype))


def assert_matches_host(out, hosts, targets, dtypes=None):
    """Every leaf has exactly its target sharding, and each shard is ``host[shard.index]``, bit for bit.

    ``hosts``, ``targets`` and ``dtypes`` are pytrees of the structure of ``out`` (dtypes: None
    keeps the host dtype); the shard indices are jax's own.
    """
    flat_out, treedef = jax.tree_util.tree_flatten_with_path(out)
    flat_hosts = treedef.flatten_up_to(hosts)
    flat_targets = treedef.flatten_up_to(targets)
    flat_dtypes = [None] * len(flat_out) if dtypes is None else treedef.flatten_up_to(dtypes)
    for (path, got), host, sharding, dtype in zip(flat_out, flat_hosts, flat_targets, flat_dtypes, strict=True):
        name = jax.tree_util.keystr(path)
        want = expected(host, dtype)
        assert got.sharding == sharding, name
        assert got.dtype == want.dtype, name
        assert {s.device for s in got.addressable_shards} == sharding.addressable_devices, name
        for shard in got.addressable_shards:
            np.testing.assert_array_equal(bits(shard.data), bits(want[shard.index]), err_msg=f"{name} {shard.device}")


# --------------------------------------------------------------------------- sweep

MESHES = {  # (device ids, shape, axis names)
    "a4": ((0, 1, 2, 3), (4,), ("x",)),
    "b4": ((4, 5, 6, 7), (2, 2), ("dp", "tp")),
    "c4": ((2, 3, 4, 5), (2, 2), ("u", "v")),
    "a8": (tuple(range(8)), (2, 2, 2), ("pp", "fsdp", "tp")),
    "b8": ((7, 6, 5, 4, 3, 2, 1, 0), (4, 2), ("dp", "tp")),
    "a2": ((0, 1), (2,), ("x",)),
}
OUT_DTYPES = (None, None, "bfloat16", "float32")  # casts to floats only: float-to-int of random bits is undefined
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
                           draw(spec_for(dst_mesh.axis_names, rank)), draw(st.sampled_from(OUT_DTYPES)))
    transport = draw(st.sampled_from(TRANSPORTS))
    # The default cap, or a third of the bytes: a few buckets, and pieces cut from the larger moves
    # (every bucket compiles programs per device with the XLA packing, so not dozens of them).
    small_cap = draw(st.booleans())
    return src_mesh, dst_mesh, leaves, transport, small_cap, draw(st.integers(0, 2**31))


# A fixed small number of examples in CI (every example compiles programs); the
# "thorough" profile (JRESHARD_HYPOTHESIS_PROFILE=thorough) runs the profile's count.
SWEEP_EXAMPLES = 24 if os.environ.get("JRESHARD_HYPOTHESIS_PROFILE", "ci") == "ci" else settings().max_examples


@settings(max_examples=SWEEP_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_sweep_bit_exact_against_host_arrays(case):
    src_mesh, dst_mesh, leaves, transport, small_cap, seed = case
    rng = np.random.default_rng(seed)
    hosts, params, target, dtypes = {}, {}, {}, {}
    for name, (shape, dtype, sspec, dspec, out_dtype) in leaves.items():
        hosts[name] = host_array(shape, dtype, rng)
        params[name] = jax.device_put(hosts[name], NamedSharding(src_mesh, sspec))
        target[name] = NamedSharding(dst_mesh, dspec)
        dtypes[name] = out_dtype
    total = sum(h.nbytes for h in hosts.values())
    cap = max(64, total // 3) if small_cap else _transfer.DEFAULT_MAX_BYTES_IN_FLIGHT
    out = xfer(params, target, transport=transport, max_bytes_in_flight=cap, dtype=dtypes)
    assert_matches_host(out, hosts, target, dtypes)


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
    assert_matches_host(out, hosts, target)
    s = jreshard.plan(params, target).stats()
    assert s.network_bytes == s.lower_bound_bytes


def compile_log(caplog, fn):
    """The lines jax logs while ``fn`` runs with ``jax.log_compiles`` on: one per trace or compilation."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="jax"), jax.log_compiles():
        jax.block_until_ready(fn())
    return [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage() or "tracing" in r.getMessage()]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_second_sync_compiles_nothing(model, transport, caplog):
    _, params = model
    target = _target(params)
    # float32 -> float16 is a compiled program in every transport (XLA quiets signalling NaNs, NumPy does not)
    dtype = {"embed": jnp.float16, "layers": None, "step": None}
    jax.clear_caches()  # the cast program is shared by all transports: compile it again, for the log to show
    first = compile_log(caplog, lambda: xfer(params, target, transport=transport, dtype=dtype))
    assert first, "the first sync compiles its programs, which the log must show"
    assert compile_log(caplog, lambda: xfer(params, target, transport=transport, dtype=dtype)) == []


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dtype_cast_as_pytree_moves_only_cast_bytes(model, transport):
    hosts, params = model
    target = _target(params)
    dtype = {"embed": jnp.bfloat16, "layers": [{"wq": None, "norm": "bfloat16"}, None], "step": None}
    out = xfer(params, target, dtype=dtype, transport=transport)
    full = {"embed": jnp.bfloat16, "layers": [{"wq": None, "norm": "bfloat16"}, {"wq": None, "norm": None}],
            "step": None}
    assert_matches_host(out, hosts, target, full)
    cast_plan = jreshard.plan(params, target, dtype=dtype)
    plain_plan = jreshard.plan(params, target)
    assert cast_plan["embed"].stats().network_bytes * 2 == plain_plan["embed"].stats().network_bytes


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_donate_deletes_sources_once_sent(model, transport):
    hosts, params = model
    target = _target(params)
    out = xfer(params, target, donate=True, transport=transport)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(params))
    assert_matches_host(out, hosts, target)


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
    assert_matches_host(first, hosts[0], dst)
    assert_matches_host(second, hosts[1], dst)
    # Once it is gone its blocks are refilled by the next sync of the same shapes.
    del first
    gc.collect()
    free, _ = OUTPUTS.stats()
    assert free >= hosts[0].nbytes
    third = xfer(jax.device_put(hosts[2], src), dst, transport=transport)
    assert pointers == {s.data.unsafe_buffer_pointer() for s in third.addressable_shards}
    assert_matches_host(third, hosts[2], dst)
    assert_matches_host(second, hosts[1], dst)
    jreshard.release_transfer_buffers()
    assert OUTPUTS.stats()[0] == 0
    del second, third
    gc.collect()
    assert OUTPUTS.stats()[0] == 0  # released: blocks in use are dropped, not kept


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
    assert_matches_host(again, hosts[1], dst)


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
    assert_matches_host(again, hosts[1], dst)


def test_output_pool_keeps_at_most_one_sync_of_free_blocks():
    import gc

    jreshard.release_transfer_buffers()
    rng = np.random.default_rng(8)
    host = host_array((32, 16), "int32", rng)
    x = jax.device_put(host, NamedSharding(TRAIN, P("fsdp")))
    outs = [jreshard.transfer(x, NamedSharding(SERVE, P("dp", "tp"))) for _ in range(4)]
    assert OUTPUTS.stats()[1] >= 4 * host.nbytes  # every live output is its own block
    del outs
    gc.collect()
    free, used = OUTPUTS.stats()
    assert (free, used) == (host.nbytes, 0)  # one sync's output (four distinct shards) is kept, the rest freed


def test_plan_from_shape_dtype_structs_is_reused_and_refused_when_it_does_not_match(model):
    hosts, params = model
    target = _target(params)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    plan = jreshard.plan(abstract, target)
    assert plan is jreshard.plan(params, target)  # the same plan, cached
    out = jreshard.transfer(params, target, plan=plan)
    assert_matches_host(out, hosts, target)
    other = jreshard.plan(params, NamedSharding(SERVE, P()))
    with pytest.raises(ValueError,
                       match=r"plan does not match params/target: for tensor 'embed' the plan's destination"):
        jreshard.transfer(params, target, plan=other)
    with pytest.raises(ValueError, match="plan does not match params: it covers tensors"):
        jreshard.transfer({"x": params["embed"]}, NamedSharding(SERVE, P()), plan=other)
    with pytest.raises(ValueError, match="plan does not match"):
        jreshard.transfer(params, target, plan=jreshard.plan(params, target, dtype=jnp.bfloat16))


@pytest.mark.parametrize("transport", ["device_put", "collective", "collective/xla"])
def test_tensor_larger_than_the_cap_arrives_intact_in_buckets(transport):
    rng = np.random.default_rng(1)
    host = host_array((64, 16), "float32", rng)  # 4 KiB; each device sends or receives 2 KiB
    x = jax.device_put(host, NamedSharding(jax.sharding.Mesh(DEVICES[:2], ("x",)), P("x")))
    target = NamedSharding(jax.sharding.Mesh(DEVICES[2:4], ("y",)), P("y"))
    cap = 1024
    out = xfer(x, target, max_bytes_in_flight=cap, transport=transport)
    assert_matches_host(out, host, target)
    # The schedule for this plan: each 2 KiB move cut in two, in two buckets under the cap.
    buckets = schedule([jreshard.plan({"x": x}, target)["x"]], itemsizes=[4], cap=cap)
    assert len(buckets) == 2
    for bucket in buckets:
        load = {}
        for msgs in bucket.rounds:
            for m in msgs:
                load[m.src] = load.get(m.src, 0) + m.nbytes
                load[m.dst] = load.get(m.dst, 0) + m.nbytes
        assert max(load.values()) <= cap


def test_partition_spec_target_with_mesh_and_prefix_targets(model):
    hosts, params = model
    out = jreshard.transfer(params, {"embed": P("tp"), "layers": P(), "step": P()}, mesh=SERVE)
    replicated = NamedSharding(SERVE, P())
    assert_matches_host(out, hosts, {"embed": NamedSharding(SERVE, P("tp")),
                                     "layers": [{"wq": replicated, "norm": replicated}] * 2, "step": replicated})
    mesh = jreshard.Mesh([[4, 5], [6, 7]], ("dp", "tp"))  # a jreshard.Mesh is looked up by device id
    out2 = jreshard.transfer(params["embed"], P(None, "tp"), mesh=mesh)
    assert_matches_host(out2, hosts["embed"], NamedSharding(SERVE, P(None, "tp")))


def test_auto_uses_memcpy_on_cpu_in_one_process(model):
    _, params = model
    assert _transfer.resolve_transport("auto", parse(params, _target(params))) == "memcpy"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_empty_and_scalar_leaves(transport):
    empty = jax.device_put(np.zeros((0, 8), np.float32), NamedSharding(TRAIN, P(None, "fsdp")))
    scalar = jax.device_put(np.float32(3.5), NamedSharding(TRAIN, P()))
    out = xfer({"e": empty, "s": scalar}, NamedSharding(SERVE, P()), transport=transport)
    assert out["e"].shape == (0, 8) and out["e"].sharding == NamedSharding(SERVE, P())
    assert float(out["s"]) == 3.5 and out["s"].sharding == NamedSharding(SERVE, P())


# --------------------------------------------------------------------------- schedule


def test_edge_colouring_uses_max_degree_rounds_and_each_round_is_a_matching():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        drawn = {(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 40))}
        pairs = sorted(drawn - {(i, i) for i in range(n)})
        if not pairs:
            continue
        colours = edge_colouring(pairs)
        degree = max(max(sum(1 for p in pairs if p[0] == s) for s, _ in pairs),
                     max(sum(1 for p in pairs if p[1] == t) for _, t in pairs))
        assert max(colours) + 1 == degree
        for c in set(colours):
            members = [p for p, k in zip(pairs, colours, strict=True) if k == c]
            assert len({s for s, _ in members}) == len(members) == len({t for _, t in members})


@pytest.mark.parametrize("cap", [16, 100, 1024, 1 << 20])
def test_schedule_writes_every_destination_element_once_under_the_cap(cap):
    """Pieces of all buckets, read back from their messages, cover each destination shard exactly once."""
    train = jreshard.Mesh([0, 1, 2, 3], ("fsdp",))
    serve = jreshard.Mesh([[2, 3], [4, 5]], ("dp", "tp"))
    src = {"a": jreshard.Layout((12, 10), train, ("fsdp",), "float32"),
           "b": jreshard.Layout((6, 4, 2), train, (None, "fsdp"), "int8")}
    dst = {"a": jreshard.Layout((12, 10), serve, (None, "tp"), "float32"),
           "b": jreshard.Layout((6, 4, 2), serve, ("dp", None, "tp"), "int8")}
    plan = jreshard.plan(src, dst)
    tplans, itemsizes = [plan["a"], plan["b"]], [4, 1]
    written = {(i, d): np.zeros(tp.dst.shard_box(d).shape, np.int32)
               for i, tp in enumerate(tplans) for d in tp.dst.mesh.device_ids}
    buckets = schedule(tplans, itemsizes=itemsizes, cap=cap)
    placed = []  # every piece
    for b, bucket in enumerate(buckets):
        assert b == 0 or not bucket.local  # local copies happen in the first bucket
        load: dict[int, int] = {}
        for msgs in bucket.rounds:
            assert len({m.src for m in msgs}) == len(msgs) == len({m.dst for m in msgs})
            for m in msgs:
                assert all(off % 64 == 0 for off in m.offsets)
                assert m.nbytes == m.offsets[-1] + m.pieces[-1].nbytes
                assert all(a + p.nbytes <= b for a, b, p in zip(m.offsets, m.offsets[1:], m.pieces, strict=False))
                piece_bytes = sum(p.nbytes for p in m.pieces)  # the cap bounds these, alignment gaps aside
                load[m.src] = load.get(m.src, 0) + piece_bytes
                load[m.dst] = load.get(m.dst, 0) + piece_bytes
                assert all((p.src, p.dst) == (m.src, m.dst) for p in m.pieces)
                placed += m.pieces
        assert max(load.values(), default=0) <= cap
        placed += [p for d, ps in bucket.local.items() for p in ps if p.src == p.dst == d]
    for p in placed:
        tp = tplans[p.leaf]
        src_lo = [a + s.start for a, s in zip(p.src_box.lo, tp.src.shard_box(p.src), strict=True)]
        dst_lo = [a + s.start for a, s in zip(p.dst_box.lo, tp.dst.shard_box(p.dst), strict=True)]
        assert src_lo == dst_lo and p.src_box.shape == p.dst_box.shape  # the same global box
        assert p.nbytes == math.prod(p.shape) * itemsizes[p.leaf]
        written[(p.leaf, p.dst)][p.dst_box] += 1
    assert all((count == 1).all() for count in written.values())
    assert len(buckets) > 1 if cap < 1024 else len(buckets) == 1


# --------------------------------------------------------------------------- bad input

X = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(TRAIN, P("fsdp")))
T = NamedSharding(SERVE, P(None, "tp"))

ERRORS = [
    # (name, args, kwargs, exception, message pattern)
    ("target missing a key", ({"a": X, "b": X}, {"a": T}), {}, ValueError,
     r"target must be .* pytree prefix of params: it has no entry for params leaf 'b'; add one"),
    ("target missing a nested key", ({"a": X, "b": {"c": X, "d": [X]}}, {"a": T, "b": {"c": T}}), {}, ValueError,
     r"target must be .* pytree prefix of params: it has no entry for params leaf 'b/d/0'"),
    ("target with an extra key", ({"a": X}, {"a": T, "z": T}), {}, ValueError,
     r"target must be .* pytree prefix of params: its entry at 'z' is not in params; remove it"),
    ("target rank too long", ({"a": X}, NamedSharding(SERVE, P(None, None, "tp"))), {}, ValueError,
     r"target at 'a' .* does not fit the array of shape \(8, 4\)"),
    ("target does not divide", ({"a": X}, NamedSharding(jax.sharding.Mesh(DEVICES[:3], ("t",)), P("t"))), {},
     ValueError, r"target at 'a' .* does not fit the array of shape \(8, 4\)"),
    ("non-jax leaf", ({"a": np.ones(4)}, T), {}, TypeError, r"params leaf at 'a' must be a jax.Array, got ndarray"),
    ("abstract leaf", ({"a": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=X.sharding)}, T), {}, TypeError,
     r"params leaf at 'a' must be a jax.Array, got ShapeDtypeStruct"),
    ("spec without mesh", ({"a": X}, P("tp")), {}, TypeError, r"target at 'a' is a PartitionSpec .* no mesh="),
    ("sharding with mesh", ({"a": X}, T), {"mesh": SERVE}, TypeError, r"pass mesh= only with PartitionSpec targets"),
    ("spec naming a missing axis", ({"a": X}, P("nope")), {"mesh": SERVE}, ValueError,
     r"target at 'a' P\('nope',\) does not fit mesh .*nope"),
    ("devices not present", ({"a": X}, P("tp")), {"mesh": jreshard.Mesh([[4, 5], [6, 99]], ("dp", "tp"))}, ValueError,
     r"mesh .* names devices \[99\] that jax does not have"),
    ("target of wrong kind", ({"a": X}, "tp"), {}, TypeError, r"target at 'a' must be a jax.sharding.Sharding"),
    ("bad dtype", ({"a": X}, T), {"dtype": "float33"}, TypeError, r"dtype at 'a' must be a NumPy or ml_dtypes dtype"),
    ("dtype of another structure", ({"a": X, "b": X}, T), {"dtype": {"z": "bfloat16"}}, ValueError,
     r"dtype must be a dtype or a pytree prefix of params: it has no entry for params leaf 'a'"),
    ("donate not bool", ({"a": X}, T), {"donate": 1}, TypeError, r"donate must be True or False, got int 1"),
    ("unknown transport", ({"a": X}, T), {"transport": "rdma"}, ValueError, r"transport must be one of"),
    ("cap not int", ({"a": X}, T), {"max_bytes_in_flight": 1.5}, TypeError, r"max_bytes_in_flight must be an int"),
    ("cap too small", ({"a": X}, T), {"max_bytes_in_flight": 0}, ValueError,
     r"max_bytes_in_flight must be an int >= 16"),
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


def test_called_inside_jit_says_to_call_it_outside():
    @jax.jit
    def step(x):
        return jreshard.transfer({"a": x}, T)

    with pytest.raises(TypeError, match=r"params leaf at 'a' is a tracer: jreshard.transfer .* must be called "
                                        r"outside jax.jit"):
        step(X)


def test_two_threads_donating_the_same_arrays_one_succeeds_the_other_gets_the_deleted_error(monkeypatch):
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    y = jax.device_put(host, NamedSharding(TRAIN, P("fsdp")))
    # Both threads get past their argument checks before either sync runs: the race in which
    # the second would otherwise run on arrays the first has deleted.
    both_parsed = threading.Barrier(2, timeout=60)
    build = _transfer.executor

    def executor_after_both_parsed(spec):
        both_parsed.wait()
        return build(spec)

    monkeypatch.setattr(_transfer, "executor", executor_after_both_parsed)
    outcomes: list = []

    def run():
        try:
            outcomes.append(jreshard.transfer({"a": y}, T, donate=True))
        except ValueError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [o for o in outcomes if isinstance(o, ValueError)]
    assert len(outcomes) == 2 and len(errors) == 1, outcomes
    assert "params leaf at 'a' has been deleted (donated by an earlier call?)" in str(errors[0])
    (out,) = [o for o in outcomes if not isinstance(o, ValueError)]
    assert_matches_host(out, {"a": host}, {"a": T})
    assert y.is_deleted()


def test_all_layout_pairs_of_a_small_mesh_pair_exhaustively():
    """Spec pairs of a 2-D tensor between FSDP4 and TP2xDP2, collective transport with XLA packing."""
    host = np.arange(8 * 8, dtype=np.int32).reshape(8, 8)
    src_specs = [P(), P("fsdp"), P(None, "fsdp")]
    dst_specs = [P(), P(None, "tp"), P("tp", "dp"), P(None, ("tp", "dp"))]
    params = {f"s{i}": jax.device_put(host, NamedSharding(TRAIN, s)) for i, s in enumerate(src_specs)}
    for d in dst_specs:
        target = NamedSharding(SERVE, d)
        out = xfer(params, target, transport="collective/xla")
        assert_matches_host(out, {k: host for k in params}, {k: target for k in params})


def test_docstring_example_runs():
    import doctest

    # No module globals: the example must import what it uses.
    result = doctest.testmod(_transfer, globs={}, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_assemble_concatenates_guillotine_tilings_and_refuses_others():
    def piece(start, shape):
        return (start, jnp.full(shape, len(start) + start[0] * 10 + start[1], jnp.uint32))

    grid = [piece((0, 0), (2, 3)), piece((0, 3), (2, 1)), piece((2, 0), (1, 4))]
    out = programs.assemble(grid, (3, 4))
    want = np.zeros((3, 4), np.uint32)
    for start, v in grid:
        want[start[0]:start[0] + v.shape[0], start[1]:start[1] + v.shape[1]] = np.asarray(v)
    np.testing.assert_array_equal(np.asarray(out), want)
    # A pinwheel has no guillotine cut; a partial cover is not a tiling: both fall back.
    pinwheel = [piece((0, 0), (2, 1)), piece((0, 1), (1, 2)), piece((1, 2), (2, 1)), piece((2, 0), (1, 2)),
                piece((1, 1), (1, 1))]
    assert programs.assemble(pinwheel, (3, 3)) is None
    assert programs.assemble(grid[:2], (3, 4)) is None


@pytest.mark.parametrize("transport", ["memcpy", "collective", "collective/xla"])
def test_complex_dtypes_move_exactly_or_are_refused_clearly(transport):
    host = (np.arange(64).reshape(8, 8) + 1j * np.arange(64).reshape(8, 8)[::-1]).astype(np.complex64)
    x = jax.device_put(host, NamedSharding(TRAIN, P("fsdp")))
    if transport.endswith("/xla") and not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="has dtype complex64, which this backend's compiled packing cannot move"):
            xfer(x, T, transport=transport)
        return
    assert_matches_host(xfer(x, T, transport=transport), host, T)
