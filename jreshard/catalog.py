"""``jreshard.catalog`` is ``jreshard.fleet.catalog``; this path stays for existing imports."""

import sys

import jreshard.fleet.catalog

sys.modules[__name__] = jreshard.fleet.catalog
