"""Who gets into a sync group: processes without the job's secret, with a wrong one, or after a taken rank.

Three members (rank 0 hosts the store, ranks 1 and 2 receive) run in processes of their own
(``python -m tests.bridge.test_membership CONFIG``) and sync 40 versions of seeded tensors,
each checked bit-exact by its receiver. Impostors come at set points, never racing the real
ranks: after the group formed (a wrong secret, the right secret claiming a taken rank, raw gloo
under the group's prefix read from the store's key list), or before it formed (raw gloo in the
place of a rank that has not come yet). Also: the store and gloo listen on the given address only.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bridge.engines import membership
from bridge.engines.group import close_group, host_store, open_group
from bridge.errors import SyncError
from bridge.wire.group import all_gather_bytes, gloo_group
from tests._procs import free_ports, kill_all, wait_all

ROOT = Path(__file__).resolve().parents[2]
# The job's secret, the same in the test and in every member process it starts (through the environment).
SECRET = bytes.fromhex(os.environ.get("JRESHARD_TEST_SECRET", "")) or secrets.token_bytes(32)
SYNCS = 40
SIZE = 3
LIMIT = 120.0  # seconds for each test's processes, all together


# ------------------------------------------------------------------ the processes
def _done(out: Path, name: str, data: dict[str, Any]) -> None:
    (out / (name + ".tmp")).write_text(json.dumps(data))
    os.replace(out / (name + ".tmp"), out / name)


def _wait_file(path: Path, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {limit:g} s")
        time.sleep(0.05)


def _syncs(pg: Any, rank: int) -> list[bool]:
    """Rank 0 sends ``SYNCS`` seeded tensors to every other rank; a receiver says whether each was bit-exact."""
    exact = []
    for version in range(SYNCS):
        want = torch.randn(4096, generator=torch.Generator().manual_seed(version))
        if rank == 0:
            for peer in range(1, SIZE):
                dist.send(want, peer, group=pg)
        else:
            got = torch.empty_like(want)
            dist.recv(got, 0, group=pg)
            exact.append(bool(torch.equal(got, want)))
    return exact


def member(cfg: dict[str, Any]) -> None:
    """A real rank: opens each group of ``names`` in turn until one forms, then syncs once ``go`` exists."""
    out, rank = Path(cfg["out"]), cfg["rank"]
    store = host_store("127.0.0.1", cfg["port"], SIZE, timeout=LIMIT) if rank == 0 else None
    report: dict[str, Any] = {"errors": {}}
    for name in cfg["names"]:
        try:
            pg = open_group("127.0.0.1", cfg["port"], rank, SIZE, secret=SECRET, timeout=LIMIT, name=name,
                            store=store)
        except SyncError as e:
            report["errors"][name] = f"{type(e).__name__}: {e}"
            continue
        report["joined"] = name
        break
    _done(out, f"joined{rank}", report)
    _wait_file(out / "go", LIMIT)
    report["exact"] = _syncs(pg, rank)
    report["after"] = [bytes(b).decode() for b in all_gather_bytes(
        f"rank {rank}".encode(), pg, SIZE, lambda w: w.wait())]  # the group is intact
    _done(out, f"member{rank}", report)
    if rank == 0:  # the store outlives the receivers' last collective
        _wait_file(out / "member1", LIMIT)
        _wait_file(out / "member2", LIMIT)
    close_group(pg)


def impostor(cfg: dict[str, Any]) -> None:
    """A process outside the job that tries to take rank 1 of group ``name`` (``how``)."""
    out, how, name = Path(cfg["out"]), cfg["how"], cfg["name"]
    report: dict[str, Any] = {"how": how}
    try:
        if how in ("wrong secret", "taken rank"):
            secret = secrets.token_bytes(32) if how == "wrong secret" else SECRET
            pg = open_group("127.0.0.1", cfg["port"], 1, SIZE, secret=secret, timeout=10, name=name)
            report["joined"] = True
            close_group(pg)
        else:  # raw gloo, no secret: the group's keys read from the store's key list
            import datetime

            store = dist.TCPStore("127.0.0.1", cfg["port"], is_master=False, timeout=datetime.timedelta(seconds=10))
            prefix = next(k for k in store.list_keys() if k.startswith(f"{name}/") and "/claim/" in k)
            prefix = prefix[:prefix.index("/claim/")] + "/gloo/"
            pg = gloo_group(dist.PrefixStore(prefix, store), 1, SIZE, cfg["timeout"])
            report["connected"] = True
            all_gather_bytes(secrets.token_bytes(16), pg, SIZE, lambda w: w.wait())  # plays the challenge
            all_gather_bytes(secrets.token_bytes(32), pg, SIZE, lambda w: w.wait())
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    _done(out, f"impostor_{how.replace(' ', '_')}", report)


def trainer(cfg: dict[str, Any]) -> None:
    """A JAX trainer process of two under jax.distributed: its syncs' secrets, as digests (never the secret)."""
    import hashlib

    import jax

    from bridge.engines.trainer import TrainerSync
    from bridge.recipes import Recipe
    from jreshard.nn import LlamaConfig

    jax.distributed.initialize(f"127.0.0.1:{cfg['jax_port']}", num_processes=2, process_id=cfg["rank"],
                               initialization_timeout=60)
    recipe = Recipe.llama(LlamaConfig.load("llama-tiny"))
    digests = [hashlib.sha256(TrainerSync(recipe, workers=1, control=object(), rank=cfg["rank"], trainers=2,
                                          port=cfg["port"], ready_timeout=60).info.secret).hexdigest()
               for _ in range(2)]
    _done(Path(cfg["out"]), f"trainer{cfg['rank']}", {"digests": digests})
    if cfg["rank"] == 0:  # it hosts jax's coordination service, which rank 1 reads the secret from
        _wait_file(Path(cfg["out"]) / "trainer1", LIMIT)
    os._exit(0)  # jax.distributed's shutdown barrier would wait for a trainer already gone


