"""The bridge's plan layer (pure: numpy and ``jreshard.core``; no torch, no jax).

``source`` (the trainer side over source ids), ``param_map`` (params and regions), ``dims``
(named dims of a rule), ``rules`` (rules and the TP/EP param map), ``dtensor`` (DTensor params),
``fp8`` (block-FP8 param maps), ``reduce`` (the trainer-side plan over source ids),
``bridge_plan`` (``BridgePlan``: moves, pieces, messages, segments, buckets), ``key`` (what a
fingerprint covers).
"""
