"""The invariants of a plan, checked element by element against the layouts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jreshard.core.plans import TensorPlan

__all__ = ["PlanError", "check_tensor_plan"]


class PlanError(ValueError):
    """A plan does not satisfy its invariants (raised by ``check``)."""


def check_tensor_plan(tp: TensorPlan) -> None:
    """Raises ``PlanError`` unless ``tp`` writes every destination element exactly once.

    Each move's box must lie inside its sender's source shard and its receiver's
    destination shard, and no receiver may get over the network what it already holds.
    """
    src_boxes, dst_boxes = tp.src.shards(), tp.dst.shards()
    counts = {d: np.zeros(box.shape, dtype=np.int32) for d, box in dst_boxes.items()}
    for m in tp.moves:
        if m.dst not in counts:
            raise PlanError(f"{m!r} sends to device {m.dst}, which is not in the destination mesh")
        if m.src not in src_boxes:
            raise PlanError(f"{m!r} reads from device {m.src}, which is not in the source mesh")
        if m.size == 0:
            raise PlanError(f"{m!r} is empty")
        if not src_boxes[m.src].contains(m.box):
            raise PlanError(f"{m!r} reads outside source shard {src_boxes[m.src]} of device {m.src}")
        if not dst_boxes[m.dst].contains(m.box):
            raise PlanError(f"{m!r} writes outside destination shard {dst_boxes[m.dst]} of device {m.dst}")
        if not m.is_local and m.dst in src_boxes:
            own = src_boxes[m.dst]
            if not own.intersect(m.box).empty:
                raise PlanError(f"{m!r} sends device {m.dst} data it already holds in {own}")
        counts[m.dst][m.box.relative_to(dst_boxes[m.dst])] += 1
    for d, c in counts.items():
        if c.size and (c != 1).any():
            where = tuple(int(x) for x in np.argwhere(c != 1)[0])
            glob = tuple(w + lo for w, lo in zip(where, dst_boxes[d].lo, strict=True))
            raise PlanError(f"element {glob} of device {d}'s shard is written {int(c[where])} times, not once")
