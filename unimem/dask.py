"""unimem on Dask: every worker's arrays from unimem's pools, and the memory
statistics of the whole cluster in one place.

::

    from dask.distributed import Client, LocalCluster
    import unimem.dask

    if __name__ == "__main__":                     # LocalCluster starts processes
        client = Client(LocalCluster(n_workers=2))
        client.register_plugin(unimem.dask.UnimemPlugin(alloc_conf="roundup_power2_divisions:4",
                                                        pool_size="1 GiB"))
        ...                                        # CuPy / dpnp work on the workers
        print(unimem.dask.memory_summary(client))  # per worker: allocated, reserved, peaks
        df = unimem.dask.memory_stats(client)      # columns: worker, device, statistic, value

The plugin is what ``dask_cuda.LocalCUDACluster(rmm_pool_size=...)`` does for
RMM: on every worker, present and future, it makes unimem the allocator of the
worker's array library (CuPy on GPUs, dpnp on SYCL devices, see
:func:`unimem.install_allocators`), with the options given, and undoes it all
when it is removed. The statistics are gathered with ``client.run``: a worker
that does not answer in time is reported, not waited for.

``pip install -e ".[dask]"`` in a checkout of unimem brings ``distributed``
and ``pandas`` (the name ``unimem`` on PyPI is another project).
"""
from __future__ import annotations

import asyncio
import numbers
import os
import threading
import uuid
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

try:
    import pandas
    from dask.utils import parse_bytes
    from distributed import Client
    from distributed.comm import resolve_address
    from distributed.diagnostics.plugin import WorkerPlugin
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError("unimem.dask needs dask.distributed and pandas: pip install distributed pandas, "
                      "or pip install -e \".[dask]\" in unimem's checkout") from exc

from . import _core, host
from ._runtime import devices as _devices
from ._runtime.config import ENV_VAR, parse_alloc_conf
from ._integrations.install import install_allocators, installed_allocators, uninstall_allocators
from ._memory_api import MemoryAPI, check_fraction

__all__ = ["UnimemPlugin", "memory_stats", "memory_summary", "cluster_summary"]

AllocConf = Union[None, str, Mapping[str, Any]]
PLUGIN_NAME = "unimem"
# The device column's name for the pinned host pool (unimem.host).
HOST_POOL = host.POOL.label(0)


def _alloc_conf_text(alloc_conf: AllocConf) -> Optional[str]:
    """``UNIMEM_ALLOC_CONF``'s text for ``alloc_conf`` (a string as is, or a
    mapping such as ``{"max_split_size_mb": 256, "roundup_power2_divisions":
    {256: 1, ">": 8}}``)."""
    if alloc_conf is None or isinstance(alloc_conf, str):
        return alloc_conf
    if not isinstance(alloc_conf, Mapping):
        raise TypeError(f"alloc_conf must be a str or a mapping of UNIMEM_ALLOC_CONF options, "
                        f"not {type(alloc_conf).__name__}")
    parts = []
    for key, value in alloc_conf.items():
        if not isinstance(key, str):
            raise TypeError(f"alloc_conf keys must be option names (str), got {key!r}")
        if isinstance(value, Mapping):
            value = "[" + ",".join(f"{boundary}:{divisions}" for boundary, divisions in value.items()) + "]"
        parts.append(f"{key}:{value}")
    return ",".join(parts)


def _pool_bytes(pool_size: Union[None, int, str]) -> int:
    if pool_size is None:
        return 0
    if isinstance(pool_size, str):
        size = parse_bytes(pool_size)      # raises ValueError on what is not a size
    elif isinstance(pool_size, numbers.Integral) and not isinstance(pool_size, bool):
        size = int(pool_size)
    else:
        raise TypeError(f"pool_size must be a number of bytes or a string such as '4 GiB', "
                        f"not {type(pool_size).__name__}")
    if size < 0:
        raise ValueError(f"pool_size must not be negative, got {pool_size!r}")
    return size


