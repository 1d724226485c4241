"""Every figure ``jreshard plan`` prints, for every built-in scenario, recorded as a fixture.

``tests/data/plan_figures.json`` holds, per case, the ``--json`` report without its
timings, and digests of the direct plan's per-device send and receive bytes. The
cost model, the baselines and the presets may be made faster; these figures must not
change. The two hypothetical frontier scenarios were recorded by the same earlier code,
given the scenario and model files. After a deliberate change of the model, record them
again (``--missing``: only cases added since):

  .venv/bin/python -m tests.plan_figures [--missing]
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pathlib
import sys
from typing import Any

FIXTURE = pathlib.Path(__file__).parent / "data" / "plan_figures.json"
_TIMINGS = ("plan_seconds_cold", "plan_seconds_warm")
_KIMI_FSDP = ["--model", "kimi-k2", "--train", "fsdp=256", "--infer", "tp=8,dp=16", "--hardware", "gb200-nvl72"]
_FRONTIER_FSDP = ["--train", "fsdp=512", "--infer", "tp=8,dp=32", "--hardware", "gb200-nvl72"]


def cases() -> dict[str, list[str]]:
    """Case name -> ``jreshard plan`` arguments: every built-in scenario, then variants of flags."""
    from jreshard.fleet.scenario import scenario_names

    out = {name: [name] for name in scenario_names()}
    out.update({
        "kimi-k2 fsdp=256 -> tp=8,dp=16 gb200": _KIMI_FSDP,
        "kimi-k3 fsdp=512 -> tp=8,dp=32 gb200": ["--model", "kimi-k3-hypothetical", *_FRONTIER_FSDP],
        "qwen3.8 fsdp=512 -> tp=8,dp=32 gb200": ["--model", "qwen3.8-2.4t-a95b-hypothetical", *_FRONTIER_FSDP],
        "dsv3-dgx-h100 fp8": ["dsv3-dgx-h100", "--dtype", "float8_e4m3fn"],
        "kimi-k2-256-to-128 fp8": ["kimi-k2-256-to-128", "--dtype", "float8_e4m3fn"],
        "qwen3-30b stacked experts": ["qwen3-30b-ep8pp2-to-tp8dp2-h100", "--experts", "stacked"],
        "qwen3-30b hierarchical never": ["qwen3-30b-ep8pp2-to-tp8dp2-h100", "--hierarchical", "never"],
        "qwen3-32b-fsdp8 hierarchical always": ["qwen3-32b-fsdp8-to-tp4dp2", "--hierarchical", "always"],
        "qwen3-4b fp8 per-channel": ["qwen3-4b-dp8-to-tp8-h100", "--dtype", "float8_e4m3fn", "--fp8-block",
                                     "channel"],
        "dsv3-ep16pp8 layer 3": ["dsv3-ep16pp8-to-tp8dp16", "--layer", "3"],
    })
    return out


def _digest(d: dict[int, int]) -> str:
    return hashlib.sha256(json.dumps(sorted(d.items())).encode()).hexdigest()[:16]


def _plan_digests(argv: list[str]) -> dict[str, str]:
    """Digests of the direct plan's per-device send and receive bytes."""
    import jreshard
    from jreshard.__main__ import main  # noqa: F401  (the same import path as the CLI)
    from jreshard.fleet.scenario import load_scenario

    name, rest = (argv[0], argv[1:]) if not argv[0].startswith("--") else (None, argv)
    if name is None:
        return {}
    opts = dict(zip(rest[::2], rest[1::2], strict=True))
    s = load_scenario(name, dtype=opts.get("--dtype"), fp8_block=opts.get("--fp8-block"))
    src, dst = s.layouts(opts.get("--experts", "separate"))
    st = jreshard.plan(src, dst).stats()
    return {"send_bytes": _digest(st.send_bytes), "recv_bytes": _digest(st.recv_bytes)}


def figures(argv: list[str]) -> dict[str, Any]:
    """The figures of one case: the ``--json`` report without timings, and the plan's digests."""
    from jreshard.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["plan", *argv, "--json", "--progress", "off"])
    if rc:
        raise RuntimeError(f"jreshard plan {' '.join(argv)} exited {rc}")
    report = {k: v for k, v in json.loads(out.getvalue()).items() if k not in _TIMINGS}
    if "--layer" not in argv:
        report["plan_digests"] = _plan_digests(argv)
    return report


def main(missing: bool = False) -> None:
    """Records every case (``missing``: only the cases the fixture lacks, keeping the others)."""
    FIXTURE.parent.mkdir(exist_ok=True)
    recorded = json.loads(FIXTURE.read_text()) if missing and FIXTURE.exists() else {}
    for name, argv in cases().items():
        if name in recorded:
            continue
        print(name, file=sys.stderr)
        recorded[name] = {"argv": argv, "figures": figures(argv)}
    FIXTURE.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(missing="--missing" in sys.argv[1:])
