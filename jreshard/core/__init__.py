"""The pure core: meshes, layouts, plans, checks and the NumPy reference executor.

Imports numpy and ml_dtypes only; never jax, torch or a higher layer of jreshard.
"""
