"""Checks of the bridge's public arguments: messages name the argument and say what to pass instead.

Pure (no torch, no jax): numpy integers pass wherever ints do, and every count or
index must fit in int64, the width the wire's headers carry.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any

__all__ = ["check_int", "check_ints", "check_seconds", "check_flag", "check_name", "INT64_MAX"]

INT64_MAX = (1 << 63) - 1


def check_int(name: str, value: Any, *, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """``value`` as an int (numpy integers too) in ``[minimum, maximum]``; bools and floats are refused.

    Example:
      >>> import numpy as np
      >>> from jreshard.core.args import check_int
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
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {v}.")
    if v > maximum:
        raise ValueError(f"{name} must be an int <= {maximum} (it must fit in int64), got {v}.")
    return v


def check_ints(name: str, values: Any, *, minimum: int = 0) -> tuple[int, ...]:
    """``values`` (a tuple, list or 1-d NumPy array) as a tuple of ints, each checked by ``check_int``.

    Example:
      >>> import numpy as np
      >>> from jreshard.core.args import check_ints
      >>> check_ints("shape", np.array([2, 3]))
      (2, 3)
      >>> check_ints("shape", "23")
      Traceback (most recent call last):
      ...
      TypeError: shape must be a tuple of ints, got str '23'.
    """
    if type(values).__name__ == "ndarray" and getattr(values, "ndim", 0) == 1:
        values = values.tolist()
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of ints, got {type(values).__name__} {values!r}.")
    return tuple(check_int(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(values))


def check_name(name: str, value: Any, what: str) -> str:
    """``value`` if it is a non-empty str; ``what`` says what the string names.

    Example:
      >>> from jreshard.core.args import check_name
      >>> check_name("Rule name", None, "the param name")
      Traceback (most recent call last):
      ...
      TypeError: Rule name must be a non-empty str (the param name), got NoneType None.
    """
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a non-empty str ({what}), got {type(value).__name__} {value!r}.")
    return value


def check_seconds(name: str, value: Any) -> float:
    """``value`` as a positive, finite number of seconds.

    Example:
      >>> from jreshard.core.args import check_seconds
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


def _is_numpy_bool(value: Any) -> bool:
    """numpy.bool_ (named ``bool`` since NumPy 2), without importing numpy for it."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def check_flag(name: str, value: Any, *, none: bool = False) -> Any:
    """``value`` if it is a bool (or ``None`` where ``none``); numpy bools pass as bools.

    Example:
      >>> import numpy as np
      >>> from jreshard.core.args import check_flag
      >>> check_flag("atomic", np.True_)
      True
      >>> check_flag("atomic", "yes")
      Traceback (most recent call last):
      ...
      TypeError: atomic must be True or False, got str 'yes'.
    """
    if value is None and none:
        return None
    if _is_numpy_bool(value):
        return bool(value)
    if not isinstance(value, bool):
        allowed = "True, False or None" if none else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}.")
    return value
