"""What every drawing shares: device colours, number labels, byte ticks, argument checks, box geometry.

Colours mean devices: one figure gives each device one colour, so a device that
appears in both the source and the destination keeps its colour across panels.

Example:
  >>> import jreshard.viz
  >>> colors = jreshard.viz.device_colors([7, 3, 5])
  >>> sorted(colors), len(set(colors.values()))
  ([3, 5, 7], 3)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

try:
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("jreshard.viz needs matplotlib; install it with `pip install 'jreshard[viz]'`.") from exc

from jreshard.core.box import Box
from jreshard.core.layout import Layout
from jreshard.core.plans import Plan, TensorPlan
from jreshard.core.stats import format_amount

__all__ = ["Color", "device_colors"]

Color = tuple[float, float, float, float]
GREY: Color = (0.8, 0.8, 0.8, 1.0)  # a device outside the colour map


def device_colors(devices: Iterable[int]) -> dict[int, Color]:
    """One colour per device: well-separated qualitative colours up to 20, a ramp beyond."""
    ids = sorted({int(d) for d in devices})
    if len(ids) <= 20:
        cmap = matplotlib.colormaps["tab20"]
        order = [*range(0, 20, 2), *range(1, 20, 2)]  # strong tones first, then their light twins
        return {d: cmap(order[i]) for i, d in enumerate(ids)}
    cmap = matplotlib.colormaps["turbo"]
    return {d: cmap(0.05 + 0.9 * i / (len(ids) - 1)) for i, d in enumerate(ids)}


def bytes_label(n: float) -> str:
    """``n`` bytes in binary units: ``'2.00 GiB'``."""
    return format_amount(n, "bytes")


def seconds_label(s: float) -> str:
    """``s`` seconds in the unit that keeps two or three significant digits."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def byte_ticks(lo: float, hi: float) -> list[float]:
    """Round multiples of KiB, MiB or GiB (not of 10**k bytes) between lo and hi."""
    unit = 1024 ** max(0, min(4, int(math.log(max(hi, 1.0), 1024))))
    ticks = MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(lo / unit, hi / unit) * unit
    return [float(t) for t in ticks if lo <= t <= hi]


def bytes_axis(axis: Any, top: float) -> None:
    """Byte ticks and labels on a matplotlib axis that runs from 0 to ``top`` bytes."""
    axis.set_ticks(byte_ticks(0.0, top))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: bytes_label(v) if v > 0 else "0"))


def new_figure(figsize: tuple[float, float]) -> Figure:
    """A figure without pyplot: headless, no global state, shown as a notebook cell's value."""
    return Figure(figsize=figsize, layout="constrained")


def mesh_text(layout: Layout) -> str:
    """The mesh's axes and sizes, ``'dp=2 x tp=2'``, or ``'single device'``."""
    mesh = layout.mesh
    return " x ".join(f"{n}={s}" for n, s in zip(mesh.axis_names, mesh.shape, strict=True)) or "single device"


def require_drawable(layout: Any, arg: str) -> Layout:
    """``layout`` if it is a Layout of at most 2 dims; TypeError or ValueError naming ``arg`` otherwise."""
    if not isinstance(layout, Layout):
        raise TypeError(
            f"{arg} must be a jreshard.Layout, got {type(layout).__name__} {layout!r}; "
            "build one with jreshard.Layout(shape, mesh, spec)."
        )
    if layout.ndim > 2:
        raise ValueError(
            f"{arg} has shape {layout.shape} (ndim {layout.ndim}); only tensors of 0, 1 or 2 dims can be "
            "drawn. Draw a 2-D layout with the same spec on the dims you care about."
        )
    return layout


def require_tensor_plan(tplan: Any, arg: str = "tplan") -> TensorPlan:
    """``tplan`` if it is the TensorPlan of one tensor; TypeError naming ``arg`` otherwise."""
    if isinstance(tplan, Plan):
        raise TypeError(
            f"{arg} must be the TensorPlan of one tensor, got a Plan of {len(tplan)} tensors; "
            f"pass plan[path] for one of {list(tplan.tensors)[:4]!r}."
        )
    if not isinstance(tplan, TensorPlan):
        raise TypeError(f"{arg} must be a jreshard.TensorPlan, got {type(tplan).__name__} {tplan!r}.")
    return tplan


class Rect(NamedTuple):
    """Where a box lies in a drawing: dim 1 runs across (x), dim 0 down (y)."""

    x: int
    y: int
    width: int
    height: int


def box_rect(layout: Layout, box: Box) -> Rect:
    """The rectangle of a box of ``layout``: a 1-dim tensor is one row, a 0-dim one a unit square."""
    if layout.ndim == 2:
        rows, cols = box
    elif layout.ndim == 1:
        rows, cols = slice(0, 1), box[0]
    else:
        rows, cols = slice(0, 1), slice(0, 1)
    return Rect(cols.start, rows.start, cols.stop - cols.start, rows.stop - rows.start)


def extent(layout: Layout) -> tuple[int, int]:
    """(rows, cols) of the drawing of ``layout``."""
    if layout.ndim == 2:
        return layout.shape[0], layout.shape[1]
    if layout.ndim == 1:
        return 1, layout.shape[0]
    return 1, 1
