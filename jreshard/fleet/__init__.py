"""The fleet layer: model catalog, parallelism presets, scenarios and the cost model.

Pure (numpy only); builds on the core.
"""
