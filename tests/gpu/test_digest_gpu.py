"""GPU check for the bridge's on-device digest (one GPU, seconds): run with
``python -m pytest -q -s tests/gpu/test_digest_gpu.py`` on a machine with a CUDA build of torch.

Not collected by default (pytest ignores tests/gpu); without a CUDA device every test is skipped,
saying why. It checks that a CUDA tensor is digested on its device (``digest`` picks the device
kind), that the result equals the same formula computed on a CPU copy, that a flipped bit and a
truncation are detected, and prints the digest's throughput beside a device-to-host copy of the
same bytes.
"""

from __future__ import annotations

import time

import pytest


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch (this machine has no GPU or a CPU-only torch build)")
    return torch


@pytest.mark.gpu
def test_cuda_digest_runs_on_the_device_and_equals_the_cpu_formula():
    torch = _cuda_or_skip()
    from bridge.wire.digest import device_digest, digest, is_device_digest

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device="cuda", generator=g)
    d = digest(x)
    assert is_device_digest(d)
    assert d == device_digest(x.cpu())  # the same formula wherever it runs
    y = x.clone()
    y[12345] ^= 4
    assert digest(y) != d
    assert digest(x[:-2]) != d
    assert digest(x.view(torch.bfloat16)) == d  # bytes, whatever the dtype


@pytest.mark.gpu
def test_cuda_digest_throughput():
    torch = _cuda_or_skip()
    from bridge.wire.digest import digest

    x = torch.randn(64 << 20, device="cuda").to(torch.bfloat16)  # 128 MiB
    digest(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        digest(x)
    t_digest = (time.perf_counter() - t0) / 5
    t0 = time.perf_counter()
    for _ in range(5):
        x.cpu()
    t_copy = (time.perf_counter() - t0) / 5
    gib = x.numel() * x.element_size() / (1 << 30)
    print(f"\ndevice digest: {gib / t_digest:.1f} GiB/s; "
          f"device-to-host copy of the same bytes: {gib / t_copy:.1f} GiB/s")
    assert t_digest > 0
