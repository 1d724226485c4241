"""A sync's alarm: a rank that gives up tells every other rank at once, through the group's store.

gloo tells a rank that a peer died only if it has an operation pending with that peer. A
rank whose pending operations are all with live ranks that already gave up (they raised,
so they no longer take part, but their connections stay open) would hear nothing until the
sync's deadline. So a rank whose sync fails in the transport (a dead peer, the deadline, the
group's timeout, a post that failed) sets one key in the group's store, unique to the sync,
and every rank checks that key while it waits for a bucket: each survivor raises within about
``SLICE`` seconds plus a store round trip of the first failure, naming the rank that raised
the alarm and why. A store that cannot be reached (its host died) counts as an alarm.

A point-to-point wait that times out closes gloo's pair, and such works have no
``is_completed`` before their ``wait``, so a bucket's works are waited for in a helper thread
while the sync's thread checks the alarm every slice; a wait shorter than a slice costs no
store round trip. Collectives (the handshake, votes, the final ack) are not cut short: one
left running in gloo's worker thread would hold up ``destroy_process_group`` until the
group's timeout, and keep this rank's connections open, so the ranks waiting for it would
not fail either. A rank that gives up and rebuilds its group closes its connections, which
fails its peers' collectives.

A group built outside torch.distributed's registry gets its store through ``register_store``
(``bridge.vllm._group.open_group`` does); a group whose store is known neither way gets no alarm:
its waits behave as before (a survivor may wait for the deadline).

Example (a one-rank group on a local store):
  >>> import torch.distributed as dist
  >>> from bridge._alarm import Alarm
  >>> store = dist.HashStore()
  >>> a, b = Alarm(store, 0, 1), Alarm(store, 0, 1)  # two syncs of the same group
  >>> a.heard() is None
  True
  >>> a.ring("rank 0: bucket 2/3 with peer rank 1 failed")
  >>> a.heard()
  'rank 0: bucket 2/3 with peer rank 1 failed'
  >>> b.heard() is None  # the next sync's key: an earlier alarm never fires again
  True
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch.distributed as dist

__all__ = ["Alarm", "Waiter", "SLICE", "store_of", "register_store", "forget_store"]

log = logging.getLogger("bridge")

SLICE = 0.2  # seconds a wait blocks between two checks of the alarm
_COUNTER = "bridge/syncs"
_LONGEST = 500  # characters of the reason kept in the store


# Stores of groups built outside torch.distributed's registry (bridge.vllm._group.open_group).
_OWN_STORES: dict[Any, Any] = {}


def register_store(group: Any, store: Any) -> None:
    """Gives a group that torch.distributed does not register (built from a ``ProcessGroup``) its store."""
    _OWN_STORES[group] = store


def forget_store(group: Any) -> None:
    """Undoes ``register_store`` (when the group is closed)."""
    _OWN_STORES.pop(group, None)


def store_of(group: Any) -> Any:
    """The store of ``group`` (default: the default group): one given to ``register_store``, else the one
    torch.distributed registered, else None."""
    if group is not None and group in _OWN_STORES:
        return _OWN_STORES[group]
    try:
        c10d = dist.distributed_c10d
        pg = group if group is not None else c10d._get_default_group()
        return c10d._world.pg_map[pg][1]
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError, IndexError):
        return None


class Alarm:
    """The alarm of one sync of a group of ``size`` ranks, on ``store``.

    Every rank of the group creates one per sync (``run_sync``, before its handshake): each
    adds one to a counter in the store, so the ``size`` ranks of the n-th sync all derive n,
    and the key ``bridge/alarm/<n>`` is that sync's alone.
    """

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store, self.rank = store, rank
        self.key = f"bridge/alarm/{(int(store.add(_COUNTER, 1)) - 1) // size}"

    def ring(self, why: str) -> None:
        """Tells every rank of this sync that this rank gave up (best effort: the store may be gone)."""
        try:
            self.store.set(self.key, why[:_LONGEST])
        except Exception as e:  # the store's host died: the others hear that instead
            log.warning("rank %d could not raise the sync's alarm: %s", self.rank, e)

    def heard(self) -> str | None:
        """Who raised this sync's alarm and why, or None while nobody did."""
        try:
            if not self.store.check([self.key]):
                return None
            return bytes(self.store.get(self.key)).decode(errors="replace")
        except Exception as e:  # noqa: BLE001 (any failure of the store: it is unreachable)
            return f"the group's store is unreachable (its host may have died): {e}"


class Waiter:
    """One daemon thread that runs blocking waits handed to it, so the caller can check an alarm.

    A wait left blocked when the caller gives up ends at its own timeout or when the group is
    destroyed; the thread is a daemon, so it never holds up the process's exit.

      >>> from bridge._alarm import Waiter
      >>> w = Waiter()
      >>> w.submit(lambda: 6 * 7).result(timeout=5)
      42
      >>> w.close()
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="bridge-wait", daemon=True).start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, fn = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 (handed to the caller)
                    fut.set_exception(e)
            # Hold nothing of a finished wait: its works keep the process group alive, and a group still
            # referenced keeps its connections open when destroyed, so its peers would not fail.
            del job, fut, fn

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn))
        return fut

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._jobs.put(None)
