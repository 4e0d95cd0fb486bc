"""``python -m unimem`` (or the ``unimem`` console script): the command line.

Subcommands:
  demo      train a small MLP on the default device through the pool and show what it did
  plot      draw the timeline and segment map of a snapshot into a PNG
  view      write a snapshot's memory report: one interactive HTML file that opens offline
  run       run a Python script with unimem as its array library's allocator, then print the summary
            on stderr, apart from the script's own stdout (-o FILE: into FILE)
            (--report memory.html: and write the memory report of the run)
            (--sycl-interpose: dpnp's C++ scratch buffers from the pools too)
  summary   print the memory summary (after running a script, if one is given)
  stats     print the memory statistics (as JSON with --json), after an optional script
  cluster   print the unimem statistics of every worker of a Dask cluster

``--version`` prints the installed version.

A mistake of the user's (a missing file, a bad argument, a device this machine
lacks, a ``UNIMEM_ALLOC_CONF`` the pools or the device refuse) is one line on
stderr, ``<prog> <command>: error: ...``, and a non-zero exit status, in every
subcommand; an error of a script run under ``run``/``summary``/``stats`` is the
script's own traceback, without unimem's frames, and exit status 1, as
``python script.py`` would give.

Standard output holds one thing: under ``run``, the script's own output (the
summary goes to stderr, as ``time`` and profilers put theirs); under
``summary`` and ``stats``, unimem's (the script's output goes to stderr, unless
``stats -o FILE`` takes the statistics elsewhere).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import runpy
import sys
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, TextIO, Tuple

from .version import VersionAction

# The exit status of a program ended by Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130
# argparse's status for a usage error, used for the same kind of mistake found later.
EXIT_USAGE = 2
# Set to 1 (true, yes, on), the scripts run by run/summary/stats have the SYCL
# interposer installed, as with ``run --sycl-interpose``.
SYCL_INTERPOSE_ENV = "UNIMEM_SYCL_INTERPOSE"
# run --report: the memory history kept (the last events of a longer run).
REPORT_MAX_ENTRIES = 200_000


class CommandError(Exception):
    """What the user asked for cannot be done: reported as one line, exit status :attr:`status`."""

    status = 1


class UsageError(CommandError):
    """A mistake in what the user asked for: reported as one line, exit status 2."""

    status = EXIT_USAGE


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _device_index(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a device index (0, 1, ...), got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a device index (0, 1, ...), got {value}")
    return value


def _output_file(text: str) -> str:
    """A file to write: named, and not a folder (checked before any script
    runs or any snapshot is read, not after)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, got an empty one")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a folder, not a file")
    return text


def _check_folder_of(path: str) -> None:
    """The folder a file is to be written into exists (checked before any
    script runs, not after)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"cannot write {path}: no such folder {folder}")


def _write_output(text: str, path: Optional[str], stream: TextIO) -> None:
    """``text`` into the file ``path``, or onto ``stream`` without one."""
    if path is None:
        stream.write(text)
        stream.flush()
        return
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None


def _output_folder(text: str) -> str:
    """A folder to write into: named, and not an existing file (checked before
    the demo trains, not after)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder name, got an empty one")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return text


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number of seconds, got {text}")
    return value


def _current_device_type() -> Any:
    """The current accelerator's device type; a device this machine lacks (or
    a bad ``UNIMEM_DEVICE``) is the user's mistake, said in one line."""
    from .._runtime import devices as _devices
    try:
        return _devices.current_type()
    except (RuntimeError, ValueError) as exc:
        raise UsageError(str(exc).removeprefix("unimem: ")) from None


@contextlib.contextmanager
def _pool_refusals() -> Iterator[None]:
    """Inside, a ``UNIMEM_ALLOC_CONF`` that does not parse (ValueError) or a
    setting the device refuses (NotImplementedError: expandable segments on
    XPU), met as a pool is made, is the user's mistake, said in one line."""
    try:
        yield
    except (ValueError, NotImplementedError) as exc:
        raise UsageError(f"cannot serve arrays from unimem's pools: {exc}") from None


