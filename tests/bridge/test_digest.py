"""bridge.wire.digest: the device digest (run here on CPU tensors, forced through the device path) detects
flipped bits, truncated, extended, shifted and permuted payloads; the host digest stays xxh3-64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from bridge.wire.digest import PRIME, device_digest, digest, host_digest, is_device_digest


def _payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def _reference(b: np.ndarray) -> int:
    """The documented formula in plain Python integers (no overflow), for a byte array."""
    padded = np.concatenate([b, np.zeros(len(b) % 2, np.uint8)])
    words = [int(w) for w in padded.view("<u2")]
    a = (sum(words) + len(b)) % PRIME
    c = sum((i + 1) * w for i, w in enumerate(words)) % PRIME
    return (1 << 62) | a << 31 | c


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1001])
def test_device_digest_equals_the_formula(n):
    t = _payload(n, n)
    assert device_digest(t) == _reference(t.numpy())


def test_device_digest_reads_bytes_whatever_the_dtype_and_layout():
    x = torch.randn(6, 10, dtype=torch.float32)
    assert device_digest(x) == _reference(x.numpy().view(np.uint8).reshape(-1))
    assert device_digest(x.t()) == device_digest(x.t().contiguous())  # the bytes as laid out C-contiguous


def test_every_single_bit_flip_is_detected():
    t = _payload(96, 1)
    base = device_digest(t)
    for i in range(t.numel()):
        for bit in range(8):
            u = t.clone()
            u[i] ^= 1 << bit
            assert device_digest(u) != base, (i, bit)


def test_truncated_extended_and_shifted_payloads_are_detected():
    t = torch.cat([_payload(256, 2), torch.zeros(16, dtype=torch.uint8)])  # trailing zeros: the length counts
    base = device_digest(t)
    for k in (1, 2, 8, 16):
        assert device_digest(t[:-k]) != base, k
        assert device_digest(torch.cat([t, torch.zeros(k, dtype=torch.uint8)])) != base, k
    assert device_digest(torch.roll(t, 1)) != base
    assert device_digest(torch.cat([t[1:], t[:1]])) != base
    assert device_digest(torch.cat([torch.zeros(1, dtype=torch.uint8), t[:-1]])) != base


def test_exchanged_words_and_permutations_are_detected():
    t = _payload(512, 3)
    words = t.view(torch.int16)
    base = device_digest(t)
    rng = np.random.default_rng(4)
    for _ in range(200):
        i, j = rng.choice(words.numel(), 2, replace=False)
        if words[i] == words[j]:
            continue
        w = words.clone()
        w[i], w[j] = words[j], words[i]
        assert device_digest(w.view(torch.uint8)) != base, (i, j)
    assert device_digest(t[torch.from_numpy(rng.permutation(t.numel()))]) != base


def test_host_digest_is_xxh3_and_the_kinds_are_tagged():
    t = _payload(300, 5)
    h = xxhash.xxh3_64_intdigest(t.numpy().data) & ~(1 << 62)
    assert host_digest(t) == (h - (1 << 64) if h >= 1 << 63 else h)
    assert digest(t) == host_digest(t) and not is_device_digest(digest(t))
    assert is_device_digest(device_digest(t))
    # A receiver recomputes the kind its sender announced.
    assert digest(t, like=device_digest(t)) == device_digest(t)
    assert digest(t, like=host_digest(t)) == host_digest(t)
    assert device_digest(torch.empty(0, dtype=torch.uint8)) != 0 and host_digest(torch.empty(0)) != 0
