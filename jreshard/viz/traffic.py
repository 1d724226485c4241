"""Who sends how much to whom: the traffic matrix, its heatmap, and per-device load bars.

Example:
  >>> import jreshard, jreshard.viz
  >>> a = jreshard.Layout((4,), jreshard.Mesh([0, 1], "x"), ("x",))
  >>> b = jreshard.Layout((4,), jreshard.Mesh([2, 3], "x"), ("x",))
  >>> fig = jreshard.viz.draw_load(jreshard.plan(a, b))
  >>> sorted(p.get_gid() for p in fig.axes[0].patches)
  ['send:0', 'send:1']
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import matplotlib
import numpy as np
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from jreshard.core.args import check_int
from jreshard.core.plans import Plan, TensorPlan
from jreshard.core.stats import PlanStats, format_amount
from jreshard.viz.common import byte_ticks, bytes_axis, bytes_label, new_figure

__all__ = ["Traffic", "draw_load", "draw_traffic", "traffic_matrix"]


class Traffic(NamedTuple):
    """Bytes from each sending device (rows) to each receiving device (columns)."""

    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    matrix: np.ndarray


def traffic_matrix(plan: Plan | TensorPlan, *, include_local: bool = False) -> Traffic:
    """Bytes sent from each source device to each destination device under ``plan``.

    Args:
      plan: a Plan or TensorPlan.
      include_local: count local copies too (network traffic only by default).

    Returns:
      ``Traffic(senders, receivers, matrix)``, a named tuple: the sorted ids of every
      source-mesh device and of every destination-mesh device, and an int64 matrix
      whose ``[i, j]`` is the bytes ``senders[i]`` sends to ``receivers[j]`` (elements
      when the layouts carry no dtype).

    Raises:
      TypeError: ``plan`` is not a Plan or TensorPlan.

    Example:
      >>> import jreshard, jreshard.viz
      >>> a = jreshard.Layout((4,), jreshard.Mesh([0, 1], "x"), ("x",))
      >>> b = jreshard.Layout((4,), jreshard.Mesh([2, 3], "x"), ("x",))
      >>> jreshard.viz.traffic_matrix(jreshard.plan(a, b))
      Traffic(senders=(0, 1), receivers=(2, 3), matrix=array([[2, 0], [0, 2]]))
    """
    if isinstance(plan, TensorPlan):
        tplans = [plan]
    elif isinstance(plan, Plan):
        tplans = list(plan.tensors.values())
    else:
        raise TypeError(f"plan must be a jreshard.Plan or TensorPlan, got {type(plan).__name__} {plan!r}.")
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
    return Traffic(tuple(int(d) for d in senders), tuple(int(d) for d in receivers), matrix)


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
      TypeError: ``plan`` is neither a plan nor a matrix, ``topology`` has no domain size, or
        the domain size is not an int.
      ValueError: the matrix is not 2-D or holds negative values, ``senders`` or
        ``receivers`` does not match it, or the domain size is below 1.
    """
    size = _domain_size(domain_size, topology)
    if isinstance(plan, (Plan, TensorPlan)):
        traffic = traffic_matrix(plan, include_local=include_local)
    else:
        traffic = _given_matrix(plan, senders, receivers)
    rows, cols, matrix = traffic
    if ax is None:
        ax = new_figure((6.4, 5.4)).add_subplot()
    nr, nc = len(rows), len(cols)
    data = np.ma.masked_equal(np.asarray(matrix, dtype=np.float64), 0.0)
    positive = data.compressed()
    lo, hi = (float(positive.min()), float(positive.max())) if len(positive) else (0.0, 1.0)
    logarithmic = log and hi > lo > 0
    norm = LogNorm(vmin=lo, vmax=hi) if logarithmic else Normalize(vmin=0.0, vmax=hi)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    image = ax.imshow(data, cmap=cmap, norm=norm, interpolation="nearest", aspect="auto",
                      extent=(-0.5, nc - 0.5, nr - 0.5, -0.5))
    bar = ax.figure.colorbar(image, ax=ax, shrink=0.85)
    bar.set_label("bytes" if log else "bytes (linear)")
    if logarithmic and hi / lo >= 16:
        bar.ax.yaxis.set_major_locator(LogLocator(base=2.0))
    else:
        bar.set_ticks(byte_ticks(lo if logarithmic else 0.0, hi))
    bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: bytes_label(v)))
    bar.ax.yaxis.set_minor_formatter(NullFormatter())
    for axis, ids, rotate in ((ax.xaxis, cols, nc > 16), (ax.yaxis, rows, False)):
        step = max(1, math.ceil(len(ids) / 16))
        ticks = list(range(0, len(ids), step))
        axis.set_ticks(ticks, [str(ids[i]) for i in ticks], fontsize=7, rotation=90 if rotate else 0)
    ax.set_xlabel("destination device")
    ax.set_ylabel("source device")
    extra = _draw_domains(ax, traffic, size) if size is not None and nr and nc else ""
    if title is None:
        title = f"traffic matrix, {bytes_label(float(np.asarray(matrix).sum()))} in all"
    ax.set_title(title + extra, fontsize=9)
    return ax.figure


