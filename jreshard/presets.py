"""``jreshard.presets`` is ``jreshard.fleet.presets``; this path stays for existing imports."""

import sys

import jreshard.fleet.presets

sys.modules[__name__] = jreshard.fleet.presets
