"""Block-scaled FP8: the quantizer, the sharded plan and the TP targets against a reference written here.

The reference quantizer below shares no code with jreshard: it walks the blocks one by
one with float32 scalars, as vLLM's ``per_block_cast_to_fp8`` computes them (amax in
float32, floored at 1e-4, ``scale = amax / 448``, ``q = x * (1 / scale)`` rounded to
nearest even by ml_dtypes). Shards come from ``tests.helpers`` (first principles).
Every comparison is bitwise.
"""

from __future__ import annotations

import doctest
import importlib
import itertools

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jreshard import Layout, Mesh
from jreshard.core.fp8 import Fp8Format, dequantize, quantize
from jreshard.core.fp8_blocks import execute, quant_plan
from jreshard.core.fp8_split import fp8_split, fp8_tp_split
from tests.helpers import LayoutCase

E4M3 = ml_dtypes.float8_e4m3fn
F32 = np.float32


def ref_quantize(x, block, *, floor=1e-4, scaling="reciprocal", fp8=E4M3):
    """Quantizes ``x`` block by block; ``block`` covers the last two dims (None: the whole dim)."""
    x = np.asarray(x).astype(F32)
    *lead, m, n = x.shape
    bm = max(m, 1) if block[0] is None else block[0]
    bn = max(n, 1) if block[1] is None else block[1]
    fmax = F32(ml_dtypes.finfo(fp8).max)
    rows, cols = -(-m // bm), -(-n // bn)
    q = np.zeros(x.shape, fp8)
    s = np.zeros((*lead, rows, cols), F32)
    for idx in itertools.product(*(range(k) for k in lead)):
        for i in range(rows):
            for j in range(cols):
                at = (*idx, slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
                blk = x[at]
                amax = max(F32(np.max(np.abs(blk))), F32(floor))
                scale = F32(amax / fmax)
                if scaling == "reciprocal":
                    y = blk * F32(F32(1) / scale)
                elif scaling == "divide":
                    y = blk / scale
                else:
                    y = blk * F32(fmax / amax)
                q[at] = y.astype(fp8)
                s[(*idx, i, j)] = scale
    return q, s


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def assert_same(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_array_equal(bits(got), bits(want))


def values(shape, seed=0):
    """Normal values with an all-zero block corner, zeros, denormals and large finite values mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(F32) * F32(3)
    flat = x.reshape(-1)
    if flat.size:
        k = flat.size
        picks = rng.choice(k, size=min(k, max(1, k // 5)), replace=False)
        kinds = rng.integers(0, 4, size=len(picks))
        flat[picks[kinds == 0]] = 0.0
        flat[picks[kinds == 1]] = F32(1e-40)  # float32 denormal
        flat[picks[kinds == 2]] = -F32(1e-3)
        flat[picks[kinds == 3]] = F32(7e-3)
    if x.ndim >= 2 and x.shape[-2] >= 4 and x.shape[-1] >= 4:
        x[..., :4, :4] = 0.0  # an all-zero block whatever the block size
    return x


# --- the format and the reference quantizer --------------------------------------------------------

def test_ml_dtypes_rounds_to_nearest_even():
    # 1.0625 lies halfway between 1.0 and 1.125 (even: 1.0); 1.1875 between 1.125 and 1.25 (even: 1.25).
    x = np.array([1.0625, 1.1875, -1.0625, 448.00003, 464.0], F32)
    np.testing.assert_array_equal(x.astype(E4M3).astype(F32), [1.0, 1.25, -1.0, 448.0, 448.0])


@pytest.mark.parametrize("shape, block", [
    ((8, 8), (4, 4)), ((10, 13), (4, 4)), ((13, 10), (8, 8)), ((1, 1), (4, 4)), ((5, 3), (1, None)),
    ((6, 9), (None, None)), ((3, 10, 12), (4, 4)), ((2, 5, 7), (None, None)),
    ((256, 384), (128, 128)), ((300, 200), (128, 128)), ((129, 257), (128, 128)),
])
def test_quantize_equals_the_reference(shape, block):
    x = values(shape)
    fmt = Fp8Format(block=block)
    got = quantize(x, fmt)
    q, s = ref_quantize(x, block)
    assert got.scale_inv.shape == fmt.scale_shape(shape)
    assert_same(got.weight, q)
    assert_same(got.scale_inv, s)


@pytest.mark.parametrize("scaling", ["reciprocal", "divide", "ratio"])
def test_each_scaling_equals_its_reference(scaling):
    x = values((40, 36), seed=3)
    got = quantize(x, Fp8Format(block=(8, 8), scaling=scaling))
    q, s = ref_quantize(x, (8, 8), scaling=scaling)
    assert_same(got.weight, q)
    assert_same(got.scale_inv, s)


def test_the_three_scalings_round_differently_on_some_values():
    # Each row is one block (amax, x): x / s lies within a float32 ulp of an FP8 midpoint, so the
    # last bit of the float32 factor decides the rounding (found by a search over random blocks).
    x = np.array([[2.7651632, 0.104928076], [2.04132, 0.04328692], [0.5578467, 0.0014786673]], F32)
    got = {}
    for scaling in ("reciprocal", "divide", "ratio"):
        got[scaling] = quantize(x, Fp8Format(block=(1, 2), scaling=scaling)).weight
        assert_same(got[scaling], ref_quantize(x, (1, 2), scaling=scaling)[0])
    assert got["reciprocal"][:, 1].astype(F32).tolist() == [16.0, 9.0, 1.25]
    assert got["divide"][:, 1].astype(F32).tolist() == [18.0, 10.0, 1.25]
    assert got["ratio"][:, 1].astype(F32).tolist() == [18.0, 9.0, 1.125]


def test_extremes_zeros_and_denormals():
    big = F32(np.finfo(F32).max)
    bf16_max = F32(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    x = np.array([[big, -big, 1.0, 0.0], [bf16_max, 1e-45, -1e-40, 0.0],
                  [0.0, 0.0, 0.0, 0.0], [1e-40, -1e-44, 0.0, 1e-38]], F32)
    got = quantize(x, Fp8Format(block=(2, 2)))
    q, s = ref_quantize(x, (2, 2))
    assert_same(got.weight, q)
    assert_same(got.scale_inv, s)
    assert np.isfinite(got.weight.astype(F32)).all() and np.isfinite(got.scale_inv).all()
    assert got.weight.astype(F32)[0, 0] == 448.0 and got.weight.astype(F32)[0, 1] == -448.0
    assert (got.weight.astype(F32)[2:] == 0).all()  # tiny and zero blocks scale by the floor and vanish
    assert got.scale_inv[1, 0] == got.scale_inv[1, 1] == F32(F32(1e-4) / F32(448))


def test_bfloat16_and_float64_inputs():
    x = values((16, 24), seed=5)
    xb = x.astype(ml_dtypes.bfloat16)
    got = quantize(xb, Fp8Format(block=(8, 8)))
    q, s = ref_quantize(xb.astype(F32), (8, 8))
    assert_same(got.weight, q)
    assert_same(got.scale_inv, s)
    got64 = quantize(x.astype(np.float64), Fp8Format(block=(8, 8)))
    assert_same(got64.weight, ref_quantize(x, (8, 8))[0])


def test_dequantize_error_is_within_fp8_precision():
    x = values((64, 48), seed=7)
    fmt = Fp8Format(block=(16, 16))
    q = quantize(x, fmt)
    back = dequantize(q.weight, q.scale_inv, fmt)
    scale = np.repeat(np.repeat(q.scale_inv, 16, 0), 16, 1)[:64, :48]
    # e4m3: 3 mantissa bits (relative error 2**-4 at most), subnormal step 2**-9 times the scale.
    bound = np.maximum(np.abs(x) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert (np.abs(back - x) <= bound).all()
    assert dequantize(q.weight, q.scale_inv, fmt, dtype="bfloat16").dtype == ml_dtypes.bfloat16


def test_per_tensor_and_per_channel_shapes():
    assert Fp8Format.per_tensor().scale_shape((300, 200)) == (1, 1)
    assert Fp8Format.per_channel().scale_shape((300, 200)) == (300, 1)
    assert Fp8Format().scale_shape((8, 300, 200)) == (8, 3, 2)  # stacked experts keep their leading dim
    assert Fp8Format(block=(128,)).scale_shape((300,)) == (3,)
    assert str(Fp8Format.per_channel()) == "float8_e4m3fn with 1xall blocks"


def test_float8_e5m2():
    x = values((12, 12), seed=2)
    got = quantize(x, Fp8Format(block=(4, 4), dtype="float8_e5m2"))
    q, s = ref_quantize(x, (4, 4), fp8=ml_dtypes.float8_e5m2)
    assert_same(got.weight, q)
    assert_same(got.scale_inv, s)


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"block": (0, 4)}, ValueError, "block sizes must be positive"),
    ({"block": ()}, TypeError, "block must be a non-empty tuple"),
    ({"block": (4.0, 4)}, TypeError, "block must hold ints or None"),
    ({"dtype": "bfloat16"}, ValueError, "dtype must be an FP8 type"),
    ({"amax_floor": 0.0}, ValueError, "amax_floor must be a finite float32"),
    ({"amax_floor": "1e-4"}, TypeError, "amax_floor must be a float"),
    ({"scaling": "multiply"}, ValueError, "scaling must be one of"),
])
def test_format_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Fp8Format(**kwargs)


def test_quantize_errors():
    with pytest.raises(TypeError, match="x must hold floating-point numbers"):
        quantize(np.ones((4, 4), np.int32))
    with pytest.raises(TypeError, match="fmt must be an Fp8Format"):
        quantize(np.ones((4, 4), F32), (4, 4))
    with pytest.raises(ValueError, match="a block of 2 dims"):
        quantize(np.ones(4, F32), Fp8Format(block=(2, 2)))
    q = quantize(np.ones((8, 8), F32), Fp8Format(block=(4, 4)))
    with pytest.raises(ValueError, match=r"scale_inv has shape \(2, 2\) but a weight of shape \(8, 8\)"):
        dequantize(q.weight, q.scale_inv, Fp8Format(block=(2, 2)))


# --- sharded quantization --------------------------------------------------------------------------

def case(shape, devices, axes, spec):
    return LayoutCase(tuple(shape), np.asarray(devices), tuple(axes), tuple(spec))


CASES = {
    "fsdp uneven, cuts rows": case((22, 13), range(4), ("fsdp",), ("fsdp",)),
    "fsdp x tp, cuts both dims": case((22, 18), np.arange(6).reshape(3, 2), ("fsdp", "tp"), ("fsdp", "tp")),
    "tp x fsdp, transposed": case((18, 22), np.arange(6).reshape(2, 3), ("tp", "fsdp"), ("fsdp", "tp")),
    "replicated over dp": case((22, 13), np.arange(8).reshape(2, 4), ("dp", "fsdp"), ("fsdp",)),
    "fully replicated": case((10, 9), range(3), ("dp",), ()),
    "two axes on one dim": case((30, 10), np.arange(6).reshape(2, 3), ("a", "b"), (("a", "b"),)),
    "empty shards": case((5, 8), range(4), ("fsdp",), ("fsdp",)),
    "ids not in order": case((22, 13), [7, 3, 5, 1], ("fsdp",), (None, "fsdp")),
    "stacked experts": case((4, 10, 12), np.arange(4).reshape(2, 2), ("ep", "fsdp"), ("ep", "fsdp")),
}


def check_sharded(c: LayoutCase, block, seed=0):
    layout = c.layout()
    x = values(c.shape, seed)
    fmt = Fp8Format(block=block)
    qp = quant_plan(layout, fmt)
    shards = {d: x[tuple(slice(lo, hi) for lo, hi in box)].copy() for d, box in c.shards().items()}
    out = execute(qp, shards)
    q, s = ref_quantize(x, block)
    bs = fmt.block_shape(c.shape)
    for d, box in c.shards().items():
        assert_same(out[d].weight, q[tuple(slice(lo, hi) for lo, hi in box)])
        sbox = tuple(slice(lo // b, -(-hi // b) if hi > lo else lo // b) for (lo, hi), b in zip(box, bs, strict=True))
        assert tuple(qp.scale_box(d)) == sbox
        assert_same(out[d].scale_inv, s[sbox])
    return qp


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("block", [(4, 4), (8, 3), (None, None), (1, None)])
def test_sharded_quantization_equals_full(name, block):
    check_sharded(CASES[name], block, seed=len(name))


@pytest.mark.parametrize("c", [
    case((384, 300), range(5), ("fsdp",), ("fsdp",)),  # shards of 77 rows: every block row is cut
    case((300, 640), np.arange(6).reshape(2, 3), ("dp", "fsdp"), (None, "fsdp")),  # 214 columns, replicated
    case((256, 384), np.arange(8).reshape(4, 2), ("fsdp", "tp"), ("fsdp", "tp")),  # 64 x 192: both dims cut
])
def test_sharded_quantization_with_128_blocks(c):
    check_sharded(c, (128, 128))


def test_exchange_messages_and_their_counts():
    c = CASES["replicated over dp"]
    qp = quant_plan(c.layout(), Fp8Format(block=(4, 4)))
    shards = c.shards()
    ex = qp.exchange()
    blocks = {tuple(b) for b in qp.cut_blocks().tolist()}
    assert len(ex.src) and {tuple(b) for b in ex.block.tolist()} == blocks
    for s, t, b in zip(ex.src.tolist(), ex.dst.tolist(), ex.block.tolist(), strict=True):
        box = tuple((j * 4, j * 4 + 4) for j in b)
        part = [tuple((max(lo, blo), min(hi, bhi)) for (lo, hi), (blo, bhi) in zip(shards[d], box, strict=True))
                for d in (s, t)]
        assert part[0] != part[1] and all(lo < hi for p in part for lo, hi in p)  # two distinct, non-empty parts
        # the replicas pair up along dp: same dp row of the mesh
        assert (np.argwhere(c.devices == s)[0][0]) == (np.argwhere(c.devices == t)[0][0])
    # each holder receives (parts - 1) values per cut block it touches; counts per pair add up
    received = [(t, tuple(b)) for t, b in zip(ex.dst.tolist(), ex.block.tolist(), strict=True)]
    for b in blocks:
        parts = qp.parts(b)
        for p in parts:
            for h in p.holders:
                assert received.count((h, b)) == len(parts) - 1
    pairs = qp.pairs()
    counted: dict[tuple[int, int], int] = {}
    for s, t in zip(ex.src.tolist(), ex.dst.tolist(), strict=True):
        counted[(s, t)] = counted.get((s, t), 0) + 1
    assert dict(zip(zip(pairs.src.tolist(), pairs.dst.tolist(), strict=True), pairs.values.tolist(),
                    strict=True)) == counted
    assert pairs.nbytes == 4 * len(ex.src)


def test_aligned_shards_exchange_nothing():
    layout = Layout((256, 512), Mesh(np.arange(8).reshape(2, 4), ("fsdp", "tp")), ("fsdp", "tp"))
    qp = quant_plan(layout, Fp8Format())
    assert qp.cut_blocks().shape == (0, 2) and len(qp.exchange().src) == 0 and qp.pairs().nbytes == 0


def test_plan_errors():
    layout = CASES["fsdp uneven, cuts rows"].layout()
    with pytest.raises(TypeError, match="layout must be a jreshard.Layout"):
        quant_plan((22, 13))
    with pytest.raises(TypeError, match="fmt must be an Fp8Format"):
        quant_plan(layout, "float8_e4m3fn")
    qp = quant_plan(layout, Fp8Format(block=(4, 4)))
    with pytest.raises(ValueError, match=r"block must index the scale grid \(6, 4\)"):
        qp.parts((6, 0))
    with pytest.raises(ValueError, match=r"src_shards lacks the shards of devices \[3\]"):
        execute(qp, {d: np.zeros(b.shape, F32) for d, b in layout.shards().items() if d != 3})
    with pytest.raises(ValueError, match=r"src_shards\[0\] has shape \(5, 13\)"):
        execute(qp, {d: np.zeros((5, 13), F32) for d in layout.shards()})


# --- TP targets --------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1, None])
def test_tp_targets_follow_the_weight_split(tp, dim):
    shape, block = (64, 96), (8, 8)
    x = values(shape, seed=tp)
    q, s = ref_quantize(x, block)
    target = fp8_tp_split(shape, tp, dim, Fp8Format(block=block), devices=range(10, 10 + tp))
    assert target.weight.dtype == "float8_e4m3fn" and target.scale.dtype == "float32"
    assert target.scale.shape == (8, 12)
    for r in range(tp):
        lo = [0, 0]
        hi = list(shape)
        if dim is not None:
            size = shape[dim] // tp
            lo[dim], hi[dim] = r * size, (r + 1) * size
        w_box = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
        s_box = tuple(slice(a // 8, b // 8) for a, b in zip(lo, hi, strict=True))
        assert target.weight.shard_box(10 + r) == w_box
        assert target.scale.shard_box(10 + r) == s_box
        assert_same(q[target.weight.shard_box(10 + r)], q[w_box])  # the slices vLLM loads on rank r
        assert_same(s[target.scale.shard_box(10 + r)], s[s_box])


def test_tp_target_at_128_and_uneven_whole_blocks():
    t = fp8_tp_split((2048, 7168), 16, 0)  # DeepSeek-V3 expert gate at TP16: 128 rows a rank
    assert t.scale.shape == (16, 56) and t.scale.shard_shape(5) == (1, 56)
    t = fp8_tp_split((255, 64), 2, 0)  # shards of 128 and 127 rows: no block cut
    assert t.weight.shard_shape(1) == (127, 64) and t.scale.shard_box(1) == (slice(1, 2), slice(0, 1))


@pytest.mark.parametrize("shape, tp, dim, match", [
    ((7168, 2048), 32, 1, r"tp=32 splits dim 1 \(size 2048\) into shards of 64, which cuts its blocks of 128 "
                          r"\(fmt.block\); vLLM refuses this split too \(input_size_per_partition = 64 is not "
                          r"divisible by block_k = 128\)"),
    ((576, 7168), 3, 0, r"output_partition_size = 192 is not divisible by block_n = 128"),
])
def test_tp_split_cutting_a_block_is_refused(shape, tp, dim, match):
    with pytest.raises(ValueError, match=match):
        fp8_tp_split(shape, tp, dim)


def test_whole_dim_scales_are_replicated_over_the_split():
    mesh = Mesh(np.arange(4).reshape(2, 2), ("dp", "tp"))
    row = fp8_split(Layout((64, 96), mesh, (None, "tp")), Fp8Format.per_channel())
    assert row.scale.shape == (64, 1) and row.scale.spec == (None, None)  # every rank: all row scales
    col = fp8_split(Layout((64, 96), mesh, ("tp", None)), Fp8Format.per_channel())
    assert col.scale.spec == ("tp", None) and col.scale.shard_shape(1) == (32, 1)
    ten = fp8_split(Layout((64, 96), mesh, ("tp", None)), Fp8Format.per_tensor())
    assert ten.scale.shape == (1, 1) and ten.scale.spec == (None, None)
    stacked = fp8_split(Layout((8, 64, 96), mesh, ("dp", "tp", None)), Fp8Format(block=(16, 16)))
    assert stacked.scale.shape == (8, 4, 6) and stacked.scale.spec == ("dp", "tp", None)


def test_target_errors():
    with pytest.raises(TypeError, match="layout must be a jreshard.Layout"):
        fp8_split((64, 96))
    with pytest.raises(ValueError, match="tp must be a positive int"):
        fp8_tp_split((64, 96), 0, 0)
    with pytest.raises(ValueError, match=r"dim must be None or a dim of shape \(64, 96\)"):
        fp8_tp_split((64, 96), 2, 2)
    with pytest.raises(ValueError, match="devices must list tp=2 ranks"):
        fp8_tp_split((64, 96), 2, 0, devices=[0])
    mesh = Mesh([0, 1, 2], ("fsdp",))
    with pytest.raises(ValueError, match=r"layout splits dim 0 \(size 64\) into shards of 22"):
        fp8_split(Layout((64, 96), mesh, ("fsdp",)), Fp8Format(block=(8, 8)))


# --- a sweep over layouts ----------------------------------------------------------------------------

@st.composite
def sharded_cases(draw):
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    names = tuple(f"m{i}" for i in range(len(sizes)))
    devices = np.array(draw(st.permutations(range(int(np.prod(sizes)))))).reshape(sizes)
    shape = tuple(draw(st.lists(st.integers(1, 20), min_size=2, max_size=3)))
    owner = [draw(st.sampled_from([None, *range(len(shape))])) for _ in names]
    spec = tuple(tuple(a for a, o in zip(names, owner, strict=True) if o == d) or None for d in range(len(shape)))
    block = (draw(st.sampled_from([1, 2, 3, 4, 5, None])), draw(st.sampled_from([1, 2, 4, 7, None])))
    return case(shape, devices, names, spec), block, draw(st.integers(0, 1000))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(sharded_cases())
def test_sweep_sharded_equals_full(args):
    c, block, seed = args
    qp = check_sharded(c, block, seed)
    # pairs() counts exactly the messages exchange() lists
    ex = qp.exchange()
    assert qp.pairs().nbytes == 4 * len(ex.src)


@pytest.mark.parametrize("module", ["jreshard.core.fp8", "jreshard.core.fp8_blocks", "jreshard.core.fp8_split"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted and not result.failed
