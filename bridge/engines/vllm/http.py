"""The weight-sync client of a ``vllm serve`` server over HTTP: vLLM's own client, plus pausing and the version.

vLLM's ``HTTPVLLMWeightSyncClient`` posts the four phases to the server's RL routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``; ``vllm serve`` mounts them with ``VLLM_SERVER_DEV_MODE=1``, see
``bridge.engines.vllm.serve``). ``HTTPClient`` is that client with what the trainer side also uses:
``pause_generation``/``resume_generation`` (``/pause``, ``/resume``: ``VLLMWeightSync`` pauses the
server during an update when its client can), ``get_weight_version`` (``/weight_info``), and
errors that carry the server's answer. The init info it posts holds the job's secret: use it on a
private network or over HTTPS.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

__all__ = ["PAUSE_MODES", "HTTPClient"]

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's /pause modes


class HTTPClient(HTTPVLLMWeightSyncClient):
    """Drives a ``vllm serve`` server's weight sync over HTTP (its RL routes, in development mode).

    Args:
      base_url: the server, ``"http://10.0.0.2:8000"``.
      timeout: seconds each call may take. A phase returns when every worker finished it: the init
        returns once every trainer and worker joined the sync group, ``update_weights`` once the
        weights are in; give more than the sync's ``ready_timeout`` and ``timeout`` together.
      pause_mode: how ``/pause`` treats requests in flight during an update (vLLM's modes:
        ``"abort"`` them, its default; ``"wait"`` for them; ``"keep"`` them frozen and go on with the
        new weights), or None not to pause.

    Raises:
      TypeError, ValueError: a bad argument (the message names it).

    Example (trainer rank 0)::

        sync = VLLMWeightSync(Recipe.llama(cfg), workers=2, client=HTTPClient("http://10.0.0.2:8000"),
                              host="10.0.0.1", port=29600)
    """

    def __init__(self, base_url: str, timeout: float = 900.0, pause_mode: str | None = "abort") -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be the server's URL, such as 'http://10.0.0.2:8000', got {base_url!r}.")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES} or None, got {pause_mode!r}.")
        super().__init__(base_url, timeout=float(timeout))
        self.pause_mode = pause_mode

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        import requests

        url = f"{self.base_url}/{path}"
        response = requests.request(method, url, timeout=self.timeout, **kw)
        if not response.ok:
            raise RuntimeError(f"{method} {url} failed with HTTP {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else None

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        self._request("POST", path, json=json)

    def pause_generation(self) -> None:
        """Pauses generation (``/pause`` with ``pause_mode``; nothing when it is None)."""
        if self.pause_mode is not None:
            self._request("POST", "pause", params={"mode": self.pause_mode})

    def resume_generation(self) -> None:
        """Resumes generation (``/resume``; nothing when ``pause_mode`` is None)."""
        if self.pause_mode is not None:
            self._request("POST", "resume")

    def get_weight_version(self) -> str:
        """The version the server serves (``/weight_info``; set by ``finish_weight_update``)."""
        return str(self._request("GET", "weight_info")["weight_version"])
