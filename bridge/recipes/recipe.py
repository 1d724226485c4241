"""A model's recipe: its rules, split over each TP group or over the engine's ranks, and its tying (pure).

The rule lists (``llama_rules``, ``qwen3_moe_rules``, ...) say how each leaf becomes params;
a ``Recipe`` bundles the lists one model needs with what applies them: which rules split
routed experts with and without expert parallelism, and whether the engine's ``lm_head``
is filled from the embedding. It is plain data (``to_data``/``from_data``), so a trainer
sends it to an engine's workers in its hello (``bridge.engines.hello``).

Example:
  >>> from bridge.recipes import Recipe
  >>> from jreshard.nn import LlamaConfig
  >>> recipe = Recipe.llama(LlamaConfig.load("llama-tiny"))
  >>> recipe.rules[0].pattern, recipe.expert_rules, recipe.tie_lm_head
  ('embed/embedding', (), False)
  >>> Recipe.from_data(recipe.to_data()) == recipe
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from bridge.plan.rules import Rule
from jreshard.core.args import check_flag

__all__ = ["Recipe"]


def _rule_to_data(rule: Rule) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(Rule):
        v = getattr(rule, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


def _rule_from_data(data: Any, where: str) -> Rule:
    if not isinstance(data, Mapping):
        raise TypeError(f"{where} must be a mapping of Rule fields, got {type(data).__name__} {data!r}.")
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(Rule)})
    if unknown:
        raise ValueError(f"{where} has fields {unknown} that Rule does not take; pass what Recipe.to_data() returns.")
    kw = dict(data)
    if isinstance(kw.get("transpose"), list):
        kw["transpose"] = tuple(kw["transpose"])
    return Rule(**kw)


@dataclasses.dataclass(frozen=True, slots=True)
class Recipe:
    """How the trainer's leaves become an engine's params: rules split over each TP group, expert rules, tying.

    Args:
      rules: rules applied over every tensor-parallel group (attention, dense MLP, norms,
        embeddings); the first rule whose pattern matches a leaf applies.
      expert_rules: rules of routed experts split over each TP group (the engine without
        expert parallelism).
      ep_expert_rules: the same experts split linearly over the engine's ranks (vLLM's
        ``enable_expert_parallel``: one row per rank, experts whole); used when the engine has
        expert parallelism.
      tie_lm_head: the engine has an ``lm_head.weight`` filled from the embedding: the embedding's
        bytes cross the wire once and each worker fills both from them (``tied``).
    """

    rules: tuple[Rule, ...]
    expert_rules: tuple[Rule, ...] = ()
    ep_expert_rules: tuple[Rule, ...] = ()
    tie_lm_head: bool = False

    def __post_init__(self) -> None:
        for what in ("rules", "expert_rules", "ep_expert_rules"):
            value = tuple(getattr(self, what))
            for r in value:
                if not isinstance(r, Rule):
                    raise TypeError(f"Recipe {what} must hold bridge.Rule, got {type(r).__name__}.")
            object.__setattr__(self, what, value)

    @classmethod
    def llama(cls, config: Any, *, vocab_pad: int = 64) -> Recipe:
        """``jreshard.nn``'s Llama/Qwen3 model as vLLM names it (fused ``qkv_proj`` and ``gate_up_proj``)."""
        from bridge.recipes.llama import llama_rules

        return cls(tuple(llama_rules(config, fused=True, vocab_pad=vocab_pad)),
                   tie_lm_head=bool(config.tie_word_embeddings))

    @classmethod
    def qwen3_moe(cls, config: Any, *, vocab_pad: int = 64, names: dict[str, str] | None = None) -> Recipe:
        """``jreshard.nn``'s Qwen3-MoE model as vLLM names it (``FusedMoE`` ``w13_weight``/``w2_weight``).

        ``names`` overrides the expert param templates (see ``bridge.recipes.qwen3_moe.expert_rules``);
        where vLLM nests the experts one module deeper the workers find them
        (``bridge.engines.hello.resolve_names``).
        """
        from bridge.recipes.qwen3_moe import expert_rules, qwen3_moe_rules

        experts = tuple(expert_rules(target="vllm", names=names))
        dense = tuple(r for r in qwen3_moe_rules(config, names=names, vocab_pad=vocab_pad) if r not in experts)
        return cls(dense, experts, tuple(expert_rules(target="vllm", names=names, ep=True)),
                   bool(config.tie_word_embeddings))

    @property
    def tied(self) -> dict[str, str]:
        """Engine params filled from another param's received tensor, not sent: ``{tied name: source name}``.

        Example:
          >>> from bridge.recipes import Recipe
          >>> from jreshard.nn import LlamaConfig
          >>> Recipe.llama(LlamaConfig.load("llama-tiny", tie_word_embeddings=True)).tied
          {'lm_head.weight': 'model.embed_tokens.weight'}
        """
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.tie_lm_head else {}

    def to_data(self) -> dict[str, Any]:
        """The recipe as JSON-ready plain data (what a trainer's hello carries)."""
        return {"rules": [_rule_to_data(r) for r in self.rules],
                "expert_rules": [_rule_to_data(r) for r in self.expert_rules],
                "ep_expert_rules": [_rule_to_data(r) for r in self.ep_expert_rules], "tie_lm_head": self.tie_lm_head}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Recipe:
        """The recipe of ``to_data``'s plain data."""
        keys = ("rules", "expert_rules", "ep_expert_rules", "tie_lm_head")
        if not isinstance(data, Mapping):
            raise TypeError(f"data must be a mapping (what Recipe.to_data() returns), got {type(data).__name__}.")
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"data lacks {missing}; pass what Recipe.to_data() returns (keys {list(keys)}).")

        def rules(key: str) -> tuple[Rule, ...]:
            if not isinstance(data[key], (list, tuple)):
                raise TypeError(f"data[{key!r}] must be a list of rules, got {type(data[key]).__name__}.")
            return tuple(_rule_from_data(r, f"data[{key!r}][{i}]") for i, r in enumerate(data[key]))

        tie = check_flag("data['tie_lm_head']", data["tie_lm_head"])
        return cls(rules("rules"), rules("expert_rules"), rules("ep_expert_rules"), tie)