def _settings_differ(existing: Mapping[str, Any], wanted: Mapping[str, Any]) -> List[str]:
    """The options in which an existing allocator's settings differ from ``wanted``."""
    def normal(key: str, value: Any) -> Any:
        if key == "max_split_size" and value in (None, -1):
            return None
        if key == "max_reserved_ratio" and not value:
            return None
        return value
    return [key for key, value in wanted.items() if normal(key, existing.get(key)) != normal(key, value)]


class UnimemPlugin(WorkerPlugin):
    """Make unimem the allocator of every Dask worker's array library.

    Register it with ``client.register_plugin(UnimemPlugin(...))``: each
    worker, including those that join later, then allocates its CuPy arrays
    (on GPUs) or dpnp arrays (on SYCL devices) from unimem's caching pool.

    Args:
        alloc_conf (str or mapping, optional): ``UNIMEM_ALLOC_CONF`` options
            (PyTorch's ``PYTORCH_CUDA_ALLOC_CONF`` syntax), e.g.
            ``"max_split_size_mb:256,garbage_collection_threshold:0.6"`` or
            ``{"max_split_size_mb": 256}``. Checked here, before any worker
            sees them.
        memory_fraction (float, optional): the share of the worker's device
            memory its pool may reserve, as ``set_per_process_memory_fraction``.
        pool_size (int or str, optional): bytes (or ``"4 GiB"``) to reserve
            up front on the worker's device, like ``rmm_pool_size``: one
            segment that later large allocations are carved from.
            ``empty_cache`` gives it back like any cached memory.
        device_type (str, optional): ``"cuda"``, ``"xpu"`` or ``"cpu"``; the
            worker's current accelerator when left out.

    The options apply to allocators created after the plugin is set up; a
    worker that already allocated through unimem with other options refuses
    the plugin (restart it: ``client.restart()``). Teardown undoes everything
    the plugin did and releases the memory cached on the worker's device.
    """

    name = PLUGIN_NAME

    def __init__(self, alloc_conf: AllocConf = None, *, memory_fraction: Optional[float] = None,
                 pool_size: Union[None, int, str] = None, device_type: Optional[str] = None) -> None:
        self.alloc_conf = _alloc_conf_text(alloc_conf)
        settings = parse_alloc_conf(self.alloc_conf)          # a bad option fails here, not on the workers
        self._core_kwargs = settings.core_kwargs()
        self.memory_fraction = None if memory_fraction is None else check_fraction(memory_fraction)
        self.pool_size = _pool_bytes(pool_size)
        if settings.max_split_size is not None and self.pool_size >= settings.max_split_size:
            raise ValueError(f"pool_size ({self.pool_size} bytes) is not below max_split_size_mb: the "
                             f"pre-reserved segment would be one block that is never split")
        if device_type is not None and device_type not in _devices.KNOWN_TYPES:
            raise ValueError(f"device_type must be one of {', '.join(_devices.KNOWN_TYPES)}, got {device_type!r}")
        self.device_type = device_type

    def __repr__(self) -> str:
        return (f"UnimemPlugin(alloc_conf={self.alloc_conf!r}, memory_fraction={self.memory_fraction!r}, "
                f"pool_size={self.pool_size!r}, device_type={self.device_type!r})")

    # -- on the worker ----------------------------------------------------
    def setup(self, worker: Any = None) -> None:
        """Install unimem on this worker (Dask calls it on every worker).

        Workers that share a process (``LocalCluster(processes=False)``)
        share its allocators and environment: the first one's setup changes
        them, the others' only count. A setup with other options (the plugin
        registered again: Dask sets the new one up worker by worker) undoes
        the process's and applies its own for all of them, unless the
        device's allocator already runs with other ``alloc_conf`` options,
        which apply to new allocators only: then it is refused before
        anything is undone, and the process's setup stays in force."""
        global _in_process
        with _process_lock:
            workers = set()
            if _in_process is not None:
                if _in_process.options == self._options():
                    _in_process.workers.add(_worker_key(worker, self))
                    return
                _refuse_other_settings(self, self._device_type())
                workers = _in_process.workers
                done, _in_process = _in_process, None
                done.undo()
            done = _ProcessSetup(self._options())
            try:
                done.apply(self)
            except BaseException:
                done.undo()
                raise
            done.workers = workers | {_worker_key(worker, self)}
            _in_process = done

    def _device_type(self) -> _devices.DeviceType:
        """The device type this plugin sets up (the current one when not named)."""
        return _devices.get_type(self.device_type) if self.device_type else _devices.current_type()

    def _options(self) -> Tuple[Any, ...]:
        """What this plugin does to a process, spelling aside: two plugins
        with equal options set a process up alike."""
        device_type = self.device_type or _devices.current_type().name
        return (self.alloc_conf is None, repr(sorted(self._core_kwargs.items())), self.memory_fraction,
                self.pool_size, device_type)

    def teardown(self, worker: Any = None) -> None:
        """Undo :meth:`setup` on this worker (in its process, once the last
        worker there is torn down)."""
        global _in_process
        with _process_lock:
            done = _in_process
            if done is None or _worker_key(worker, self) not in done.workers:
                return
            done.workers.discard(_worker_key(worker, self))
            if done.workers:
                return
            _in_process = None
            done.undo()


