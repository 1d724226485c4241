"""Memory shared between two processes of one host, as torch shares it: the smoke check under ``cuda_ipc``.

``ipc_smoke`` allocates a tensor in this process (CUDA memory on GPU 0, or shared host memory with
``device="cpu"``), hands it to a child started with the ``spawn`` method through a
``torch.multiprocessing`` queue (for CUDA: an IPC handle of the allocation, opened in the child),
and the child writes a known pattern into it on its own stream and synchronises. This process then
reads the tensor: bit-exact means the child wrote into this process's memory, not a copy. The child
also times its write (the same bytes over IPC-mapped memory) against a copy between two tensors of
its own, so the first GPU session learns whether IPC on one device works there and what it costs.
Every wait has a timeout; a child still alive at the end is killed.
"""

from __future__ import annotations

import queue as queue_mod
import time
from typing import Any

REPS = 5


def pattern(torch: Any, n: int, device: Any) -> Any:
    """``n`` bytes that no zeroed or stale buffer holds by chance: ``(i * 2654435761 + 7) mod 251``."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * 2654435761 + 7) % 251).to(torch.uint8)


def _writer(inbox: Any, outbox: Any) -> None:
    """The child: takes the shared tensor, writes ``pattern`` into it, reports times (or the error)."""
    try:
        import torch

        from tests.gpu._checks import timer

        shared = inbox.get(timeout=120)
        src = pattern(torch, shared.numel(), shared.device)
        own = torch.empty_like(src)
        timed = timer(torch, shared.device, REPS)
        ipc_s = timed(lambda: shared.copy_(src))
        local_s = timed(lambda: own.copy_(src))
        outbox.put({"ok": True, "device": str(shared.device), "ipc_s": ipc_s, "local_s": local_s})
        inbox.get(timeout=120)  # hold the mapping until the parent has read the tensor
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        outbox.put({"ok": False, "error": f"{type(e).__name__}: {e}"})


def ipc_smoke(device: str, nbytes: int, *, timeout: float = 120.0) -> dict[str, Any]:
    """One tensor of ``nbytes`` shared with a spawned child that writes into it; what was seen.

    ``device``: ``"cuda"`` (GPU 0, CUDA IPC) or ``"cpu"`` (shared memory: the same code path on a
    machine without a GPU). Returns ``ok`` (the child wrote every byte as asked and this process
    sees them), ``exact``, the child's median seconds for its write through the shared mapping
    (``ipc_s``) and for the same copy into memory of its own (``local_s``), or ``error``.
    """
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    if dev.type == "cpu":
        buf.share_memory_()
    child = ctx.Process(target=_writer, args=(inbox, outbox), daemon=True)
    child.start()
    t0 = time.monotonic()
    try:
        inbox.put(buf)
        try:
            got = outbox.get(timeout=timeout)
        except queue_mod.Empty:
            return {"ok": False, "error": f"the child sent nothing within {timeout:.0f} s "
                                          f"(alive: {child.is_alive()}, exit code {child.exitcode})"}
        if got["ok"]:
            got["exact"] = bool(torch.equal(buf, pattern(torch, nbytes, dev)))
            got["ok"] = got["exact"]
        inbox.put(None)  # the child may let go of its mapping now
        child.join(max(1.0, timeout - (time.monotonic() - t0)))
        return got
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