# ---------------------------------------------------------------------------
# demo, plot
# ---------------------------------------------------------------------------
def _demo(args: argparse.Namespace) -> int:
    dtype = _current_device_type()
    with _pool_refusals():
        dtype.allocator(dtype.current_index())         # the pool the demo trains with
    try:
        os.makedirs(args.out, exist_ok=True)           # before training, not after
    except OSError as exc:
        raise UsageError(f"cannot write into {args.out}: {exc.strerror or exc}") from None
    from . import demo
    demo.run(steps=args.steps, out_dir=args.out, show_oom=not args.no_oom)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .._observe.plot import plot_snapshot
    return _write_from_snapshot(args, lambda snapshot: plot_snapshot(
        snapshot, args.output, device=args.device, source_lines=args.source_lines))


def _write_from_snapshot(args: argparse.Namespace, write: Callable[[Dict[str, Any]], str]) -> int:
    """Read ``args.snapshot`` safely, ``write(snapshot)`` into ``args.output``
    and print the path; a bad file, device or output is one line."""
    from .._observe.snapshot_file import SnapshotError, load_snapshot
    try:
        snapshot = load_snapshot(args.snapshot)
    except OSError as exc:
        raise UsageError(f"cannot read {args.snapshot}: {exc.strerror or exc}") from None
    except SnapshotError as exc:
        raise UsageError(f"{args.snapshot}: {exc}") from None
    try:
        print(write(snapshot))
    except ValueError as exc:                    # a device the snapshot does not have
        raise UsageError(f"{args.snapshot}: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    return 0


def _view(args: argparse.Namespace) -> int:
    from .._observe.report import write_report
    return _write_from_snapshot(args, lambda snapshot: write_report(snapshot, args.output, device=args.device))


# ---------------------------------------------------------------------------
# running a script
# ---------------------------------------------------------------------------
def _check_script(argv: List[str]) -> None:
    if argv and not (os.path.isfile(argv[0])
                     or os.path.isfile(os.path.join(argv[0], "__main__.py"))):
        raise UsageError(f"no such script: {argv[0]}")


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While the script runs, whatever it writes to stdout (from Python or
    from C, file descriptor 1) goes to stderr, so that stdout carries only
    unimem's own output (``summary``'s table, ``stats``' figures)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _script_traceback(exc: BaseException, script: str) -> str:
    """The traceback of an exception a script raised, starting at the script's
    own first frame (unimem's and runpy's frames, which ran it, left out)."""
    script = os.path.realpath(script)
    tb = exc.__traceback__
    while tb is not None and os.path.realpath(tb.tb_frame.f_code.co_filename) != script \
            and not tb.tb_frame.f_code.co_filename.startswith(os.path.realpath(script) + os.sep):
        tb = tb.tb_next
    # No frame of the script (a SyntaxError in it): the exception says where.
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _sycl_interpose_from_environment() -> bool:
    value = os.environ.get(SYCL_INTERPOSE_ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"{SYCL_INTERPOSE_ENV}={os.environ[SYCL_INTERPOSE_ENV]!r}: expected 1 or 0")


#: The globals of the scripts run, kept for the process's life.
_script_globals: List[Dict[str, Any]] = []


def _run_script(argv: List[str], install: bool, quiet_stdout: bool = False, sycl_interpose: bool = False) -> int:
    """Run ``argv[0]`` as ``__main__`` with ``argv`` as its arguments; returns
    its exit status (1 after printing its traceback if it raised).
    ``sycl_interpose`` (or UNIMEM_SYCL_INTERPOSE=1): install the SYCL
    interposer before anything imports dpnp."""
    from .._runtime.config import settings_from_env
    with _pool_refusals():
        settings_from_env()               # whether or not a script runs: its pools' settings
    if not argv:
        return 0
    _check_script(argv)
    sycl_interpose = sycl_interpose or _sycl_interpose_from_environment()
    if install:
        from .._integrations.install import POOL_OF_LIBRARY, install_allocators
        try:
            with _pool_refusals():        # before the script runs
                installed = install_allocators(sycl_interpose=sycl_interpose)
        except RuntimeError as exc:
            if not sycl_interpose:
                raise
            raise UsageError(f"cannot install the SYCL interposer: {exc}") from None
        served = ", ".join(f"{name} from the {POOL_OF_LIBRARY[name]} pool" for name in installed)
        if sycl_interpose:
            served += " (and dpnp's C++ scratch buffers)"
        print(f"unimem: serving {served or 'no array library'} "
              f"(current accelerator: {_current_device_type().name})", file=sys.stderr)
    script = argv[0]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    process = os.getpid()
    try:
        code = _run_as_main(script, quiet_stdout)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if os.getpid() != process:
        # A process the script forked, ending: as under ``python script.py``
        # it just exits, printing no summary and writing no report of its own
        # (which would replace the parent's).
        raise SystemExit(code)
    return code


def _run_as_main(script: str, quiet_stdout: bool) -> int:
    """Run ``script`` as ``__main__``: its exit status (1 after printing its
    traceback if it raised)."""
    try:
        with _stdout_to_stderr() if quiet_stdout else contextlib.nullcontext():
            # the script's globals stay alive, as a script's do until the
            # interpreter exits, so that the summaries show its live arrays
            _script_globals.append(runpy.run_path(script, run_name="__main__"))
    except SystemExit as exc:
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)                # sys.exit("message"), as Python does
        return 1
    except KeyboardInterrupt:
        raise
    except BaseException as exc:                    # the script's own error
        sys.stderr.write(_script_traceback(exc, script))
        return 1
    return 0


