"""A training loop step by step: the reward per step, and where each step's time went.

Example:
  >>> import jreshard.viz
  >>> fig = jreshard.viz.draw_rl_loop([0.1, 0.4, 0.9], {"generate": [1.0, 0.9, 0.9], "train": [2.0, 0.5, 0.5]})
  >>> [p.get_gid() for p in fig.axes[1].patches][:4]
  ['seconds:generate:0', 'seconds:generate:1', 'seconds:generate:2', 'seconds:train:0']
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import matplotlib
import numpy as np
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from jreshard.viz.common import new_figure
from jreshard.viz.comparisons import _check_series

__all__ = ["draw_rl_loop"]


def draw_rl_loop(rewards: Sequence[float], seconds_by_phase: Mapping[str, Sequence[float]], *,
                 during: Mapping[str, Sequence[float]] | None = None, title: str | None = None) -> Figure:
    """Two panels: the mean reward of each step's rollouts, and each step's seconds stacked by phase.

    Args:
      rewards: one mean reward per step.
      seconds_by_phase: phase name (``"generate"``, ``"train"``, ``"transfer"``, ...) -> seconds per step,
        one value per step; phases stack in the mapping's order (the step's wall time).
      during: phases that ran at the same time as the stacked ones (a refit while the engine
        generates, its pause), each drawn as a narrow bar of its own beside each step's stack,
        labelled "(overlapped)"; the same form as ``seconds_by_phase``.
      title: the figure title.

    Returns:
      The matplotlib Figure; the reward line has the gid ``'reward'``, each bar
      ``'seconds:<phase>:<step>'`` (the ``during`` phases' too).

    Raises:
      TypeError: ``rewards`` holds non-numbers or ``seconds_by_phase`` is not a mapping of sequences.
      ValueError: no steps, a reward is not finite, a phase has a different number of steps, or a
        phase's seconds are negative or not finite (rewards may be negative), or a ``during``
        phase has a stacked phase's name.
    """
    reward = _check_rewards(rewards)
    steps = np.arange(len(reward))
    phases = _check_series(seconds_by_phase, len(reward), "seconds_by_phase", against="rewards")
    fig = new_figure((10.5, 3.8))
    left, right = fig.subplots(1, 2)
    left.plot(steps, reward, marker="o", color=matplotlib.colormaps["tab10"](2), gid="reward")
    left.set_xlabel("step")
    left.set_title("mean reward of the step's rollouts", fontsize=9)
    left.grid(True, alpha=0.3)
    beside = {} if during is None else _check_series(during, len(reward), "during", against="rewards")
    if clash := sorted(set(beside) & set(phases)):
        raise ValueError(f"during names {clash}, which seconds_by_phase stacks already; give them other names.")
    width = 0.8 if not beside else 0.55
    bottom = np.zeros(len(rewards))
    for i, (phase, ys) in enumerate(phases.items()):
        bars = right.bar(steps - (0.8 - width) / 2, ys, width, bottom=bottom, label=phase,
                         color=matplotlib.colormaps["tab10"](i % 10))
        _name_bars(bars, phase)
        bottom += np.asarray(ys)
    narrow = (0.8 - width) / max(1, len(beside))
    for j, (phase, ys) in enumerate(beside.items()):
        bars = right.bar(steps - 0.4 + width + (j + 0.5) * narrow, ys, narrow,
                         label=f"{phase} (overlapped)", color=matplotlib.colormaps["tab10"]((len(phases) + j) % 10),
                         alpha=0.8)
        _name_bars(bars, phase)
    right.set_xlabel("step")
    right.set_ylabel("seconds")
    right.set_title("where each step's time went", fontsize=9)
    right.grid(True, axis="y", alpha=0.3)
    right.legend(fontsize=8)
    if title is not None:
        fig.suptitle(title, fontsize=10)
    return fig


def _name_bars(bars: BarContainer, phase: str) -> None:
    for step, bar in enumerate(bars):
        bar.set_gid(f"seconds:{phase}:{step}")


def _check_rewards(rewards: object) -> list[float]:
    if not isinstance(rewards, Sequence) or isinstance(rewards, str) or not rewards:
        raise ValueError(f"rewards must be a non-empty sequence of numbers (one per step), got {rewards!r}.")
    out = []
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            raise TypeError(f"rewards[{i}] must be a number, got {type(r).__name__} {r!r}.")
        if not math.isfinite(r):
            raise ValueError(f"rewards[{i}] must be finite, got {r!r}.")
        out.append(float(r))
    return out
