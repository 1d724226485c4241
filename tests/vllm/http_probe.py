"""Asks a ``vllm serve`` server something from inside a node of the simulated cluster; prints JSON.

``tests/vllm/test_cluster_live.py`` runs it in the server's node (the test's own process cannot
reach the nodes' addresses): ``http_probe.py health URL SECONDS`` (waits until ``/health`` answers),
``http_probe.py generate URL MODEL PROMPTS MAX_TOKENS`` (greedy tokens and log-probabilities from
``/v1/completions``; PROMPTS as JSON), ``http_probe.py version URL`` (``/weight_info``).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import requests

    op, url, *rest = sys.argv[1:]
    if op == "health":
        deadline = time.monotonic() + float(rest[0])
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=5).ok:
                    print(json.dumps(True))
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        sys.exit(f"{url}/health did not answer within {rest[0]} s")
    elif op == "generate":
        from tests.vllm._live import completions

        print(json.dumps(completions(url, rest[0], json.loads(rest[1]), int(rest[2]))))
    elif op == "version":
        print(json.dumps(str(requests.get(f"{url}/weight_info", timeout=60).json()["weight_version"])))
    else:
        sys.exit(f"unknown op {op!r}: health, generate or version")


if __name__ == "__main__":
    main()
