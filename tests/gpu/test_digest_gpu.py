"""GPU check for the bridge's on-device digest (one GPU, seconds): run with
``python -m pytest -q -s tests/gpu/test_digest_gpu.py`` on a machine with a CUDA build of torch.

Not collected by default (pytest ignores tests/gpu); without a CUDA device every test is skipped,
saying why. It checks that a CUDA tensor is digested on its device (``digest`` picks the device
kind), that the result equals the same formula computed on a CPU copy, that a flipped bit and a
truncation are detected, and prints the digest's throughput beside a device-to-host copy of the
same bytes (``tests/gpu/_checks.py``, which ``tests/gpu/run_device_checks.py`` runs too).
"""

from __future__ import annotations

import pytest

from tests.gpu._checks import digest_problems, digest_speed


def _cuda_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch (this machine has no GPU or a CPU-only torch build)")
    return torch


@pytest.mark.gpu
def test_cuda_digest_runs_on_the_device_and_equals_the_cpu_formula():
    torch = _cuda_or_skip()
    assert digest_problems(torch, "cuda") == []


@pytest.mark.gpu
def test_cuda_digest_throughput():
    torch = _cuda_or_skip()
    r = digest_speed(torch, "cuda")
    gib = r["bytes"] / (1 << 30)
    print(f"\ndevice digest: {gib / r['digest_s']:.1f} GiB/s; "
          f"device-to-host copy of the same bytes: {gib / r['copy_s']:.1f} GiB/s; "
          f"xxh3 of the host copy: {gib / r['host_s']:.1f} GiB/s")
    assert r["digest_s"] > 0
