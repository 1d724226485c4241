"""``jreshard.reference`` is ``jreshard.core.reference``; this path stays for existing imports."""

import sys

import jreshard.core.reference

sys.modules[__name__] = jreshard.core.reference
