"""Command line: ``python -m jreshard demo`` (and the subcommands of later layers)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jreshard", description="Plan and run sharded-tensor reshards.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="reshard a few tiny-Llama tensors on simulated devices and check them")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jreshard._demo import main as demo

        return demo()
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
