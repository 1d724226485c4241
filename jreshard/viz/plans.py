"""Drawing one tensor's plan: source layout, the moves between devices, destination layout.

Example:
  >>> import jreshard, jreshard.viz
  >>> src = jreshard.Layout((4, 4), jreshard.Mesh([0, 1], "x"), ("x",), dtype="float32")
  >>> dst = jreshard.Layout((4, 4), jreshard.Mesh([2, 3], "x"), (None, "x"), dtype="float32")
  >>> fig = jreshard.viz.draw_plan(jreshard.plan(src, dst))
  >>> sorted(line.get_gid() for line in fig.axes[1].lines if (line.get_gid() or "").startswith("flow"))
  ['flow:0->2', 'flow:0->3', 'flow:1->2', 'flow:1->3']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle

from jreshard.core.box import Box
from jreshard.core.layout import Layout
from jreshard.core.plans import TensorPlan
from jreshard.core.stats import format_amount
from jreshard.viz.common import (
    Color,
    box_rect,
    device_colors,
    mesh_text,
    new_figure,
    require_drawable,
    require_tensor_plan,
)
from jreshard.viz.layouts import draw_layout

__all__ = ["draw_plan"]

_MAX_OUTLINES = 400  # beyond this many moves the outlines are a grey smear, not information


def draw_plan(tplan: TensorPlan, *, title: str | None = None) -> Figure:
    """Draws one tensor's plan: source layout, the moves between devices, destination layout.

    The middle panel has the source devices on the left and the destination devices
    on the right; a line joins each (sender, receiver) pair, in the sender's colour,
    as thick as the bytes it carries (gid ``'flow:<src>-><dst>'``). Local copies are
    dashed grey lines (gid ``'local:<device>'``). The destination panel outlines, for
    the first holder of each shard, the boxes the plan assembles it from (when there
    are at most 400 of them; gid ``'move:<src>-><dst>'``).

    Args:
      tplan: the TensorPlan of one tensor (``plan[path]`` for a Plan), of 0 to 2 dims.
      title: the figure title; defaults to the plan's statistics.

    Returns:
      The matplotlib Figure.

    Raises:
      TypeError: ``tplan`` is not a TensorPlan.
      ValueError: the tensor has more than 2 dims.
    """
    tplan = require_tensor_plan(tplan)
    require_drawable(tplan.src, "tplan.src")
    require_drawable(tplan.dst, "tplan.dst")
    colors = device_colors([*tplan.src.mesh.device_ids, *tplan.dst.mesh.device_ids])
    fig = new_figure((13.5, 4.6))
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.0, 0.75, 1.0]})
    draw_layout(tplan.src, ax=axes[0], colors=colors, title=f"source {tplan.src.spec_str}\n{_placement(tplan.src)}")
    draw_layout(tplan.dst, ax=axes[2], colors=colors,
                title=f"destination {tplan.dst.spec_str}\n{_placement(tplan.dst)}")
    _outline_moves(axes[2], tplan)
    _draw_flows(axes[1], tplan, colors)
    if title is None:
        s = tplan.stats()
        dtype = tplan.dst.dtype or tplan.src.dtype
        network, lower = format_amount(s.network_bytes, s.unit), format_amount(s.lower_bound_bytes, s.unit)
        title = (f"{tplan.shape}{f' {dtype}' if dtype else ''}: {s.moves} network moves "
                 f"({network}, lower bound {lower}), {s.local_moves} local copies; "
                 f"gather-then-broadcast {format_amount(s.naive_bytes, s.unit)}")
    fig.suptitle(title, fontsize=10)
    return fig


def _placement(layout: Layout) -> str:
    """The mesh and its devices: ``'dp=2 x tp=2 on devices 4-7'``."""
    ids = layout.mesh.device_ids
    contiguous = list(ids) == list(range(ids[0], ids[0] + len(ids)))
    return f"{mesh_text(layout)} on {f'devices {ids[0]}-{ids[-1]}' if contiguous else f'{len(ids)} devices'}"


def _outline_moves(ax: Any, tplan: TensorPlan) -> None:
    firsts = np.array(sorted({g[0] for g in tplan.dst.replica_groups()}), dtype=np.int64)
    rows = np.flatnonzero(np.isin(tplan.move_dst, firsts))
    if len(rows) > _MAX_OUTLINES:
        return
    for i in rows.tolist():
        x, y, w, h = box_rect(tplan.dst, Box.from_bounds(tplan.move_lo[i], tplan.move_hi[i]))
        if w > 0 and h > 0:
            ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="black", linewidth=0.6, linestyle=(0, (2, 2)),
                                   gid=f"move:{int(tplan.move_src[i])}->{int(tplan.move_dst[i])}"))


def _draw_flows(ax: Any, tplan: TensorPlan, colors: Mapping[int, Color]) -> None:
    srcs, dsts = list(tplan.src.mesh.device_ids), list(tplan.dst.mesh.device_ids)
    ys = {("s", d): 1 - (i + 0.5) / len(srcs) for i, d in enumerate(srcs)}
    ys.update({("d", d): 1 - (i + 0.5) / len(dsts) for i, d in enumerate(dsts)})
    pairs: dict[tuple[int, int], int] = {}
    for s, d, b in zip(tplan.move_src.tolist(), tplan.move_dst.tolist(), tplan.move_bytes.tolist(), strict=True):
        pairs[(s, d)] = pairs.get((s, d), 0) + b
    peak = max((b for (s, d), b in pairs.items() if s != d), default=1) or 1
    for (s, d), b in sorted(pairs.items()):
        xs, line_ys = [0.0, 1.0], [ys[("s", s)], ys[("d", d)]]
        if s == d:
            ax.add_line(Line2D(xs, line_ys, color="0.55", linestyle="--", linewidth=0.8, gid=f"local:{s}", zorder=1))
        else:
            ax.add_line(Line2D(xs, line_ys, color=colors[s], alpha=0.75,
                               linewidth=0.6 + 5.0 * b / peak, gid=f"flow:{s}->{d}", zorder=2))
    size = max(4.0, min(12.0, 110.0 / max(len(srcs), len(dsts))))
    for side, devices, x in (("s", srcs, 0.0), ("d", dsts, 1.0)):
        for d in devices:
            ax.plot([x], [ys[(side, d)]], marker="o", markersize=size, color=colors[d], markeredgecolor="black",
                    zorder=3)
            if len(devices) <= 32:
                ax.text(x + (-0.06 if side == "s" else 0.06), ys[(side, d)], str(d), fontsize=7,
                        ha="right" if side == "s" else "left", va="center")
    ax.set_xlim(-0.2, 1.2)
    ax.set_ylim(0, 1)
    ax.set_xticks([0, 1], ["sends", "receives"])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
    network = sum(1 for s, d in pairs if s != d)
    ax.set_title(f"{network} sender->receiver pairs\n(width ~ bytes, dashed: local copy)", fontsize=9)
