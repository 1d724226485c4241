"""Model recipes: rule lists from a trainer's leaf names to an inference engine's params.

Each recipe is pure (it reads a config's sizes, never imports jax or torch) and
returns ``bridge.Rule`` lists or ready ``bridge.ParamMap``s; the mechanism that
plans and sends them lives in ``bridge`` itself.
"""

from __future__ import annotations

from bridge.recipes.llama import llama_param_map, llama_rules

__all__ = ["llama_param_map", "llama_rules"]
