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

The sync's waits live here too: ``SyncAlarm.open`` gives one sync of one rank its alarm (passed
explicitly to whatever waits: the session, its transport), ``SyncAlarm.wait_for`` waits for a
collective, ``SyncAlarm.run`` runs a transport's point-to-point waits in the helper thread, and
``SyncAlarm.give_up`` raises the alarm on a transport failure.

A group built outside torch.distributed's registry gets its store through ``register_store``
(``bridge.engines.group.open_group`` does); a group whose store is known neither way gets no alarm:
its waits behave as before (a survivor may wait for the deadline).

Example (a one-rank group on a local store):
  >>> import torch.distributed as dist
  >>> from bridge.wire.alarm import Alarm
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

import atexit
import contextlib
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, TimeoutError as FutureTimeout
from types import TracebackType
from typing import Any

import torch.distributed as dist

from bridge.errors import REBUILD_GROUP, SyncError

__all__ = ["Alarm", "Waiter", "SyncAlarm", "SLICE", "store_of", "register_store", "forget_store", "wait_once",
           "wait_failure"]

log = logging.getLogger("bridge")

SLICE = 0.2  # seconds a wait blocks between two checks of the alarm
_COUNTER = "bridge/syncs"
_LONGEST = 500  # characters of the reason kept in the store


# Stores of groups built outside torch.distributed's registry (bridge.engines.group.open_group).
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

    Every rank of the group creates one per sync (``SyncAlarm.open``, before its handshake): each
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


EXIT_GRACE = 30.0  # seconds the process's exit waits, at most, for closed waiters still in a wait
_DRAINING: set[threading.Thread] = set()  # threads of closed waiters whose last wait has not ended


@atexit.register
def _drain() -> None:
    """At exit, lets waits left running by a failed sync end (each is bounded by its sync's deadline):
    a daemon thread still inside a gloo wait while the interpreter tears down ends the process with
    ``terminate called without an active exception``."""
    end = time.monotonic() + EXIT_GRACE
    for t in list(_DRAINING):
        t.join(max(0.0, end - time.monotonic()))


