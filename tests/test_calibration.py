"""Predictions against published measurements: each published figure stays in its band (docs/cost_model.md).

Figures are predicted in the dtype they were measured in. The goal band is 0.7-1.3; where the
model cannot meet it without fitting, the band pins today's ratio (+-15%) so that a drift shows,
and docs/cost_model.md ("Calibration") says why.
"""

from __future__ import annotations

import functools

import pytest

from jreshard.fleet import calibration, cost, scenario

GOAL = calibration.BAND
BANDS = {  # (scenario, method): (low, high) of predicted / published
    ("dsv3-dgx-h100", "jreshard"): GOAL,
    ("dsv3-ep16pp8-to-tp8dp16", "jreshard"): GOAL,
    ("kimi-k2-256-to-128", "jreshard"): GOAL,
    # Not met (docs): one NIC per broadcast hop where NCCL spreads a broadcast over several rails.
    ("dsv3-dgx-h100", "gather_broadcast"): (1.45, 2.0),
    ("dsv3-pp16ep16-to-tp32dp8-h100", "gather_broadcast"): (1.5, 2.05),
    # Not met (docs): the published reshards pay per-parameter calls and fixed costs the model does not charge.
    ("dsv3-pp16ep16-to-tp32dp8-h100", "jreshard"): (0.34, 0.46),
    ("qwen3-30b-ep8pp2-to-tp8dp2-h100", "jreshard"): (0.18, 0.25),
    ("qwen3-4b-dp8-to-tp8-h100", "jreshard"): (0.08, 0.12),
    ("qwen3-235b-tp2cp2ep16pp4-to-tp8dp8", "jreshard"): (0.22, 0.3),
    ("dsv3-ep16pp8-to-tp8dp16", "flat_direct"): (1.38, 1.88),
    ("qwen3-235b-tp2cp2ep16pp4-to-tp8dp8", "flat_direct"): (0.55, 0.75),
}


@functools.cache
def _predicted(name: str) -> dict[str, float]:
    s = scenario.load_scenario(name)
    s = scenario.load_scenario(name, dtype=s.published.get("dtype"))  # as measured
    src, dst = s.layouts()
    fp8 = s.fp8_costs()
    return cost.compare(src, dst, s.topology(), fp8=fp8[0] if fp8 else None).seconds()


def test_every_published_figure_has_a_band():
    published = {(n, m) for n in scenario.scenario_names()
                 for m in calibration.published(scenario.load_scenario(n).published)}
    assert published == set(BANDS)


@pytest.mark.parametrize(("name", "method"), sorted(BANDS))
def test_published_figure_stays_in_its_band(name, method):
    fig = calibration.published(scenario.load_scenario(name).published)[method]
    r = calibration.ratio(_predicted(name)[method], fig)
    lo, hi = BANDS[(name, method)]
    assert lo <= r <= hi, f"{name} {method}: predicted / published {r:.2f} left its band {lo}-{hi}"


@pytest.mark.parametrize("name", sorted({n for n, _ in BANDS}))
def test_ranking_of_published_methods(name):
    figs = calibration.published(scenario.load_scenario(name).published)
    pred = _predicted(name)
    by_published = sorted(figs, key=lambda m: figs[m].low)
    assert by_published == sorted(figs, key=lambda m: pred[m])


def test_published_parsing_errors():
    with pytest.raises(ValueError, match="names no method"):
        calibration.Published.parse("fast_s", 1.0)
    with pytest.raises(ValueError, match=r"\[low, high\] range"):
        calibration.Published.parse("reshard_s", [1, 2, 3])
