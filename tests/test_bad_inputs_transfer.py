"""Bad inputs of ``jreshard.transfer`` and ``jreshard.plan`` on jax arrays (rows as in tests/test_bad_inputs.py).

Wrong kinds of params, targets, meshes and dtypes; bad ``max_bytes_in_flight``, ``transport``,
``donate``, ``domains`` (devices jax lacks) and ``plan``; a target naming a mesh axis twice; a call
inside ``jit``; arrays donated (deleted) by an earlier call; a target without an entry for a leaf
(the message names the leaf's path); the JAX FP8 quantizer's format and arrays. Every row fails
before anything moves.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jreshard
from jreshard import transfer
from jreshard.core.fp8 import Fp8Format
from jreshard.jax_executor import fp8
from tests.test_bad_inputs import check_row

DEVS = np.array(jax.devices()[:8])
TRAIN = jax.sharding.Mesh(DEVS[:4], ("fsdp",))
SERVE = jax.sharding.Mesh(DEVS[4:].reshape(2, 2), ("dp", "tp"))
S = NamedSharding(SERVE, P(None, "tp"))
ROWS = []


def row(name, fn, exc, pat):
    ROWS.append((name, fn, exc, pat))


def w(shape=(8, 4)):
    return jax.device_put(np.arange(np.prod(shape), dtype=np.float32).reshape(shape), NamedSharding(TRAIN, P("fsdp")))


def tx(params=None, target=S, **kw):
    return transfer({"w": w()} if params is None else params, target, **kw)


def donated():
    x = w()
    transfer({"w": x}, S, donate=True)
    return transfer({"w": x}, S, donate=True)


for name, kw, exc, pat in [
    ("params numpy", {"params": {"w": np.zeros((8, 4))}}, TypeError, "params leaf at 'w' must be a jax.Array"),
    ("params float", {"params": [1.0]}, TypeError, "params leaf at '0' must be a jax.Array"),
    ("params empty", {"params": {}}, ValueError, "params is an empty pytree"),
    ("params ShapeDtypeStruct", {"params": {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=S)}}, TypeError,
     "params leaf at 'w' must be a jax.Array"),
    ("target str", {"target": "tp"}, TypeError, "target at 'w' must be a jax.sharding.Sharding"),
    ("target None", {"target": None}, TypeError, "target at 'w'"),
    ("target int", {"target": 3}, TypeError, "target at 'w'"),
    ("target PartitionSpec without mesh", {"target": P("tp")}, TypeError, "target at 'w' is a PartitionSpec"),
    ("target unknown axis", {"target": P("zz"), "mesh": SERVE}, ValueError, "target at 'w'"),
    ("target spec too long", {"target": P("dp", "tp", None), "mesh": SERVE}, ValueError, "target at 'w'"),
    ("target not dividing", {"target": NamedSharding(SERVE, P(("dp", "tp"), None)),
                             "params": {"w": jax.device_put(np.zeros((6, 4), np.float32),
                                                            NamedSharding(TRAIN, P()))}},
     ValueError, "target at 'w' .* does not fit the array of shape"),
    ("target missing key", {"params": {"w": w(), "v": w()}, "target": {"w": S}}, ValueError,
     "no entry for params leaf 'v'"),
    ("target missing nested key", {"params": {"a": {"w": w(), "v": w()}}, "target": {"a": {"w": S}}}, ValueError,
     "no entry for params leaf 'a/v'"),
    ("target extra key", {"target": {"w": S, "v": S}}, ValueError, "its entry at 'v' is not in params"),
    ("target list for dict", {"target": [S]}, ValueError, "target must be"),
    ("mesh with Sharding", {"mesh": SERVE}, TypeError, "mesh= was also given"),
    ("mesh str", {"target": P("tp"), "mesh": "B"}, TypeError, "mesh must be"),
    ("mesh unknown devices", {"target": P("x"), "mesh": jreshard.Mesh([100, 101], "x")}, ValueError,
     r"mesh .* names devices \[100, 101\]"),
    ("dtype name", {"dtype": "floaty"}, TypeError, "dtype at 'w'"),
    ("dtype object", {"dtype": object}, TypeError, "dtype at 'w' must be a numeric dtype"),
    ("dtype str", {"dtype": "U4"}, TypeError, "dtype at 'w' must be a numeric dtype"),
    ("dtype int", {"dtype": 5}, TypeError, "dtype at 'w'"),
    ("dtype tree missing key", {"params": {"w": w(), "v": w()}, "dtype": {"w": "bfloat16"}}, ValueError,
     "dtype must be .* no entry for params leaf 'v'"),
    ("donate str", {"donate": "yes"}, TypeError, "donate"),
    ("donate None", {"donate": None}, TypeError, "donate"),
    ("max_bytes_in_flight 0", {"max_bytes_in_flight": 0}, ValueError, "max_bytes_in_flight"),
    ("max_bytes_in_flight -1", {"max_bytes_in_flight": -1}, ValueError, "max_bytes_in_flight"),
    ("max_bytes_in_flight float", {"max_bytes_in_flight": 1e6}, TypeError, "max_bytes_in_flight"),
    ("max_bytes_in_flight str", {"max_bytes_in_flight": "1M"}, TypeError, "max_bytes_in_flight"),
    ("max_bytes_in_flight bool", {"max_bytes_in_flight": True}, TypeError, "max_bytes_in_flight"),
    ("max_bytes_in_flight 2**63", {"max_bytes_in_flight": 2**63}, ValueError, "max_bytes_in_flight"),
    ("max_bytes_in_flight uint64", {"max_bytes_in_flight": np.uint64(2**64 - 1)}, ValueError, "max_bytes_in_flight"),
    ("transport name", {"transport": "nccl"}, ValueError, "transport must be one of"),
    ("transport None", {"transport": None}, ValueError, "transport must be one of"),
    ("transport list", {"transport": ["memcpy"]}, ValueError, "transport must be one of"),
    ("plan str", {"plan": "p"}, TypeError, "plan must be a jreshard.Plan"),
    ("plan for another target", {"plan": jreshard.plan({"w": w()}, NamedSharding(SERVE, P("tp")))}, ValueError,
     "plan does not match params/target: for tensor 'w'"),
    ("plan for other leaves", {"plan": jreshard.plan({"v": w()}, S)}, ValueError, "plan does not match params"),
    ("max_bytes_in_flight 2**70", {"max_bytes_in_flight": 2**70}, ValueError, "max_bytes_in_flight must be an int <="),
    ("domains unknown devices", {"domains": [list(range(8)), [100, 101]]}, ValueError,
     r"domains .* names devices \[100, 101\] that jax does not have"),
    ("domains only unknown devices", {"domains": jreshard.Domains.from_groups([[100], [101]])}, ValueError,
     r"names devices \[100, 101\] that jax does not have; its devices are \[0, 1"),
    ("domains unknown devices with block", {"domains": [[0, 1], [99]], "dtype": "float8_e4m3fn", "block": (2, 2)},
     ValueError, r"names devices \[99\]"),
    ("target axis twice", {"target": P("tp", "tp"), "mesh": SERVE}, ValueError,
     r"target at 'w' P\('tp', 'tp'\) uses mesh axis 'tp' twice"),
    ("target axis twice in one entry", {"target": P(("dp", "dp")), "mesh": SERVE}, ValueError,
     "target at 'w' .* uses mesh axis 'dp' twice"),
    ("target axis twice in a tree", {"target": {"w": P(None, ("tp", "dp", "tp"))}, "mesh": SERVE}, ValueError,
     "target at 'w' .* uses mesh axis 'tp' twice"),
]:
    row(f"transfer {name}", lambda kw=kw: tx(**kw), exc, pat)
row("transfer unknown keyword", lambda: tx(bogus=1), TypeError, "bogus")
row("transfer inside jit", lambda: jax.jit(lambda x: transfer({"w": x}, S))(w()), TypeError,
    "must be called outside jax.jit")
row("transfer deleted array", lambda: (lambda x: (x.delete(), tx({"w": x})))(w()), ValueError,
    "params leaf at 'w' has been deleted")
row("transfer donated twice", donated, ValueError, "params leaf at 'w' has been deleted")
row("plan jax balance", lambda: jreshard.plan({"w": w()}, S, balance="yes"), TypeError, "balance must be True or False")
row("plan jax unknown keyword", lambda: jreshard.plan({"w": w()}, S, bogus=1), TypeError, "bogus")
row("plan jax dtype", lambda: jreshard.plan({"w": w()}, S, dtype="U3"), TypeError, "dtype at 'w'")
row("plan axis twice", lambda: jreshard.plan({"w": w()}, P("dp", "dp"), mesh=SERVE), ValueError,
    "target at 'w' .* uses mesh axis 'dp' twice")
row("plan inside jit", lambda: jax.jit(lambda x: (jreshard.plan({"w": x}, S), x)[1])(w()), TypeError,
    "params leaf at 'w' is a tracer: .* must be called outside jax.jit")
row("plan inside jit, list", lambda: jax.jit(lambda x: (jreshard.plan([x], S), x)[1])(w()), TypeError,
    "params leaf at '0' is a tracer")
row("plan deleted array", lambda: (lambda x: (x.delete(), jreshard.plan({"w": x}, S)))(w()), ValueError,
    "params leaf at 'w' has been deleted")
row("fp8 quantize deleted array", lambda: (lambda x: (x.delete(), fp8.quantize(x)))(w((8, 128))), ValueError,
    "x has been deleted")
row("fp8 quantize inside jit", lambda: jax.jit(lambda x: fp8.quantize(x)[0])(w((8, 128))), TypeError,
    "x is a tracer: quantize must be called outside jax.jit")
row("fp8 quantize fmt str", lambda: fp8.quantize(w(), "e4m3"), TypeError, "fmt must be an Fp8Format")
row("fp8 scale_sharding fmt str", lambda: fp8.scale_sharding(S, (8, 4), "x"), TypeError, "fmt must be an Fp8Format")
row("fp8 amax_reduce fmt tuple", lambda: fp8.amax_reduce(S, (8, 4), (2, 2)), TypeError, "fmt must be")
row("fp8 transfer block beyond int64", lambda: tx(dtype="float8_e4m3fn", block=(1 << 64, 2)), ValueError,
    "block sizes must be positive and fit in int64")
row("plan ShapeDtypeStruct without sharding", lambda: jreshard.plan({"w": jax.ShapeDtypeStruct((8, 4), np.float32)},
                                                                     S), TypeError, "without a sharding")


def test_refusals_leave_params_alive_and_good_inputs_still_work():
    x = w()
    for bad in ({"domains": [[0, 1, 2, 3, 4, 5, 6, 7], [100]]}, {"target": P("tp", "tp"), "mesh": SERVE}):
        with pytest.raises(ValueError):
            transfer({"w": x}, bad.pop("target", S), donate=True, **bad)
        assert not x.is_deleted()  # refused before anything moved or was donated
    out = transfer({"w": x}, S, domains=[[0, 1, 2, 3], [4, 5, 6, 7]], max_bytes_in_flight=2**63 - 1)
    assert np.array_equal(out["w"], w())
    big, whole = fp8.quantize(w((8, 8)), Fp8Format(block=(1 << 40, 4))), fp8.quantize(w((8, 8)), Fp8Format(
        block=(None, 4)))  # a block larger than its dim is the whole dim
    assert np.array_equal(np.asarray(big[1]), np.asarray(whole[1]))
    assert np.array_equal(np.asarray(big[0]).view(np.uint8), np.asarray(whole[0]).view(np.uint8))


def test_numpy_ints_pass_where_ints_do():
    out = tx(max_bytes_in_flight=np.int64(1 << 20), donate=np.bool_(False))
    assert out["w"].sharding == S and np.array_equal(out["w"], w())


@pytest.mark.parametrize(("name", "fn", "exc", "pattern"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, fn, exc, pattern):
    check_row(name, fn, exc, pattern)
