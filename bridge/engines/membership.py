"""Who gets into a sync group: the job's secret, a claim per rank, and a challenge once the group formed.

A sync group's store (``bridge.engines.group``) is a plain ``TCPStore``: anyone who reaches its
port can read, list and write its keys. So every member proves that it holds the job's secret
(random bytes that trainer rank 0 makes or the user gives; the workers get them through the
engine's init call) three times, each with an HMAC (SHA-256) of the secret:

1. The group's *verifier* (``{name}/verifier``, written once by the group's rank 0) is an HMAC of
   the group's name: a rank whose secret differs learns it at once and is refused, before it
   touches anything of the group.
2. Every key of the group (the claims, gloo's rendezvous, the alarm) lives under a prefix derived
   from the secret (``group_prefix``): a process with another secret, or none, writes elsewhere.
3. A rank is *claimed* once per group with an atomic ``compare_set`` of a proof bound to a
   per-process nonce: a second claim of a taken rank is refused, and the first holder keeps it.
4. Once gloo connected the ranks, each all-gathers a fresh nonce, then an HMAC of every rank's nonce
   and its own rank (``prove_members``): a member that joined gloo without the secret (it read the
   prefix from the store's key list and wrote gloo's keys itself) is named, and every rank raises
   before any weight moves. The nonces make each proof good for one group only (no replay).

The prefix is not hidden (``TCPStore.list_keys``), and nothing is encrypted; see the threat model
in docs/reliability.md for what this gives and what it does not.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from typing import Any

from bridge.errors import SyncError
from bridge.wire.group import all_gather_bytes

__all__ = ["MembershipError", "SECRET_ENV", "MIN_SECRET_BYTES", "check_secret", "new_secret", "env_secret",
           "group_prefix", "open_verifier", "claim_rank", "prove_members"]

SECRET_ENV = "JRESHARD_SYNC_SECRET"
"""The environment variable a trainer rank reads its secret from when ``secret=`` is not given."""

MIN_SECRET_BYTES = 16

_NONCE = 16
_FIX = ("Give every rank the same secret: TrainerSync(secret=...) or the environment variable "
        f"{SECRET_ENV} on every trainer rank; an engine's workers get it from trainer rank 0's init call.")


class MembershipError(SyncError):
    """A process could not prove that it belongs to a sync group, or its rank was taken; nothing was sent."""


def check_secret(name: str, secret: Any) -> bytes:
    """``secret`` (bytes, or a str taken as UTF-8) as bytes; never shows its value in an error.

    Raises:
      TypeError: not bytes nor str.
      ValueError: shorter than ``MIN_SECRET_BYTES`` bytes (a guessable secret can be found offline
        from the group's public verifier).
    """
    if isinstance(secret, str):
        secret = secret.encode()
    elif isinstance(secret, bytearray | memoryview):
        secret = bytes(secret)
    elif not isinstance(secret, bytes):
        raise TypeError(f"{name} must be bytes or str (the job's secret), got {type(secret).__name__}; make one "
                        "with secrets.token_bytes(32).")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{name} must hold at least {MIN_SECRET_BYTES} bytes of randomness, got {len(secret)} "
                         "bytes (its value is not shown); make one with secrets.token_bytes(32) or "
                         "secrets.token_hex(16).")
    return secret


def new_secret() -> bytes:
    """A fresh secret for one job (32 random bytes)."""
    return secrets.token_bytes(32)


def env_secret() -> bytes | None:
    """The secret in ``SECRET_ENV`` (``None`` when unset or empty)."""
    value = os.environ.get(SECRET_ENV)
    return check_secret(SECRET_ENV, value) if value else None


def _mac(secret: bytes, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed (no two part lists give the same message)."""
    msg = b"".join(len(b).to_bytes(4, "big") + b for b in (
        p.encode() if isinstance(p, str) else p.to_bytes(8, "big") if isinstance(p, int) else p for p in parts))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def group_prefix(secret: bytes, name: str) -> str:
    """The store prefix of every key of group ``name`` (derived from the secret)."""
    return f"{name}/{_mac(secret, 'prefix', name).hex()[:32]}/"


def open_verifier(store: Any, secret: bytes, name: str, rank: int, where: str) -> None:
    """Rank 0 writes group ``name``'s verifier; every other rank waits for it and compares its own.

    Raises:
      MembershipError: the verifier differs (this process's secret is not rank 0's), or rank 0
        found one written before it (another process on the store).
      SyncError: rank 0 did not open the group within the store's timeout.
    """
    key, mine = f"{name}/verifier", _mac(secret, "verifier", name).hex()
    if rank == 0:
        got = store.compare_set(key, "", mine).decode()
        if got != mine:
            raise MembershipError(f"group {name!r} on {where} already has a verifier that rank 0 did not write: "
                                  "another process wrote it. Open the group under another name, or check who "
                                  "can reach the port.")
        return
    try:
        got = store.get(key).decode()  # waits for rank 0, up to the store's timeout
    except Exception as e:  # torch's DistStoreError: rank 0 never opened the group
        raise SyncError(f"rank {rank}: group {name!r} was not opened on {where} within the store's timeout "
                        f"({type(e).__name__}); start trainer rank 0 first.") from None
    if not hmac.compare_digest(got, mine):
        raise MembershipError(f"rank {rank} is refused from group {name!r} on {where}: the secret it was given is "
                              f"not the one the group's rank 0 holds (the group's verifier differs). {_FIX}")


def claim_rank(store: Any, secret: bytes, name: str, rank: int) -> None:
    """Claims ``rank`` of group ``name`` for this process, once: a taken rank is refused, its holder untouched.

    Raises:
      MembershipError: the rank was claimed already (by another process, or an earlier claim).
    """
    nonce = secrets.token_bytes(_NONCE)
    proof = nonce.hex() + ":" + _mac(secret, "claim", name, rank, nonce).hex()
    got = store.compare_set(f"{group_prefix(secret, name)}claim/{rank}", "", proof).decode()
    if got != proof:
        raise MembershipError(f"rank {rank} of group {name!r} is already claimed: another process holds it and "
                              "keeps it. Give this process a rank of its own, or open a new group.")


def prove_members(pg: Any, secret: bytes, name: str, rank: int, size: int, wait: Callable[[Any], None]) -> None:
    """The challenge once gloo connected the group: every rank proves the secret over the group itself.

    Each rank all-gathers a fresh nonce, then an HMAC of the group's name, its rank and every nonce;
    every rank checks every proof, so all of them name the same ranks. ``wait`` waits for each
    collective (``bridge.wire.group.all_gather_bytes``).

    Raises:
      MembershipError: some rank's proof is wrong (a process without the secret joined in its place).
    """
    nonces = all_gather_bytes(secrets.token_bytes(_NONCE), pg, size, wait)
    transcript = b"".join(n.ljust(_NONCE, b"\0")[:_NONCE] for n in nonces)
    proofs = all_gather_bytes(_mac(secret, "member", name, rank, transcript), pg, size, wait)
    bad = [r for r, (n, p) in enumerate(zip(nonces, proofs, strict=True))
           if len(n) != _NONCE or not hmac.compare_digest(p, _mac(secret, "member", name, r, transcript))]
    if bad:
        raise MembershipError(f"sync ranks {bad} of group {name!r} did not prove that they hold the job's secret: a "
                              "process outside the job joined in their place; nothing was sent. Check who can "
                              f"reach the group's port. {_FIX}")
