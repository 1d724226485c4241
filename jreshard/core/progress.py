"""When executors and the CLI show a progress bar, and the bar itself (tqdm, imported only when shown).

One policy for every long operation: ``progress=None`` shows a bar only when the work is large
(``PROGRESS_BYTES`` of payload, or any count of CLI steps) and stderr is a terminal; ``True`` and
``False`` force it. tqdm is optional: without it nothing is shown.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["PROGRESS_BYTES", "show_progress", "progress_bar"]

PROGRESS_BYTES = 1 << 30  # with progress=None, executions moving more than this many bytes show a bar


def show_progress(enabled: bool | None, total: int, *, threshold: int = PROGRESS_BYTES) -> bool:
    """Whether to show a bar: ``enabled`` when given, else ``total`` above ``threshold`` on a terminal.

    Example:
      >>> from jreshard.core.progress import show_progress
      >>> show_progress(None, 10), show_progress(True, 10), show_progress(False, 1 << 40)
      (False, True, False)
    """
    if enabled is not None:
        return bool(enabled)
    return total > threshold and sys.stderr.isatty()


def progress_bar(enabled: bool | None, total: int, desc: str, *, unit: str = "B",
                 threshold: int = PROGRESS_BYTES) -> Any:
    """A tqdm bar on stderr counting ``total`` ``unit`` (bytes scaled to KB, MB, ...), or ``None`` when
    ``show_progress`` says no or tqdm is not installed. Callers ``update(n)`` and ``close()`` it."""
    if not show_progress(enabled, total, threshold=threshold):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, leave=False, file=sys.stderr)