# ------------------------------------------------------------------ the tests
def _start(out: Path, **cfg: Any) -> subprocess.Popen:
    role = cfg["role"]
    with open(out / f"{role}{cfg.get('rank', '')}{cfg.get('how', '').replace(' ', '_')}.log", "w") as log:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", JRESHARD_TEST_SECRET=SECRET.hex(),
                   JAX_PLATFORMS="cpu", **{membership.SECRET_ENV: ""})
        return subprocess.Popen([sys.executable, "-m", "tests.bridge.test_membership", json.dumps({**cfg, "out": str(
            out)})], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _read(out: Path, name: str) -> dict[str, Any]:
    logs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("*.log")))
    assert (out / name).exists(), f"{name} missing; logs:\n{logs}"
    return json.loads((out / name).read_text())


def _check_synced(out: Path, name: str) -> list[dict[str, Any]]:
    reports = [_read(out, f"member{r}") for r in range(SIZE)]
    for r, report in enumerate(reports):
        assert report["joined"] == name
        assert report["after"] == [f"rank {p}" for p in range(SIZE)]
        assert report["exact"] == ([] if r == 0 else [True] * SYNCS)
    return reports


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    kill_all(started)


def test_impostors_after_the_group_formed_are_refused_and_change_nothing(tmp_path, procs):
    port = free_ports(1)[0]
    procs += [_start(tmp_path, role="member", rank=r, port=port, names=["g"]) for r in range(SIZE)]
    for r in range(SIZE):
        _wait_file(tmp_path / f"joined{r}", LIMIT)
    wrong = _start(tmp_path, role="impostor", how="wrong secret", port=port, name="g")
    taken = _start(tmp_path, role="impostor", how="taken rank", port=port, name="g")
    raw = _start(tmp_path, role="impostor", how="raw gloo", port=port, name="g", timeout=5.0)
    procs += [wrong, taken, raw]
    wait_all([wrong, taken, raw], LIMIT)
    (tmp_path / "go").touch()
    wait_all(procs, LIMIT)
    _check_synced(tmp_path, "g")
    got = {how: _read(tmp_path, f"impostor_{how.replace(' ', '_')}") for how in ("wrong secret", "taken rank")}
    assert "joined" not in got["wrong secret"] and "joined" not in got["taken rank"]
    assert got["wrong secret"]["error"].startswith("MembershipError: rank 1 is refused from group 'g'")
    assert "the secret it was given is not the one the group's rank 0 holds" in got["wrong secret"]["error"]
    assert "JRESHARD_SYNC_SECRET" in got["wrong secret"]["error"]
    assert got["taken rank"]["error"].startswith("MembershipError: rank 1 of group 'g' is already claimed")
    # Raw gloo under the group's keys after it formed: no member exchanges anything with it (its first
    # collective fails), and the members above synced as if it were not there.
    assert "error" in _read(tmp_path, "impostor_raw_gloo")


def test_an_impostor_in_place_of_a_rank_is_named_and_the_next_group_syncs(tmp_path, procs):
    port = free_ports(1)[0]
    procs += [_start(tmp_path, role="member", rank=r, port=port, names=["g1", "g2"]) for r in (0, 2)]
    deadline = time.monotonic() + LIMIT
    prefix = membership.group_prefix(SECRET, "g1")
    import datetime

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=LIMIT))
    while not {f"{prefix}claim/0", f"{prefix}claim/2"} <= set(store.list_keys()):  # both wait for rank 1
        assert time.monotonic() < deadline, "ranks 0 and 2 did not claim their ranks"
        time.sleep(0.05)
    raw = _start(tmp_path, role="impostor", how="raw gloo", port=port, name="g1", timeout=LIMIT)
    procs.append(raw)
    wait_all([raw], LIMIT)
    procs.append(_start(tmp_path, role="member", rank=1, port=port, names=["g2"]))
    (tmp_path / "go").touch()
    wait_all(procs, LIMIT)
    reports = _check_synced(tmp_path, "g2")
    for r in (0, 2):
        error = reports[r]["errors"]["g1"]
        assert error.startswith("MembershipError: sync ranks [1] of group 'g1' did not prove that they hold the "
                                "job's secret"), error
        assert "nothing was sent" in error
    assert reports[1]["errors"] == {}
    raw_report = _read(tmp_path, "impostor_raw_gloo")
    assert raw_report["connected"] is True  # it got into gloo, and learned nothing: the members raised


