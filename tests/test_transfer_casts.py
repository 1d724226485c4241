"""Casts in jreshard.transfer: NumPy's conversions used by the host copies give XLA's bits, casts arrive
bit for bit in every transport, and the compiled programs do not multiply with leaves or devices."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jreshard.jax_executor.casts import NUMPY_CASTS
from tests.test_transfer import DEVICES, SERVE, TRAIN, TRANSPORTS, assert_matches_host, compile_log, xfer


def _uint(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def _inputs(dtype: np.dtype) -> np.ndarray:
    """Every bit pattern of a 8- or 16-bit dtype; for wider ones every exponent and sign with the
    mantissa bits around each rounding boundary of a 16-bit result, plus random bits."""
    if dtype.itemsize <= 2:
        return np.arange(1 << 8 * dtype.itemsize, dtype=f"u{dtype.itemsize}").view(dtype)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0FFF, 0x1000, 0x1001], np.uint32)
    noise = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 16, dtype=np.uint32)
    return np.concatenate([(high[:, None] | low).ravel(), noise]).view(dtype)


@pytest.mark.parametrize("pair", sorted(NUMPY_CASTS, key=str), ids=lambda p: f"{p[0]}->{p[1]}")
def test_numpy_casts_give_xla_bits_for_every_input(pair):
    src, dst = pair
    a = _inputs(src)
    want = np.asarray(jnp.asarray(a).astype(dst))
    got = np.empty(a.shape, dst)
    with np.errstate(all="ignore"):
        got[...] = a  # the copies cast by assignment, as here
    bad = np.flatnonzero(_uint(got) != _uint(want))
    assert bad.size == 0, f"{src}->{dst}: inputs {[hex(v) for v in _uint(a)[bad[:4]]]} differ from XLA's"


def _special(n: int) -> np.ndarray:
    """float32 values where casts go wrong: NaN payloads of both kinds and signs, infinities,
    subnormals, rounding ties, overflow to a narrower type; the rest random bits."""
    bits = np.array([0x7F800001, 0xFF800001, 0x7FC00001, 0x7FBFFFFF, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
                     0x00000001, 0x807FFFFF, 0x00400000, 0x3F808000, 0x3F818000, 0x3F808001, 0x477FF000,
                     0x47800000, 0x7F7FFFFF, 0x00000000, 0x80000000], np.uint32)
    rest = np.random.default_rng(1).integers(0, 1 << 32, size=n - bits.size, dtype=np.uint32)
    return np.concatenate([bits, rest]).view(np.float32)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "int8"])
@pytest.mark.parametrize("spec", [P("dp", "tp"), P(None, "tp")], ids=["one-copy", "replicas"])
def test_casts_of_special_values_arrive_bit_for_bit(transport, dtype, spec):
    host = _special(32 * 16).reshape(32, 16)
    if dtype == "int8":  # a NumPy cast from an integer source
        host = np.arange(-256, 256, dtype=np.int16).astype(np.int8).reshape(32, 16)
        dtype = "bfloat16"
    x = jax.device_put(host, NamedSharding(TRAIN, P("fsdp")))
    target = NamedSharding(SERVE, spec)  # replicas: each element goes to two devices, cast once
    assert_matches_host(xfer(x, target, transport=transport, dtype=dtype), host, target, dtype)
    back = xfer(x.astype(dtype), target, transport=transport, dtype="float32")  # and widening
    assert_matches_host(back, np.asarray(x.astype(dtype)), target, "float32")


_SIZES = itertools.count(3)  # fresh shapes for every sync below, so that no earlier compile is reused


def _compiles(transport: str, leaves: int, dtype: str, caplog: pytest.LogCaptureFixture,
              width: int | None = None, **kwargs) -> list[str]:
    """What the first sync of ``leaves`` equal float32 leaves of a fresh shape, cast to ``dtype``, compiles."""
    shape = (16, width or 8 * next(_SIZES))
    params = {f"w{i}": jax.device_put(np.full(shape, i, np.float32), NamedSharding(TRAIN, P("fsdp")))
              for i in range(leaves)}
    target = NamedSharding(SERVE, P(None, "tp"))
    return compile_log(caplog, lambda: xfer(params, target, transport=transport, dtype=dtype, **kwargs))


@pytest.mark.parametrize("transport", ["memcpy", "device_put", "collective"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_many_equal_leaves_with_a_cast_compile_no_more_than_two(transport, dtype, caplog):
    two = _compiles(transport, 2, dtype, caplog)
    many = _compiles(transport, 32, dtype, caplog)
    assert len(many) <= len(two), many
    if dtype == "bfloat16" and transport == "memcpy":  # NumPy casts it while copying
        assert two == many == []
    if dtype == "float16":  # one compiled cast per shape, whatever the leaves and devices
        assert sum(line.startswith("Compiling jit(cast)") for line in many) == 1, many


def test_compiled_packing_shares_programs_between_buckets_of_equal_leaves(caplog):
    """Leaves moved whole from device 0 to device 1, one per bucket: the buckets differ only in their leaf."""
    src, dst = (NamedSharding(jax.sharding.Mesh(DEVICES[k:k + 1], ("x",)), P()) for k in (0, 1))
    shape = (16, 8 * next(_SIZES))

    def compiles(leaves: int) -> list[str]:
        params = [jax.device_put(np.full(shape, i, np.float32), src) for i in range(leaves)]
        cap = 3 * math.prod(shape)  # bytes: one bfloat16 leaf fits, two do not
        jax.clear_caches()  # the same programs compiled again, for the log to show them
        log = compile_log(caplog, lambda: xfer(params, dst, transport="collective/xla", dtype="bfloat16",
                                               max_bytes_in_flight=cap))
        return [line for line in log if line.startswith("Compiling")]

    one, four = compiles(1), compiles(4)
    assert any(line.startswith("Compiling jit(pack)") for line in one), one
    assert len(four) == len(one), four


def test_devices_doing_the_same_work_compile_one_pack_and_one_unpack(caplog):
    """FSDP4 -> TP2 x DP2: the four senders (and the four receivers) pack (unpack) alike, so each
    program compiles once for all of them, not once per device."""
    lines = [line for line in _compiles("collective/xla", 8, "bfloat16", caplog) if line.startswith("Compiling")]
    assert sum("pack" in line and "unpack" not in line for line in lines) == 1, lines
    assert sum("unpack" in line for line in lines) == 1, lines