# ---------------------------------------------------------------------------
# what the pools hold
# ---------------------------------------------------------------------------
def _has_served(stats: Dict[str, Any]) -> bool:
    """Whether a pool with these statistics has served an allocation (or
    still holds memory): an allocator made for the run (the XPU pool that
    installing dpnp's allocator makes) has only zeros."""
    return any(stats.get(key, 0) for key in ("allocation.all.allocated", "allocation.all.current",
                                              "reserved_bytes.all.current"))


def _pools_to_report(device: Optional[int]) -> List[Tuple[str, int]]:
    """``[(device type, index), ...]`` whose statistics to show: with
    ``--device``, that device of the current accelerator; otherwise every pool
    that has served an allocation (the current accelerator's first), so that
    arrays routed to another device type's pool (dpnp's to the XPU pool under
    ``UNIMEM_DEVICE=cpu``) are reported where they really went; the current
    accelerator's current device when no pool has been used."""
    from .._runtime import devices as _devices
    current = _current_device_type()
    if device is not None:
        try:
            _devices.device_index(device, current)
        except (ValueError, TypeError, IndexError) as exc:
            raise UsageError(str(exc)) from None
        return [(current.name, device)]
    used = []
    for dtype in sorted(_devices.probed_types(), key=lambda t: t.name != current.name):
        for index, allocator in sorted(dtype.registry.initialized().items()):
            if _has_served(allocator.memory_stats()):
                used.append((dtype.name, index))
    return used or [(current.name, current.current_index())]


def _memory_api(type_name: str) -> Any:
    return importlib.import_module(f"unimem.{type_name}")


def _summary_text(device: Optional[int], abbreviated: bool) -> str:
    """The summary of every pool to report, and what the dpnp allocator and
    the SYCL interposer served, where installed."""
    lines = [_memory_api(type_name).memory_summary(index, abbreviated=abbreviated)
             for type_name, index in _pools_to_report(device)]
    lines.extend(line for line in (_dpnp_counters_line(), _sycl_counters_line()) if line is not None)
    return "\n".join(lines) + "\n"


