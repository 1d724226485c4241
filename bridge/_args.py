"""Checks of the bridge's public arguments: messages name the argument and say what to pass instead.

Pure (no torch, no jax): numpy integers pass wherever ints do, and every count or
index must fit in int64, the width the wire's headers carry.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

__all__ = ["check_int", "check_seconds", "check_flag", "INT64_MAX"]

INT64_MAX = (1 << 63) - 1


def check_int(name: str, value: Any, *, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """``value`` as an int (numpy integers too) in ``[minimum, maximum]``; bools and floats are refused.

    Example:
      >>> import numpy as np
      >>> from bridge._args import check_int
      >>> check_int("rank", np.int32(3))
      3
      >>> check_int("rank", -1)
      Traceback (most recent call last):
      ...
      ValueError: rank must be an int >= 0, got -1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}.")
    v = operator.index(value)
    if v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v}.")
    if v > maximum:
        raise ValueError(f"{name} must be an int <= {maximum} (it must fit in int64), got {v}.")
    return v


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a positive, finite number of seconds.

    Example:
      >>> from bridge._args import check_seconds
      >>> check_seconds("timeout", float("nan"))
      Traceback (most recent call last):
      ...
      ValueError: timeout must be a positive, finite number of seconds, got nan.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds (int or float), got {type(value).__name__} {value!r}.")
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {v!r}.")
    return v


def check_flag(name: str, value: Any, *, none: bool = False) -> Any:
    """``value`` if it is a bool (or ``None`` where ``none``); numpy bools pass as bools."""
    if value is None and none:
        return None
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing numpy for it
        return bool(value)
    if not isinstance(value, bool):
        allowed = "True, False or None" if none else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}.")
    return value
