"""What the GPU checks measure, shared by the pytest files of tests/gpu and ``run_device_checks.py``.

Every function takes the modules (``jax``, ``torch``) and the device it runs on as arguments, so
the same code runs on a GPU and, with small sizes, on the CPU (``run_device_checks.py --device
cpu``) before any GPU is lent. Nothing here skips or asserts: callers decide what a figure means.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

Timer = Callable[[Callable[[], Any]], float]


def timer(torch: Any, device: Any, reps: int) -> Timer:
    """A function that times ``fn`` (median of ``reps`` runs after one warm-up) on ``device``.

    On CUDA every run ends with ``torch.cuda.synchronize()``, a device-wide wait, so work that XLA
    queued on its own streams is counted as well.
    """
    cuda = getattr(device, "type", device) == "cuda"

    def timed(fn: Callable[[], Any]) -> float:
        fn()
        if cuda:
            torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return float(np.median(out))

    return timed


def dlpack_zero_copy(jax: Any, torch: Any, device: Any, dtype: str) -> tuple[bool, str]:
    """Whether a JAX array of ``dtype`` on ``device``, exported with DLPack, is the torch tensor's memory.

    Returns (ok, what was seen): the same pointer, the torch tensor on the expected device type and
    its values equal to the JAX array's.
    """
    import jax.numpy as jnp

    x = jax.device_put(jnp.arange(1 << 20, dtype=jnp.float32).astype(dtype).reshape(1024, 1024), device)
    t = torch.from_dlpack(x)
    want_type = "cuda" if device.platform == "gpu" else "cpu"
    same = t.data_ptr() == x.unsafe_buffer_pointer()
    equal = torch.equal(t.float().cpu(), torch.from_numpy(np.array(x.astype(jnp.float32))))
    ok = same and equal and t.device.type == want_type
    return ok, (f"{dtype}: torch {t.device}, pointer {'same' if same else 'DIFFERENT (copied)'}, "
                f"values {'equal' if equal else 'DIFFER'}")


def llama_params(jax: Any, device: Any, cfg: Any, seed: int = 0) -> dict[str, Any]:
    """A float32 parameter tree of ``jreshard.nn``'s Llama ``cfg``, replicated on the one-device mesh of ``device``."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jreshard.nn import param_shapes

    sharding = NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), P())
    rng = np.random.default_rng(seed)
    params: dict[str, Any] = {}
    for path, shape in param_shapes(cfg).items():
        node = params
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = jax.device_put(jnp.asarray(rng.standard_normal(shape, dtype=np.float32)), sharding)
    return params


def host_arrays(params: Any) -> dict[str, np.ndarray]:
    """The leaves of ``params`` by path, copied to NumPy (the input of ``plan.reference``)."""
    from bridge.trainer.sender import flatten_params

    return {p: np.asarray(x) for p, x in flatten_params(params).items()}


def exact(torch: Any, got: dict[str, Any], want: dict[str, np.ndarray]) -> bool:
    """Whether every tensor of ``got`` equals its NumPy reference in ``want`` bit for bit (as float32)."""
    return all(torch.equal(got[n].float().cpu(), torch.from_numpy(want[n].astype(np.float32))) for n in got)


def measure(jax: Any, torch: Any, device: Any, *, layers: int = 4, hidden: int = 2048, vocab: int = 32000,
            reps: int = 5) -> dict[str, Any]:
    """Pack and unpack of one trainer device -> one inference rank (TP1, bfloat16) on ``device``, timed.

    Pack is the Sender's own step (``Sender._pack``: XLA's cast + transpose of the float32 JAX
    shards, then the copies into the bucket buffer; a segment already cast and contiguous is sent
    from the shard). Unpack is the receiver's landing of the wire bytes (the receive's copies into
    its buffer or straight into the params) plus ``InPlaceCommit.unpack``. The whole model is one
    bucket: one message. The baseline is one device copy of the message's bytes. Returns the bytes,
    the three median times (seconds) and whether the unpacked params equal ``plan.reference``.
    """
    import bridge
    from bridge.trainer.sender import Sender, describe
    from bridge.wire.commit import InPlaceCommit, Wiring
    from jreshard.nn import LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=max(hidden // 128, 2),
                      num_key_value_heads=max(hidden // 256, 1), head_dim=min(128, hidden // 2))
    params = llama_params(jax, device, cfg)
    src = describe(params, trainer_ranks=[0])
    plan = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [1], fused=True, dtype="bfloat16"),
                             bucket_bytes=1 << 40)  # one bucket: one message, the whole model
    (msg,) = plan.messages
    sender = Sender(plan, rank=0)
    shards = sender._shards(params)
    dev = torch.device("cuda") if device.platform == "gpu" else torch.device("cpu")
    local = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16, device=dev) for p in plan.param_map.for_rank(1)}
    into = InPlaceCommit(Wiring(plan, 1), local)
    buf, staging, other = (torch.empty(msg.nbytes, dtype=torch.uint8, device=dev) for _ in range(3))
    segments = plan.segments(msg)

    def pack() -> list[Any]:
        return sender._pack(shards, {}, set(), msg, buf)  # a fresh cache: XLA's work is timed too

    wire = torch.cat([s.reshape(-1).view(torch.uint8) for s in pack()])
    targets = into.recv(msg, staging)

    def unpack() -> None:
        for target, seg in zip(targets, segments, strict=True):
            target.copy_(wire[seg.start:seg.stop])
        into.unpack(msg, staging)

    timed = timer(torch, dev, reps)
    out: dict[str, Any] = {"bytes": msg.nbytes, "wire_bytes": wire.numel()}
    out["pack_s"], out["unpack_s"] = timed(pack), timed(unpack)
    out["copy_s"] = timed(lambda: other.copy_(buf))
    out["exact"] = wire.numel() == msg.nbytes and exact(torch, local, plan.reference(host_arrays(params))[1])
    return out