def _dpnp_counters() -> Optional[Dict[str, int]]:
    """What the dpnp allocator served and passed by, if it was installed."""
    from .._integrations.install import installed_allocators
    if "dpnp" not in installed_allocators():
        return None
    import unimem.xpu
    return unimem.xpu.allocator_counters()


def _served_line(what: str, counters: Dict[str, int], unit: str, reasons: Tuple[str, ...]) -> str:
    """``<what>: N <unit>, X from unimem's pools; M <unit>, Y around them
    (<reason>: n, ...)`` from a hook's ``pooled.*`` / ``bypassed.*`` counters."""
    from .._observe.summary import format_size
    pooled, bypassed = counters["pooled.bytes"], counters["bypassed.bytes"]
    why = ", ".join(f"{reason.replace('_', ' ')}: {counters[f'bypassed.{reason}.{unit}']}"
                    for reason in reasons if counters[f"bypassed.{reason}.{unit}"])
    return (f"{what}: {counters[f'pooled.{unit}']} {unit}, {format_size(pooled, pooled).strip()} from unimem's "
            f"pools; {counters[f'bypassed.{unit}']} {unit}, {format_size(bypassed, bypassed).strip()} "
            f"around them{f' ({why})' if why else ''}")


def _dpnp_counters_line() -> Optional[str]:
    from .._integrations.usm_memory import BYPASS_REASONS
    counters = _dpnp_counters()
    return None if counters is None else _served_line("dpnp arrays", counters, "allocations", BYPASS_REASONS)


def _sycl_counters() -> Optional[Dict[str, int]]:
    """What the SYCL interposer served and forwarded, if it was installed."""
    from .._integrations.install import sycl_interposer_installed
    if not sycl_interposer_installed():
        return None
    from .._integrations import sycl_interposer as _sycl_interposer
    return _sycl_interposer.counters()


def _sycl_counters_line() -> Optional[str]:
    from .._integrations.sycl_interposer import REASONS
    counters = _sycl_counters()
    if counters is None:
        return None
    refused = f"; {counters['refused.calls']} refused (out of memory)" if counters["refused.calls"] else ""
    return _served_line("dpnp C++ scratch", counters, "calls", REASONS) + refused


def _record_for_report(path: str) -> None:
    """``run --report``: a folder to write into, and every available device
    type's memory history recorded from before the script starts."""
    from .._runtime import devices as _devices
    _check_folder_of(path)
    for name in _devices.KNOWN_TYPES:
        if _devices.is_available(name):
            _memory_api(name)._record_memory_history(max_entries=REPORT_MAX_ENTRIES)