class Waiter:
    """One daemon thread that runs blocking waits handed to it, so the caller can check an alarm.

    A wait left blocked when the caller gives up ends at its own timeout or when the group is
    destroyed; the thread is a daemon, but once closed, the process's exit waits for its last
    wait to end (up to ``EXIT_GRACE`` seconds).

      >>> from bridge.wire.alarm import Waiter
      >>> w = Waiter()
      >>> w.submit(lambda: 6 * 7).result(timeout=5)
      42
      >>> w.close()
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[[], Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="bridge-wait", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            _DRAINING.discard(threading.current_thread())

    def _serve(self) -> None:
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
            if self._thread.is_alive():
                _DRAINING.add(self._thread)
            self._jobs.put(None)


def wait_once(work: Any, deadline: float, what: str, rank: int) -> None:
    """Waits for ``work`` until ``deadline``; a failure raises SyncError (the alarm is the caller's to raise)."""
    left = max(deadline - time.monotonic(), 0.001)
    try:
        work.wait(datetime.timedelta(seconds=left))
    except Exception as e:  # gloo reports a dead peer, a closed pair or a timeout as RuntimeError
        raise wait_failure(e, deadline, left, what, rank) from e


def wait_failure(e: Exception, deadline: float, left: float, what: str, rank: int) -> SyncError:
    """The error of a wait for ``what`` that failed with ``e`` when ``left`` seconds were left before ``deadline``."""
    # Time still left means the transport failed first: the group's own (shorter) timeout, or a peer
    # that died or closed its connections.
    why = ("timeout" if time.monotonic() >= deadline - 0.01 else "the process group's timeout, shorter than "
           "this wait" if "timed out" in str(e).lower() else "a peer's connection closed: it died or gave up")
    return SyncError(f"rank {rank}: {what} failed before the sync's deadline ({left:.3g} s were left; "
                     f"{why}): {e}.", advice=REBUILD_GROUP)


class SyncAlarm:
    """One sync's alarm as one rank holds it, and the thread that runs its point-to-point waits.

    Without a store (``alarm=None``) it rings nothing and hears nothing: waits then behave as
    plain waits bounded by the deadline. Used as a context manager around the sync: a failure
    that escapes other than a ``SyncError`` (which rang it where it arose, if it ended this
    rank's part) rings it; leaving closes the helper thread.

      >>> from bridge.errors import REBUILD_GROUP, SyncError
      >>> from bridge.wire.alarm import SyncAlarm
      >>> with SyncAlarm(None, rank=0) as quiet:
      ...     quiet.run(lambda: None, "bucket 1/1")
      ...     str(quiet.give_up(SyncError("rank 0: gone")))
      'rank 0: gone'
    """

    def __init__(self, alarm: Alarm | None, rank: int) -> None:
        self.alarm, self.rank = alarm, rank
        self.waiter = Waiter() if alarm is not None else None
        self._on_give_up: list[Callable[[], None]] = []

    @classmethod
    def open(cls, group: Any, rank: int, size: int) -> SyncAlarm:
        """The alarm of this rank's next sync on ``group`` (of ``size`` ranks); a quiet one where the
        group's store is unknown or fails."""
        store = store_of(group)
        if store is None:
            return cls(None, rank)
        try:
            return cls(Alarm(store, rank, size), rank)
        except Exception as e:  # noqa: BLE001 (the sync then runs without one)
            log.warning("rank %d: the sync runs without an alarm (the group's store failed: %s)", rank, e)
            return cls(None, rank)

    def on_give_up(self, fn: Callable[[], None]) -> None:
        """Calls ``fn`` when this rank gives up (a transport's ``abort``)."""
        self._on_give_up.append(fn)

    def give_up(self, e: SyncError) -> SyncError:
        """Rings the alarm (a transport failure: this rank stops taking part); returns ``e``."""
        if self.alarm is not None:
            self.alarm.ring(str(e))
        for fn in self._on_give_up:
            try:
                fn()
            except Exception:  # noqa: BLE001 (the sync already failed: the first error is the one raised)
                log.exception("rank %d: aborting the transport failed", self.rank)
        return e

    def wait_for(self, work: Any, deadline: float, what: str) -> None:
        """Waits for the collective ``work`` until ``deadline`` (``time.monotonic()`` seconds), the sync's one
        deadline; a failure rings the alarm.

        A collective is not abandoned on an alarm: left running in gloo's worker thread, it would hold up
        ``destroy_process_group`` (so ``rebuild_group``) until the group's own timeout, and this rank's
        connections would stay open, so the ranks that wait for it would not fail either.
        """
        try:
            wait_once(work, deadline, what, self.rank)
        except SyncError as e:
            raise self.give_up(e) from e.__cause__

    def run(self, job: Callable[[], None], what: str) -> None:
        """Runs ``job`` (point-to-point waits, which bound themselves by the deadline). With an alarm, in the
        helper thread, checking the alarm every slice: a gloo point-to-point wait that times out closes its
        pair, so it cannot be cut into slices. A ``SyncError`` of the job rings the alarm."""
        if self.waiter is None:
            try:
                return job()
            except SyncError as e:
                raise self.give_up(e) from e.__cause__
        fut = self.waiter.submit(job)
        try:
            while True:
                try:
                    return fut.result(timeout=SLICE)
                except FutureTimeout:
                    self._check(what, fut.done)
                except SyncError as e:
                    raise self.give_up(e) from e.__cause__
        finally:
            del fut  # the error's traceback holds this frame: no cycle that keeps the works (and the group) alive

    def _check(self, what: str, done: Callable[[], bool]) -> None:
        """Raises if another rank rang the alarm, unless what this rank waits for completed meanwhile (the
        others may have finished the sync, and the store's host exited)."""
        heard = self.alarm.heard() if self.alarm is not None else None
        if heard is not None and not done():
            raise SyncError(f"rank {self.rank}: stopped waiting for {what}: another rank gave up and raised the "
                            f"sync's alarm ({heard}).", advice=REBUILD_GROUP)

    def close(self) -> None:
        if self.waiter is not None:
            self.waiter.close()

    def __enter__(self) -> SyncAlarm:
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if e is not None and not isinstance(e, SyncError):
                self.give_up(SyncError(f"rank {self.rank}: {type(e).__name__}: {e}"))
        finally:
            self.close()
