"""A simulated cluster on one machine: nodes as Linux network namespaces joined by shaped links.

Each node is a network namespace ``<prefix>-node<K>`` with its loopback up and one veth
link ``eth0`` (address ``10.213.0.<K+1>/24``) to a bridge ``br0`` in a namespace of its
own (``<prefix>-sw``). ``tc`` shapes every node link in both directions: a token bucket
(``tbf``) at ``rate_mbit`` on the node's side and on the switch's side, and, where the
kernel has ``sch_netem``, half of ``latency_ms`` of delay on each side (one way, node to
node). Processes of one node talk over its loopback (the fast "NVLink"), processes of
different nodes over the shaped links (the "network").

Only namespaces and addresses the harness creates are used; nothing is added to the
machine's own namespace. ``ip netns exec`` reads ``/etc/netns/<namespace>/hosts`` in place
of ``/etc/hosts``, so inside a node the machine's host name resolves to the node's
address (gloo, in JAX and torch, advertises the address of the host name). Everything is
removed on exit: ``Cluster`` is a context manager and also tears down from ``atexit`` and
on SIGINT/SIGTERM/SIGHUP; ``python benchmarks/cluster.py --cleanup`` removes what a killed
run left behind.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable()`` says why a cluster cannot be
built, and the benchmarks then fall back to loopback.

Usage:
  python benchmarks/cluster.py [--nodes 2 --rate-mbit 400 --latency-ms 1 --seconds 1]
  python benchmarks/cluster.py --cleanup [--all]

Example (as root, from the repository root; ``tests/test_cluster.py`` runs the same):
  >>> import sys; sys.path.insert(0, "benchmarks")
  >>> from cluster import Cluster, stream_rate
  >>> with Cluster(2, rate_mbit=400) as c:  # doctest: +SKIP
  ...     out = c.run(1, ["ip", "-br", "addr", "show", "eth0"], capture_output=True, text=True).stdout
  ...     print(out.split()[2], stream_rate(c, 0, 1) * 8 / 1e6 < 400)
  10.213.0.2/24 True
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

SUBNET = "10.213.0"
NETNS_ETC = "/etc/netns"
_PREFIX_RE = re.compile(r"^jrs-(\d+)-")
_LIVE: list[Cluster] = []


def unavailable() -> str | None:
    """Why namespaces cannot be created here (not root, no ``ip``/``tc``), or ``None`` when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    return None


