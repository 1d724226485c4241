"""Command line: ``python -m jreshard demo`` and ``jreshard plan SCENARIO.json``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from jreshard.cli.plan import add_plan_parser, run_plan

    parser = argparse.ArgumentParser(prog="jreshard", description="Plan and run sharded-tensor reshards.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="reshard a few tiny-Llama tensors on simulated devices and check them")
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jreshard.cli.demo import main as demo

        return demo()
    if args.command == "plan":
        return run_plan(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