def digest_problems(torch: Any, device: Any, nbytes: int = 3 << 20) -> list[str]:
    """What is wrong with ``bridge.wire.digest`` on ``device`` (an empty list: nothing).

    The digest ``digest`` picks for a tensor there (the device sum off the host, xxh3 on it) must
    equal the same formula on a host copy (``like=``, as a receiver in host memory recomputes a
    sender's), the host digest must not depend on where the bytes lie, a flipped bit and a
    truncation must change it, and the dtype must not matter (bytes are digested).
    """
    from bridge.wire.digest import device_digest, digest, host_digest, is_device_digest

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=g)
    problems = []
    d = digest(x)
    on_host = torch.device(device).type == "cpu"
    if is_device_digest(d) == on_host:
        problems.append(f"digest picked the {'device' if is_device_digest(d) else 'host'} kind on {device}")
    if device_digest(x) != device_digest(x.cpu()):
        problems.append("the device sum differs from the same formula on a host copy")
    if digest(x.cpu(), like=d) != d:
        problems.append("a host copy recomputed like the announced digest differs")
    if host_digest(x) != host_digest(x.cpu()):
        problems.append("the host digest depends on where the bytes lie")
    y = x.clone()
    y[12345] ^= 4
    if digest(y) == d:
        problems.append("a flipped bit went unnoticed")
    if digest(x[:-2]) == d:
        problems.append("a truncation went unnoticed")
    if digest(x.view(torch.bfloat16)) != d:
        problems.append("the dtype changed the digest")
    return problems


def digest_speed(torch: Any, device: Any, nbytes: int = 128 << 20, reps: int = 5) -> dict[str, float]:
    """Seconds (median) of ``digest`` of ``nbytes`` bfloat16 bytes on ``device``, of a copy of them to
    the host (on the host itself: a copy there) and of xxh3 (``host_digest``) of the host copy."""
    from bridge.wire.digest import digest, host_digest

    x = torch.randn(nbytes // 2, device=device).to(torch.bfloat16)
    on_host = x.cpu()
    timed = timer(torch, torch.device(device), reps)
    return {"bytes": float(nbytes), "digest_s": timed(lambda: digest(x)),
            "copy_s": timed(lambda: x.cpu() if x.device.type != "cpu" else x.clone()),
            "host_s": timed(lambda: host_digest(on_host))}


def transfer_vs_device_put(jax: Any, device: Any, nbytes: int = 256 << 20, reps: int = 5) -> dict[str, Any]:
    """``jreshard.transfer`` on one device against ``jax.device_put`` of the same arrays, timed.

    Two float32 leaves of ``nbytes`` in all on the one-device mesh ``("x",)`` go to the mesh
    ``("a", "b")`` of the same device, split on both axes (a layout change that moves nothing), and
    once more cast to bfloat16 (``dtype=``), where the baseline is ``device_put`` of the cast arrays
    (XLA's cast then ``device_put``). Returns the median seconds of each, whether each result equals
    its baseline bit for bit, and whether the same-dtype result reuses the source's memory.
    """
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jreshard

    one = jax.sharding.Mesh(np.array([device]), ("x",))
    two = jax.sharding.Mesh(np.array([device]).reshape(1, 1), ("a", "b"))
    n = int(np.sqrt(nbytes // 8))
    rng = np.random.default_rng(0)
    params = {k: jax.device_put(jnp.asarray(rng.standard_normal((n, n), dtype=np.float32)), NamedSharding(one, P()))
              for k in ("w", "v")}
    target = {k: NamedSharding(two, P("a", "b")) for k in params}
    cast = jax.jit(lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t))

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        out = jax.block_until_ready(fn())
        runs = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            runs.append(time.perf_counter() - t0)
        return float(np.median(runs)), out

    res: dict[str, Any] = {"bytes": 2 * n * n * 4}
    res["transfer_s"], got = timed(lambda: jreshard.transfer(params, target))
    res["device_put_s"], want = timed(lambda: jax.device_put(params, target))
    res["cast_transfer_s"], got16 = timed(lambda: jreshard.transfer(params, target, dtype="bfloat16"))
    res["cast_device_put_s"], want16 = timed(lambda: jax.device_put(cast(params), target))
    res["exact"] = all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in params)
    res["cast_exact"] = all(np.array_equal(np.asarray(got16[k]).view(np.uint16), np.asarray(want16[k]).view(np.uint16))
                            for k in params)
    res["reused"] = all(got[k].unsafe_buffer_pointer() == params[k].unsafe_buffer_pointer() for k in params)
    res["shardings_ok"] = all(got[k].sharding == target[k] and got16[k].sharding == target[k] for k in params)
    return res