def _worker_key(worker: Any, plugin: UnimemPlugin) -> int:
    """Which worker a setup or teardown is for (the plugin itself when Dask
    passes none, as a direct call does)."""
    return id(worker if worker is not None else plugin)


class _ProcessSetup:
    """What the plugin changed in this process, for the last teardown to put
    back: the environment, the array libraries installed, the memory fraction,
    and the device whose cache it emptied."""

    def __init__(self, options: Tuple[Any, ...]) -> None:
        self.options = options
        self.workers: set = set()
        self.env_before: Optional[Tuple[bool, Optional[str]]] = None
        self.installed: List[str] = []
        self.device: Optional[Tuple[str, int]] = None
        self.fraction_before: Optional[float] = None

    def apply(self, plugin: UnimemPlugin) -> None:
        self.env_before = (ENV_VAR in os.environ, os.environ.get(ENV_VAR))
        if plugin.alloc_conf is not None:
            os.environ[ENV_VAR] = plugin.alloc_conf
        dtype = plugin._device_type()
        _refuse_other_settings(plugin, dtype)
        before = set(installed_allocators())
        install_allocators()
        self.installed = [name for name in installed_allocators() if name not in before]
        index = dtype.current_index()
        self.device = (dtype.name, index)
        api = MemoryAPI(dtype.name)
        if plugin.memory_fraction is not None:
            self.fraction_before = api.get_per_process_memory_fraction(index)
            api.set_per_process_memory_fraction(plugin.memory_fraction, index)
        if plugin.pool_size:
            fresh = not api.memory_reserved(index)
            # Reserve by allocating and freeing: the segment stays cached.
            ptr = dtype.registry.alloc(plugin.pool_size, index, None)
            dtype.registry.delete(ptr)
            if fresh:
                # The reservation is not the workload's: its peaks start here.
                api.reset_peak_memory_stats(index)

    def undo(self) -> None:
        try:
            if self.installed:
                uninstall_allocators(self.installed)
            if self.device is not None:
                type_name, index = self.device
                api = MemoryAPI(type_name)
                if self.fraction_before is not None:
                    api.set_per_process_memory_fraction(self.fraction_before, index)
                api.empty_cache()
        finally:
            if self.env_before is not None:
                was_set, value = self.env_before
                if was_set:
                    os.environ[ENV_VAR] = value  # type: ignore[assignment]
                else:
                    os.environ.pop(ENV_VAR, None)


def _refuse_other_settings(plugin: UnimemPlugin, dtype: _devices.DeviceType) -> None:
    if plugin.alloc_conf is None:
        return
    for index, allocator in dtype.registry.initialized().items():
        differ = _settings_differ(allocator.settings, plugin._core_kwargs)
        if differ:
            raise RuntimeError(
                f"unimem: {dtype.name}:{index} on this worker already allocates with other options "
                f"({', '.join(differ)}); UNIMEM_ALLOC_CONF applies to new allocators only. "
                f"Register the plugin before the first allocation, or restart the workers.")


_process_lock = threading.Lock()
_in_process: Optional[_ProcessSetup] = None


_token: Tuple[int, str] = (0, "")


