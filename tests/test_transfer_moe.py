"""jreshard.transfer on a DeepSeek-V3-shaped MoE layer, scaled down, on 8 simulated CPU devices.

Expert-parallel training layouts (EP8, EP combined with FSDP or TP) to tensor-parallel
inference layouts (TP2 x DP4, EP4 x TP2) and back. Every output shard is checked bit for
bit against ``host[shard.index]`` with jax's own shard indices, and every plan's network
bytes against a lower bound counted here from jax's index maps.
"""

from __future__ import annotations

import math

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jreshard

# Many experts, small dims: 64 routed experts as in DeepSeek-V3 (which has 256), a shared expert.
E, H, M, M_SHARED = 64, 32, 16, 32  # experts, hidden, expert and shared intermediate
DEVICES = np.array(jax.devices())
EP8 = jax.sharding.Mesh(DEVICES, ("ep",))
TP2DP4 = jax.sharding.Mesh(DEVICES.reshape(4, 2), ("dp", "tp"))
EP4TP2 = jax.sharding.Mesh(DEVICES.reshape(4, 2), ("ep", "tp"))
EP4FSDP2 = jax.sharding.Mesh(DEVICES.reshape(4, 2), ("ep", "fsdp"))
EP2FSDP2TP2 = jax.sharding.Mesh(DEVICES.reshape(2, 2, 2), ("ep", "fsdp", "tp"))
TRANSPORTS = ("auto", "collective", "device_put")


def layer_shapes() -> dict:
    """One MoE feed-forward layer as JAX trainers store it: experts stacked on dim 0."""
    return {
        "router": (H, E),
        "w_gate": (E, H, M),
        "w_up": (E, H, M),
        "w_down": (E, M, H),
        "shared": {"w_gate": (H, M_SHARED), "w_up": (H, M_SHARED), "w_down": (M_SHARED, H)},
    }


def training(mesh, experts, inner=None, shared=None) -> dict:
    """Experts split over ``experts`` (an axis or a tuple of axes), their intermediate dim over ``inner``.

    The router is replicated, the shared expert split by the spec ``shared`` (replicated by default).
    """
    shared = P() if shared is None else shared
    return {
        "router": NamedSharding(mesh, P()),
        "w_gate": NamedSharding(mesh, P(experts, None, inner)),
        "w_up": NamedSharding(mesh, P(experts, None, inner)),
        "w_down": NamedSharding(mesh, P(experts, inner, None)),
        "shared": {k: NamedSharding(mesh, shared) for k in ("w_gate", "w_up", "w_down")},
    }


def inference(mesh, ep=None) -> dict:
    """TP inside experts and the shared expert (column then row parallel), experts over ``ep`` or replicated."""
    return {
        "router": NamedSharding(mesh, P()),
        "w_gate": NamedSharding(mesh, P(ep, None, "tp")),
        "w_up": NamedSharding(mesh, P(ep, None, "tp")),
        "w_down": NamedSharding(mesh, P(ep, "tp", None)),
        "shared": {"w_gate": NamedSharding(mesh, P(None, "tp")), "w_up": NamedSharding(mesh, P(None, "tp")),
                   "w_down": NamedSharding(mesh, P("tp", None))},
    }


def random_host(shape, dtype: str, rng, finite: bool = False) -> np.ndarray:
    """Random bits of the dtype (NaN payloads included), or finite normals where a cast must round."""
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    if finite:
        return rng.standard_normal(shape, dtype=np.float32).astype(dt)
    raw = rng.integers(0, 256, size=math.prod(shape) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def hosts_for(shapes, dtype: str, seed: int, finite: bool = False):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: random_host(s, dtype, rng, finite), shapes, is_leaf=lambda x: isinstance(x, tuple))


def put(hosts, shardings):
    return jax.tree.map(jax.device_put, hosts, shardings)


