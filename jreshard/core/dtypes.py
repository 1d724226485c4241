"""The one dtype resolver: canonical names, item sizes and NumPy dtypes.

Layouts carry a dtype as its canonical name (``'float32'``, ``'bfloat16'``), which
NumPy, ml_dtypes, jax and torch all understand. Only numeric dtypes (bool
included) are accepted: a reshard moves numbers.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["canonical_dtype", "itemsize_of", "numpy_dtype"]

_HINT = "use for example 'float32', 'bfloat16' or 'int8'"

# ml_dtypes takes about half a second to import: planning knows the names of its common types
# and their sizes, and imports it only for a NumPy dtype or another name.
_ML_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
                "float8_e4m3": 1, "float8_e8m0fnu": 1}


def _resolve(dtype: Any, arg: str) -> np.dtype:
    try:
        resolved = np.dtype(dtype)
    except (TypeError, ValueError):
        import ml_dtypes

        # jnp.bfloat16 and similar scalar types, or ml_dtypes names NumPy does not know.
        name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or getattr(dtype, "__name__", None)
        found = getattr(ml_dtypes, name, None) if isinstance(name, str) else None
        if found is None:
            raise TypeError(f"{arg} must be a NumPy or ml_dtypes dtype or its name, got {dtype!r}; {_HINT}.") from None
        resolved = np.dtype(found)
    if resolved.kind not in "biufc" and resolved.type.__module__ != "ml_dtypes":
        raise TypeError(
            f"{arg} must be a numeric dtype (bool, integer, floating or complex, ml_dtypes included), "
            f"got {resolved}; {_HINT}."
        )
    return resolved


def canonical_dtype(dtype: Any, *, arg: str = "dtype") -> str | None:
    """The canonical name of a numeric dtype given as a dtype, a scalar type or a name.

    ``None`` stays ``None`` (a layout without a dtype counts elements). ``arg`` names
    the argument in the error message.

    Example:
      >>> import numpy as np
      >>> from jreshard.core.dtypes import canonical_dtype
      >>> canonical_dtype(np.float32), canonical_dtype("bfloat16"), canonical_dtype(None)
      ('float32', 'bfloat16', None)
    """
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in _ML_ITEMSIZE:
        return dtype
    return _resolve(dtype, arg).name


@functools.cache
def _itemsize(name: str) -> int:
    """Bytes per element of a dtype name.

    Example (the names known without importing ml_dtypes have its sizes):
      >>> import ml_dtypes
      >>> import numpy as np
      >>> from jreshard.core.dtypes import _ML_ITEMSIZE
      >>> all(np.dtype(getattr(ml_dtypes, n)).itemsize == k for n, k in _ML_ITEMSIZE.items())
      True
    """
    return _ML_ITEMSIZE.get(name) or _resolve(name, "dtype").itemsize


def itemsize_of(dtype: Any) -> int:
    """Bytes per element of a dtype (or its name); 1 for ``None``, which counts elements.

    Example:
      >>> from jreshard.core.dtypes import itemsize_of
      >>> itemsize_of("bfloat16"), itemsize_of("float8_e4m3fn"), itemsize_of(None)
      (2, 1, 1)
    """
    if dtype is None:
        return 1
    return _itemsize(dtype) if isinstance(dtype, str) else _resolve(dtype, "dtype").itemsize


def numpy_dtype(dtype: Any, *, arg: str = "dtype") -> np.dtype | None:
    """The ``numpy.dtype`` of a numeric dtype or its name (ml_dtypes for bfloat16, float8, ...).

    Example:
      >>> import ml_dtypes
      >>> import numpy as np
      >>> from jreshard.core.dtypes import numpy_dtype
      >>> numpy_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16), numpy_dtype(None)
      (True, None)
    """
    if dtype is None:
        return None
    return _resolve(dtype, arg)
