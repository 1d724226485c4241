"""The JAX executor: the adapter from jax arrays and shardings to layouts, and ``transfer``.

Imports jax; used by ``jreshard.transfer`` on first access.
"""