def process_token() -> str:
    """A name for this process that no other has (host names and process
    ids repeat across containers): memory_summary counts each process's
    pools once. A forked child makes its own (no fork handler: the
    runtime's own is the only one)."""
    global _token
    if _token[0] != os.getpid():
        _token = (os.getpid(), uuid.uuid4().hex)
    return _token[1]


def worker_report(dask_worker: Any = None) -> Dict[str, Any]:
    """What :func:`memory_stats` gathers from one worker: ``memory_stats`` of
    every device unimem serves there (the current one always, any other once
    it has an allocator), the pinned host pool's statistics if it was used,
    which array libraries are routed to unimem, and whether the plugin is on."""
    devices: Dict[str, Dict[str, Any]] = {}
    current = _devices.current_type()
    wanted = {(current.name, current.current_index())}
    for dtype in _devices.probed_types():
        wanted.update((dtype.name, index) for index in dtype.registry.initialized())
    for type_name, index in sorted(wanted, key=lambda d: (_devices.KNOWN_TYPES.index(d[0]), d[1])):
        devices[_devices.DEVICE_POOLS[type_name].label(index)] = dict(MemoryAPI(type_name).memory_stats(index))
    if host.is_initialized():
        devices[HOST_POOL] = dict(host.host_memory_stats())
    plugins = getattr(dask_worker, "plugins", {})
    return {"devices": devices, "installed": installed_allocators(), "plugin": PLUGIN_NAME in plugins,
            "process": process_token()}


def _gather(client: Client, workers: Optional[List[str]], timeout: float
            ) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, str]]:
    """Ask every worker for its :func:`worker_report`, each bounded by
    ``timeout`` seconds: (reports by worker, why each missing worker is missing)."""
    if getattr(client, "asynchronous", False):
        raise TypeError("unimem.dask needs a synchronous distributed.Client (not asynchronous=True); "
                        "from async code, call it in a thread: await asyncio.to_thread(memory_stats, client)")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if workers is None:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    elif isinstance(workers, str):
        raise TypeError("workers must be a list of worker addresses, not a str")
    else:
        workers = list(workers)

    async def ask(address: str) -> Any:
        try:
            answers = await asyncio.wait_for(
                client.run(worker_report, workers=[address], on_error="return", asynchronous=True), timeout)
        except asyncio.TimeoutError:
            return TimeoutError(f"no answer within {timeout:g} s")
        except Exception as exc:   # the scheduler could not reach it
            return exc
        return answers.get(address, LookupError("not a worker of this cluster"))

    async def ask_all() -> List[Any]:
        return await asyncio.gather(*(ask(address) for address in workers))

    answers = client.sync(ask_all) if workers else []
    reports: Dict[str, Dict[str, Any]] = {}
    missing: Dict[str, str] = {}
    for address, answer in zip(workers, answers):
        if isinstance(answer, BaseException):
            missing[address] = f"{type(answer).__name__}: {answer}".rstrip(": ")
        else:
            reports[address] = answer
    return reports, missing


def memory_stats(client: Client, workers: Optional[List[str]] = None, timeout: float = 10.0) -> "pandas.DataFrame":
    r"""Return every worker's memory allocator statistics, for every device.

    One row per (worker, device, statistic), with the statistic's value: the
    keys and values of :func:`unimem.accelerator.memory_stats` on each of the
    worker's devices (``"cuda:0"``, ``"xpu:0"``, ``"cpu:0"``), and of
    :func:`unimem.host_memory_stats` (device ``"host"``) where the pinned pool
    was used.

    Args:
        client: a ``distributed.Client`` of the cluster.
        workers (list of str, optional): the worker addresses to ask; every
            worker the scheduler knows when left out.
        timeout (float): seconds to wait for each worker.

    Workers that did not answer are in ``df.attrs["missing_workers"]``
    (address -> reason); the others are still reported.
    """
    reports, missing = _gather(client, workers, timeout)
    rows = [(address, device, statistic, value)
            for address, report in reports.items()
            for device, stats in report["devices"].items()
            for statistic, value in stats.items()]
    frame = pandas.DataFrame(rows, columns=["worker", "device", "statistic", "value"])
    frame["value"] = frame["value"].astype("int64")
    frame.attrs["missing_workers"] = missing
    return frame


