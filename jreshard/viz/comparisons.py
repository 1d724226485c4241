"""Comparing methods from plain numbers: bars of bytes and seconds, and lines across a sweep.

Any cost model's output fits, for example
``{'jreshard': ..., 'flat direct sends': ..., 'gather-then-broadcast': ...}``.

Example:
  >>> import jreshard.viz
  >>> fig = jreshard.viz.draw_comparison({"jreshard": 1 << 30, "gather-then-broadcast": 7 << 30})
  >>> [t.get_text() for t in fig.axes[0].texts]
  ['1.00 GiB (1.00x)', '7.00 GiB (7.00x)']
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from jreshard.viz.common import bytes_axis, bytes_label, new_figure, seconds_label

__all__ = ["draw_comparison", "draw_sweep"]


def draw_comparison(bytes_by_method: Mapping[str, float], seconds_by_method: Mapping[str, float] | None = None, *,
                    nvlink_bytes_by_method: Mapping[str, float] | None = None, baseline: str | None = None,
                    title: str | None = None) -> Figure:
    """Bars of bytes moved (and predicted seconds) per method, with ratios to a baseline.

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
    panels: list[tuple[str, dict[str, float], Callable[[float], str]]] = [("bytes", nbytes, bytes_label)]
    if seconds:
        panels.append(("seconds", seconds, seconds_label))
    fig = new_figure((5.6 * len(panels) + 1.5, 0.55 * len(methods) + 1.8))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    palette = matplotlib.colormaps["tab10"]
    colors = [palette(i % 10) for i in range(len(methods))]
    ys = np.arange(len(methods))
    for ax, (kind, values, fmt) in zip(axes, panels, strict=True):
        widths = [values[m] for m in methods]
        bars = ax.barh(ys, widths, color=colors)
        for patch, m in zip(bars.patches, methods, strict=True):
            patch.set_gid(f"{kind}:{m}")
        stacked = kind == "bytes" and nvlink is not None
        extra = nvlink if stacked and nvlink is not None else dict.fromkeys(methods, 0.0)
        if stacked:
            hatched = ax.barh(ys, [extra[m] for m in methods], left=widths, color=colors, alpha=0.35,
                              hatch="//", edgecolor="0.3")
            for patch, m in zip(hatched.patches, methods, strict=True):
                patch.set_gid(f"nvlink:{m}")
        top = max(values[m] + extra[m] for m in methods) or 1.0
        ref = values[base]
        for y, m in zip(ys, methods, strict=True):
            text = fmt(values[m]) + (f" ({values[m] / ref:.2f}x)" if ref else "")
            if stacked:
                text += f" + {fmt(extra[m])} NVLink"
            ax.text(values[m] + extra[m] + top * 0.01, y, text, va="center", fontsize=8)
        ax.set_yticks(ys, methods, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, top * (1.75 if stacked else 1.45))
        if kind == "bytes":
            bytes_axis(ax.xaxis, ax.get_xlim()[1])
            ax.set_title("bytes over the network" + (" (+ inside NVLink domains, hatched)" if stacked else ""),
                         fontsize=9)
        else:
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos, f=fmt: f(v) if v > 0 else "0"))
            ax.set_title("predicted time", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(title if title is not None else f"ratios relative to {base}", fontsize=10)
    return fig


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

    Example:
      >>> import jreshard.viz
      >>> fig = jreshard.viz.draw_sweep([2, 4, 8], {"jreshard": [1e9, 2e9, 4e9]}, xlabel="inference TP")
      >>> [line.get_gid() for line in fig.axes[0].lines]
      ['bytes:jreshard']
    """
    xs = list(x)
    if not xs:
        raise ValueError("x must hold at least one setting, got an empty sequence.")
    panels: list[tuple[str, dict[str, list[float]], Callable[[float], str]]] = [
        ("bytes", _check_series(bytes_by_method, len(xs), "bytes_by_method"), bytes_label)]
    if seconds_by_method is not None:
        panels.append(("seconds", _check_series(seconds_by_method, len(xs), "seconds_by_method"), seconds_label))
    fig = new_figure((5.0 * len(panels) + 0.8, 3.8))
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


def _check_series(values: Any, n: int, arg: str, against: str = "x") -> dict[str, list[float]]:
    if not isinstance(values, Mapping) or not values:
        raise TypeError(f"{arg} must be a non-empty mapping of method name -> sequence of numbers, got {values!r}.")
    out = {}
    for name, ys in values.items():
        ys = list(ys)
        if len(ys) != n:
            raise ValueError(f"{arg}[{name!r}] has {len(ys)} values but {against} has {n}; give one value per setting.")
        out[str(name)] = list(_check_numbers({f"{name}[{i}]": y for i, y in enumerate(ys)}, arg).values())
    return out