def _write_run_report(path: str, script: str) -> None:
    """``run --report``: the report of the pool the summary shows first."""
    from .._observe.report import write_report
    from .._observe.history import history
    from .._runtime.devices import DEVICE_POOLS
    type_name, index = _pools_to_report(None)[0]
    api = _memory_api(type_name)
    snapshot = api._snapshot()
    try:
        write_report(snapshot, path, device=index, stats=api.memory_stats(index),
                     title=f"unimem memory report: {os.path.basename(script)} ({type_name} device {index})")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    print(f"unimem: wrote {path}", file=sys.stderr)
    traces = snapshot.get("device_traces") or []
    if history(DEVICE_POOLS[type_name]).enabled is None and not (index < len(traces) and traces[index]):
        # PyTorch's recipe ends with _record_memory_history(enabled=None), which
        # drops the history, the run's too: say so rather than leave an empty timeline
        print(f"unimem: the script stopped recording the memory history (_record_memory_history(enabled="
              f"None) drops it), so {path} has no timeline; a snapshot the script dumped before "
              f"that has it: python -m unimem view SNAPSHOT", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    if args.output:
        _check_folder_of(args.output)
    if args.report:
        _record_for_report(args.report)
    code = _run_script([args.script] + args.args, install=True, sycl_interpose=args.sycl_interpose)
    sys.stdout.flush()                   # the script's output first, where both reach a terminal
    # Apart from the script's own standard output, as time and profilers keep theirs.
    _write_output(_summary_text(None, args.abbreviated), args.output, sys.stderr)
    if args.report:
        _write_run_report(args.report, args.script)
    return code


def _summary(args: argparse.Namespace) -> int:
    # The summary on stdout must be the only thing there.
    code = _run_script(args.script, install=True, quiet_stdout=True)
    _write_output(_summary_text(args.device, args.abbreviated), None, sys.stdout)
    return code


def _stats(args: argparse.Namespace) -> int:
    from .. import host
    from .._runtime.devices import DEVICE_POOLS
    if args.output:
        _check_folder_of(args.output)
    # The statistics on stdout must be the only thing there.
    code = _run_script(args.script, install=True, quiet_stdout=args.output is None)
    pools = _pools_to_report(args.device)
    by_device: Dict[str, Dict[str, Any]] = {
        DEVICE_POOLS[name].label(index): dict(_memory_api(name).memory_stats(index)) for name, index in pools}
    first = next(iter(by_device))
    view = {"device": first, "memory_stats": by_device[first], "devices": by_device,
            "host_memory_stats": dict(host.host_memory_stats())}
    counters = _dpnp_counters()
    if counters is not None:
        view["dpnp_allocator"] = counters
    scratch = _sycl_counters()
    if scratch is not None:
        view["sycl_interposer"] = scratch
    if args.json:
        text = json.dumps(view, indent=2, sort_keys=True) + "\n"
    else:
        lines = []
        for label, stats in by_device.items():
            lines.append(f"device {label}")
            lines.extend(f"{key} {value}" for key, value in stats.items())
        lines.extend(f"host.{key} {value}" for key, value in view["host_memory_stats"].items())
        text = "\n".join(lines) + "\n"
    _write_output(text, args.output, sys.stdout)
    return code


def _cluster(args: argparse.Namespace) -> int:
    try:
        from .. import dask as unimem_dask
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    try:
        print(unimem_dask.cluster_summary(args.address, timeout=args.timeout))
    except (OSError, TimeoutError, ValueError) as exc:
        raise CommandError(f"cannot read the Dask cluster at {args.address}: {type(exc).__name__}: {exc}") from None
    return 0


# ---------------------------------------------------------------------------
# the parser
# ---------------------------------------------------------------------------
def build_parser(prog: str = "unimem") -> argparse.ArgumentParser:
    """The argument parser; ``prog`` is how the usage line names the program."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="unimem: caching allocation and memory statistics for CuPy, dpnp and host memory.")
    parser.add_argument("--version", action=VersionAction,
                        help="print the installed version of unimem (and where it is imported from) and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    demo = commands.add_parser("demo", help="train a small MLP on the default device through the pool "
                                            "and show what the pool did")
    demo.add_argument("--steps", type=_positive_int, default=300, help="training steps (default: %(default)s)")
    demo.add_argument("--out", default="unimem-demo", type=_output_folder,
                      help="folder for snapshot.pickle and timeline.png (default: %(default)s)")
    demo.add_argument("--no-oom", action="store_true", help="do not provoke the example out-of-memory error")
    demo.set_defaults(handler=_demo)

    plot = commands.add_parser("plot", help="draw a snapshot's memory timeline and segment map (PNG)")
    plot.add_argument("snapshot", help="a pickled snapshot (_dump_snapshot, or the demo's snapshot.pickle); "
                                       "read without running any code it names")
    plot.add_argument("-o", "--output", default="timeline.png", type=_output_file,
                      help="the PNG to write (default: %(default)s)")
    plot.add_argument("-d", "--device", type=_device_index, default=None,
                      help="device index (default: the busiest)")
    plot.add_argument("--source-lines", action="store_true",
                      help="name allocation sites by their source line, read from the files the snapshot's "
                           "frames name (regular files only, the first MiB of each); without it no path "
                           "named in the snapshot is opened")
    plot.set_defaults(handler=_plot)

    view = commands.add_parser("view", help="write a snapshot's memory report: one interactive HTML file "
                                            "that opens offline")
    view.add_argument("snapshot", help="a pickled snapshot (_dump_snapshot, or the demo's snapshot.pickle); "
                                       "read without running any code it names")
    view.add_argument("-o", "--output", default="memory.html", type=_output_file,
                      help="the HTML file to write (default: %(default)s)")
    view.add_argument("-d", "--device", type=_device_index, default=None,
                      help="device index (default: the busiest)")
    view.set_defaults(handler=_view)

    run = commands.add_parser("run", help="run a script with unimem as the array library's allocator "
                                          "and print the memory summary at exit (on standard error)")
    run.add_argument("script", help="the Python script to run as __main__ (a file, or a folder with a "
                                    "__main__.py); run's options come before it")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    run.add_argument("-o", "--output", metavar="FILE", default=None, type=_output_file,
                     help="write the memory summary into FILE (default: standard error, apart from the "
                          "script's own standard output)")
    run.add_argument("--abbreviated", action="store_true", help="no per-pool rows in the summary")
    run.add_argument("--sycl-interpose", action="store_true",
                     help="also serve dpnp's C++ scratch buffers (its extensions' sycl::aligned_alloc and "
                          "sycl::free) from unimem's pools, by interposing SYCL's USM functions before dpnp "
                          f"is imported; {SYCL_INTERPOSE_ENV}=1 does the same for run, summary and stats")
    run.add_argument("--report", metavar="HTML", default=None, type=_output_file,
                     help="record the memory history while the script runs and write its memory report "
                          "(as `view` does) into HTML")
    run.set_defaults(handler=_run)

    summary = commands.add_parser("summary", help="print the memory summary table of this process "
                                                  "(after running SCRIPT, if given)")
    summary.add_argument("--device", type=_device_index, default=None,
                         help="device index of the current accelerator (default: every pool in use)")
    summary.add_argument("--abbreviated", action="store_true", help="no per-pool rows")
    summary.add_argument("script", nargs=argparse.REMAINDER,
                         help="a script and its arguments (its standard output goes to standard error)")
    summary.set_defaults(handler=_summary)

    stats = commands.add_parser("stats", help="print the memory statistics of this process "
                                              "(after running SCRIPT, if given)")
    stats.add_argument("--json", action="store_true",
                       help="as JSON (on stdout, or into -o FILE)")
    stats.add_argument("-o", "--output", default=None, metavar="FILE", type=_output_file,
                       help="write the statistics to FILE instead of stdout")
    stats.add_argument("--device", type=_device_index, default=None,
                       help="device index of the current accelerator (default: every pool in use)")
    stats.add_argument("script", nargs=argparse.REMAINDER,
                       help="a script and its arguments (its standard output goes to standard error, "
                            "unless -o FILE takes the statistics)")
    stats.set_defaults(handler=_stats)

    cluster = commands.add_parser("cluster", help="print every Dask worker's unimem statistics")
    cluster.add_argument("address", help="the scheduler's address, e.g. tcp://10.0.0.1:8786")
    cluster.add_argument("--timeout", type=_positive_seconds, default=10.0,
                         help="seconds to wait for the cluster (default: %(default)s)")
    cluster.set_defaults(handler=_cluster)
    return parser


def main(argv: Optional[List[str]] = None, prog: str = "unimem") -> int:
    """Run the command line with ``argv`` (``sys.argv[1:]`` by default);
    returns the exit status."""
    args = build_parser(prog).parse_args(argv)
    try:
        return args.handler(args)
    except CommandError as exc:
        print(f"{prog} {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        print(f"{prog} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


