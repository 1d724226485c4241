"""FP8 on jax devices: ``jax_executor.fp8.quantize`` and ``jreshard.transfer(..., block=)``.

Every result is compared bit for bit with ``ref_quantize``, a NumPy / ml_dtypes
quantizer that shares no code with jreshard (tests/_workers/fp8_worker.py, so that
the multi-process worker checks against the same one). Sources cut blocks in one
dim, in both dims, with several mesh axes on one dim, with replicas, or are
replicated; targets are TP1, TP2 and TP4 as vLLM splits them.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import jreshard
from jreshard.core.fp8 import Fp8Format
from jreshard.jax_executor.fp8 import quantize, quantize_tree
from tests._workers.fp8_worker import ref_quantize
from tests._workers.launch import run_two

DEVS = jax.devices()
WORKER = Path(__file__).parent / "_workers" / "fp8_worker.py"


def _mesh(shape: tuple[int, ...], names: tuple[str, ...], start: int = 0) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(DEVS[start:start + math.prod(shape)]).reshape(shape), names)


def _values(shape: tuple[int, ...], dtype: object, seed: int) -> np.ndarray:
    """Normal values over 40 binades, with zeros, an all-zero block, denormals, extremes and ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    flat = x.reshape(-1)
    flat[::5] = 0
    flat[1::11] = np.float32(1e-40)  # float32 denormals
    big = float(ml_dtypes.finfo(dtype).max) if dtype is ml_dtypes.bfloat16 else float(np.finfo(np.float32).max)
    flat[2] = big
    flat[3] = -big
    flat[4] = np.finfo(np.float32).tiny
    x[..., :2, :2] = 0  # the first block's corner; with blocks of 2 x 2 a whole zero block
    return x.astype(dtype)


# name, shape, block, mesh shape, axis names, spec: how the trainer holds the tensor.
SOURCES = [
    ("fsdp4_cuts_rows", (12, 32), (4, 8), (4,), ("fsdp",), P("fsdp")),  # 3 rows a shard
    ("cuts_both_dims_not_multiple", (18, 20), (4, 8), (2, 2), ("a", "b"), P("a", "b")),  # 9 x 10 shards
    ("two_axes_on_one_dim_replicas", (24, 32), (4, 8), (2, 2, 2), ("dp", "a", "b"), P(("b", "a"))),  # 6 rows
    ("replicated", (10, 12), (4, 8), (4,), ("dp",), P()),
    ("stacked_experts", (4, 10, 16), (4, 8), (2, 2), ("ep", "fsdp"), P("ep", "fsdp")),  # 5 rows
    ("per_tensor", (12, 32), (None, None), (4,), ("fsdp",), P("fsdp")),
    ("per_channel", (12, 32), (1, None), (4,), ("fsdp",), P(None, "fsdp")),
    ("blocks_of_128", (384, 256), (128, 128), (2, 2), ("a", "b"), P("b", "a")),  # 192 x 128 shards: rows cut
]


def _source(case: tuple, dtype: object = np.float32, seed: int = 0) -> tuple[np.ndarray, jax.Array]:
    _, shape, _, mshape, names, spec = case
    x = _values(shape, dtype, seed)
    return x, jax.device_put(x, NamedSharding(_mesh(mshape, names), spec))


def _bits_equal(got: jax.Array, want: np.ndarray) -> bool:
    got = np.asarray(got)
    return got.dtype == want.dtype and np.array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


def _scale_spec(spec: P, ndim: int, cut: tuple[int, ...]) -> P:
    """The scale's spec: the weight's axes except on the dims in ``cut``, trailing Nones dropped."""
    entries = [None if d in cut else e for d, e in enumerate(list(spec) + [None] * (ndim - len(spec)))]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


# Dims whose shard boundaries cut blocks (whole-dim blocks over a split dim count as cut).
CUT = {"fsdp4_cuts_rows": (0,), "cuts_both_dims_not_multiple": (0, 1), "two_axes_on_one_dim_replicas": (0,),
       "replicated": (), "stacked_experts": (1,), "per_tensor": (0,), "per_channel": (1,), "blocks_of_128": (0,)}


