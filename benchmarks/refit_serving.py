"""Refit while serving: a ``vllm serve`` server generating under load while jreshard syncs into it.

Used by ``benchmarks/vllm_bench.py --serve`` (the server must run with ``--enable-scale-out``, for
``/inference/v1/generate``). A thread keeps one streamed greedy request of 4 prompts in flight at all
times and stamps every token it receives. Then, with nothing else running: tokens per second while the
server is idle of syncs, and during syncs with ``VLLMWeightSync(pause="sync")`` (generation pauses for
the whole sync) and ``pause="commit"`` (it pauses only for the commit; vLLM's ``"keep"`` pause, so the
requests in flight go on). For each: the pause (``SyncReport.pause_seconds``) over the whole sync.
Goal: with ``pause="commit"``, pause / sync <= 0.25.
"""

from __future__ import annotations

import bisect
import statistics
import threading
import time
from typing import Any

PROMPTS = [[1, 2, 3, 4], [17, 400, 9], [5, 6, 7], [499, 0, 311]]
TOKENS = 200  # per prompt and request


class Load:
    """Keeps one streamed request in flight on ``url`` and records when each token arrived."""

    def __init__(self, url: str) -> None:
        self.url, self.stamps, self.errors = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from tests.vllm._live import stream_tokens

        while not self._stop.is_set():
            for prompt in PROMPTS:
                try:
                    for chunk in stream_tokens(self.url, prompt, TOKENS):
                        n = sum(len(c.get("token_ids") or []) for c in chunk["choices"])
                        self.stamps.extend([time.perf_counter()] * n)
                except Exception as e:  # counted, shown in the summary
                    self.errors.append(f"{type(e).__name__}: {e}")
                if self._stop.is_set():
                    break

    def rate(self, t0: float, t1: float) -> float:
        """Tokens per second that arrived in ``[t0, t1)``."""
        return (bisect.bisect_left(self.stamps, t1) - bisect.bisect_left(self.stamps, t0)) / (t1 - t0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)


def measure(url: str, make_sync: Any, params: Any, reps: int, idle_seconds: float = 3.0) -> dict[str, Any]:
    """Tokens/s idle and during ``reps`` syncs per pause mode, and each mode's pause / sync (medians).

    ``make_sync(pause)`` returns a connected-on-first-use ``VLLMWeightSync`` with that ``pause`` and an
    ``HTTPClient(url, pause_mode="keep")``; versions continue from 100."""
    load = Load(url)
    out: dict[str, Any] = {}
    try:
        time.sleep(1.0)  # the first request under way
        t0 = time.perf_counter()
        time.sleep(idle_seconds)
        out["idle"] = load.rate(t0, time.perf_counter())
        version = 100
        for pause in ("sync", "commit"):
            sync = make_sync(pause)
            sync.sync(params, version)  # the group, hellos and plan
            version += 1
            rows = []
            for _ in range(reps):
                time.sleep(0.5)
                t0 = time.perf_counter()
                report = sync.sync(params, version)
                t1 = time.perf_counter()
                version += 1
                workers = [report.seconds[r] for r in sorted(report.bytes_received)]
                rows.append({"rate": load.rate(t0, t1), "sync": report.sync_seconds,
                             "pause": report.pause_seconds or 0.0, "send": report.seconds[0]["send"],
                             "pack": report.seconds[0].get("pack", 0.0),
                             "receive": max(w["receive"] for w in workers),
                             "commit": max(w["commit"] for w in workers)})
            sync.close()
            out[pause] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    finally:
        load.stop()
    out["errors"] = load.errors
    return out


def show(result: dict[str, Any], reps: int) -> None:
    idle = result["idle"]
    print(f"\nRefit while serving (vllm serve, one streamed request of {TOKENS} tokens always in flight; "
          f"medians of {reps} syncs): idle {idle:.0f} tokens/s")
    print(f"{'pause':<10}{'sync s':>8}{'paused s':>10}{'paused / sync':>15}{'tokens/s in sync':>18}{'/ idle':>8}"
          f"{'send (pack) s':>16}{'receive s':>11}{'commit s':>10}")
    for pause in ("sync", "commit"):
        row = result[pause]
        print(f"{pause:<10}{row['sync']:>8.3f}{row['pause']:>10.3f}{row['pause'] / row['sync']:>15.2f}"
              f"{row['rate']:>18.0f}{row['rate'] / idle:>8.2f}{row['send']:>9.3f} ({row['pack']:.3f})"
              f"{row['receive']:>11.3f}{row['commit']:>10.3f}")
    print("(send: trainer rank 0's Sender.sync, of which pack; receive, commit: the slower worker's)")
    print(f"goal: pause='commit' paused / sync <= 0.25: {result['commit']['pause'] / result['commit']['sync'] <= 0.25}"
          f"; request errors: {len(result['errors'])} {result['errors'][:2]}")
