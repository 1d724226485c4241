"""One decoder layer's routed experts through the cost model: jreshard vs the baselines.

``predict_layer`` takes a scenario and a layer index and predicts the sync of that
layer's routed expert weights alone (every expert's gate, up and down projection),
with the layouts the scenario gives the whole model; ``format_layer`` prints the
prediction next to the scenario's published per-layer figures
(``published.moe_layer_reshard_s`` and ``published.moe_layer_flat_direct_sends_s``)
and says where jreshard's lead comes from. See ``docs/cost_model.md``.

Example:
  >>> from jreshard.fleet.layer import predict_layer
  >>> p = predict_layer({"model": "qwen3-moe-tiny", "train": {"gpus": 8, "ep": 8},
  ...                    "infer": {"gpus": 8, "tp": 2, "dp": 4}, "hardware": "dgx-h100"}, 1)
  >>> len(p.names), p.nbytes  # 8 experts x 3 projections of 64 x 128 float32
  (24, 786432)
  >>> p.network_copies()  # the 4 engines each get the layer once: (jreshard, flat direct sends)
  (4.0, 4.0)
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import textwrap
from collections.abc import Mapping
from typing import NamedTuple

from jreshard.core.args import INT64_MAX, check_int
from jreshard.fleet.cost import Comparison, compare
from jreshard.fleet.fp8 import fp8_costs, fp8_layouts
from jreshard.fleet.presets import infer_layouts, train_layouts
from jreshard.fleet.scenario import Scenario, load_scenario

__all__ = ["LayerPrediction", "PublishedLayer", "predict_layer", "format_layer"]


class PublishedLayer(NamedTuple):
    """Per-layer figures quoted publicly for a scenario (seconds)."""

    jreshard_s: float
    flat_direct_s: float


@dataclasses.dataclass(frozen=True, slots=True)
class LayerPrediction:
    """The predicted sync of one layer's routed experts, and the published figures if any.

    ``nbytes`` is one copy of the tensors as delivered (FP8 weights and their scales under
    FP8 delivery); ``comparison`` holds jreshard (the delivery the cost model chose) and
    the baselines, each with its network and NVLink bytes.
    """

    scenario: str
    model: str
    layer: int
    names: tuple[str, ...]
    nbytes: int
    comparison: Comparison
    published: PublishedLayer | None

    @property
    def speedup(self) -> float:
        """Flat direct sends' predicted time over jreshard's."""
        return self.comparison.flat_direct.seconds / self.comparison.jreshard.seconds

    def network_copies(self) -> tuple[float, float]:
        """How many times (jreshard, flat direct sends) carry the layer over the network."""
        c = self.comparison
        return c.jreshard.network_bytes / self.nbytes, c.flat_direct.network_bytes / self.nbytes


def _published(s: Scenario) -> PublishedLayer | None:
    pub = s.published
    keys = ("moe_layer_reshard_s", "moe_layer_flat_direct_sends_s")
    if not all(isinstance(pub.get(k), numbers.Real) for k in keys):
        return None
    return PublishedLayer(float(pub[keys[0]]), float(pub[keys[1]]))


def predict_layer(scenario: Scenario | str | os.PathLike | Mapping, layer: int, *, experts: str = "separate",
                  hierarchical: str = "auto") -> LayerPrediction:
    """Predicts the sync of layer ``layer``'s routed experts under ``scenario``.

    Args:
      scenario: a ``Scenario``, or what ``load_scenario`` reads (a built-in name, a path, a dict).
      layer: the decoder layer; it must hold routed experts.
      experts: ``'separate'`` (one tensor per expert, Hugging Face names) or ``'stacked'``.
      hierarchical: as for ``cost.compare``.

    Raises:
      TypeError: ``layer`` is not an int.
      ValueError: the layer does not exist or holds no routed experts.
    """
    s = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    layer = check_int("layer", layer, minimum=-INT64_MAX - 1)
    infos = s.tensors(experts)
    with_experts = sorted({t.layer for t in infos if t.is_expert and t.layer is not None})
    if layer not in with_experts:
        where = (f"layers {with_experts[0]} to {with_experts[-1]} do; pass one of them" if with_experts
                 else "the model has none; pick a scenario with a mixture-of-experts model")
        raise ValueError(f"layer {layer} of {s.model.name} holds no routed experts; {where}.")
    # The other layers' experts change no layout of this one's: leave them out (tens of thousands of tensors).
    kept = [t for t in infos if not t.is_expert or t.layer == layer]
    src = train_layouts(kept, s.train, s.train_devices())
    dst = infer_layouts(kept, s.infer, s.infer_devices())
    moe = [t for t in kept if t.is_expert]
    src = {t.name: src[t.name] for t in moe}
    dst = {t.name: dst[t.name] for t in moe}
    fp8 = None
    if s.fp8 is not None:
        src, dst = fp8_layouts(moe, src, dst, s.fp8)
        fp8 = fp8_costs(moe, src, s.fp8, s.topology())[0]
    names = tuple(src)
    comparison = compare(src, dst, s.topology(), hierarchical=hierarchical, fp8=fp8)
    return LayerPrediction(s.name, s.model.name, int(layer), names, sum(dst[n].nbytes for n in names), comparison,
                           _published(s))


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f} ms"


def format_layer(p: LayerPrediction) -> str:
    """The prediction as a table next to the published figures, and what explains the difference.

    Its gather-then-broadcast row is the baseline as RL stacks run it (through one training
    rank); the ideal pipelined tree, a bound, is in ``p.comparison.pipelined_tree``.
    """
    c, pub = p.comparison, p.published
    rows = [("", "predicted", "published"),
            (f"jreshard ({c.delivery})", _ms(c.jreshard.seconds), _ms(pub.jreshard_s if pub else None)),
            ("flat direct sends", _ms(c.flat_direct.seconds), _ms(pub.flat_direct_s if pub else None)),
            ("speed-up", f"{p.speedup:.1f}x", f"{pub.flat_direct_s / pub.jreshard_s:.1f}x" if pub else "-"),
            ("gather-then-broadcast", _ms(c.gather_broadcast.seconds), "-")]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    table = [f"{r[0]:<{width[0]}}  {r[1]:>{width[1]}}  {r[2]:>{width[2]}}" for r in rows]
    ours, flat = p.network_copies()
    head = (f"{p.model} layer {p.layer}, routed experts on {p.scenario}: {len(p.names):,} tensors, "
            f"{p.nbytes / 1e9:,.2f} GB")
    how = ("once per NVLink domain that holds replicas, then over NVLink inside it" if c.delivery == "hierarchical"
           else "each piece from the least loaded of its holders")
    why = (f"Flat direct sends carry the layer over the network {flat:.1f} times (each piece from its first "
           f"holder to every inference replica) and jreshard {ours:.1f} times ({c.delivery} delivery: {how}), so "
           f"the busiest sending NIC carries {c.flat_direct.max_network_out_bytes / 1e9:,.2f} GB instead of "
           f"{c.jreshard.max_network_out_bytes / 1e9:,.2f} GB.")
    return "\n".join([head, *table, *textwrap.wrap(why, 100)])
