"""Digests of the pieces a sync moves: xxh3-64 in host memory, a weighted word sum on an accelerator.

A tensor in host memory is hashed with xxh3-64 (the ``xxhash`` package). A tensor on another
device (CUDA) is digested where it lies, with torch ops on that device, so no byte is copied to
the host to be checked: its bytes are read as ``n`` little-endian 16-bit words ``w_0 .. w_{n-1}``
(a zero byte pads an odd length) and, with the prime ``P = 2**31 - 1``,

    A = (sum of w_i + byte length) mod P,    B = (sum of (i + 1) * w_i) mod P.

Why it detects what a sync can do to a piece (for pieces under ``P`` words, 4 GiB):

* a change confined to one word (a flipped bit, any corrupt byte pair) changes that word by
  ``d`` with ``0 < |d| < 2**16 < P``, so ``A`` changes;
* a truncated or extended piece changes the byte length by ``k`` with ``0 < k < P``; trailing
  zero words leave the sums alone, so the length is added to ``A`` (byte counts are also
  checked in the vote);
* two words exchanged (a permutation) leave ``A`` alone but change ``B`` by
  ``(w_i - w_j)(i - j)``, a product of two non-zero numbers below ``P`` in magnitude, which
  the prime ``P`` does not divide;
* other changes (a payload shifted by a byte, several words altered) pass unnoticed only if
  both sums collide, about one chance in ``P**2 = 2**62`` for unstructured damage.

Each digest is tagged with the method that made it (bit 62 set for the device sum, clear for
xxh3), so a receiver whose buffer lies elsewhere than its sender's recomputes the sender's
kind (``digest(t, like=announced)``). Digests are never 0: 0 means "not computed".

>>> import torch
>>> from bridge.wire.digest import digest, device_digest, is_device_digest
>>> t = torch.arange(64, dtype=torch.uint8)
>>> is_device_digest(digest(t)), is_device_digest(device_digest(t))
(False, True)
>>> u = t.clone(); u[5] ^= 1
>>> device_digest(u) != device_digest(t) and digest(u) != digest(t)
True
>>> digest(t, like=device_digest(t)) == device_digest(t)
True
"""

from __future__ import annotations

import torch
import xxhash

__all__ = ["digest", "device_digest", "host_digest", "is_device_digest", "PRIME"]

PRIME = (1 << 31) - 1
DEVICE_TAG = 1 << 62
_CHUNK = 1 << 24  # words per step: bounds the int64 temporaries to 256 MiB on the device


def is_device_digest(d: int) -> bool:
    """Whether ``d`` came from ``device_digest`` (its tag bit), not from xxh3-64."""
    return d > 0 and bool(d & DEVICE_TAG)


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def host_digest(t: torch.Tensor) -> int:
    """xxh3-64 of ``t``'s bytes (copied to host memory first if ``t`` lies elsewhere), tag bit cleared."""
    b = _flat_bytes(t)
    if b.device.type != "cpu":
        b = b.cpu()
    h = xxhash.xxh3_64_intdigest(b.numpy().data) & ~DEVICE_TAG
    return (h - (1 << 64) if h >= 1 << 63 else h) or 1


def device_digest(t: torch.Tensor) -> int:
    """The weighted 16-bit word sum of ``t``'s bytes, computed with torch ops on ``t``'s device.

    One transfer of two numbers to the host per call. Works on any device (on the CPU it serves
    to test the method); ``digest`` picks it for tensors outside host memory.
    """
    b = _flat_bytes(t)
    nbytes = b.numel()
    if nbytes % 2:
        b = torch.cat([b, b.new_zeros(1)])
    words = b.view(torch.int16)
    sums = torch.zeros(2, dtype=torch.int64, device=b.device)
    for s in range(0, words.numel(), _CHUNK):
        # int16 -> int64, then the low 16 bits: the unsigned word, on any device.
        w = words[s:s + _CHUNK].to(torch.int64) & 0xFFFF
        pos = torch.arange(s + 1, s + 1 + w.numel(), dtype=torch.int64, device=b.device) % PRIME
        # w < 2**16 and pos < 2**31: every product fits in int64, and so does a chunk's sum of residues.
        sums[0] += w.sum()
        sums[1] += ((w * pos) % PRIME).sum()
        sums %= PRIME
    a, c = sums.tolist()
    return DEVICE_TAG | ((a + nbytes) % PRIME) << 31 | c


def digest(t: torch.Tensor, like: int | None = None) -> int:
    """The digest of ``t``: the kind of ``like`` if given (a digest announced by a sender), else xxh3-64
    for a tensor in host memory and the device sum for one on an accelerator."""
    device = is_device_digest(like) if like else t.device.type != "cpu"
    return device_digest(t) if device else host_digest(t)
