"""The errors a sync raises (plain Python: every bridge module, and callers, import them from here or
from ``bridge.wire.session``)."""

from __future__ import annotations

__all__ = ["SyncError", "PlanMismatchError"]


class SyncError(RuntimeError):
    """A sync failed (a peer died, stalled or rejected it); the receivers' weights are unchanged."""


class PlanMismatchError(SyncError):
    """The ranks computed different plans or model metadata; nothing was sent."""
