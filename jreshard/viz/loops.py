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
from matplotlib.figure import Figure

from jreshard.viz.common import new_figure
from jreshard.viz.comparisons import _check_series

__all__ = ["draw_rl_loop"]


def draw_rl_loop(rewards: Sequence[float], seconds_by_phase: Mapping[str, Sequence[float]], *,
                 title: str | None = None) -> Figure:
    """Two panels: the mean reward of each step's rollouts, and each step's seconds stacked by phase.

    Args:
      rewards: one mean reward per step.
      seconds_by_phase: phase name (``"generate"``, ``"train"``, ``"transfer"``, ...) -> seconds per step,
        one value per step; phases stack in the mapping's order.
      title: the figure title.

    Returns:
      The matplotlib Figure; the reward line has the gid ``'reward'``, each bar
      ``'seconds:<phase>:<step>'``.

    Raises:
      TypeError: ``rewards`` holds non-numbers or ``seconds_by_phase`` is not a mapping of sequences.
      ValueError: no steps, a reward is not finite, a phase has a different number of steps, or a
        phase's seconds are negative or not finite (rewards may be negative).
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
    bottom = np.zeros(len(rewards))
    for i, (phase, ys) in enumerate(phases.items()):
        bars = right.bar(steps, ys, bottom=bottom, label=phase, color=matplotlib.colormaps["tab10"](i % 10))
        for step, bar in enumerate(bars):
            bar.set_gid(f"seconds:{phase}:{step}")
        bottom += np.asarray(ys)
    right.set_xlabel("step")
    right.set_ylabel("seconds")
    right.set_title("where each step's time went", fontsize=9)
    right.grid(True, axis="y", alpha=0.3)
    right.legend(fontsize=8)
    if title is not None:
        fig.suptitle(title, fontsize=10)
    return fig


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