@pytest.mark.parametrize("case", SOURCES, ids=[c[0] for c in SOURCES])
def test_quantize_at_the_source_equals_the_reference(case):
    dtype = ml_dtypes.bfloat16 if case[0] in ("cuts_both_dims_not_multiple", "blocks_of_128") else np.float32
    x, xs = _source(case, dtype)
    w, s = quantize(xs, Fp8Format(block=case[2]))
    q, scale = ref_quantize(x, case[2])
    assert _bits_equal(w, q) and _bits_equal(s, scale)
    assert w.sharding == xs.sharding
    assert s.sharding.spec == _scale_spec(case[5], x.ndim, CUT[case[0]])


def test_only_block_amax_crosses_devices():
    """The program reduces one float32 per block of the cut dim and gathers no element."""
    from jreshard.jax_executor import fp8

    _, xs = _source(SOURCES[0])  # 12 x 32 over FSDP4, blocks of 4 x 8: scale grid 3 x 4, all local in dim 1
    hlo = fp8._sharded_program(xs.sharding.mesh, (("fsdp",), ()), (12, 32), Fp8Format(block=(4, 8))).lower(
        xs, np.uint32(0)).compile().as_text()
    reduces = [ln for ln in hlo.splitlines() if "all-reduce(" in ln or "all-reduce-start(" in ln]
    # Block rows 0-2 whole plus a window of 2 (room for a shard's blocks), 4 block columns: 20 floats.
    assert fp8.amax_reduce(xs.sharding, (12, 32), Fp8Format(block=(4, 8))) == fp8.AmaxReduce(20, 4, ("fsdp",))
    assert reduces and all("f32[5,4]" in ln for ln in reduces), reduces
    for op in ("all-gather", "all-to-all", "collective-permute"):
        assert op not in hlo


def test_one_device_and_whole_array_programs():
    x = _values((10, 20), np.float32, 3)
    w, s = quantize(jax.device_put(x, SingleDeviceSharding(DEVS[5])), Fp8Format(block=(4, 8)))
    q, scale = ref_quantize(x, (4, 8))
    assert _bits_equal(w, q) and _bits_equal(s, scale)
    assert w.sharding == SingleDeviceSharding(DEVS[5]) and s.sharding == SingleDeviceSharding(DEVS[5])


