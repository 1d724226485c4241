"""The ``jreshard`` command: ``plan`` and ``demo``."""
