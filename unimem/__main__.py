"""``python -m unimem``: the command line.

Subcommands:
  demo      train a small MLP on the default device through the pool and show what it did
  plot      draw the timeline and segment map of a snapshot into a PNG
  run       run a Python script with unimem as its array library's allocator, then print the summary
  summary   print the memory summary (after running a script, if one is given)
  stats     print the memory statistics (as JSON with --json), after an optional script
  cluster   print the unimem statistics of every worker of a Dask cluster
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import runpy
import sys
from typing import List, Optional


def _demo(args: argparse.Namespace) -> int:
    from . import demo
    demo.run(steps=args.steps, out_dir=args.out, show_oom=not args.no_oom)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from ._plot import plot_snapshot
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    if isinstance(snapshot, list):                  # a memory_snapshot() list of segments
        snapshot = {"segments": snapshot, "device_traces": []}
    print(plot_snapshot(snapshot, args.output, device=args.device))
    return 0


def _run_script(argv: List[str], install: bool) -> int:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its arguments."""
    if not argv:
        return 0
    if install:
        from ._install import install_allocators
        installed = install_allocators()
        print(f"unimem: serving {', '.join(installed) if installed else 'no array library'} "
              f"(current accelerator: {_accelerator_name()})", file=sys.stderr)
    script = argv[0]
    if not os.path.exists(script):
        print(f"unimem: no such script: {script}", file=sys.stderr)
        return 2
    saved_argv = sys.argv
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = saved_argv
    return 0


def _accelerator_name() -> str:
    from . import accelerator
    return str(accelerator.current_accelerator())


def _print_summary(device: Optional[int], abbreviated: bool) -> None:
    from . import accelerator
    print(accelerator.memory_summary(device, abbreviated=abbreviated))


def _run(args: argparse.Namespace) -> int:
    try:
        return _run_script([args.script] + args.args, install=True)
    finally:
        _print_summary(None, args.abbreviated)


def _summary(args: argparse.Namespace) -> int:
    code = _run_script(args.script, install=True)
    _print_summary(args.device, args.abbreviated)
    return code


def _stats(args: argparse.Namespace) -> int:
    from . import accelerator, host
    code = _run_script(args.script, install=True)
    view = {"device": f"{_accelerator_name()}:{accelerator.current_device_index() if args.device is None else args.device}",
            "memory_stats": dict(accelerator.memory_stats(args.device)),
            "host_memory_stats": dict(host.host_memory_stats())}
    if args.json:
        print(json.dumps(view, indent=2, sort_keys=True))
    else:
        print(f"device {view['device']}")
        for key, value in view["memory_stats"].items():
            print(f"{key} {value}")
        for key, value in view["host_memory_stats"].items():
            print(f"host.{key} {value}")
    return code


def _cluster(args: argparse.Namespace) -> int:
    try:
        from . import dask as unimem_dask
    except ImportError as exc:
        print(f"unimem: {exc}", file=sys.stderr)
        return 1
    try:
        print(unimem_dask.cluster_summary(args.address, timeout=args.timeout))
    except (OSError, TimeoutError, ValueError) as exc:
        print(f"unimem: cannot read the Dask cluster at {args.address}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m unimem",
        description="unimem: caching allocation and memory statistics for CuPy, dpnp and host memory.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    demo = commands.add_parser("demo", help="train a small MLP on the default device through the pool "
                                            "and show what the pool did")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--out", default="unimem-demo", help="folder for snapshot.pickle and timeline.png")
    demo.add_argument("--no-oom", action="store_true", help="do not provoke the example out-of-memory error")
    demo.set_defaults(handler=_demo)

    plot = commands.add_parser("plot", help="draw a snapshot's memory timeline and segment map (PNG)")
    plot.add_argument("snapshot", help="a pickled snapshot (_dump_snapshot, or the demo's snapshot.pickle)")
    plot.add_argument("-o", "--output", default="timeline.png", help="the PNG to write (default timeline.png)")
    plot.add_argument("-d", "--device", type=int, default=None, help="device index (default: the busiest)")
    plot.set_defaults(handler=_plot)

    run = commands.add_parser("run", help="run a script with unimem as the array library's allocator "
                                          "and print the memory summary at exit")
    run.add_argument("script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.add_argument("--abbreviated", action="store_true", help=argparse.SUPPRESS)
    run.set_defaults(handler=_run)

    summary = commands.add_parser("summary", help="print the memory summary table of this process "
                                                  "(after running SCRIPT, if given)")
    summary.add_argument("--device", type=int, default=None)
    summary.add_argument("--abbreviated", action="store_true", help="no per-pool rows")
    summary.add_argument("script", nargs=argparse.REMAINDER, help="a script and its arguments")
    summary.set_defaults(handler=_summary)

    stats = commands.add_parser("stats", help="print the memory statistics of this process "
                                              "(after running SCRIPT, if given)")
    stats.add_argument("--json", action="store_true", help="as JSON")
    stats.add_argument("--device", type=int, default=None)
    stats.add_argument("script", nargs=argparse.REMAINDER, help="a script and its arguments")
    stats.set_defaults(handler=_stats)

    cluster = commands.add_parser("cluster", help="print every Dask worker's unimem statistics")
    cluster.add_argument("address", help="the scheduler's address, e.g. tcp://10.0.0.1:8786")
    cluster.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the cluster")
    cluster.set_defaults(handler=_cluster)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
