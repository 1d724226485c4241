"""``jreshard plan`` prints the recorded figures for every built-in scenario (``tests/plan_figures.py``).

The cost model, the baselines and the presets work per class of tensors that share a
shape, a dtype and layouts; these figures were recorded when they worked tensor by
tensor, and must agree to the last byte and the last bit of every float.
"""

from __future__ import annotations

import json

import pytest

from tests.plan_figures import FIXTURE, cases, figures

RECORDED = json.loads(FIXTURE.read_text())


def test_every_case_is_recorded():
    assert set(RECORDED) == set(cases())
    assert all(RECORDED[name]["argv"] == argv for name, argv in cases().items())


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_figures_as_recorded(name):
    want = RECORDED[name]["figures"]
    got = json.loads(json.dumps(figures(RECORDED[name]["argv"])))
    for key in sorted(set(want) | set(got)):
        assert got.get(key) == want.get(key), f"{name}: {key}"