def _tp_target(shape: tuple[int, ...], block: tuple[int | None, ...], tp: int) -> tuple[P, int | None]:
    """vLLM-like TP over devices 4.. : column parallel (dim -2) where whole blocks allow it, else row parallel."""
    nd = len(shape)
    for dim in (nd - 2, nd - 1):
        b = block[dim - nd]
        n = shape[dim]
        if tp == 1 or (n % tp == 0 and (b is None or (n // tp) % b == 0)):
            spec: list[str | None] = [None] * nd
            spec[dim] = "tp"
            return P(*spec), dim
    return P(), None


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_transfer_delivers_the_reference_into_tp_targets(tp):
    mesh = _mesh((tp,), ("tp",), start=4)
    params, targets, ref, split = {}, {}, {}, 0
    for i, case in enumerate(SOURCES):
        x, xs = _source(case, seed=10 + i)
        spec, dim = _tp_target(case[1], case[2], tp)
        split += dim is not None and tp > 1
        params[case[0]] = xs
        targets[case[0]] = NamedSharding(mesh, spec)
        ref[case[0]] = ref_quantize(x, case[2])
    assert split >= {1: 0, 2: 6, 4: 4}[tp]  # leaves really are split
    blocks = {c[0]: c[2] for c in SOURCES}
    for block in sorted(set(blocks.values()), key=str):  # block= is one format per call
        names = [n for n in params if blocks[n] == block]
        w, s = jreshard.transfer({n: params[n] for n in names}, {n: targets[n] for n in names},
                                 dtype="float8_e4m3fn", block=block)
        for n in names:
            assert _bits_equal(w[n], ref[n][0]), n
            assert _bits_equal(s[n], ref[n][1]), n
            assert w[n].sharding == targets[n]
            nd = len(params[n].shape)
            whole = tuple(d for d in range(nd) if d >= nd - 2 and block[d - nd] is None)
            assert s[n].sharding == NamedSharding(mesh, _scale_spec(targets[n].spec, nd, whole)), n


def test_what_stays_in_high_precision():
    """One FP8 dtype quantizes 2-D+ leaves; 1-D ones keep their dtype; a dtype prefix picks per leaf."""
    train, serve = _mesh((4,), ("fsdp",)), _mesh((2,), ("tp",), start=4)
    host = {"w": _values((12, 32), np.float32, 1), "emb": _values((12, 32), np.float32, 2),
            "norm": np.linspace(-1, 1, 8, dtype=np.float32)}
    params = {k: jax.device_put(v, NamedSharding(train, P("fsdp"))) for k, v in host.items()}
    cols = NamedSharding(serve, P(None, "tp"))
    target = {"w": cols, "emb": cols, "norm": NamedSharding(serve, P())}
    w, s = jreshard.transfer(params, target, dtype="float8_e4m3fn", block=(4, 8))
    assert s["norm"] is None and s["emb"] is not None
    assert _bits_equal(w["norm"], host["norm"])
    w, s = jreshard.transfer(params, target, block=(4, 8),
                             dtype={"w": "float8_e4m3fn", "emb": "bfloat16", "norm": None})
    assert _bits_equal(w["w"], ref_quantize(host["w"], (4, 8))[0])
    assert _bits_equal(w["emb"], host["emb"].astype(ml_dtypes.bfloat16))
    assert _bits_equal(w["norm"], host["norm"])
    assert (s["emb"], s["norm"]) == (None, None)


def test_quantize_tree_and_donate():
    mesh = _mesh((4,), ("fsdp",))
    x = _values((12, 32), np.float32, 4)
    params = {"w": jax.device_put(x, NamedSharding(mesh, P("fsdp"))), "n": jax.device_put(x[0], DEVS[0])}
    w, s = quantize_tree(params, lambda path, leaf: Fp8Format(block=(4, 8)) if leaf.ndim == 2 else None)
    assert _bits_equal(w["w"], ref_quantize(x, (4, 8))[0]) and s["n"] is None and w["n"] is params["n"]
    w, s = jreshard.transfer({"w": params["w"]}, NamedSharding(_mesh((2,), ("tp",), 4), P(None, "tp")),
                             dtype="float8_e4m3fn", block=(4, 8), donate=True)
    assert params["w"].is_deleted() and _bits_equal(s["w"], ref_quantize(x, (4, 8))[1])


def _errors() -> list:
    train, serve = _mesh((4,), ("fsdp",)), _mesh((4,), ("tp",), start=4)
    x = jax.device_put(np.ones((12, 32), np.float32), NamedSharding(train, P("fsdp")))
    tp4 = NamedSharding(serve, P("tp"))  # 3 rows a shard: cuts blocks of 4
    ok = NamedSharding(serve, P(None, "tp"))
    plan = jreshard.plan({"w": x}, ok)
    return [
        ("target cuts a block", lambda: jreshard.transfer({"w": x}, tp4, dtype="float8_e4m3fn", block=(4, 8)),
         ValueError, r"target at 'w'.*cuts its blocks of 4.*block_n = 4"),
        ("no FP8 dtype", lambda: jreshard.transfer({"w": x}, ok, block=(4, 8)), ValueError, r"dtype=None gives none"),
        ("plan", lambda: jreshard.transfer({"w": x}, ok, plan=plan, dtype="float8_e4m3fn", block=(4, 4)),
         ValueError, r"plan must be None with block="),
        ("bad block", lambda: jreshard.transfer({"w": x}, ok, dtype="float8_e4m3fn", block=(0, 4)),
         ValueError, r"block sizes must be positive"),
        ("int array", lambda: quantize(jax.numpy.ones((4, 4), jax.numpy.int32)), TypeError, r"must hold float32"),
        ("numpy array", lambda: quantize(np.ones((4, 4), np.float32)), TypeError, r"concrete jax.Array"),
        ("fmt", lambda: quantize(x, (4, 4)), TypeError, r"fmt must be an Fp8Format"),
        ("1-D with a 2-D block", lambda: quantize(x[0], Fp8Format(block=(4, 4))), ValueError, r"at least as many dims"),
    ]


@pytest.mark.parametrize("i", range(8))
def test_errors_name_the_argument(i):
    name, call, exc, match = _errors()[i]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.multiprocess
def test_two_processes_exchange_amax_across_processes():
    results = run_two(WORKER, 180)
    for r in results:
        assert r["quantize_a"] and r["transfer_a"], r
    assert [r["held_a"] for r in results] == [0, 2]
