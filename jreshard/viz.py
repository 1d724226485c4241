"""Pictures of layouts and plans (matplotlib, the ``viz`` extra).

Import it explicitly (``import jreshard.viz``); ``import jreshard`` never loads
matplotlib. Every function returns a ``matplotlib.figure.Figure`` built without
pyplot, so it works headless (Agg), keeps no global figure state, and displays as
a notebook cell's value; ``fig.savefig(path)`` writes it to a file.

Colours mean devices: one figure gives each device one colour, so a device that
appears in both the source and the destination keeps its colour across panels.

Example:
  >>> import jreshard, jreshard.viz
  >>> mesh = jreshard.Mesh([[0, 1], [2, 3]], ("dp", "tp"))
  >>> fig = jreshard.viz.draw_layout(jreshard.Layout((8, 8), mesh, (None, "tp")))
  >>> sorted(p.get_gid() for p in fig.axes[0].patches if (p.get_gid() or "").startswith("shard"))
  ['shard:0,2', 'shard:1,3']
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

try:
    import matplotlib
    from matplotlib.colors import LogNorm, Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("jreshard.viz needs matplotlib; install it with `pip install 'jreshard[viz]'`.") from exc

from jreshard.core.layout import Layout
from jreshard.core.planner import Plan, PlanStats, TensorPlan, _fmt

__all__ = [
    "device_colors",
    "draw_comparison",
    "draw_layout",
    "draw_load",
    "draw_plan",
    "draw_sweep",
    "draw_traffic",
    "traffic_matrix",
]

Color = tuple[float, float, float, float]


# --------------------------------------------------------------------------- helpers


def device_colors(devices: Iterable[int]) -> dict[int, Color]:
    """One colour per device: well-separated qualitative colours up to 20, a ramp beyond."""
    ids = sorted({int(d) for d in devices})
    if len(ids) <= 20:
        cmap = matplotlib.colormaps["tab20"]
        order = [*range(0, 20, 2), *range(1, 20, 2)]  # strong tones first, then their light twins
        return {d: cmap(order[i]) for i, d in enumerate(ids)}
    cmap = matplotlib.colormaps["turbo"]
    return {d: cmap(0.05 + 0.9 * i / (len(ids) - 1)) for i, d in enumerate(ids)}


def _bytes_label(n: float) -> str:
    return _fmt(n, "bytes")


def _seconds_label(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


def _byte_ticks(lo: float, hi: float) -> list[float]:
    """Round multiples of KiB, MiB or GiB (not of 10**k bytes) between lo and hi."""
    unit = 1024 ** max(0, min(4, int(math.log(max(hi, 1.0), 1024))))
    ticks = MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]).tick_values(lo / unit, hi / unit) * unit
    return [float(t) for t in ticks if lo <= t <= hi]


def _bytes_axis(axis: Any, top: float) -> None:
    axis.set_ticks(_byte_ticks(0.0, top))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: _bytes_label(v) if v > 0 else "0"))


def _new_figure(figsize: tuple[float, float]) -> Figure:
    return Figure(figsize=figsize, layout="constrained")


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


def _require_drawable(layout: Any, arg: str) -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(
            f"{arg} must be a jreshard.Layout, got {type(layout).__name__} {layout!r}; "
            "build one with jreshard.Layout(shape, mesh, spec)."
        )
    if layout.rank > 2:
        raise ValueError(
            f"{arg} has shape {layout.shape} (rank {layout.rank}); only rank 0, 1 and 2 tensors can be "
            "drawn. Draw a 2-D layout with the same spec on the dims you care about."
        )
    return layout


def _require_tensor_plan(tplan: Any, arg: str = "tplan") -> TensorPlan:
    if isinstance(tplan, Plan):
        raise TypeError(
            f"{arg} must be the TensorPlan of one tensor, got a Plan of {len(tplan)} tensors; "
            f"pass plan[path] for one of {list(tplan.tensors)[:4]!r}."
        )
    if not isinstance(tplan, TensorPlan):
        raise TypeError(f"{arg} must be a jreshard.TensorPlan, got {type(tplan).__name__} {tplan!r}.")
    return tplan


def _grid_2d(layout: Layout, box: tuple[slice, ...]) -> tuple[float, float, float, float]:
    """(x, y, width, height) of a box: dim 1 runs across, dim 0 down (a rank-1 tensor is one row)."""
    if layout.rank == 2:
        rows, cols = box
    elif layout.rank == 1:
        rows, cols = slice(0, 1), box[0]
    else:
        rows, cols = slice(0, 1), slice(0, 1)
    return cols.start, rows.start, cols.stop - cols.start, rows.stop - rows.start


def _extent(layout: Layout) -> tuple[int, int]:
    """(rows, cols) of the drawing."""
    if layout.rank == 2:
        return layout.shape[0], layout.shape[1]
    if layout.rank == 1:
        return 1, layout.shape[0]
    return 1, 1


# --------------------------------------------------------------------------- layouts


def draw_layout(layout: Layout, *, ax: Any = None, title: str | None = None,
                colors: Mapping[int, Color] | None = None, labels: bool = True) -> Figure:
    """Draws a rank-0, 1 or 2 tensor's layout: one box per distinct shard, coloured by device.

    Each box is filled with the colour of its first holder and, when the shard is
    replicated, carries a strip of chips, one per replica's colour; the label lists
    the devices holding the box. Dim 0 runs down, dim 1 across (a vector is one row).
    The shard boxes carry the matplotlib gid ``'shard:<devices>'``.

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
      ValueError: the tensor has rank above 2.
    """
    layout = _require_drawable(layout, "layout")
    if ax is None:
        fig = _new_figure((5.2, 4.2))
        ax = fig.add_subplot()
    colors = dict(colors) if colors is not None else device_colors(layout.mesh.device_ids)
    rows, cols = _extent(layout)
    groups = layout.replica_groups()
    font = max(5.0, min(10.0, 40.0 / math.sqrt(max(len(groups), 1))))
    # The panel's size in points, to keep labels inside their boxes (before layout: an estimate).
    bbox = ax.get_position()
    width_pt = bbox.width * ax.figure.get_figwidth() * 72
    height_pt = bbox.height * ax.figure.get_figheight() * 72
    empty = 0
    for group in groups:
        box = layout.shard_box(group[0])
        x, y, w, h = _grid_2d(layout, box)
        if w <= 0 or h <= 0:
            empty += len(group)
            continue
        fill = colors.get(group[0], (0.8, 0.8, 0.8, 1.0))
        ax.add_patch(Rectangle((x, y), w, h, facecolor=fill, alpha=0.55, edgecolor="black",
                               linewidth=1.0, gid="shard:" + ",".join(map(str, group))))
        if len(group) > 1:
            # Why chips rather than stripes: stripes would read as a split of the data.
            strip = h * 0.16
            for k, device in enumerate(group):
                ax.add_patch(Rectangle((x + k * w / len(group), y), w / len(group), strip,
                                       facecolor=colors.get(device, (0.8, 0.8, 0.8, 1.0)),
                                       edgecolor="white", linewidth=0.4, gid=f"replica:{device}"))
        label = _fitting_label(group, w / max(cols, 1) * width_pt, h / max(rows, 1) * height_pt, font) if labels else None
        if label:
            ax.text(x + w / 2, y + h / 2 + (h * 0.08 if len(group) > 1 else 0), label,
                    ha="center", va="center", fontsize=font, clip_on=True,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.7})
    ax.set_xlim(0, max(cols, 1))
    ax.set_ylim(max(rows, 1), 0)
    _shard_ticks(ax, layout)
    if layout.rank == 2:
        ax.set_xlabel(f"dim 1 ({layout.shape[1]})")
        ax.set_ylabel(f"dim 0 ({layout.shape[0]})")
    elif layout.rank == 1:
        ax.set_xlabel(f"dim 0 ({layout.shape[0]})")
        ax.set_yticks([])
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    if title is None:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(layout.mesh.axis_names, layout.mesh.shape, strict=True))
        dtype = f" {layout.dtype}" if layout.dtype else ""
        title = f"{layout.shape}{dtype} {layout.spec_str}\nmesh {mesh or 'single device'}"
        if layout.replication > 1:
            title += f", {layout.replication} replicas per shard"
        if empty:
            title += f"\n{empty} devices hold empty shards"
    ax.set_title(title, fontsize=9)
    return ax.figure


def _shard_ticks(ax: Any, layout: Layout) -> None:
    """Ticks at the shard boundaries, thinned to at most nine per axis."""
    boxes = list(layout.shards().values())

    def bounds(dim: int) -> list[int]:
        edges = sorted({b[dim].start for b in boxes} | {b[dim].stop for b in boxes} | {0, layout.shape[dim]})
        step = max(1, math.ceil((len(edges) - 1) / 8))
        return edges[::step] if edges[-1] in edges[::step] else edges[::step] + [edges[-1]]

    if layout.rank == 2:
        ax.set_yticks(bounds(0))
        ax.set_xticks(bounds(1))
    elif layout.rank == 1:
        ax.set_xticks(bounds(0))
    for label in ax.get_xticklabels():
        label.set_fontsize(7)
    for label in ax.get_yticklabels():
        label.set_fontsize(7)


# --------------------------------------------------------------------------- plans


def draw_plan(tplan: TensorPlan, *, title: str | None = None) -> Figure:
    """Draws one tensor's plan: source layout, the moves between devices, destination layout.

    The middle panel has the source devices on the left and the destination devices
    on the right; a line joins each (sender, receiver) pair, in the sender's colour,
    as thick as the bytes it carries (gid ``'flow:<src>-><dst>'``). Local copies are
    dashed grey lines (gid ``'local:<dev>'``). The destination panel outlines, for the
    first holder of each shard, the boxes the plan assembles it from (when there are
    at most 400 of them).

    Args:
      tplan: the TensorPlan of one tensor (``plan[path]`` for a Plan), rank 0 to 2.
      title: the figure title; defaults to the plan's statistics.

    Returns:
      The matplotlib Figure.

    Raises:
      TypeError: ``tplan`` is not a TensorPlan.
      ValueError: the tensor has rank above 2.
    """
    tplan = _require_tensor_plan(tplan)
    _require_drawable(tplan.src, "tplan.src")
    _require_drawable(tplan.dst, "tplan.dst")
    colors = device_colors([*tplan.src.mesh.device_ids, *tplan.dst.mesh.device_ids])
    fig = _new_figure((13.5, 4.6))
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1.0, 0.75, 1.0]})
    draw_layout(tplan.src, ax=axes[0], colors=colors, title=f"source {tplan.src.spec_str}\n{_mesh_text(tplan.src)}")
    draw_layout(tplan.dst, ax=axes[2], colors=colors, title=f"destination {tplan.dst.spec_str}\n{_mesh_text(tplan.dst)}")
    _outline_pieces(axes[2], tplan)
    _draw_flows(axes[1], tplan, colors)
    if title is None:
        s = tplan.stats()
        dtype = f" {tplan.dst.dtype or tplan.src.dtype}" if (tplan.dst.dtype or tplan.src.dtype) else ""
        title = (f"{tplan.shape}{dtype}: {s.moves} network moves ({_fmt(s.network_bytes, s.unit)}, lower bound "
                 f"{_fmt(s.lower_bound_bytes, s.unit)}), {s.local_moves} local copies; "
                 f"gather-then-broadcast {_fmt(s.naive_bytes, s.unit)}")
    fig.suptitle(title, fontsize=10)
    return fig


def _mesh_text(layout: Layout) -> str:
    ids = layout.mesh.device_ids
    span = f"devices {ids[0]}-{ids[-1]}" if list(ids) == list(range(ids[0], ids[0] + len(ids))) else f"{len(ids)} devices"
    shape = " x ".join(f"{n}={s}" for n, s in zip(layout.mesh.axis_names, layout.mesh.shape, strict=True))
    return f"{shape or 'single device'} on {span}"


_MAX_OUTLINES = 400  # beyond this many pieces the outlines are a grey smear, not information


def _outline_pieces(ax: Any, tplan: TensorPlan) -> None:
    firsts = np.array(sorted({g[0] for g in tplan.dst.replica_groups()}), dtype=np.int64)
    rows = np.flatnonzero(np.isin(tplan.move_dst, firsts))
    if len(rows) > _MAX_OUTLINES:
        return
    for i in rows.tolist():
        box = tuple(slice(int(a), int(b)) for a, b in zip(tplan.move_lo[i], tplan.move_hi[i], strict=True))
        x, y, w, h = _grid_2d(tplan.dst, box)
        if w > 0 and h > 0:
            ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="black", linewidth=0.6, linestyle=(0, (2, 2)),
                                   gid=f"piece:{int(tplan.move_src[i])}->{int(tplan.move_dst[i])}"))


def _draw_flows(ax: Any, tplan: TensorPlan, colors: Mapping[int, Color]) -> None:
    srcs, dsts = list(tplan.src.mesh.device_ids), list(tplan.dst.mesh.device_ids)
    ys = {("s", d): 1 - (i + 0.5) / len(srcs) for i, d in enumerate(srcs)}
    ys.update({("d", d): 1 - (i + 0.5) / len(dsts) for i, d in enumerate(dsts)})
    pairs: dict[tuple[int, int], int] = {}
    for s, d, b in zip(tplan.move_src.tolist(), tplan.move_dst.tolist(), tplan.move_bytes.tolist(), strict=True):
        pairs[(s, d)] = pairs.get((s, d), 0) + b
    peak = max((b for (s, d), b in pairs.items() if s != d), default=1) or 1
    for (s, d), b in sorted(pairs.items()):
        p0, p1 = (0.0, ys[("s", s)]), (1.0, ys[("d", d)])
        if s == d:
            ax.add_line(Line2D([p0[0], p1[0]], [p0[1], p1[1]], color="0.55", linestyle="--", linewidth=0.8,
                               gid=f"local:{s}", zorder=1))
        else:
            ax.add_line(Line2D([p0[0], p1[0]], [p0[1], p1[1]], color=colors[s], alpha=0.75,
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


# --------------------------------------------------------------------------- traffic


def _plans_of(plan: Any, arg: str) -> list[TensorPlan]:
    if isinstance(plan, TensorPlan):
        return [plan]
    if isinstance(plan, Plan):
        return list(plan.tensors.values())
    raise TypeError(f"{arg} must be a jreshard.Plan or TensorPlan, got {type(plan).__name__} {plan!r}.")


def traffic_matrix(plan: Plan | TensorPlan, *,
                   include_local: bool = False) -> tuple[tuple[int, ...], tuple[int, ...], np.ndarray]:
    """Bytes sent from each source device to each destination device under ``plan``.

    Args:
      plan: a Plan or TensorPlan.
      include_local: count local copies too (network traffic only by default).

    Returns:
      ``(senders, receivers, matrix)``: the sorted ids of every source-mesh device
      and of every destination-mesh device, and an int64 matrix whose ``[i, j]`` is
      the bytes ``senders[i]`` sends to ``receivers[j]`` (elements when the layouts
      carry no dtype).

    Example:
      >>> import jreshard
      >>> a = jreshard.Layout((4,), jreshard.Mesh([0, 1], "x"), ("x",))
      >>> b = jreshard.Layout((4,), jreshard.Mesh([2, 3], "x"), ("x",))
      >>> traffic_matrix(jreshard.plan(a, b))
      ((0, 1), (2, 3), array([[2, 0], [0, 2]]))
    """
    tplans = _plans_of(plan, "plan")
    senders = np.array(sorted({d for tp in tplans for d in tp.src.mesh.device_ids}), dtype=np.int64)
    receivers = np.array(sorted({d for tp in tplans for d in tp.dst.mesh.device_ids}), dtype=np.int64)
    ns, nr = len(senders), len(receivers)
    matrix = np.zeros((ns, nr), np.int64)
    if tplans and ns and nr:
        src = np.concatenate([tp.move_src for tp in tplans])
        dst = np.concatenate([tp.move_dst for tp in tplans])
        nbytes = np.concatenate([tp.move_bytes for tp in tplans])
        if not include_local:
            keep = src != dst
            src, dst, nbytes = src[keep], dst[keep], nbytes[keep]
        flat = np.searchsorted(senders, src) * nr + np.searchsorted(receivers, dst)
        matrix = np.bincount(flat, weights=nbytes, minlength=ns * nr).astype(np.int64).reshape(ns, nr)
    return tuple(int(d) for d in senders), tuple(int(d) for d in receivers), matrix


def _domain_size(domain_size: Any, topology: Any) -> int | None:
    if topology is not None:
        if domain_size is not None:
            raise ValueError("give either domain_size or topology, not both.")
        for name in ("gpus_per_domain", "domain_size"):
            value = topology.get(name) if isinstance(topology, Mapping) else getattr(topology, name, None)
            if value is not None:
                domain_size = value
                break
        else:
            raise TypeError(
                f"topology must have a 'gpus_per_domain' (or 'domain_size') attribute or key, got "
                f"{type(topology).__name__} {topology!r}; or pass domain_size=<GPUs per NVLink domain>."
            )
    if domain_size is None:
        return None
    if isinstance(domain_size, bool) or not isinstance(domain_size, numbers.Integral) or domain_size < 1:
        raise ValueError(f"domain_size must be a positive int (GPUs per NVLink domain), got {domain_size!r}.")
    return int(domain_size)


def draw_traffic(plan: Plan | TensorPlan | np.ndarray, *, senders: Sequence[int] | None = None,
                 receivers: Sequence[int] | None = None, domain_size: int | None = None, topology: Any = None,
                 include_local: bool = False, log: bool = True, title: str | None = None, ax: Any = None) -> Figure:
    """A heatmap of bytes from each source device (rows) to each destination device (columns).

    Zero cells stay white. With an NVLink domain size (``domain_size``, or a
    ``topology`` with a ``gpus_per_domain`` attribute or key), device ``d`` is in
    domain ``d // domain_size``: domain boundaries are drawn as lines on both axes,
    the cells where sender and receiver share a domain are outlined in red (gid
    ``'domain:<k>'``), and the title gives the share of bytes that crosses domains.

    Args:
      plan: a Plan or TensorPlan, or a matrix of bytes (rows send, columns receive).
      senders: the device ids of a matrix's rows (default 0..rows-1); ignored for plans.
      receivers: the device ids of a matrix's columns (default: ``senders`` for a
        square matrix, else 0..columns-1); ignored for plans.
      domain_size: GPUs per NVLink domain.
      topology: an object or mapping with ``gpus_per_domain``, instead of domain_size.
      include_local: count local copies (a device sending to itself).
      log: logarithmic colour scale.
      title: the panel title.
      ax: optional Axes to draw into.

    Returns:
      The matplotlib Figure.

    Raises:
      TypeError: ``plan`` is neither a plan nor a matrix, or ``topology`` has no domain size.
      ValueError: the matrix is not 2-D or holds negative values, ``senders`` or
        ``receivers`` does not match it, or the domain size is not a positive int.
    """
    size = _domain_size(domain_size, topology)
    if isinstance(plan, (Plan, TensorPlan)):
        rows, cols, matrix = traffic_matrix(plan, include_local=include_local)
    else:
        if not isinstance(plan, (np.ndarray, list, tuple)):
            raise TypeError(
                f"plan must be a jreshard.Plan, TensorPlan or a matrix of bytes, got {type(plan).__name__}."
            )
        matrix = np.asarray(plan, dtype=np.float64)
        if matrix.ndim != 2:
            raise ValueError(f"plan as a matrix must be 2-D (senders x receivers), got shape {matrix.shape}.")
        if not np.isfinite(matrix).all() or (matrix < 0).any():
            raise ValueError("plan as a matrix must hold finite, non-negative byte counts.")
        rows = tuple(range(matrix.shape[0])) if senders is None else tuple(int(d) for d in senders)
        if receivers is None:
            cols = rows if matrix.shape[0] == matrix.shape[1] else tuple(range(matrix.shape[1]))
        else:
            cols = tuple(int(d) for d in receivers)
        for arg, ids, n in (("senders", rows, matrix.shape[0]), ("receivers", cols, matrix.shape[1])):
            if len(ids) != n:
                raise ValueError(f"{arg} has {len(ids)} ids but the matrix has {n}; give one id per "
                                 f"{'row' if arg == 'senders' else 'column'}.")
    if ax is None:
        fig = _new_figure((6.4, 5.4))
        ax = fig.add_subplot()
    nr, nc = len(rows), len(cols)
    data = np.ma.masked_equal(np.asarray(matrix, dtype=np.float64), 0.0)
    positive = data.compressed()
    if log and len(positive) and positive.max() > positive.min():
        norm: Normalize = LogNorm(vmin=float(positive.min()), vmax=float(positive.max()))
    else:
        norm = Normalize(vmin=0.0, vmax=float(positive.max()) if len(positive) else 1.0)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    image = ax.imshow(data, cmap=cmap, norm=norm, interpolation="nearest", aspect="auto",
                      extent=(-0.5, nc - 0.5, nr - 0.5, -0.5))
    bar = ax.figure.colorbar(image, ax=ax, shrink=0.85)
    bar.set_label("bytes" if log else "bytes (linear)")
    if isinstance(norm, LogNorm) and norm.vmax / norm.vmin >= 16:
        bar.ax.yaxis.set_major_locator(LogLocator(base=2.0))
    else:
        bar.set_ticks(_byte_ticks(norm.vmin, norm.vmax))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _bytes_label(v)))
    bar.ax.yaxis.set_minor_formatter(NullFormatter())
    for axis, ids, rotate in ((ax.xaxis, cols, nc > 16), (ax.yaxis, rows, False)):
        step = max(1, math.ceil(len(ids) / 16))
        ticks = list(range(0, len(ids), step))
        axis.set_ticks(ticks, [str(ids[i]) for i in ticks], fontsize=7, rotation=90 if rotate else 0)
    ax.set_xlabel("destination device")
    ax.set_ylabel("source device")
    total = float(np.asarray(matrix).sum())
    extra = ""
    if size is not None and nr and nc:
        row_dom, col_dom = np.array(rows) // size, np.array(cols) // size
        row_runs, col_runs = _runs(row_dom), _runs(col_dom)
        for a, _, _ in row_runs[1:]:
            ax.axhline(a - 0.5, color="0.35", linewidth=0.6)
        for a, _, _ in col_runs[1:]:
            ax.axvline(a - 0.5, color="0.35", linewidth=0.6)
        for r0, r1, dom in row_runs:
            for c0, c1, dom_c in col_runs:
                if dom == dom_c:
                    ax.add_patch(Rectangle((c0 - 0.5, r0 - 0.5), c1 - c0, r1 - r0, fill=False, edgecolor="red",
                                           linewidth=1.4, gid=f"domain:{dom}"))
        crossing = float(np.asarray(matrix)[row_dom[:, None] != col_dom[None, :]].sum())
        share = crossing / total if total else 0.0
        extra = f"\n{size} GPUs per NVLink domain (red: same domain): {share:.0%} of bytes cross domains"
    if title is None:
        title = f"traffic matrix, {_bytes_label(total)} in all"
    ax.set_title(title + extra, fontsize=9)
    return ax.figure


def _runs(domains: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, stop, domain) of each run of equal consecutive domains."""
    cuts = [0, *(i for i in range(1, len(domains)) if domains[i] != domains[i - 1]), len(domains)]
    return [(a, b, int(domains[a])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def _loads(plan: Any) -> tuple[dict[int, int], dict[int, int], str]:
    if isinstance(plan, PlanStats):
        return plan.send_bytes, plan.recv_bytes, plan.unit
    if isinstance(plan, (Plan, TensorPlan)):
        s = plan.stats()
        return s.send_bytes, s.recv_bytes, s.unit
    raise TypeError(f"plan must be a jreshard.Plan, TensorPlan or PlanStats, got {type(plan).__name__} {plan!r}.")


def draw_load(plan: Plan | TensorPlan | PlanStats, *, title: str | None = None) -> Figure:
    """Per-device send and receive bars, each against its mean (dashed line).

    The means are over the devices that send (receive) anything, as in
    ``PlanStats``; bars carry the gid ``'send:<dev>'`` / ``'recv:<dev>'`` and the mean
    lines ``'mean:send'`` / ``'mean:recv'``.

    Args:
      plan: a Plan, TensorPlan or their PlanStats.
      title: the figure title; defaults to the max/mean ratios.

    Returns:
      The matplotlib Figure.

    Raises:
      TypeError: ``plan`` is not a Plan, TensorPlan or PlanStats.
    """
    send, recv, unit = _loads(plan)
    fig = _new_figure((max(6.0, min(16.0, 0.12 * len(set(send) | set(recv)) + 4.0)), 5.0))
    axes = fig.subplots(2, 1, sharex=False)
    ratios = []
    for ax, loads, kind, color in ((axes[0], send, "send", "tab:blue"), (axes[1], recv, "recv", "tab:orange")):
        devices = sorted(loads)
        values = [loads[d] for d in devices]
        mean = float(np.mean(values)) if values else 0.0
        peak = max(values, default=0)
        ratios.append(peak / mean if mean else 1.0)
        positions = np.arange(len(devices))
        bars = ax.bar(positions, values, color=color, width=0.8)
        for patch, d in zip(bars.patches, devices, strict=True):
            patch.set_gid(f"{kind}:{d}")
        ax.axhline(mean, color="black", linestyle="--", linewidth=1.0, gid=f"mean:{kind}")
        step = max(1, math.ceil(len(devices) / 32))
        ax.set_xticks(positions[::step], [str(d) for d in devices[::step]], fontsize=7,
                      rotation=90 if len(devices) > 16 else 0)
        ax.set_xlim(-0.6, max(len(devices), 1) - 0.4)
        ax.set_ylim(0, max(peak, 1) * 1.12)
        if unit == "bytes":
            _bytes_axis(ax.yaxis, max(peak, 1) * 1.12)
        verb = "sends" if kind == "send" else "receives"
        ax.set_ylabel(f"{verb} ({unit})", fontsize=8)
        ax.set_xlabel(f"{'sending' if kind == 'send' else 'receiving'} device", fontsize=8)
        label = _fmt(mean, unit)
        ax.set_title(f"{len(devices)} devices {verb[:-1]}; max/mean {peak / mean if mean else 1.0:.3f} "
                     f"(mean {label}, dashed)", fontsize=9)
    if title is None:
        title = f"per-device load: send max/mean {ratios[0]:.3f}, receive max/mean {ratios[1]:.3f}"
    fig.suptitle(title, fontsize=10)
    return fig


# --------------------------------------------------------------------------- comparisons


def _check_numbers(values: Any, arg: str) -> dict[str, float]:
    if not isinstance(values, Mapping) or not values:
        raise TypeError(
            f"{arg} must be a non-empty mapping of method name -> number, got {values!r}; "
            "pass for example {'jreshard': 1.2e9, 'gather-then-broadcast': 6.9e9}."
        )
    out = {}
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{arg}[{name!r}] must be a number, got {type(v).__name__} {v!r}.")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{arg}[{name!r}] must be finite and non-negative, got {v!r}.")
        out[str(name)] = float(v)
    return out


def draw_comparison(bytes_by_method: Mapping[str, float], seconds_by_method: Mapping[str, float] | None = None, *,
                    nvlink_bytes_by_method: Mapping[str, float] | None = None, baseline: str | None = None,
                    title: str | None = None) -> Figure:
    """Bars of bytes moved (and predicted seconds) per method, with ratios to a baseline.

    Takes plain numbers, so any cost model's output fits, for example
    ``{'jreshard': ..., 'flat direct sends': ..., 'gather-then-broadcast': ...}``.
    Bars carry the gid ``'bytes:<method>'``, ``'nvlink:<method>'`` or
    ``'seconds:<method>'``; ratios divide by the baseline's value (network bytes
    for the bytes panel).

    Args:
      bytes_by_method: method name -> bytes moved over the network.
      seconds_by_method: optional method name -> predicted seconds (same names).
      nvlink_bytes_by_method: optional method name -> bytes moved inside NVLink
        domains, stacked after the network bytes (hatched).
      baseline: the method the ratios divide by (default: the first one).
      title: the figure title.

    Returns:
      The matplotlib Figure.

    Raises:
      TypeError: an argument is not a non-empty mapping of numbers.
      ValueError: a value is negative or not finite, the mappings name different
        methods, or ``baseline`` is not one of them.
    """
    nbytes = _check_numbers(bytes_by_method, "bytes_by_method")
    methods = list(nbytes)
    seconds = _same_methods(seconds_by_method, "seconds_by_method", methods)
    nvlink = _same_methods(nvlink_bytes_by_method, "nvlink_bytes_by_method", methods)
    base = methods[0] if baseline is None else baseline
    if base not in nbytes:
        raise ValueError(f"baseline {baseline!r} is not one of the methods {methods}.")
    panels = [("bytes", nbytes, _bytes_label)] + ([("seconds", seconds, _seconds_label)] if seconds else [])
    fig = _new_figure((5.6 * len(panels) + 1.5, 0.55 * len(methods) + 1.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    palette = matplotlib.colormaps["tab10"]
    colors = [palette(i % 10) for i in range(len(methods))]
    ys = np.arange(len(methods))
    for ax, (kind, values, fmt) in zip(axes, panels, strict=True):
        widths = [values[m] for m in methods]
        bars = ax.barh(ys, widths, color=colors)
        for patch, m in zip(bars.patches, methods, strict=True):
            patch.set_gid(f"{kind}:{m}")
        extra = {m: 0.0 for m in methods}
        if kind == "bytes" and nvlink:
            extra = nvlink
            stacked = ax.barh(ys, [nvlink[m] for m in methods], left=widths, color=colors, alpha=0.35,
                              hatch="//", edgecolor="0.3")
            for patch, m in zip(stacked.patches, methods, strict=True):
                patch.set_gid(f"nvlink:{m}")
        top = max(values[m] + extra[m] for m in methods) or 1.0
        ref = values[base]
        for y, m in zip(ys, methods, strict=True):
            text = fmt(values[m]) + (f" ({values[m] / ref:.2f}x)" if ref else "")
            if kind == "bytes" and nvlink:
                text += f" + {fmt(nvlink[m])} NVLink"
            ax.text(values[m] + extra[m] + top * 0.01, y, text, va="center", fontsize=8)
        ax.set_yticks(ys, methods, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, top * (1.75 if kind == "bytes" and nvlink else 1.45))
        if kind == "bytes":
            _bytes_axis(ax.xaxis, ax.get_xlim()[1])
        else:
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos, f=fmt: f(v) if v > 0 else "0"))
        ax.tick_params(axis="x", labelsize=7)
        if kind == "bytes":
            ax.set_title("bytes over the network" + (" (+ inside NVLink domains, hatched)" if nvlink else ""),
                         fontsize=9)
        else:
            ax.set_title("predicted time", fontsize=9)
    fig.suptitle(title if title is not None else f"ratios relative to {base}", fontsize=10)
    return fig


def _same_methods(values: Mapping[str, float] | None, arg: str, methods: list[str]) -> dict[str, float] | None:
    if values is None:
        return None
    checked = _check_numbers(values, arg)
    if set(checked) != set(methods):
        raise ValueError(
            f"{arg} names {sorted(checked)} but bytes_by_method names {sorted(methods)}; "
            "give both for the same methods."
        )
    return {m: checked[m] for m in methods}


def draw_sweep(x: Sequence[Any], bytes_by_method: Mapping[str, Sequence[float]],
               seconds_by_method: Mapping[str, Sequence[float]] | None = None, *, xlabel: str = "",
               bytes_title: str = "bytes over the network", log: bool = True, title: str | None = None) -> Figure:
    """Lines of bytes (and predicted seconds) per method across a sweep of settings.

    Args:
      x: the settings swept (for example inference TP degrees), one per point.
      bytes_by_method: method name -> one byte count per setting.
      seconds_by_method: optional method name -> one predicted time per setting.
      xlabel: the x axis label.
      bytes_title: the title of the bytes panel (say what the bytes count).
      log: logarithmic y axes.
      title: the figure title.

    Returns:
      The matplotlib Figure; each line has the gid ``'bytes:<method>'`` or
      ``'seconds:<method>'``.

    Raises:
      TypeError: a mapping is empty or holds non-numbers.
      ValueError: a series has a different length from ``x`` or holds a negative value.
    """
    xs = list(x)
    if not xs:
        raise ValueError("x must hold at least one setting, got an empty sequence.")
    panels = [("bytes", _check_series(bytes_by_method, len(xs), "bytes_by_method"), _bytes_label)]
    if seconds_by_method is not None:
        panels.append(("seconds", _check_series(seconds_by_method, len(xs), "seconds_by_method"), _seconds_label))
    fig = _new_figure((5.0 * len(panels) + 0.8, 3.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    positions = np.arange(len(xs))
    for ax, (kind, series, fmt) in zip(axes, panels, strict=True):
        for i, (name, ys) in enumerate(series.items()):
            # Distinct markers keep coinciding series visible.
            ax.plot(positions, ys, marker="osD^v<>"[i % 7], markersize=7 - 1.2 * (i % 3), label=name,
                    color=matplotlib.colormaps["tab10"](i % 10), gid=f"{kind}:{name}")
        if log and all(v > 0 for ys in series.values() for v in ys):
            ax.set_yscale("log")
            # Bytes tick at powers of two (1 GiB, 2 GiB, ...), seconds at 1-2-5 decades.
            ax.yaxis.set_major_locator(LogLocator(base=2.0) if kind == "bytes" else LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, f=fmt: f(v) if v > 0 else "0"))
        ax.set_xticks(positions, [str(v) for v in xs])
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.set_title(bytes_title if kind == "bytes" else "predicted time", fontsize=9)
        ax.legend(fontsize=8)
    if title is not None:
        fig.suptitle(title, fontsize=10)
    return fig


def _check_series(values: Any, n: int, arg: str) -> dict[str, list[float]]:
    if not isinstance(values, Mapping) or not values:
        raise TypeError(f"{arg} must be a non-empty mapping of method name -> sequence of numbers, got {values!r}.")
    out = {}
    for name, ys in values.items():
        ys = list(ys)
        if len(ys) != n:
            raise ValueError(f"{arg}[{name!r}] has {len(ys)} values but x has {n}; give one value per setting.")
        out[str(name)] = list(_check_numbers({f"{name}[{i}]": y for i, y in enumerate(ys)}, arg).values())
    return out
