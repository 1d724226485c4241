"""jreshard.plan on jax objects: Arrays, ShapeDtypeStructs, Shardings, PartitionSpecs."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jreshard
from jreshard import Layout, Mesh
from jreshard.jax_executor.adapter import leaf_name, parse, plan_from_jax

DEVICES = np.array(jax.devices())
TRAIN = jax.sharding.Mesh(DEVICES[:4], ("fsdp",))
SERVE = jax.sharding.Mesh(DEVICES[4:8].reshape(2, 2), ("dp", "tp"))


def abstract(shape, dtype, sharding):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def test_plan_of_shape_dtype_structs_equals_the_plan_of_layouts():
    params = {"w": abstract((8, 4), jnp.bfloat16, NamedSharding(TRAIN, P("fsdp"))),
              "b": abstract((4,), jnp.float32, NamedSharding(TRAIN, P()))}
    target = {"w": NamedSharding(SERVE, P(None, "tp")), "b": NamedSharding(SERVE, P("tp"))}
    p = jreshard.plan(params, target)
    train, serve = Mesh([0, 1, 2, 3], ("fsdp",)), Mesh([[4, 5], [6, 7]], ("dp", "tp"))
    by_hand = jreshard.plan(
        {"w": Layout((8, 4), train, ("fsdp",), "bfloat16"), "b": Layout((4,), train, (), "float32")},
        {"w": Layout((8, 4), serve, (None, "tp"), "bfloat16"), "b": Layout((4,), serve, ("tp",), "float32")})
    assert list(p.tensors) == ["b", "w"]
    for name in ("w", "b"):
        assert p[name].moves == by_hand[name].moves
        assert (p[name].src, p[name].dst) == (by_hand[name].src, by_hand[name].dst)
    s = p.stats()
    assert s.network_bytes == s.lower_bound_bytes == 8 * 4 * 2 * 2 + 4 * 4 * 2


def test_jax_arrays_plan_like_their_abstract_values_and_are_cached():
    x = jax.device_put(np.ones((8, 8), np.float32), NamedSharding(TRAIN, P(None, "fsdp")))
    target = NamedSharding(SERVE, P("dp", "tp"))
    assert jreshard.plan([x], target) is jreshard.plan([abstract((8, 8), np.float32, x.sharding)], target)


def test_dtype_pytree_changes_the_bytes_on_the_wire():
    params = {"a": abstract((16, 8), jnp.float32, NamedSharding(TRAIN, P("fsdp"))),
              "b": abstract((16, 8), jnp.float32, NamedSharding(TRAIN, P("fsdp")))}
    p = jreshard.plan(params, NamedSharding(SERVE, P(None, "tp")), dtype={"a": jnp.bfloat16, "b": None})
    assert p["a"].stats().network_bytes * 2 == p["b"].stats().network_bytes
    assert p["a"].dst.dtype == "bfloat16" and p["b"].dst.dtype == "float32"


def test_partition_specs_with_mesh_and_path_names():
    params = {"layers": [{"wq": abstract((8, 8), jnp.float32, NamedSharding(TRAIN, P("fsdp")))}],
              "norm": abstract((8,), jnp.float32, NamedSharding(TRAIN, P()))}
    leaves = parse(params, {"layers": P(None, "tp"), "norm": P()}, mesh=SERVE)
    assert leaves.names == ("layers/0/wq", "norm")
    assert leaves.shardings[0] == NamedSharding(SERVE, P(None, "tp"))
    assert leaves.dst[0].spec == (None, "tp")


def test_leaf_names_of_dict_index_and_attribute_keys():
    Pair = collections.namedtuple("Pair", ["left", "right"])
    flat, _ = jax.tree_util.tree_flatten_with_path({"a": (1, [2]), "b": Pair(3, 4)})
    assert [leaf_name(p) for p, _ in flat] == ["a/0", "a/1/0", "b/left", "b/right"]


def test_keys_that_print_alike_keep_their_full_key_paths():
    params = {"a": [abstract((4,), jnp.float32, NamedSharding(TRAIN, P()))],
              "a/0": abstract((4,), jnp.float32, NamedSharding(TRAIN, P()))}
    assert parse(params, NamedSharding(SERVE, P())).names == ("['a'][0]", "['a/0']")


def test_planning_tracers_says_to_call_it_outside_jit():
    x = jax.device_put(np.ones((8,), np.float32), NamedSharding(TRAIN, P()))
    with pytest.raises(TypeError, match=r"params leaf at 'w' is a tracer: .* must be called outside jax.jit"):
        jax.jit(lambda a: plan_from_jax({"w": a}, NamedSharding(SERVE, P())).stats().moves)(x)


@pytest.mark.parametrize("params,target,kwargs,exc,pattern", [
    ({"w": jax.ShapeDtypeStruct((8,), jnp.float32)}, NamedSharding(SERVE, P()), {}, TypeError,
     r"ShapeDtypeStruct without a sharding"),
    ({"w": abstract((8,), jnp.float32, NamedSharding(TRAIN, P()))}, P("tp"), {}, TypeError, r"no mesh= was given"),
    ({"w": abstract((6,), jnp.float32, NamedSharding(TRAIN, P()))}, NamedSharding(SERVE, P("tp", None)), {}, ValueError,
     r"target at 'w'.* does not fit the array of shape \(6,\)"),
], ids=["abstract without sharding", "spec without mesh", "target rank too long"])
def test_plan_errors_name_the_argument(params, target, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        jreshard.plan(params, target, **kwargs)
