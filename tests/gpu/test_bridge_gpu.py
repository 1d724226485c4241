"""GPU check for the bridge (one GPU, under 5 minutes): DLPack zero-copy and pack/unpack throughput.

Not collected by default (pytest ignores tests/gpu); run it on a GPU machine with
``python -m pytest -q -s tests/gpu/test_bridge_gpu.py``. It needs a CUDA build of
jax (a GPU backend) and of torch; without them every test is skipped, saying why.
``tests/gpu/run_device_checks.py`` runs the same measurements (``tests/gpu/_checks.py``)
among its checks, as one script (docs/gpu.md).

1. A JAX GPU array (float32 and bfloat16) exported with DLPack is the same device
   memory as the torch CUDA tensor (same pointer, same values, no copy).
2. The bridge's own pack (Sender: cast + transpose of the JAX shard, copy into the
   per-peer buffer) and unpack (Receiver: copy into the torch parameters) run on
   GPU tensors; their throughput is printed beside a plain device-to-device copy of
   the same bytes, and the unpacked parameters are checked bit for bit.
"""

from __future__ import annotations

import os

import pytest

from tests.gpu._checks import dlpack_zero_copy, measure

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
    ok, seen = dlpack_zero_copy(jax, torch, dev, dtype)
    assert ok, seen


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
