"""``jreshard.cost`` is ``jreshard.fleet.cost``; this path stays for existing imports."""

import sys

import jreshard.fleet.cost

sys.modules[__name__] = jreshard.fleet.cost