def _sh(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", "netns", "exec", ns, *argv] if ns else list(argv)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netem_available(ns: str) -> bool:
    """Whether the kernel has the ``netem`` qdisc (delay), probed on the loopback of namespace ``ns``."""
    ok = _sh("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms", ns=ns, check=False).returncode == 0
    if ok:
        _sh("tc", "qdisc", "del", "dev", "lo", "root", ns=ns, check=False)
    return ok


@dataclasses.dataclass(frozen=True, slots=True)
class LinkShape:
    """A node link: ``rate_mbit`` per direction, ``latency_ms`` one way between two nodes."""

    rate_mbit: float = 400.0
    latency_ms: float = 1.0

    def __post_init__(self) -> None:
        for name in ("rate_mbit", "latency_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a number, got {type(v).__name__}.")
        if not self.rate_mbit > 0 or not self.latency_ms >= 0:
            raise ValueError(f"rate_mbit must be > 0 and latency_ms >= 0, got {self.rate_mbit!r} and "
                             f"{self.latency_ms!r}.")


class Cluster:
    """``nodes`` network namespaces joined by shaped veth links to one bridge.

    Args:
      nodes: how many nodes (1 to 250).
      rate_mbit, latency_ms: the shape of every node link (``LinkShape``).
      prefix: namespace name prefix (default ``jrs-<pid>``; ``--cleanup`` recognises it).

    ``latency_shaped`` tells whether the delay could be applied (the kernel may lack netem).
    """

    def __init__(self, nodes: int, *, rate_mbit: float = 400.0, latency_ms: float = 1.0,
                 prefix: str | None = None) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int):
            raise TypeError(f"nodes must be an int, got {type(nodes).__name__}.")
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be between 1 and 250, got {nodes}.")
        self.nodes = nodes
        self.shape = LinkShape(rate_mbit, latency_ms)
        self.prefix = prefix or f"jrs-{os.getpid()}"
        self.latency_shaped = False
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, Any] = {}

    def ns(self, node: int) -> str:
        """The namespace name of ``node``."""
        return f"{self.prefix}-node{node}"

    @staticmethod
    def addr(node: int) -> str:
        """The address of ``node`` on the simulated network."""
        return f"{SUBNET}.{node + 1}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    # ------------------------------------------------------------------ set-up and teardown
    def up(self) -> Cluster:
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot build a simulated cluster: {reason}.")
        _LIVE.append(self)
        self._trap_signals()
        try:
            self._add_ns(self.switch)
            _sh("ip", "link", "add", "br0", "type", "bridge", ns=self.switch)
            _sh("ip", "link", "set", "br0", "up", ns=self.switch)
            self.latency_shaped = self.shape.latency_ms == 0 or netem_available(self.switch)
            host = socket.gethostname()
            for k in range(self.nodes):
                ns, peer = self.ns(k), f"v{k}"
                self._add_ns(ns)
                _sh("ip", "link", "add", "name", "eth0", "netns", ns, "type", "veth", "peer", "name", peer,
                    "netns", self.switch)
                _sh("ip", "addr", "add", f"{self.addr(k)}/24", "dev", "eth0", ns=ns)
                _sh("ip", "link", "set", "eth0", "up", ns=ns)
                _sh("ip", "link", "set", peer, "master", "br0", "up", ns=self.switch)
                self._shape(ns, "eth0")
                self._shape(self.switch, peer)
                os.makedirs(f"{NETNS_ETC}/{ns}", exist_ok=True)
                names = "".join(f"{self.addr(j)} {self.ns(j)}\n" for j in range(self.nodes))
                with open(f"{NETNS_ETC}/{ns}/hosts", "w") as f:
                    f.write(f"127.0.0.1 localhost\n{self.addr(k)} {host}\n{names}")
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _sh("ip", "netns", "add", ns)
        self._created.append(ns)
        _sh("ip", "link", "set", "lo", "up", ns=ns)

    def _shape(self, ns: str, dev: str) -> None:
        # Token bucket at the link rate; a burst of 1 ms at that rate (at least 64 KiB, one GSO
        # segment), and netem's delay under it where the kernel has netem.
        burst = max(64 << 10, int(self.shape.rate_mbit * 1e6 / 8 / 1000))
        _sh("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{self.shape.rate_mbit}mbit",
            "burst", str(burst), "latency", "100ms", ns=ns)
        if self.latency_shaped and self.shape.latency_ms > 0:
            _sh("tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem", "delay",
                f"{self.shape.latency_ms / 2}ms", ns=ns)

    def down(self) -> None:
        """Ends the processes started in the nodes and removes every namespace this cluster created."""
        for p in self._procs:
            _end(p.pid, group=True)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        self._procs.clear()
        for ns in reversed(self._created):
            _remove_ns(ns)
        self._created.clear()
        if self in _LIVE:
            _LIVE.remove(self)
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _trap_signals(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, _on_signal)

    def __enter__(self) -> Cluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ processes in nodes
    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside ``node``."""
        if not 0 <= node < self.nodes:
            raise ValueError(f"node must be in [0, {self.nodes}), got {node}.")
        return ["ip", "netns", "exec", self.ns(node), *argv]

    def popen(self, node: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        """Starts ``argv`` inside ``node`` in a session of its own (ended by ``down``)."""
        p = subprocess.Popen(self.command(node, argv), start_new_session=True, **kw)
        self._procs.append(p)
        return p

    def run(self, node: int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        """Runs ``argv`` inside ``node`` to completion."""
        kw.setdefault("timeout", 120)
        return subprocess.run(self.command(node, argv), **kw)


def _end(pid: int, *, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _remove_ns(ns: str) -> None:
    # Whatever still runs inside a namespace we created was started there by us.
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        _end(int(pid))
    _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(f"{NETNS_ETC}/{ns}", ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(NETNS_ETC)  # only when empty: other entries are not ours


def _on_signal(signum: int, frame: object) -> None:
    for c in list(_LIVE):
        c.down()
    raise SystemExit(128 + signum)


@atexit.register
def _at_exit() -> None:
    for c in list(_LIVE):
        c.down()


def leftovers(all_pids: bool = False) -> list[str]:
    """Namespaces named ``jrs-<pid>-...`` whose creating process is gone (every such one with ``all_pids``)."""
    names = _sh("ip", "netns", "list", check=False).stdout.split("\n")
    out = []
    for line in names:
        name = line.split(" ")[0]
        m = _PREFIX_RE.match(name)
        if m and (all_pids or not os.path.exists(f"/proc/{m.group(1)}")):
            out.append(name)
    if os.path.isdir(NETNS_ETC):
        out += [n for n in os.listdir(NETNS_ETC) if _PREFIX_RE.match(n) and n not in out
                and (all_pids or not os.path.exists(f"/proc/{_PREFIX_RE.match(n).group(1)}"))]  # type: ignore[union-attr]
    return out


def cleanup(all_pids: bool = False) -> list[str]:
    """Removes the ``leftovers``; returns their names."""
    gone = leftovers(all_pids)
    for ns in gone:
        _remove_ns(ns)
    return gone


# ---------------------------------------------------------------------- measurements
def _recv(host: str, port: int) -> None:
    """Accepts one connection, reads to EOF, prints the bytes and seconds from first byte to EOF."""
    with socket.create_server((host, port)) as srv:
        print("READY", flush=True)
        conn, _ = srv.accept()
        with conn:
            buf = bytearray(1 << 20)
            n = conn.recv_into(buf)
            t0, total = time.perf_counter(), 0
            while n:
                total += n
                n = conn.recv_into(buf)
            print(json.dumps({"bytes": total, "seconds": time.perf_counter() - t0}), flush=True)


def _send(host: str, port: int, seconds: float) -> None:
    with socket.create_connection((host, port), timeout=30) as s:
        chunk, end = b"\0" * (1 << 20), time.perf_counter() + seconds
        while time.perf_counter() < end:
            s.sendall(chunk)


def _pingpong(host: str, port: int, rounds: int) -> None:
    """A 1-byte ping-pong: the server (``rounds == 0``) echoes, the client prints the median round trip."""
    if not rounds:
        with socket.create_server((host, port)) as srv:
            print("READY", flush=True)
            conn, _ = srv.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while b := conn.recv(1):
                    conn.sendall(b)
        return
    with socket.create_connection((host, port), timeout=30) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"rtt_s": sorted(times)[len(times) // 2]}), flush=True)


def _pair(cluster: Cluster | None, server: int, client: int, srv_args: list[str], cli_args: list[str],
          timeout: float) -> dict:
    """Runs this script with ``srv_args`` in node ``server``, then with ``cli_args`` in node ``client``.

    Without a cluster both run on the machine itself."""
    def cmd(node: int, args: list[str]) -> list[str]:
        argv = [sys.executable, os.path.abspath(__file__), *args]
        return cluster.command(node, argv) if cluster else argv

    with subprocess.Popen(cmd(server, srv_args), stdout=subprocess.PIPE, text=True) as srv:
        try:
            assert srv.stdout is not None
            if srv.stdout.readline().strip() != "READY":
                raise RuntimeError("the measuring server did not start")
            cli = subprocess.run(cmd(client, cli_args), capture_output=True, text=True, timeout=timeout)
            if cli.returncode:
                raise RuntimeError(f"the measuring client failed: {cli.stderr[-2000:]}")
            out = srv.communicate(timeout=timeout)[0]
        finally:
            if srv.poll() is None:
                srv.kill()
    return json.loads((out + cli.stdout).strip().splitlines()[-1])


def stream_rate(cluster: Cluster | None, src: int, dst: int, seconds: float = 1.0, port: int = 5201) -> float:
    """Bytes per second of one TCP stream from node ``src`` to node ``dst`` for about ``seconds``.

    ``src == dst`` measures the node's loopback; ``cluster=None`` the machine's loopback.
    """
    host = "127.0.0.1" if cluster is None or src == dst else Cluster.addr(dst)
    r = _pair(cluster, dst, src, ["--recv", host, str(port)], ["--send", host, str(port), str(seconds)], seconds + 60)
    return r["bytes"] / r["seconds"]


def round_trip(cluster: Cluster | None, a: int, b: int, rounds: int = 200, port: int = 5202) -> float:
    """Median round trip (seconds) of a 1-byte TCP ping-pong from node ``a`` to node ``b``."""
    host = "127.0.0.1" if cluster is None or a == b else Cluster.addr(b)
    return _pair(cluster, b, a, ["--pingpong", host, str(port), "0"], ["--pingpong", host, str(port), str(rounds)],
                 60)["rtt_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--rate-mbit", type=float, default=400.0)
    ap.add_argument("--latency-ms", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=1.0, help="length of each stream measurement")
    ap.add_argument("--cleanup", action="store_true", help="remove namespaces left by runs that are gone")
    ap.add_argument("--all", action="store_true", help="with --cleanup: also those of running processes")
    ap.add_argument("--recv", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--send", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--pingpong", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.recv is not None:
        return _recv(args.recv[0], int(args.recv[1]))
    if args.send is not None:
        return _send(args.send[0], int(args.send[1]), float(args.send[2]))
    if args.pingpong is not None:
        return _pingpong(args.pingpong[0], int(args.pingpong[1]), int(args.pingpong[2]))
    reason = unavailable()
    if args.cleanup:
        if reason:
            print(f"nothing to clean up: {reason}")
            return
        gone = cleanup(args.all)
        print(f"removed {len(gone)} namespace(s)" + (f": {', '.join(gone)}" if gone else ""))
        return
    if reason:
        print(f"no simulated cluster: {reason}; measuring the machine's loopback instead")
        print(f"loopback: {stream_rate(None, 0, 0, args.seconds) * 8 / 1e9:.2f} Gbit/s")
        return
    with Cluster(max(2, args.nodes), rate_mbit=args.rate_mbit, latency_ms=args.latency_ms) as c:
        shaped = stream_rate(c, 0, 1, args.seconds)
        loop = stream_rate(c, 0, 0, args.seconds)
        rtt, rtt_lo = round_trip(c, 0, 1), round_trip(c, 0, 0)
        print(f"simulated cluster: {c.nodes} nodes, links shaped to {c.shape.rate_mbit:g} Mbit/s, "
              f"latency {c.shape.latency_ms:g} ms " + ("(netem)" if c.latency_shaped else
                                                      "NOT applied: this kernel has no netem qdisc"))
        print(f"  node 0 -> node 1 (shaped link): {shaped * 8 / 1e6:8.1f} Mbit/s, 1-byte round trip "
              f"{rtt * 1e6:.0f} us")
        print(f"  loopback inside node 0:         {loop * 8 / 1e6:8.1f} Mbit/s, 1-byte round trip "
              f"{rtt_lo * 1e6:.0f} us  ({loop / shaped:.0f}x the shaped link)")


if __name__ == "__main__":
    main()