SUMMARY_COLUMNS = (
    ("allocated", "allocated_bytes.all.current"),
    ("peak allocated", "allocated_bytes.all.peak"),
    ("reserved", "reserved_bytes.all.current"),
    ("peak reserved", "reserved_bytes.all.peak"),
    ("raw allocs", "num_device_alloc"),
)
# The same columns from host_memory_stats (device "host"), whose keys have
# no pool part and whose raw allocations are num_host_alloc, as PyTorch's.
HOST_SUMMARY_KEYS = ("allocated_bytes.current", "allocated_bytes.peak", "reserved_bytes.current",
                     "reserved_bytes.peak", "num_host_alloc")


def _summary_values(device: str, stats: Mapping[str, Any]) -> List[int]:
    """The summary's columns of one device's statistics (0 for a key a
    worker of another unimem version does not report)."""
    keys = HOST_SUMMARY_KEYS if device == "host" else tuple(key for _, key in SUMMARY_COLUMNS)
    return [int(stats.get(key, 0)) for key in keys]


def _summary_table(reports: Mapping[str, Mapping[str, Any]], missing: Mapping[str, str]) -> str:
    header = ("worker", "device") + tuple(title for title, _ in SUMMARY_COLUMNS)
    rows: List[Tuple[str, ...]] = []
    totals: Dict[str, List[int]] = {}
    counted = set()      # workers that share a process share its pools: each pool counts once
    for address in sorted(reports):
        for device, stats in reports[address]["devices"].items():
            values = _summary_values(device, stats)
            rows.append((address, device, *(_core.format_size(v) for v in values[:-1]), str(values[-1])))
            pool = (reports[address].get("process", address), device)
            if pool in counted:
                continue
            counted.add(pool)
            kind = device.split(":")[0]
            sums = totals.setdefault(kind, [0] * len(values))
            for i, value in enumerate(values):
                sums[i] += value
    total_rows = [(f"total ({kind})", "", *(_core.format_size(v) for v in sums[:-1]), str(sums[-1]))
                  for kind, sums in totals.items()]
    body = rows + total_rows
    widths = [max(len(row[i]) for row in [header] + body) for i in range(len(header))]

    def line(row: Tuple[str, ...]) -> str:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:])]
        return "  ".join(cells).rstrip()

    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    answered = len(reports)
    lines = [f"unimem memory across {answered + len(missing)} Dask workers "
             f"({answered} answered, {len(missing)} missing)", rule, line(header), rule]
    lines += [line(row) for row in rows]
    if total_rows:
        lines.append(rule)
        lines += [line(row) for row in total_rows]
    lines.append(rule)
    for address in sorted(missing):
        lines.append(f"missing: {address} ({missing[address]})")
    without_plugin = sorted(a for a, r in reports.items() if not r["plugin"])
    if without_plugin:
        lines.append(f"without the unimem plugin: {', '.join(without_plugin)}")
    return "\n".join(lines)


def memory_summary(client: Client, workers: Optional[List[str]] = None, timeout: float = 10.0) -> str:
    r"""Return a human-readable table of the cluster's memory: per worker and
    device, the current and peak allocated and reserved memory and the number
    of raw device allocations, with totals per device type (peaks are summed
    per worker, not simultaneous) and the workers that did not answer.

    Useful to print periodically during a job: ``print(memory_summary(client))``.
    Arguments as :func:`memory_stats`.
    """
    reports, missing = _gather(client, workers, timeout)
    return _summary_table(reports, missing)


def cluster_summary(address: str, timeout: float = 10.0) -> str:
    """:func:`memory_summary` of the cluster whose scheduler is at ``address``
    (what ``python -m unimem cluster ADDRESS`` prints)."""
    # An address Client cannot parse fails in its constructor, and the half
    # made Client then prints a traceback when it is collected: check first.
    resolve_address(address)
    with Client(address, timeout=timeout, set_as_default=False) as client:
        return memory_summary(client, timeout=timeout)
