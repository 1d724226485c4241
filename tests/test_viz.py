"""jreshard.viz: every figure shows what the plan says (checked through the artists' gids)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import io
import pkgutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("matplotlib", reason="jreshard.viz needs the viz extra (matplotlib)")

import jreshard  # noqa: E402
import jreshard.viz as viz  # noqa: E402
from jreshard import Layout, Mesh  # noqa: E402

TRAIN = Mesh([0, 1, 2, 3], ("fsdp",))
SERVE = Mesh([[4, 5], [6, 7]], ("dp", "tp"))
SHARED = Mesh([[0, 1, 2, 3], [4, 5, 6, 7]], ("dp", "tp"))

LAYOUTS = [
    ("rows", Layout((12, 10), TRAIN, ("fsdp",), dtype="float32")),
    ("replicated-columns", Layout((12, 10), SERVE, (None, "tp"), dtype="bfloat16")),
    ("both-dims", Layout((8, 8), SERVE, ("dp", "tp"))),
    ("two-axes-one-dim", Layout((16, 4), SERVE, (("dp", "tp"),))),
    ("uneven-with-empty", Layout((3, 5), TRAIN, ("fsdp",))),
    ("vector", Layout((10,), SERVE, ("tp",))),
    ("scalar", Layout((), SERVE, ())),
    ("fully-replicated", Layout((4, 4), SERVE, ())),
]


def gids(ax, prefix):
    return [a for a in [*ax.patches, *ax.lines] if (a.get_gid() or "").startswith(prefix)]


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40)
    return buf.getvalue()


def box_xywh(layout, box):
    if len(layout.shape) == 2:
        rows, cols = box
    elif len(layout.shape) == 1:
        rows, cols = slice(0, 1), box[0]
    else:
        rows, cols = slice(0, 1), slice(0, 1)
    return (cols.start, rows.start, cols.stop - cols.start, rows.stop - rows.start)


@pytest.mark.parametrize("name,layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_draw_layout_draws_each_shard_once_with_its_replicas(name, layout):
    fig = viz.draw_layout(layout)
    ax = fig.axes[0]
    want = {}
    for group in layout.replica_groups():
        box = layout.shard_box(group[0])
        x, y, w, h = box_xywh(layout, box)
        if w > 0 and h > 0:
            want["shard:" + ",".join(map(str, group))] = (x, y, w, h)
    got = {p.get_gid(): (p.get_x(), p.get_y(), p.get_width(), p.get_height()) for p in gids(ax, "shard:")}
    assert got == want
    chips = sorted(int(p.get_gid().split(":")[1]) for p in gids(ax, "replica:"))
    replicated = [g for g in layout.replica_groups() if len(g) > 1 and f"shard:{','.join(map(str, g))}" in want]
    want_chips = sorted(d for g in replicated for d in g)
    assert chips == want_chips
    # The boxes tile the tensor: their areas add up to the global size.
    assert sum(w * h for _, _, w, h in got.values()) == max(layout.size, 1)
    assert png_bytes(fig).startswith(b"\x89PNG")


def test_draw_layout_labels_and_shared_colors():
    layout = LAYOUTS[1][1]
    colors = viz.device_colors(range(8))
    fig = viz.draw_layout(layout, colors=colors)
    ax = fig.axes[0]
    assert sorted(t.get_text() for t in ax.texts) == ["4, 6", "5, 7"]
    shard = {p.get_gid(): p for p in gids(ax, "shard:")}
    assert shard["shard:4,6"].get_facecolor()[:3] == pytest.approx(colors[4][:3])
    assert "2 replicas per shard" in ax.get_title()
    assert len(viz.draw_layout(layout, labels=False).axes[0].texts) == 0


def test_device_colors_are_distinct():
    for n in (4, 20, 64):
        colors = viz.device_colors(range(100, 100 + n))
        assert len({c for c in colors.values()}) == n


def test_draw_plan_flows_match_the_moves():
    tp = jreshard.plan(Layout((12, 10), SHARED, ("dp", None), dtype="float32"),
                       Layout((12, 10), SHARED, (None, "tp"), dtype="float32"))
    fig = viz.draw_plan(tp)
    assert len(fig.axes) == 3
    pairs = {}
    for m in tp.moves:
        pairs[(m.src, m.dst)] = pairs.get((m.src, m.dst), 0) + m.size * tp.itemsize
    network = {f"flow:{s}->{d}": b for (s, d), b in pairs.items() if s != d}
    local = {f"local:{s}" for (s, d) in pairs if s == d}
    flows = {ln.get_gid(): ln for ln in gids(fig.axes[1], "flow:")}
    assert set(flows) == set(network)
    assert {ln.get_gid() for ln in gids(fig.axes[1], "local:")} == local
    assert len(local) > 0
    # Thicker lines carry more bytes.
    order = sorted(network, key=network.get)
    widths = [flows[g].get_linewidth() for g in order]
    assert widths == sorted(widths)
    assert f"{tp.stats().moves} network moves" in fig.get_suptitle()
    firsts = {g[0] for g in tp.dst.replica_groups()}
    outlined = sorted((p.get_gid(), p.get_x(), p.get_y(), p.get_width(), p.get_height())
                      for p in gids(fig.axes[2], "move:"))
    want = sorted((f"move:{m.src}->{m.dst}", *box_xywh(tp.dst, m.box)) for m in tp.moves if m.dst in firsts and m.size)
    assert outlined == want and len(want) > 1
    assert png_bytes(fig).startswith(b"\x89PNG")


def small_pytree_plan():
    src = {"a": Layout((16, 8), TRAIN, ("fsdp",), dtype="bfloat16"),
           "b": Layout((8,), SERVE, (), dtype="float32"),
           "c": Layout((6, 6), SHARED, ("dp", "tp"), dtype="float32")}
    dst = {"a": Layout((16, 8), SHARED, (None, "tp"), dtype="bfloat16"),
           "b": Layout((8,), SHARED, ("tp",), dtype="float32"),
           "c": Layout((6, 6), SERVE, (None, "dp"), dtype="float32")}
    return jreshard.plan(src, dst)


def test_traffic_matrix_agrees_with_moves_and_stats():
    p = small_pytree_plan()
    senders, receivers, matrix = viz.traffic_matrix(p)
    assert senders == receivers == tuple(range(8))
    want = np.zeros((8, 8), np.int64)
    local = np.zeros(8, np.int64)
    for tp in p.tensors.values():
        for m in tp.moves:
            if m.is_local:
                local[m.src] += m.size * tp.itemsize
            else:
                want[m.src, m.dst] += m.size * tp.itemsize
    np.testing.assert_array_equal(matrix, want)
    s = p.stats()
    assert matrix.sum() == s.network_bytes
    assert {d: int(v) for d, v in enumerate(matrix.sum(axis=1)) if v} == s.send_bytes
    assert {d: int(v) for d, v in enumerate(matrix.sum(axis=0)) if v} == s.recv_bytes
    _, _, with_local = viz.traffic_matrix(p, include_local=True)
    np.testing.assert_array_equal(np.diag(with_local), local)
    assert local.sum() == s.local_bytes > 0


def test_traffic_matrix_of_one_tensor_plan_with_sparse_device_ids():
    a = Layout((8, 4), Mesh([10, 30], "x"), ("x",), dtype="int8")
    b = Layout((8, 4), Mesh([[7], [200]], ("x", "y")), (None, "x"))
    traffic = viz.traffic_matrix(jreshard.plan(a, b))
    assert (traffic.senders, traffic.receivers) == ((10, 30), (7, 200))
    np.testing.assert_array_equal(traffic.matrix, [[8, 8], [8, 8]])


def test_draw_traffic_sources_by_destinations_with_disjoint_domains():
    a = Layout((64, 8), Mesh(list(range(8)), "fsdp"), ("fsdp",), dtype="float32")
    b = Layout((64, 8), Mesh([[8, 9, 10, 11], [12, 13, 14, 15]], ("dp", "tp")), (None, "tp"), dtype="float32")
    tp = jreshard.plan(a, b)
    fig = viz.draw_traffic(tp, domain_size=8)
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (8, 8)
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(d) for d in range(8, 16)]
    assert gids(ax, "domain:") == []  # no sender shares a domain with a receiver
    assert "100% of bytes cross domains" in ax.get_title()
    fig4 = viz.draw_traffic(tp, domain_size=4)
    assert gids(fig4.axes[0], "domain:") == []
    fig16 = viz.draw_traffic(tp, domain_size=16)
    (same,) = gids(fig16.axes[0], "domain:")
    assert (same.get_width(), same.get_height()) == (8, 8)
    assert "0% of bytes cross domains" in fig16.axes[0].get_title()


def test_draw_traffic_shows_the_matrix_and_domains():
    p = small_pytree_plan()
    _, _, matrix = viz.traffic_matrix(p)
    fig = viz.draw_traffic(p, domain_size=4)
    ax = fig.axes[0]
    shown = ax.images[0].get_array()
    np.testing.assert_array_equal(shown.filled(0), matrix)
    assert shown.mask.sum() == (matrix == 0).sum()
    assert sorted(p.get_gid() for p in gids(ax, "domain:")) == ["domain:0", "domain:1"]
    crossing = matrix[:4, 4:].sum() + matrix[4:, :4].sum()
    assert f"{crossing / matrix.sum():.0%} of bytes cross domains" in ax.get_title()
    assert gids(viz.draw_traffic(p).axes[0], "domain:") == []
    # A topology object or mapping gives the domain size too.
    fig2 = viz.draw_traffic(p, topology={"gpus_per_domain": 2})
    assert len(gids(fig2.axes[0], "domain:")) == 4
    assert png_bytes(fig).startswith(b"\x89PNG")


def test_draw_traffic_from_a_matrix():
    m = np.array([[0, 5, 0], [1, 0, 0], [0, 0, 0]])
    fig = viz.draw_traffic(m, senders=[8, 9, 16], domain_size=8, log=False)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "9", "16"]
    assert sorted(p.get_gid() for p in gids(ax, "domain:")) == ["domain:1", "domain:2"]
    assert "0% of bytes cross" in ax.get_title()
    viz.draw_traffic(np.zeros((2, 2)))  # nothing moves: still draws
    wide = viz.draw_traffic(np.ones((2, 3)), receivers=[5, 6, 7]).axes[0]
    assert [t.get_text() for t in wide.get_xticklabels()] == ["5", "6", "7"]
    assert [t.get_text() for t in wide.get_yticklabels()] == ["0", "1"]


def test_draw_load_bars_and_means():
    p = small_pytree_plan()
    s = p.stats()
    for source in (p, s):
        fig = viz.draw_load(source)
        send_ax, recv_ax = fig.axes
        assert {int(b.get_gid()[5:]): b.get_height() for b in gids(send_ax, "send:")} == s.send_bytes
        assert {int(b.get_gid()[5:]): b.get_height() for b in gids(recv_ax, "recv:")} == s.recv_bytes
        (mean,) = gids(send_ax, "mean:send")
        assert mean.get_ydata()[0] == pytest.approx(s.mean_send_bytes)
        (mean,) = gids(recv_ax, "mean:recv")
        assert mean.get_ydata()[0] == pytest.approx(s.mean_recv_bytes)
        assert f"send max/mean {s.send_imbalance:.3f}" in fig.get_suptitle()
    assert png_bytes(fig).startswith(b"\x89PNG")
    one = viz.draw_load(p["a"])
    assert {int(b.get_gid()[5:]): b.get_height() for b in gids(one.axes[0], "send:")} == p["a"].stats().send_bytes


def test_draw_comparison_bars_and_ratios():
    nbytes = {"jreshard": 2 << 30, "flat direct sends": 2 << 30, "gather-then-broadcast": 14 << 30}
    seconds = {"jreshard": 0.5, "flat direct sends": 1.25, "gather-then-broadcast": 4.0}
    fig = viz.draw_comparison(nbytes, seconds)
    left, right = fig.axes
    assert {b.get_gid(): b.get_width() for b in gids(left, "bytes:")} == {f"bytes:{k}": v for k, v in nbytes.items()}
    want_seconds = {f"seconds:{k}": v for k, v in seconds.items()}
    assert {b.get_gid(): b.get_width() for b in gids(right, "seconds:")} == want_seconds
    texts = [t.get_text() for t in left.texts]
    assert texts == ["2.00 GiB (1.00x)", "2.00 GiB (1.00x)", "14.00 GiB (7.00x)"]
    assert [t.get_text() for t in right.texts][2] == "4.00 s (8.00x)"
    only_bytes = viz.draw_comparison(nbytes, baseline="gather-then-broadcast")
    assert len(only_bytes.axes) == 1
    assert only_bytes.axes[0].texts[0].get_text().endswith("(0.14x)")
    assert png_bytes(fig).startswith(b"\x89PNG")


def test_draw_comparison_stacks_nvlink_bytes_after_network_bytes():
    net = {"jreshard": 1 << 30, "gather-then-broadcast": 1 << 30}
    nvl = {"jreshard": 0, "gather-then-broadcast": 3 << 30}
    fig = viz.draw_comparison(net, nvlink_bytes_by_method=nvl)
    ax = fig.axes[0]
    stacked = {b.get_gid(): (b.get_x(), b.get_width()) for b in gids(ax, "nvlink:")}
    assert stacked == {"nvlink:jreshard": (1 << 30, 0), "nvlink:gather-then-broadcast": (1 << 30, 3 << 30)}
    assert [t.get_text() for t in ax.texts] == ["1.00 GiB (1.00x) + 0 B NVLink", "1.00 GiB (1.00x) + 3.00 GiB NVLink"]
    assert "NVLink" in ax.get_title()
    with pytest.raises(ValueError, match=r"nvlink_bytes_by_method names \['jreshard'\]"):
        viz.draw_comparison(net, nvlink_bytes_by_method={"jreshard": 1})


def test_draw_sweep_lines():
    x = [1, 2, 4, 8]
    nbytes = {"jreshard": [1e9, 2e9, 3e9, 4e9], "gather-then-broadcast": [8e9, 8e9, 8e9, 8e9]}
    seconds = {"jreshard": [0.1, 0.2, 0.3, 0.4], "gather-then-broadcast": [1.0, 1.0, 1.0, 1.0]}
    fig = viz.draw_sweep(x, nbytes, seconds, xlabel="inference TP", bytes_title="bytes moved")
    left, right = fig.axes
    lines = {ln.get_gid(): list(ln.get_ydata()) for ln in gids(left, "bytes:")}
    assert lines == {f"bytes:{k}": v for k, v in nbytes.items()}
    assert [t.get_text() for t in left.get_xticklabels()] == ["1", "2", "4", "8"]
    assert right.get_yscale() == "log"
    assert (left.get_title(), right.get_title()) == ("bytes moved", "predicted time")
    assert {ln.get_gid() for ln in gids(right, "seconds:")} == {"seconds:jreshard", "seconds:gather-then-broadcast"}
    assert png_bytes(fig).startswith(b"\x89PNG")


def test_plans_that_move_nothing_still_draw():
    same = Layout((4, 4), TRAIN, ("fsdp",), dtype="float32")
    tp = jreshard.plan(same, same)
    fig = viz.draw_plan(tp)
    assert gids(fig.axes[1], "flow:") == [] and len(gids(fig.axes[1], "local:")) == 4
    assert "0 network moves" in fig.get_suptitle()
    assert viz.traffic_matrix(tp)[2].sum() == 0
    assert viz.draw_traffic(tp, include_local=True).axes[0].images[0].get_array().sum() == same.nbytes
    load = viz.draw_load(tp)
    assert gids(load.axes[0], "send:") == [] and "0 devices send" in load.axes[0].get_title()
    empty = Layout((0, 4), TRAIN, ("fsdp",))
    fig = viz.draw_plan(jreshard.plan(empty, Layout((0, 4), SERVE, (None, "tp"))))
    assert gids(fig.axes[0], "shard:") == []
    for f in (fig, load):
        assert png_bytes(f).startswith(b"\x89PNG")


BIG = Layout((2, 2, 2), SERVE, ())
ERRORS = [
    ("layout-not-layout", lambda: viz.draw_layout((4, 4)), TypeError, r"layout must be a jreshard.Layout, got tuple"),
    ("layout-ndim-3", lambda: viz.draw_layout(BIG),
     ValueError, r"shape \(2, 2, 2\) \(ndim 3\); only tensors of 0, 1 or 2 dims"),
    ("plan-of-a-pytree", lambda: viz.draw_plan(small_pytree_plan()),
     TypeError, r"pass plan\[path\] for one of \['a', 'b', 'c'\]"),
    ("plan-not-plan", lambda: viz.draw_plan("moves"), TypeError, r"tplan must be a jreshard.TensorPlan, got str"),
    ("plan-ndim-3", lambda: viz.draw_plan(jreshard.plan(BIG, BIG)), ValueError, r"tplan.src has shape \(2, 2, 2\)"),
    ("traffic-not-plan", lambda: viz.traffic_matrix({"a": 1}),
     TypeError, r"plan must be a jreshard.Plan or TensorPlan, got dict"),
    ("draw-traffic-bad", lambda: viz.draw_traffic("x"),
     TypeError, r"plan must be a jreshard.Plan, TensorPlan or a matrix of bytes, got str"),
    ("traffic-not-2d", lambda: viz.draw_traffic(np.zeros(3)),
     ValueError, r"must be 2-D \(senders x receivers\), got shape \(3,\)"),
    ("traffic-negative", lambda: viz.draw_traffic(-np.ones((2, 2))), ValueError, r"finite, non-negative"),
    ("traffic-senders", lambda: viz.draw_traffic(np.ones((2, 2)), senders=[1]),
     ValueError, r"senders has 1 ids but the matrix has 2; give one id per row"),
    ("traffic-receivers", lambda: viz.draw_traffic(np.ones((2, 3)), receivers=[1]),
     ValueError, r"receivers has 1 ids but the matrix has 3; give one id per column"),
    ("domain-size-zero", lambda: viz.draw_traffic(np.ones((2, 2)), domain_size=0),
     ValueError, r"domain_size must be a positive int, got 0"),
    ("domain-both", lambda: viz.draw_traffic(np.ones((2, 2)), domain_size=2, topology={"gpus_per_domain": 2}),
     ValueError, r"either domain_size or topology"),
    ("topology-without-size", lambda: viz.draw_traffic(np.ones((2, 2)), topology=object()),
     TypeError, r"topology must have a 'gpus_per_domain'"),
    ("load-not-plan", lambda: viz.draw_load([1, 2]),
     TypeError, r"plan must be a jreshard.Plan, TensorPlan or PlanStats, got list"),
    ("comparison-empty", lambda: viz.draw_comparison({}), TypeError, r"bytes_by_method must be a non-empty mapping"),
    ("comparison-string", lambda: viz.draw_comparison({"a": "1 GB"}),
     TypeError, r"bytes_by_method\['a'\] must be a number, got str"),
    ("comparison-negative", lambda: viz.draw_comparison({"a": -1}),
     ValueError, r"bytes_by_method\['a'\] must be finite and non-negative, got -1"),
    ("comparison-nan", lambda: viz.draw_comparison({"a": 1}, {"a": float("nan")}),
     ValueError, r"seconds_by_method\['a'\] must be finite"),
    ("comparison-methods", lambda: viz.draw_comparison({"a": 1}, {"b": 1}),
     ValueError, r"seconds_by_method names \['b'\] but bytes_by_method names \['a'\]"),
    ("comparison-baseline", lambda: viz.draw_comparison({"a": 1}, baseline="z"),
     ValueError, r"baseline 'z' is not one of the methods \['a'\]"),
    ("sweep-empty-x", lambda: viz.draw_sweep([], {"a": []}), ValueError, r"x must hold at least one setting"),
    ("sweep-length", lambda: viz.draw_sweep([1, 2], {"a": [1]}),
     ValueError, r"bytes_by_method\['a'\] has 1 values but x has 2"),
    ("sweep-not-mapping", lambda: viz.draw_sweep([1], [1]), TypeError, r"bytes_by_method must be a non-empty mapping"),
    ("loop-empty", lambda: viz.draw_rl_loop([], {"train": []}), ValueError, r"rewards must be a non-empty sequence"),
    ("loop-reward-string", lambda: viz.draw_rl_loop([0.1, "x"], {"train": [1, 1]}),
     TypeError, r"rewards\[1\] must be a number, got str"),
    ("loop-reward-nan", lambda: viz.draw_rl_loop([float("nan")], {"train": [1]}),
     ValueError, r"rewards\[0\] must be finite"),
    ("loop-steps", lambda: viz.draw_rl_loop([0.1, 0.2], {"train": [1]}),
     ValueError, r"seconds_by_phase\['train'\] has 1 values but rewards has 2"),
    ("loop-during-clash", lambda: viz.draw_rl_loop([0.1], {"train": [1]}, during={"train": [1]}),
     ValueError, r"during names \['train'\], which seconds_by_phase stacks already"),
    ("loop-during-steps", lambda: viz.draw_rl_loop([0.1], {"train": [1]}, during={"pause": [1, 2]}),
     ValueError, r"during"),
    ("loop-negative-seconds", lambda: viz.draw_rl_loop([0.1], {"train": [-1]}),
     ValueError, r"seconds_by_phase\['train\[0\]'\] must be finite and non-negative"),
]


@pytest.mark.parametrize("name,fn,exc,pattern", ERRORS, ids=[c[0] for c in ERRORS])
def test_bad_input(name, fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


VIZ_MODULES = ["jreshard.viz", *(f"jreshard.viz.{m.name}" for m in pkgutil.iter_modules(viz.__path__))]


@pytest.mark.parametrize("name", VIZ_MODULES)
def test_docstring_examples_are_self_contained(name):
    # Empty globals: an example passes only if it imports what it uses.
    module = importlib.import_module(name)
    result = doctest.testmod(module, globs={}, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0


def test_draw_rl_loop_stacks_each_phase_on_the_ones_before():
    rewards = [-0.5, 0.25, 1.0]
    fig = viz.draw_rl_loop(rewards, {"generate": [1.0, 2.0, 3.0], "train": [4.0, 0.5, 0.5]}, title="t")
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_gid() == "reward"]
    assert list(line.get_ydata()) == rewards
    bars = {p.get_gid(): p for p in fig.axes[1].patches}
    assert sorted(bars) == sorted(f"seconds:{ph}:{i}" for ph in ("generate", "train") for i in range(3))
    for i, (g, t) in enumerate([(1.0, 4.0), (2.0, 0.5), (3.0, 0.5)]):
        assert (bars[f"seconds:generate:{i}"].get_y(), bars[f"seconds:generate:{i}"].get_height()) == (0.0, g)
        assert (bars[f"seconds:train:{i}"].get_y(), bars[f"seconds:train:{i}"].get_height()) == (g, t)
    assert fig.texts[0].get_text() == "t"


def test_draw_rl_loop_draws_overlapped_phases_beside_the_stack():
    fig = viz.draw_rl_loop([0.1, 0.2], {"generate": [1.0, 2.0], "train": [0.5, 0.5]},
                           during={"transfer": [0.8, 0.3], "pause": [0.1, 0.05]})
    bars = {p.get_gid(): p for p in fig.axes[1].patches}
    assert len(bars) == 8
    for i, (t, p) in enumerate([(0.8, 0.1), (0.3, 0.05)]):
        stack, transfer, pause = bars[f"seconds:train:{i}"], bars[f"seconds:transfer:{i}"], bars[f"seconds:pause:{i}"]
        assert (transfer.get_y(), transfer.get_height(), pause.get_y(), pause.get_height()) == (0.0, t, 0.0, p)
        # side by side within the step's slot: the stack, then each overlapped phase
        assert i - 0.4 == pytest.approx(stack.get_x())
        assert stack.get_x() + stack.get_width() == pytest.approx(transfer.get_x())
        assert transfer.get_x() + transfer.get_width() == pytest.approx(pause.get_x())
        assert pause.get_x() + pause.get_width() == pytest.approx(i + 0.4)
    assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == [
        "generate", "train", "transfer (overlapped)", "pause (overlapped)"]


def test_every_public_name_is_served_by_the_package():
    assert sorted(VIZ_MODULES) == ["jreshard.viz", "jreshard.viz.common", "jreshard.viz.comparisons",
                                   "jreshard.viz.layouts", "jreshard.viz.loops", "jreshard.viz.plans",
                                   "jreshard.viz.traffic"]
    for name in viz.__all__:
        value = getattr(viz, name)
        if inspect.isfunction(value) or inspect.isclass(value):
            assert value.__module__.startswith("jreshard.viz."), name
    assert viz.Color == tuple[float, float, float, float]


def test_headless_without_pyplot_and_not_imported_by_the_core():
    code = textwrap.dedent(
        """
        import sys
        import jreshard
        assert 'matplotlib' not in sys.modules, 'import jreshard loaded matplotlib'
        import jreshard.viz as viz
        from jreshard import Layout, Mesh
        tp = jreshard.plan(Layout((4, 4), Mesh([0, 1], 'x'), ('x',)), Layout((4, 4), Mesh([2, 3], 'x'), (None, 'x')))
        figs = [viz.draw_layout(tp.src), viz.draw_plan(tp), viz.draw_traffic(tp), viz.draw_load(tp),
                viz.draw_comparison({'a': 1.0}), viz.draw_sweep([1], {'a': [1.0]})]
        for fig in figs:
            fig.savefig(sys.argv[1], format='png')
        assert 'matplotlib.pyplot' not in sys.modules, 'viz used pyplot'
        print('ok', len(figs))
        """
    )
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MPLBACKEND": "Agg", "DISPLAY": ""}
        out = subprocess.run([sys.executable, "-W", "error", "-c", code, os.path.join(tmp, "f.png")],
                             capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok 6"
