"""Model recipes: rule lists from a trainer's leaf names to an inference engine's params.

Each recipe is pure (it reads a config's sizes, never imports jax or torch) and
returns ``bridge.Rule`` lists or ready ``bridge.ParamMap``s; the mechanism that
plans and sends them lives in ``bridge`` itself. ``llama``: the flax Llama/Qwen3 of
``jreshard.nn``; ``qwen3_moe``: its MoE model (vLLM ``FusedMoE`` or transformers names,
TP and EP); ``maxtext``: a MaxText-style scanned tree; ``Recipe``: the rule lists one model
needs, as plain data a trainer sends to an engine's workers (``bridge.engines``).
"""

from __future__ import annotations

from bridge.recipes.llama import llama_param_map, llama_rules
from bridge.recipes.maxtext import maxtext_param_map, maxtext_rules, maxtext_shapes
from bridge.recipes.qwen3_moe import expert_rules, qwen3_moe_param_map, qwen3_moe_rules
from bridge.recipes.recipe import Recipe

__all__ = ["Recipe", "expert_rules", "llama_param_map", "llama_rules", "maxtext_param_map", "maxtext_rules",
           "maxtext_shapes", "qwen3_moe_param_map", "qwen3_moe_rules"]
