"""``python -m unimem``: the command line."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def _demo(args: argparse.Namespace) -> int:
    from . import demo
    demo.run(steps=args.steps)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m unimem",
        description="unimem: caching allocation and memory statistics for CuPy, dpnp and host memory.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    demo = commands.add_parser("demo", help="run a workload through the pool on the default device "
                                            "and show what the pool did")
    demo.add_argument("--steps", type=int, default=300, help="training steps to run (default 300)")
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
