"""A ``vllm serve`` server with the jreshard backend, started from Python as a child process.

For a notebook, a benchmark or a test that runs the engine server on its own host; a
deployment starts ``python -m bridge.engines.vllm.serve`` itself (see ``bridge.engines.vllm.serve``)::

    with Server([checkpoint, "--host", "127.0.0.1", "--port", "8000"], log="serve.log").wait() as server:
        sync = VLLMWeightSync(Recipe.llama(cfg), workers=1, client=HTTPClient(server.url), port=29600)

The server runs in a session of its own; ``close`` (or leaving the ``with`` block, or this
interpreter's exit) ends its whole process group: the API server, the engine core and the workers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from bridge.engines.vllm.serve import check_plugin, serve_args, serve_env

__all__ = ["Server"]

_DEFAULT_PORT = 8000  # vllm serve's
_GRACE = 30.0  # seconds from SIGTERM to SIGKILL


class Server:
    """``python -m bridge.engines.vllm.serve ARGS`` in a child process.

    Args:
      args: ``vllm serve``'s arguments, the model first; ``--host`` is required (see
        ``bridge.engines.vllm.serve.serve_args``), ``--port`` defaults to vLLM's 8000.
      env: the server's environment (default: this process's); ``VLLM_SERVER_DEV_MODE=1`` is
        added (``serve_env``).
      log: a file for the server's output (default: discarded).
      cwd: the server's working directory.

    Attributes:
      url: where the server answers, ``"http://127.0.0.1:8000"`` (a wildcard host is reached on
        127.0.0.1).
      proc: the server's ``subprocess.Popen``.

    Raises:
      TypeError, ValueError: bad ``args`` or ``env`` (the message names them); nothing is started.
      RuntimeError: this package's vLLM plugin is not installed.
    """

    def __init__(self, args: Sequence[str], *, env: dict[str, str] | None = None, log: str | Path | None = None,
                 cwd: str | Path | None = None) -> None:
        self.args = serve_args(args)
        environment = serve_env(dict(os.environ if env is None else env))
        given = list(args)  # as the caller wrote them, before serve_args added the backend's config
        self.url = f"http://{_url_host(_flag(given, '--host'))}:{_port(given)}"
        check_plugin()
        self.log = None if log is None else Path(log)
        out: IO[bytes] | int = subprocess.DEVNULL if self.log is None else open(self.log, "wb")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "bridge.engines.vllm.serve", *self.args],
                                         env=environment, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            if not isinstance(out, int):
                out.close()  # the child holds its own descriptor
        self._stop = weakref.finalize(self, _stop_group, self.proc)

    def wait(self, timeout: float = 900.0) -> Server:
        """Returns this server once ``/health`` answers 200.

        Raises:
          RuntimeError: the server exited first (the message ends with its log's tail).
          TimeoutError: no answer within ``timeout`` seconds; the server is stopped.
        """
        import requests

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {self.proc.returncode} before answering "
                                   f"{self.url}/health{self._tail()}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"vllm serve did not answer {self.url}/health within {timeout:g} s; "
                                   f"stopped it{self._tail()}")
            time.sleep(1.0)

    def close(self) -> int | None:
        """Stops the server's process group (SIGTERM, then SIGKILL after 30 s); returns its exit status."""
        self._stop()
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tail(self, chars: int = 4000) -> str:
        if self.log is None or not self.log.exists():
            return " (no log: pass log= to keep the server's output)."
        return f"; the end of its log ({self.log}):\n{self.log.read_text(errors='replace')[-chars:]}"


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL to what is left after ``_GRACE`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(_GRACE)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):  # the group's other processes (engine core, workers)
            os.killpg(proc.pid, signal.SIGKILL)
        return


def _flag(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in ``args`` (the last one given), or None."""
    value = None
    for i, a in enumerate(args):
        if a == name:
            if i + 1 >= len(args):
                raise ValueError(f"args end with {name} and no value; give it one.")
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a[len(name) + 1:]
    return value


def _port(args: list[str]) -> int:
    text = _flag(args, "--port")
    if text is None:
        return _DEFAULT_PORT
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"args give --port {text!r}; it must be a port number from 1 to 65535.")
    return int(text)


def _url_host(host: str | None) -> str:
    if host in (None, "", "0.0.0.0", "::"):  # every interface: reach it here on the loopback one
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host
