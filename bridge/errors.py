"""The errors a sync raises (plain Python: every bridge module, and callers, import them from here).

A ``SyncError`` carries what failed (``reason``) apart from what the caller should do next
(``advice``), so that a layer above the wire (an engine's trainer side, which cannot reach the
workers' groups) can give advice that fits its own callers without parsing the text.

Example:
  >>> from bridge.errors import REBUILD_GROUP, SyncError
  >>> e = SyncError("rank 1: bucket 2/4 failed", advice=REBUILD_GROUP)
  >>> str(e) == f"rank 1: bucket 2/4 failed {REBUILD_GROUP}", e.reason, e.advice == REBUILD_GROUP
  (True, 'rank 1: bucket 2/4 failed', True)
  >>> str(e.with_advice("Call sync again."))
  'rank 1: bucket 2/4 failed Call sync again.'
"""

from __future__ import annotations

__all__ = ["SyncError", "PlanMismatchError", "REBUILD_GROUP"]

# What a torch.distributed caller does after a sync that broke its group (a timeout, a dead peer).
REBUILD_GROUP = ("The process group is no longer usable: call bridge.rebuild_group(...) on every rank, "
                 "then retry.")


class SyncError(RuntimeError):
    """A sync failed (a peer died, stalled or rejected it); the receivers' weights are unchanged.

    Args:
      reason: what failed, and where.
      advice: what the caller should do next (``REBUILD_GROUP`` where the group is broken), or "".
    """

    def __init__(self, reason: str = "", *, advice: str = "") -> None:
        super().__init__(f"{reason} {advice}" if advice else reason)
        self.reason, self.advice = reason, advice

    def with_advice(self, advice: str) -> SyncError:
        """The same error (same type and reason) with other advice."""
        return type(self)(self.reason, advice=advice)


class PlanMismatchError(SyncError):
    """The ranks computed different plans or model metadata; nothing was sent."""
