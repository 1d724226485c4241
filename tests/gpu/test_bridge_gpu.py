"""GPU check for the bridge (one GPU, under 5 minutes): DLPack zero-copy and pack/unpack throughput.

Not collected by default (pytest ignores tests/gpu); run it on a GPU machine with
``python -m pytest -q -s tests/gpu/test_bridge_gpu.py``. It needs a CUDA build of
jax (a GPU backend) and of torch; without them every test is skipped, saying why.

1. A JAX GPU array (float32 and bfloat16) exported with DLPack is the same device
   memory as the torch CUDA tensor (same pointer, same values, no copy).
2. The bridge's own pack (Sender: cast + transpose of the JAX shard, copy into the
   per-peer buffer) and unpack (Receiver: copy into the torch parameters) run on
   GPU tensors; their throughput is printed beside a plain device-to-device copy of
   the same bytes, and the unpacked parameters are checked bit for bit.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

os.environ.pop("JAX_PLATFORMS", None)  # the test suite pins CPU; this script wants the GPU backend


def _gpu_or_skip():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch (this machine has no GPU or a CPU-only torch build)")
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        pytest.skip("jax has no GPU backend here (install a CUDA build of jaxlib to run this check)")
    return jax, torch, devices[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dlpack_is_zero_copy_on_gpu(dtype):
    jax, torch, dev = _gpu_or_skip()
    import jax.numpy as jnp

    x = jax.device_put(jnp.arange(1 << 20, dtype=jnp.float32).astype(dtype).reshape(1024, 1024), dev)
    t = torch.from_dlpack(x)
    assert t.device.type == "cuda"
    assert t.data_ptr() == x.unsafe_buffer_pointer(), "DLPack copied the buffer"
    assert torch.equal(t.float().cpu(), torch.from_numpy(np.asarray(x.astype(jnp.float32))))


def measure(jax, torch, device, *, layers: int = 4, hidden: int = 2048, reps: int = 5) -> dict[str, float]:
    """Pack and unpack throughput of one trainer device -> one inference rank (TP1, bfloat16) on ``device``."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import bridge
    from bridge.trainer.sender import Sender, describe
    from jreshard.nn import LlamaConfig, param_shapes

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=hidden // 128,
                      num_key_value_heads=hidden // 256, head_dim=128)
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    rng = np.random.default_rng(0)
    params = {}
    for path, shape in param_shapes(cfg).items():
        node = params
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = jax.device_put(jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
                                    NamedSharding(mesh, P()))
    src = describe(params, trainer_ranks=[0])
    plan = bridge.BridgePlan(src, bridge.llama_param_map(cfg, src, [1], fused=True, dtype="bfloat16"),
                             bucket_bytes=1 << 40)  # one bucket: one message, the whole model
    (msg,) = plan.messages
    sender = Sender(plan, rank=0)
    shards = sender._shards(params)
    dev = torch.device("cuda") if device.platform == "gpu" else torch.device("cpu")
    local = {p.name: torch.zeros(p.shape, dtype=torch.bfloat16, device=dev) for p in plan.param_map.for_rank(1)}
    receiver = bridge.Receiver(plan, local, rank=1)
    buf = torch.empty(msg.nbytes, dtype=torch.uint8, device=dev)
    other = torch.empty_like(buf)

    def timed(fn) -> float:
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return float(np.median(out))

    pack = timed(lambda: sender._pack(shards, {}, msg, buf))
    unpack = timed(lambda: receiver._unpack(receiver.params, msg, buf))
    copy = timed(lambda: other.copy_(buf))
    flat = {p: np.asarray(x) for p, x in sender_flat(params).items()}
    want = plan.reference(flat)[1]
    exact = all(torch.equal(local[n].float().cpu(), torch.from_numpy(want[n].astype(np.float32))) for n in local)
    return {"bytes": msg.nbytes, "pack_s": pack, "unpack_s": unpack, "copy_s": copy, "exact": exact}


def sender_flat(params):
    from bridge.trainer.sender import flatten_params

    return flatten_params(params)


@pytest.mark.gpu
def test_pack_unpack_throughput_on_gpu():
    jax, torch, dev = _gpu_or_skip()
    r = measure(jax, torch, dev)
    gb = r["bytes"] / 1e9
    print(f"\nGPU {torch.cuda.get_device_name()}, jax {jax.__version__}, torch {torch.__version__}: "
          f"{r['bytes'] / 1e6:.0f} MB bfloat16 (float32 JAX shards, kernels transposed)\n"
          f"  pack (cast+transpose+copy) {gb / r['pack_s']:7.1f} GB/s   unpack {gb / r['unpack_s']:7.1f} GB/s   "
          f"plain device-to-device copy {gb / r['copy_s']:7.1f} GB/s\n"
          f"  pack / copy time {r['pack_s'] / r['copy_s']:.1f}x, unpack / copy time {r['unpack_s'] / r['copy_s']:.1f}x")
    assert r["exact"], "unpacked parameters differ from the NumPy reference"
