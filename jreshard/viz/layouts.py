"""Drawing one layout: a box per distinct shard, coloured by the devices that hold it.

Example:
  >>> import jreshard, jreshard.viz
  >>> mesh = jreshard.Mesh([[0, 1], [2, 3]], ("dp", "tp"))
  >>> fig = jreshard.viz.draw_layout(jreshard.Layout((6,), mesh, ("tp",)))
  >>> [p.get_gid() for p in fig.axes[0].patches]
  ['shard:0,2', 'replica:0', 'replica:2', 'shard:1,3', 'replica:1', 'replica:3']
  >>> [t.get_text() for t in fig.axes[0].texts]
  ['0, 2', '1, 3']
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from jreshard.core.layout import Layout
from jreshard.viz.common import GREY, Color, box_rect, device_colors, extent, mesh_text, new_figure, require_drawable

__all__ = ["draw_layout"]


def draw_layout(layout: Layout, *, ax: Any = None, title: str | None = None,
                colors: Mapping[int, Color] | None = None, labels: bool = True) -> Figure:
    """Draws the layout of a tensor of 0, 1 or 2 dims: one box per distinct shard, coloured by device.

    Each box is filled with the colour of its first holder and, when the shard is
    replicated, carries a strip of chips, one per replica's colour; the label lists
    the devices holding the box. Dim 0 runs down, dim 1 across (a vector is one row).
    The shard boxes carry the matplotlib gid ``'shard:<devices>'``, the chips
    ``'replica:<device>'``.

    Args:
      layout: the layout to draw.
      ax: optional Axes to draw into (its figure is returned); a new figure otherwise.
      title: the panel title; defaults to the shape, dtype, spec and mesh.
      colors: device -> colour; defaults to ``device_colors`` over the layout's mesh.
      labels: write the device ids on each box.

    Returns:
      The matplotlib Figure.

    Raises:
      TypeError: ``layout`` is not a Layout.
      ValueError: the tensor has more than 2 dims.
    """
    layout = require_drawable(layout, "layout")
    if ax is None:
        ax = new_figure((5.2, 4.2)).add_subplot()
    colors = dict(colors) if colors is not None else device_colors(layout.mesh.device_ids)
    rows, cols = extent(layout)
    groups = layout.replica_groups()
    font = max(5.0, min(10.0, 40.0 / math.sqrt(max(len(groups), 1))))
    # The panel's size in points, to keep labels inside their boxes (before layout: an estimate).
    bbox = ax.get_position()
    width_pt = bbox.width * ax.figure.get_figwidth() * 72
    height_pt = bbox.height * ax.figure.get_figheight() * 72
    empty = 0
    for group in groups:
        x, y, w, h = box_rect(layout, layout.shard_box(group[0]))
        if w <= 0 or h <= 0:
            empty += len(group)
            continue
        ax.add_patch(Rectangle((x, y), w, h, facecolor=colors.get(group[0], GREY), alpha=0.55, edgecolor="black",
                               linewidth=1.0, gid="shard:" + ",".join(map(str, group))))
        if len(group) > 1:
            # Chips rather than stripes: stripes would read as a split of the data.
            strip = h * 0.16
            for k, device in enumerate(group):
                ax.add_patch(Rectangle((x + k * w / len(group), y), w / len(group), strip,
                                       facecolor=colors.get(device, GREY),
                                       edgecolor="white", linewidth=0.4, gid=f"replica:{device}"))
        label = _fitting_label(group, w / max(cols, 1) * width_pt, h / max(rows, 1) * height_pt, font)
        if labels and label:
            ax.text(x + w / 2, y + h / 2 + (h * 0.08 if len(group) > 1 else 0), label,
                    ha="center", va="center", fontsize=font, clip_on=True,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})
    ax.set_xlim(0, max(cols, 1))
    ax.set_ylim(max(rows, 1), 0)
    _shard_ticks(ax, layout)
    _dim_labels(ax, layout)
    if title is None:
        dtype = f" {layout.dtype}" if layout.dtype else ""
        title = f"{layout.shape}{dtype} {layout.spec_str}\nmesh {mesh_text(layout)}"
        if layout.replication > 1:
            title += f", {layout.replication} replicas per shard"
        if empty:
            title += f"\n{empty} devices hold empty shards"
    ax.set_title(title, fontsize=9)
    return ax.figure


def _devices_text(devices: Sequence[int], limit: int = 4) -> str:
    if len(devices) <= limit:
        return ", ".join(str(d) for d in devices)
    return ", ".join(str(d) for d in devices[:limit - 1]) + f", ... ({len(devices)})"


def _fitting_label(devices: Sequence[int], width_pt: float, height_pt: float, font: float) -> str | None:
    """The device list ('4, 6'), else its short form ('4+1'), if it fits a box of this size; else None."""
    if height_pt < 1.4 * font:
        return None
    shortest = [_devices_text(devices), f"{devices[0]}+{len(devices) - 1}" if len(devices) > 1 else str(devices[0])]
    for text in shortest:
        if len(text) * 0.62 * font + 4 <= width_pt:
            return text
    return None


def _shard_ticks(ax: Any, layout: Layout) -> None:
    """Ticks at the shard boundaries, thinned to at most nine per axis."""
    boxes = list(layout.shards().values())

    def bounds(dim: int) -> list[int]:
        edges = sorted({b[dim].start for b in boxes} | {b[dim].stop for b in boxes} | {0, layout.shape[dim]})
        step = max(1, math.ceil((len(edges) - 1) / 8))
        return edges[::step] if edges[-1] in edges[::step] else edges[::step] + [edges[-1]]

    if layout.ndim == 2:
        ax.set_yticks(bounds(0))
        ax.set_xticks(bounds(1))
    elif layout.ndim == 1:
        ax.set_xticks(bounds(0))
    for label in [*ax.get_xticklabels(), *ax.get_yticklabels()]:
        label.set_fontsize(7)


def _dim_labels(ax: Any, layout: Layout) -> None:
    if layout.ndim == 2:
        ax.set_xlabel(f"dim 1 ({layout.shape[1]})")
        ax.set_ylabel(f"dim 0 ({layout.shape[0]})")
    elif layout.ndim == 1:
        ax.set_xlabel(f"dim 0 ({layout.shape[0]})")
        ax.set_yticks([])
    else:
        ax.set_xticks([])
        ax.set_yticks([])