def _given_matrix(plan: Any, senders: Sequence[int] | None, receivers: Sequence[int] | None) -> Traffic:
    """A matrix of bytes given in place of a plan, checked, with its row and column device ids."""
    if not isinstance(plan, (np.ndarray, list, tuple)):
        raise TypeError(f"plan must be a jreshard.Plan, TensorPlan or a matrix of bytes, got {type(plan).__name__}.")
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
    for arg, ids, n, line in (("senders", rows, matrix.shape[0], "row"),
                              ("receivers", cols, matrix.shape[1], "column")):
        if len(ids) != n:
            raise ValueError(f"{arg} has {len(ids)} ids but the matrix has {n}; give one id per {line}.")
    return Traffic(rows, cols, matrix)


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
    return check_int("domain_size", domain_size, minimum=1)  # GPUs per NVLink domain


def _draw_domains(ax: Any, traffic: Traffic, size: int) -> str:
    """Domain boundaries and same-domain outlines on the heatmap; returns the title's extra line."""
    matrix = np.asarray(traffic.matrix)
    row_dom, col_dom = np.array(traffic.senders) // size, np.array(traffic.receivers) // size
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
    total = float(matrix.sum())
    crossing = float(matrix[row_dom[:, None] != col_dom[None, :]].sum())
    share = crossing / total if total else 0.0
    return f"\n{size} GPUs per NVLink domain (red: same domain): {share:.0%} of bytes cross domains"


def _runs(domains: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, stop, domain) of each run of equal consecutive domains."""
    cuts = [0, *(i for i in range(1, len(domains)) if domains[i] != domains[i - 1]), len(domains)]
    return [(a, b, int(domains[a])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def draw_load(plan: Plan | TensorPlan | PlanStats, *, title: str | None = None) -> Figure:
    """Per-device send and receive bars, each against its mean (dashed line).

    The means are over the devices that send (receive) anything, as in
    ``PlanStats``; bars carry the gid ``'send:<device>'`` / ``'recv:<device>'`` and
    the mean lines ``'mean:send'`` / ``'mean:recv'``.

    Args:
      plan: a Plan, TensorPlan or their PlanStats.
      title: the figure title; defaults to the max/mean ratios.

    Returns:
      The matplotlib Figure.

    Raises:
      TypeError: ``plan`` is not a Plan, TensorPlan or PlanStats.
    """
    if isinstance(plan, (Plan, TensorPlan)):
        stats = plan.stats()
    elif isinstance(plan, PlanStats):
        stats = plan
    else:
        raise TypeError(f"plan must be a jreshard.Plan, TensorPlan or PlanStats, got {type(plan).__name__} {plan!r}.")
    send, recv, unit = stats.send_bytes, stats.recv_bytes, stats.unit
    fig = new_figure((max(6.0, min(16.0, 0.12 * len(set(send) | set(recv)) + 4.0)), 5.0))
    axes = fig.subplots(2, 1, sharex=False)
    ratios = [_load_panel(axes[0], send, "send", "tab:blue", unit),
              _load_panel(axes[1], recv, "recv", "tab:orange", unit)]
    if title is None:
        title = f"per-device load: send max/mean {ratios[0]:.3f}, receive max/mean {ratios[1]:.3f}"
    fig.suptitle(title, fontsize=10)
    return fig


def _load_panel(ax: Any, loads: Mapping[int, int], kind: str, color: str, unit: str) -> float:
    """One panel of bars, one per device, and its mean; returns the max/mean ratio."""
    devices = sorted(loads)
    values = [loads[d] for d in devices]
    mean = float(np.mean(values)) if values else 0.0
    peak = max(values, default=0)
    ratio = peak / mean if mean else 1.0
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
        bytes_axis(ax.yaxis, max(peak, 1) * 1.12)
    verb = "sends" if kind == "send" else "receives"
    ax.set_ylabel(f"{verb} ({unit})", fontsize=8)
    ax.set_xlabel(f"{'sending' if kind == 'send' else 'receiving'} device", fontsize=8)
    ax.set_title(f"{len(devices)} devices {verb[:-1]}; max/mean {ratio:.3f} "
                 f"(mean {format_amount(mean, unit)}, dashed)", fontsize=9)
    return ratio
