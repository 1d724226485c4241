"""Pictures of layouts and plans (matplotlib, the ``viz`` extra).

Import it explicitly (``import jreshard.viz``); ``import jreshard`` never loads
matplotlib. Every function returns a ``matplotlib.figure.Figure`` built without
pyplot, so it works headless (Agg), keeps no global figure state, and displays as
a notebook cell's value; ``fig.savefig(path)`` writes it to a file. The artists
carry matplotlib gids (``'shard:0,2'``, ``'flow:0->4'``) that say what they show.

Modules, by what they draw:

- ``layouts``: one layout (``draw_layout``);
- ``plans``: one tensor's plan between two layouts (``draw_plan``);
- ``traffic``: who sends how much to whom (``traffic_matrix``, ``draw_traffic``, ``draw_load``);
- ``comparisons``: methods compared from plain numbers (``draw_comparison``, ``draw_sweep``);
- ``loops``: a training loop step by step, its reward and its time per phase (``draw_rl_loop``);
- ``common``: device colours (``device_colors``) and what the drawings share.

Example:
  >>> import jreshard, jreshard.viz
  >>> mesh = jreshard.Mesh([[0, 1], [2, 3]], ("dp", "tp"))
  >>> fig = jreshard.viz.draw_layout(jreshard.Layout((8, 8), mesh, (None, "tp")))
  >>> sorted(p.get_gid() for p in fig.axes[0].patches if p.get_gid().startswith("shard"))
  ['shard:0,2', 'shard:1,3']
"""

from __future__ import annotations

from jreshard.viz.common import Color, device_colors
from jreshard.viz.comparisons import draw_comparison, draw_sweep
from jreshard.viz.layouts import draw_layout
from jreshard.viz.loops import draw_rl_loop
from jreshard.viz.plans import draw_plan
from jreshard.viz.traffic import Traffic, draw_load, draw_traffic, traffic_matrix

__all__ = [
    "Color",
    "Traffic",
    "device_colors",
    "draw_comparison",
    "draw_layout",
    "draw_load",
    "draw_plan",
    "draw_rl_loop",
    "draw_sweep",
    "draw_traffic",
    "traffic_matrix",
]
