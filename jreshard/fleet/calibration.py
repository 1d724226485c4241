"""Predictions beside published figures: which method each figure measures, and the ratio.

A scenario's ``published`` object holds seconds per full sync under keys that name a
method (``reshard_s``: a reshard such as jreshard's; ``gather_broadcast_s``;
``flat_direct_sends_s``), each a number or a ``[low, high]`` range, and optionally the
``dtype`` they were measured in (FP8 for the DGX H100 announcements). ``ratio`` is
predicted over published: over the nearer end of a range, ``1.0`` inside it. Nothing here
is fitted: the predictions come from the hardware files alone (docs/cost_model.md).

Example:
  >>> from jreshard.fleet.calibration import Published, ratio
  >>> p = Published.parse("reshard_s", [2.39, 2.83])
  >>> p.method, p.text, round(ratio(2.0, p), 2), ratio(2.5, p), round(ratio(3.4, p), 2)
  ('jreshard', '2.39-2.83', 0.84, 1.0, 1.2)
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

__all__ = ["Published", "published", "ratio", "METHODS", "BAND"]

# Published key -> the ``Comparison.seconds()`` key of the method it measures.
METHODS = {"reshard_s": "jreshard", "gather_broadcast_s": "gather_broadcast", "flat_direct_sends_s": "flat_direct"}
BAND = (0.7, 1.3)  # the goal for predicted / published (issue 29)


@dataclasses.dataclass(frozen=True, slots=True)
class Published:
    """One published figure: the method it measures and its seconds (a range when ``low < high``)."""

    method: str
    low: float
    high: float

    @classmethod
    def parse(cls, key: str, value: Any) -> Published:
        if key not in METHODS:
            raise ValueError(f"published key {key!r} names no method; use one of {sorted(METHODS)}.")
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not 1 <= len(values) <= 2 or not all(isinstance(v, numbers.Real) and float(v) > 0 for v in values):
            raise ValueError(f"published {key!r} must be positive seconds or a [low, high] range, got {value!r}.")
        return cls(METHODS[key], float(min(values)), float(max(values)))

    @property
    def text(self) -> str:
        return f"{self.low:g}" if self.low == self.high else f"{self.low:g}-{self.high:g}"


def published(figures: Mapping[str, Any]) -> dict[str, Published]:
    """The full-sync figures of a scenario's ``published`` object, by method (other keys are skipped)."""
    return {p.method: p for p in (Published.parse(k, v) for k, v in figures.items() if k in METHODS)}


def ratio(predicted: float, figure: Published) -> float:
    """Predicted over published: over the nearer end of a range, 1.0 inside it."""
    if predicted < figure.low:
        return predicted / figure.low
    if predicted > figure.high:
        return predicted / figure.high
    return 1.0