def test_a_wrong_secret_is_refused_at_once_in_one_process():
    store = host_store("127.0.0.1", 0, 2, timeout=10)
    pg = open_group("127.0.0.1", store.port, 0, 1, secret=SECRET, timeout=10, name="solo", store=store)
    try:
        with pytest.raises(membership.MembershipError, match="not the one the group's rank 0 holds"):
            open_group("127.0.0.1", store.port, 1, 2, secret=b"another secret of 32 bytes .....", timeout=10,
                       name="solo")
        with pytest.raises(membership.MembershipError, match="rank 0 of group 'solo' is already claimed"):
            membership.claim_rank(store, SECRET, "solo", 0)
    finally:
        close_group(pg)


def test_where_a_trainer_takes_its_secret_from(monkeypatch):
    pytest.importorskip("jax")
    from bridge.engines.trainer import TrainerSync
    from bridge.recipes import Recipe
    from jreshard.nn import LlamaConfig

    def secret_of(**kw: Any) -> bytes:
        sync = TrainerSync(Recipe.llama(LlamaConfig.load("llama-tiny")), workers=1, control=object(), rank=0,
                           trainers=1, port=29999, **kw)
        assert "secret" not in repr(sync.info)
        return sync.info.secret

    monkeypatch.delenv(membership.SECRET_ENV, raising=False)
    made = secret_of(), secret_of()
    assert all(len(s) == 32 for s in made) and made[0] != made[1]  # one trainer: a new one per object
    monkeypatch.setenv(membership.SECRET_ENV, "x" * 20)
    assert secret_of() == b"x" * 20
    assert secret_of(secret=SECRET) == SECRET  # the argument first
    monkeypatch.setenv(membership.SECRET_ENV, "short")
    with pytest.raises(ValueError, match=f"{membership.SECRET_ENV} must hold at least 16 bytes"):
        secret_of()

def test_trainers_under_jax_distributed_share_rank_0s_new_secret(tmp_path, procs):
    pytest.importorskip("jax")
    jax_port, port = free_ports(2)
    procs += [_start(tmp_path, role="trainer", rank=r, jax_port=jax_port, port=port) for r in (0, 1)]
    wait_all(procs, LIMIT)
    (first, second), again = (_read(tmp_path, f"trainer{r}")["digests"] for r in (0, 1))
    assert again == [first, second] and first != second  # the same on both ranks, a new one per sync object

def _other_address() -> str | None:
    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return str(a.address)
    return None


def _reaches(address: str, port: int) -> bool:
    import socket

    try:
        with socket.create_connection((address, port), timeout=2):
            return True
    except OSError:
        return False


def test_the_store_and_gloo_listen_on_the_given_address_only():
    import socket

    import psutil

    other = _other_address()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with socket.socket() as control:  # the other address does reach this machine's sockets on every interface
        control.bind(("0.0.0.0", 0))
        control.listen()
        if not _reaches(other, control.getsockname()[1]):
            pytest.skip(f"{other} does not reach this machine's own listening sockets")
    me = psutil.Process()
    before = {c.laddr for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    pg = open_group("127.0.0.1", 0, 0, 1, secret=SECRET, timeout=10)
    try:
        opened = {c.laddr for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN} - before
        assert opened, "open_group listens on nothing"
        assert {a.ip for a in opened} == {"127.0.0.1"}, opened  # the store's socket and gloo's
        assert all(_reaches("127.0.0.1", a.port) and not _reaches(other, a.port) for a in opened)
    finally:
        close_group(pg)



def test_init_groups_store_listens_on_the_given_address_only():
    # In a process of its own: init_group makes torch.distributed's default group.
    port = free_ports(1)[0]
    code = (f"import json, psutil, bridge; bridge.init_group(0, 1, port={port}, host='127.0.0.1', timeout=10); "
            "print(json.dumps([[c.laddr.ip, c.laddr.port] for c in psutil.Process().net_connections('tcp') "
            "if c.status == psutil.CONN_LISTEN]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT)
    assert done.returncode == 0, done.stderr[-3000:]
    listening = json.loads(done.stdout.strip().splitlines()[-1])
    assert [ip for ip, p in listening if p == port] == ["127.0.0.1"], listening

def _main() -> None:
    cfg = json.loads(sys.argv[1])
    with contextlib.suppress(KeyboardInterrupt):
        {"member": member, "impostor": impostor, "trainer": trainer}[cfg["role"]](cfg)


if __name__ == "__main__":
    _main()