def assert_shards_equal(out, hosts, targets, dtype=None) -> None:
    """Each leaf has its target sharding and dtype, and each shard is ``host[shard.index]`` bit for bit."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(out)
    for (path, got), host, target in zip(flat, treedef.flatten_up_to(hosts), treedef.flatten_up_to(targets),
                                         strict=True):
        name = jax.tree_util.keystr(path)
        want = host if dtype is None else host.astype(np.dtype(getattr(ml_dtypes, dtype, dtype)))
        assert got.sharding == target, name
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert {s.device for s in got.addressable_shards} == target.addressable_devices, name
        for shard in got.addressable_shards:
            have = np.ascontiguousarray(np.asarray(shard.data)).view(np.uint8)
            need = np.ascontiguousarray(want[shard.index]).view(np.uint8)
            np.testing.assert_array_equal(have, need, err_msg=f"{name} on {shard.device}")


def box_size(index, shape) -> int:
    return math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def overlap_size(a, b, shape) -> int:
    lengths = []
    for sa, sb, n in zip(a, b, shape, strict=True):
        ra, rb = range(*sa.indices(n)), range(*sb.indices(n))
        lengths.append(max(0, min(ra.stop, rb.stop) - max(ra.start, rb.start)))
    return math.prod(lengths)


def lower_bound(src_shardings, dst_shardings, hosts, itemsize: int | None = None) -> int:
    """Bytes the destination devices lack: per device, its destination box less what its source box covers."""
    total = 0
    for src, dst, host in zip(jax.tree.leaves(src_shardings), jax.tree.leaves(dst_shardings), jax.tree.leaves(hosts),
                              strict=True):
        held = src.devices_indices_map(host.shape)
        for dev, index in dst.devices_indices_map(host.shape).items():
            missing = box_size(index, host.shape)
            if dev in held:
                missing -= overlap_size(index, held[dev], host.shape)
            total += missing * (itemsize or host.dtype.itemsize)
    return total


def checked_plan(params, target, dtype=None, itemsize=None):
    """The plan jreshard makes, checked: invariants hold and it moves exactly the lower bound."""
    plan = jreshard.plan(params, target, dtype=dtype)
    plan.check()
    stats = plan.stats()
    hosts = jax.tree.map(lambda x: np.empty(x.shape, x.dtype), params)
    sources = jax.tree.map(lambda x: x.sharding, params)
    assert stats.network_bytes == stats.lower_bound_bytes
    assert stats.network_bytes == lower_bound(sources, target, hosts, itemsize)
    return plan


# --------------------------------------------------------------------------- stacked experts


@pytest.mark.parametrize(("dtype", "transport"), [("float32", "auto"), ("bfloat16", "auto"),
                                                  ("float32", "collective"), ("bfloat16", "device_put")])
def test_ep8_to_tp2dp4_and_back(dtype, transport):
    shapes = layer_shapes()
    hosts = hosts_for(shapes, dtype, seed=1)
    src, dst = training(EP8, "ep"), inference(TP2DP4)
    params = put(hosts, src)
    plan = checked_plan(params, dst)
    # Counted by hand: each device holds 8 whole experts and needs half the intermediate
    # dim of the other 56, for 3 expert matrices; router and shared expert are local.
    itemsize = np.dtype(hosts["w_gate"].dtype).itemsize
    assert plan.stats().network_bytes == 8 * 3 * (E - 8) * H * (M // 2) * itemsize
    out = jreshard.transfer(params, dst, plan=plan, transport=transport)
    assert_shards_equal(out, hosts, dst)
    back = jreshard.transfer(out, src, transport=transport)
    assert_shards_equal(back, hosts, src)


def test_cast_to_bfloat16_at_the_sender():
    shapes = layer_shapes()
    hosts = hosts_for(shapes, "float32", seed=2, finite=True)
    src, dst = training(EP8, "ep"), inference(TP2DP4)
    params = put(hosts, src)
    plan = checked_plan(params, dst, dtype="bfloat16", itemsize=2)
    out = jreshard.transfer(params, dst, plan=plan, dtype="bfloat16")
    assert_shards_equal(out, hosts, dst, dtype="bfloat16")
    back = jreshard.transfer(out, src, dtype="float32")
    assert_shards_equal(back, jax.tree.map(lambda h: h.astype(ml_dtypes.bfloat16), hosts), src, dtype="float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("mesh", "experts", "inner"), [(EP4FSDP2, ("ep", "fsdp"), None),
                                                        (EP2FSDP2TP2, ("ep", "fsdp"), "tp")],
                         ids=["ep4xfsdp2", "ep2xfsdp2_tp2"])
def test_ep_with_fsdp_to_tp2dp4_and_back(mesh, experts, inner, dtype):
    shapes = layer_shapes()
    hosts = hosts_for(shapes, dtype, seed=3)
    src, dst = training(mesh, experts, inner, shared=P("fsdp")), inference(TP2DP4)
    params = put(hosts, src)
    out = jreshard.transfer(params, dst, plan=checked_plan(params, dst))
    assert_shards_equal(out, hosts, dst)
    back = jreshard.transfer(out, src, plan=checked_plan(out, src))
    assert_shards_equal(back, hosts, src)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ep8_to_ep4tp2_inference_and_back(dtype):
    shapes = layer_shapes()
    hosts = hosts_for(shapes, dtype, seed=4)
    src, dst = training(EP8, "ep"), inference(EP4TP2, ep="ep")
    params = put(hosts, src)
    out = jreshard.transfer(params, dst, plan=checked_plan(params, dst))
    assert_shards_equal(out, hosts, dst)
    back = jreshard.transfer(out, src, plan=checked_plan(out, src))
    assert_shards_equal(back, hosts, src)


# --------------------------------------------------------------------------- one leaf per expert


def per_expert_shapes(experts: int = E) -> dict:
    return {"router": (H, experts),
            "experts": [{"w_gate": (H, M), "w_up": (H, M), "w_down": (M, H)} for _ in range(experts)]}


def per_expert_training(experts: int = E) -> dict:
    """Expert ``e`` on its EP8 device alone (linear placement), router replicated."""
    per = experts // len(DEVICES)
    return {"router": NamedSharding(EP8, P()),
            "experts": [dict.fromkeys(("w_gate", "w_up", "w_down"), SingleDeviceSharding(DEVICES[e // per]))
                        for e in range(experts)]}


def per_expert_tp(mesh_for_expert, experts: int) -> dict:
    """Each expert TP2 (column then row parallel) over the mesh ``mesh_for_expert(e)``."""
    def one(mesh):
        return {"w_gate": NamedSharding(mesh, P(None, "tp")), "w_up": NamedSharding(mesh, P(None, "tp")),
                "w_down": NamedSharding(mesh, P("tp", None))}
    return {"router": NamedSharding(TP2DP4, P()), "experts": [one(mesh_for_expert(e)) for e in range(experts)]}


PER_EXPERT_TARGETS = {
    # Every expert on every device, TP2 x DP4.
    "tp2dp4": lambda n=E: per_expert_tp(lambda e: TP2DP4, n),
    # EP4 x TP2: expert e on the TP2 pair of its EP rank (linear placement).
    "ep4tp2": lambda n=E: per_expert_tp(lambda e: jax.sharding.Mesh(EP4TP2.devices[e // (n // 4)], ("tp",)), n),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("target", sorted(PER_EXPERT_TARGETS))
def test_one_leaf_per_expert_and_back(target, dtype):
    shapes = per_expert_shapes()
    hosts = hosts_for(shapes, dtype, seed=5)
    src, dst = per_expert_training(), PER_EXPERT_TARGETS[target]()
    params = put(hosts, src)
    out = jreshard.transfer(params, dst, plan=checked_plan(params, dst))
    assert_shards_equal(out, hosts, dst)
    back = jreshard.transfer(out, src, plan=checked_plan(out, src))
    assert_shards_equal(back, hosts, src)


def test_one_leaf_per_expert_cast_to_bfloat16():
    # 16 experts: the sender compiles its cast per leaf and device, which costs more than the copies here.
    shapes = per_expert_shapes(16)
    hosts = hosts_for(shapes, "float32", seed=6, finite=True)
    src, dst = per_expert_training(16), PER_EXPERT_TARGETS["ep4tp2"](16)
    params = put(hosts, src)
    out = jreshard.transfer(params, dst, plan=checked_plan(params, dst, dtype="bfloat16", itemsize=2),
                            dtype="bfloat16")
    assert_shards_equal(out, hosts, dst, dtype="bfloat16")
