"""Qwen3-MoE (``jreshard.nn``'s flax MoE model) to vLLM ``FusedMoE`` or Hugging Face names, TP and EP.

The routed experts of a sparse layer become, per rank, vLLM's ``FusedMoE`` params
``w13_weight [E_local, 2*I/tp, H]`` (this rank's gate rows, then its up rows) and
``w2_weight [E_local, H, I/tp]``, or ``transformers`` 5.x's ``mlp.experts.gate_up_proj
[E_local, 2*I/tp, H]`` and ``mlp.experts.down_proj [E_local, H, I/tp]`` (the same split);
the router ``mlp.gate.weight [E, H]`` is replicated. Experts are placed linearly: rank
``r`` of ``ep`` holds experts ``[r*E/ep, (r+1)*E/ep)``, each split over ``tp``. The
trainer may keep the experts stacked (``layers_{i}/mlp/experts/gate_proj [E, H, I]``,
as ``jreshard.nn`` does) or one leaf per expert
(``layers_{i}/mlp/experts_{j}/gate_proj/kernel [H, I]``). Attention, norms, embeddings,
dense MLP layers and the shared expert follow ``llama_rules``.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from typing import TYPE_CHECKING, Any

from bridge.plan.param_map import ParamMap
from bridge.plan.rules import Rule, tp_param_map
from bridge.plan.source import SOURCE_BASE, Source
from bridge.recipes.llama import llama_rules, tie_lm_head
from jreshard.core.args import check_flag, check_int
from jreshard.core.degrees import InferParallel, rank_grid
from jreshard.core.tp_split import TP_DIMS

if TYPE_CHECKING:
    from jreshard.nn.config import MoeConfig

__all__ = ["VLLM_NAMES", "HF_NAMES", "expert_rules", "qwen3_moe_rules", "qwen3_moe_param_map"]

# Param name templates; ``{layer}`` is the decoder layer.
VLLM_NAMES = {
    "w13": "model.layers.{layer}.mlp.experts.w13_weight",
    "w2": "model.layers.{layer}.mlp.experts.w2_weight",
    "router": "model.layers.{layer}.mlp.gate.weight",
}
HF_NAMES = {
    "w13": "model.layers.{layer}.mlp.experts.gate_up_proj",
    "w2": "model.layers.{layer}.mlp.experts.down_proj",
    "router": "model.layers.{layer}.mlp.gate.weight",
}
_LAYER = r"layers_(?P<layer>\d+)/mlp"


def _names(target: str, names: dict[str, str] | None) -> dict[str, str]:
    if target not in ("vllm", "hf"):
        raise ValueError(f"target must be 'vllm' (FusedMoE names) or 'hf' (transformers names), got {target!r}.")
    out = dict(VLLM_NAMES if target == "vllm" else HF_NAMES)
    for key, template in (names or {}).items():
        if key not in out:
            raise ValueError(f"names has key {key!r}; give templates for {sorted(out)}.")
        if not isinstance(template, str) or "{layer}" not in template:
            raise ValueError(f"names[{key!r}] must be a str with '{{layer}}' in it, got {template!r}.")
        out[key] = template
    return out


def _splits_experts(ep: Any) -> bool:
    """``ep`` as a flag: True/False (numpy bools too), or an expert-parallel degree that splits when above 1."""
    if isinstance(ep, bool) or type(ep).__module__ == "numpy" and type(ep).__name__ in ("bool", "bool_"):
        return check_flag("ep", ep)
    if isinstance(ep, numbers.Integral):
        return check_int("ep", ep, minimum=1) > 1
    raise TypeError(f"ep must be True, False or an expert-parallel degree (an int), got {type(ep).__name__} {ep!r}.")


def expert_rules(*, target: str = "vllm", names: dict[str, str] | None = None, ep: bool = False,
                 prefix: str = _LAYER) -> list[Rule]:
    """Rules for the routed experts and the router of every sparse layer.

    Args:
      target: ``"vllm"`` (``FusedMoE``'s ``w13_weight``/``w2_weight``) or ``"hf"``
        (``gate_up_proj``/``down_proj``): the same layout, other names.
      names: param name templates overriding the target's, keyed ``w13``, ``w2``, ``router``
        (``{layer}`` is the layer), e.g. ``{"w13": "model.layers.{layer}.mlp.experts.routed_experts.w13_weight"}``.
      ep: split the experts over the rows of the rank grid (expert parallelism): ``True``, or a
        degree above 1 (an int, numpy ints too; 1 and ``False`` keep every expert on each row).
      prefix: the regular expression of a layer's MLP path, with a group ``(?P<layer>...)``.
    """
    n = _names(target, names)
    ep_dim = "e" if _splits_experts(ep) else None
    rules = []
    for part, x in enumerate(("gate", "up")):  # [E, H, I] -> [E, I, H], this rank's gate rows then its up rows
        rules += [Rule(rf"{prefix}/experts/{x}_proj", n["w13"], dims="e h i -> e i h", dim="i",
                       ep_dim=ep_dim, part=part),
                  Rule(rf"{prefix}/experts_(?P<expert>\d+)/{x}_proj/kernel", n["w13"], dims="h i -> e i h",
                       dim="i", ep_dim=ep_dim, at="{expert}", part=part)]
    rules += [
        Rule(rf"{prefix}/experts/down_proj", n["w2"], dims="e i h -> e h i", dim="i", ep_dim=ep_dim),
        Rule(rf"{prefix}/experts_(?P<expert>\d+)/down_proj/kernel", n["w2"], dims="i h -> e h i", dim="i",
             ep_dim=ep_dim, at="{expert}"),
        Rule(rf"{prefix}/router/kernel", n["router"], transpose=True),
    ]
    return rules


def _shared_expert_rules(fused: bool) -> list[Rule]:
    """The shared expert (DeepSeek-V3) as a dense MLP, in vLLM's Qwen2-MoE names."""
    L, q = r"layers_(\d+)/mlp/shared_expert", "model.layers.{1}.mlp.shared_expert"
    col, row = TP_DIMS["column"], TP_DIMS["row"]
    if fused:
        up = [Rule(rf"{L}/{x}_proj/kernel", f"{q}.gate_up_proj.weight", transpose=True, dim=col, part=i)
              for i, x in enumerate(("gate", "up"))]
    else:
        up = [Rule(rf"{L}/(gate|up)_proj/kernel", q + ".{2}_proj.weight", transpose=True, dim=col)]
    return [*up, Rule(rf"{L}/down_proj/kernel", f"{q}.down_proj.weight", transpose=True, dim=row)]


def qwen3_moe_rules(config: MoeConfig, *, target: str = "vllm", names: dict[str, str] | None = None,
                    fused: bool | None = None, vocab_pad: int = 64, ep: bool = False) -> list[Rule]:
    """Every rule of the flax MoE model: ``llama_rules`` for the dense parts, then ``expert_rules``.

    ``fused`` (default: ``target == "vllm"``) fuses q/k/v and the dense gate/up as vLLM does.
    """
    fused = target == "vllm" if fused is None else fused
    return [*llama_rules(config, fused=fused, vocab_pad=vocab_pad), *_shared_expert_rules(fused),
            *expert_rules(target=target, names=names, ep=ep)]


def qwen3_moe_param_map(config: MoeConfig, source: Source, tp_ranks: Any, *, ep: int = 1, target: str = "vllm",
                        names: dict[str, str] | None = None, fused: bool | None = None, vocab_pad: int = 64,
                        dtype: Any = "float32") -> ParamMap:
    """The ready param map for ``jreshard.nn``'s MoE model on TP (and EP) ranks.

    Args:
      tp_ranks: as in ``llama_param_map``: one TP group, or one per replica (attention is
        tensor parallel within each).
      ep: the expert-parallel degree. ``1``: experts are split like the attention, over each
        TP group. Above 1: every rank of ``tp_ranks``, in order, reshaped to ``[ep, -1]``; row
        ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``, each split over its row (TP inside
        experts). vLLM's ``enable_expert_parallel`` on TP2 is ``tp_ranks=[0, 1], ep=2``.
      target, names, fused, vocab_pad: as in ``qwen3_moe_rules``.

    Example:
      >>> from jreshard.nn import MoeConfig, param_shapes, fsdp_spec
      >>> from bridge import Source, trainer_mesh
      >>> from bridge.recipes.qwen3_moe import qwen3_moe_param_map
      >>> cfg = MoeConfig.load("qwen3-moe-tiny")
      >>> src = Source.build(param_shapes(cfg), trainer_mesh((4,), "fsdp", [0, 1], 2), fsdp_spec)
      >>> m = qwen3_moe_param_map(cfg, src, [[2, 3], [4, 5]], ep=2)
      >>> w13 = m.for_rank(5)[[p.name for p in m.for_rank(5)].index("model.layers.0.mlp.experts.w13_weight")]
      >>> w13.shape == (cfg.num_experts // 2, cfg.moe_intermediate_size, cfg.hidden_size)
      True
    """
    ep = check_int("ep", ep, minimum=1)  # the expert-parallel degree
    fused = target == "vllm" if fused is None else fused
    dense = [*llama_rules(config, fused=fused, vocab_pad=vocab_pad), *_shared_expert_rules(fused)]
    experts = expert_rules(target=target, names=names, ep=ep > 1)
    unmatched = [path for path in source.paths
                 if not any(re.fullmatch(r.pattern, path) for r in (*dense, *experts))]
    if unmatched:
        raise ValueError(f"trainer leaves {unmatched[:3]} match no rule of the MoE recipe; is this the "
                         "jreshard.nn MoE model's tree?")
    grid = rank_grid(tp_ranks, "tp_ranks", below=SOURCE_BASE)
    if grid.size % ep:
        raise ValueError(f"ep={ep} does not divide the {grid.size} inference ranks of tp_ranks; "
                         "give an expert-parallel degree dividing them.")
    par = InferParallel.of_grid(grid)
    if ep > 1:
        par = dataclasses.replace(par, ep=ep, expert_tp=grid.size // ep)
    expert_grid = par.expert_groups(grid.ravel()).tolist()
    param_map = tp_param_map(source, dense, tp_ranks, dtype=dtype, strict=False)
    if any(re.fullmatch(r.pattern, path) for path in source.paths for r in experts):  # a model with sparse layers
        param_map = param_map + tp_param_map(source, experts, expert_grid, dtype=dtype, strict=False)
    return tie_lm_head(param_map) if config.tie_word_embeddings else param_map
