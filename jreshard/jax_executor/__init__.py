"""The JAX executor: ``jreshard.transfer`` and the adapter from jax arrays and shardings to layouts.

Imports jax; ``jreshard`` imports it on first use of ``transfer``. Modules, from
the entry point down: ``transfer`` (arguments), ``adapter`` (jax arguments to
layouts), ``executor`` (set up once, called per sync), ``buckets`` (running a
bucket), ``programs`` (jitted programs), ``shards`` and ``host`` (memory).
"""
