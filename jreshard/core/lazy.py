"""Module attributes imported on first use (PEP 562), so that a package imports no optional dependency
up front: ``import jreshard`` needs no jax, ``import bridge`` no torch.

Example:
  >>> import types
  >>> from jreshard.core.lazy import lazy_attributes
  >>> pkg = types.ModuleType("pkg")
  >>> pkg.__getattr__ = lazy_attributes("pkg", {"sqrt": "math"}, globals=vars(pkg))
  >>> pkg.__getattr__("sqrt")(9.0), "sqrt" in vars(pkg)
  (3.0, True)
  >>> pkg.__getattr__("cube")
  Traceback (most recent call last):
  ...
  AttributeError: module 'pkg' has no attribute 'cube'
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(package: str, names: Mapping[str, str], *, globals: MutableMapping[str, Any],
                    modules: Mapping[str, str] | None = None) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``names`` maps an attribute to the module that defines it
    (imported, then the attribute cached in ``globals``), ``modules`` an attribute to a module that is
    the attribute itself (a subpackage reachable without an import)."""

    def __getattr__(name: str) -> Any:
        if modules is not None and name in modules:
            return importlib.import_module(modules[name])
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals[name] = value
        return value

    return __getattr__
