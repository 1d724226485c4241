"""A JSON object read from a file, with errors that name the argument and the file.

Model configs, hardware and scenario files are all JSON objects; a missing file, a
folder, text that is not JSON or a JSON list each get a ``ValueError`` that says which
argument named the file and what to pass instead (``FileNotFoundError``,
``IsADirectoryError`` and ``json.JSONDecodeError`` never reach the caller).
"""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["read_json_object"]


def read_json_object(arg: str, path: Any, what: str = "a JSON object") -> dict[str, Any]:
    """The object in the JSON file ``path``; ``arg`` names the argument in errors, ``what`` the content.

    Example:
      >>> from jreshard.core.jsonfile import read_json_object
      >>> read_json_object("config", "/no/such/config.json", "a model's config.json")
      Traceback (most recent call last):
      ...
      ValueError: config '/no/such/config.json' does not exist; pass the path of a file holding a model's config.json.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{arg} must be a path (str or os.PathLike), got {type(path).__name__} {path!r}.")
    name = os.fspath(path)
    if os.path.isdir(name):
        raise ValueError(f"{arg} {name!r} is a folder; pass the path of a file holding {what}.")
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"{arg} {name!r} does not exist; pass the path of a file holding {what}.") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{arg} {name!r} cannot be read ({exc}); pass a readable file holding {what}.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{arg} {name!r} is not valid JSON ({exc}); it must hold {what}.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{arg} {name!r} holds a JSON {type(data).__name__}, not a JSON object; it must hold {what} "
                         "({\"name\": value, ...}).")
    return data
