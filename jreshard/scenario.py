"""``jreshard.scenario`` is ``jreshard.fleet.scenario``; this path stays for existing imports."""

import sys

import jreshard.fleet.scenario

sys.modules[__name__] = jreshard.fleet.scenario
