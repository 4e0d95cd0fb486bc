"""Prometheus metrics: every unimem statistic of every device in use.

::

    import unimem.prometheus
    unimem.prometheus.register()                 # into prometheus_client's default registry
    prometheus_client.start_http_server(8000)

Each statistic of :func:`unimem.accelerator.memory_stats` (and of the pinned pool's
:func:`unimem.host_memory_stats`) is a series named after its key, typed as
Prometheus' naming rules ask, with labels ``device`` (``xpu:0``, ``cuda:1``,
``cpu:0``, ``host`` for the pinned pool, ``xpu-shared:0``) and ``pool``
(``all``, ``large_pool``, ``small_pool``; ``all`` for a statistic of the
whole device or host pool):

* ``<name>.<pool>.current`` is the gauge ``unimem_<name>``, and ``.peak`` the
  gauge ``unimem_<name>_peak``;
* ``.allocated`` and ``.freed``, which only grow, are the counters
  ``unimem_<name>_allocated_total`` and ``unimem_<name>_freed_total``, as are
  the event counts ``num_*`` (``unimem_num_ooms_total``);
* the pinned pool's timings, kept in microseconds, are in seconds: the summary
  ``unimem_host_alloc_time_seconds`` (``_sum`` and ``_count``) and the gauges
  ``unimem_host_alloc_time_max_seconds`` and ``..._min_seconds`` (the average
  is ``_sum / _count``).

For example::

    unimem_allocated_bytes{device="xpu:0",pool="large_pool"} 2.097152e+06
    unimem_allocated_bytes_peak{device="xpu:0",pool="all"} 4.194304e+06
    unimem_num_ooms_total{device="xpu:0",pool="all"} 0.0

``reset_peak_stats`` and ``reset_accumulated_stats`` reset the peaks and the
counters; Prometheus' ``rate()`` reads a counter that drops as a reset.
Only allocators that exist are reported; nothing is created by scraping.
Needs ``prometheus_client``: ``pip install -e ".[prometheus]"`` in a checkout
of unimem (the name ``unimem`` on PyPI is another project).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

try:
    import prometheus_client  # noqa: F401
except ImportError as exc:
    raise ImportError("unimem.prometheus needs prometheus_client: pip install prometheus_client, "
                      "or pip install -e \".[prometheus]\" in unimem's checkout") from exc

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from . import _core, host
from ._runtime.pools import PoolKind, named_pools

LABELS = ["device", "pool"]
WHOLE = "all"                     # the pool label of a statistic of the whole device or host pool
MICROSECONDS_PER_SECOND = 1_000_000


class Series(NamedTuple):
    """Where one statistic goes: its family (name and type) and its pool label."""
    family: str
    kind: type
    pool: str


_STAT_PARTS = {"current": ("", GaugeMetricFamily), "peak": ("_peak", GaugeMetricFamily),
               "allocated": ("_allocated", CounterMetricFamily), "freed": ("_freed", CounterMetricFamily)}
_TIMING_GAUGES = {"max": "_max_seconds", "min": "_min_seconds"}


def _is_timing(name: str) -> bool:
    return name.endswith("_time")


def _series(key: str) -> Optional[Series]:
    """Where the statistic ``key`` goes; None for what another series already
    says (a timing's average) and for a key of no known shape."""
    parts = key.split(".")
    name = parts[0]
    if len(parts) == 1:
        kind = CounterMetricFamily if name.startswith("num_") else GaugeMetricFamily
        return Series(f"unimem_{name}", kind, WHOLE)
    if len(parts) == 2 and _is_timing(name):
        if parts[1] in ("total", "count"):
            return Series(f"unimem_{name}_seconds", SummaryMetricFamily, WHOLE)
        suffix = _TIMING_GAUGES.get(parts[1])
        return None if suffix is None else Series(f"unimem_{name}{suffix}", GaugeMetricFamily, WHOLE)
    pool = parts[1] if len(parts) == 3 else WHOLE
    part = _STAT_PARTS.get(parts[-1])
    if part is None or len(parts) > 3:
        return None
    return Series(f"unimem_{name}{part[0]}", part[1], pool)


def _documentation(key: str, series: Series) -> str:
    """Which statistic a family holds, for its HELP line."""
    parts = key.split(".")
    if len(parts) == 3:
        parts[1] = "<pool>"
    if series.kind is SummaryMetricFamily:
        parts[-1] = "{total,count}"
    text = f"unimem memory statistic {'.'.join(parts)} (see memory_stats)"
    return text + ", in seconds" if series.family.endswith("_seconds") else text


def families(statistics: Iterable[Tuple[str, Dict[str, int]]]) -> List[Any]:
    """The metric families of ``[(device label, statistics), ...]``."""
    out: Dict[str, Any] = {}
    timings: Dict[Tuple[str, str, str], Dict[str, float]] = {}
    for device, stats in statistics:
        for key, value in stats.items():
            series = _series(key)
            if series is None:
                continue
            family = out.get(series.family)
            if family is None:
                family = out[series.family] = series.kind(series.family, _documentation(key, series),
                                                          labels=LABELS)
            if series.kind is SummaryMetricFamily:
                timings.setdefault((series.family, device, series.pool), {})[key.rsplit(".", 1)[1]] = value
                continue
            scale = MICROSECONDS_PER_SECOND if series.family.endswith("_seconds") else 1
            family.add_metric([device, series.pool], float(value) / scale)
    for (name, device, pool), parts in timings.items():
        out[name].add_metric([device, pool], count_value=parts.get("count", 0),
                             sum_value=float(parts.get("total", 0)) / MICROSECONDS_PER_SECOND)
    return list(out.values())


def snapshot_statistics() -> List[Tuple[str, Dict[str, int]]]:
    """``[(device label, statistics), ...]`` for every allocator in use: each
    device type's, the shared USM pools', and the pinned host pool's (in
    :func:`unimem.host_memory_stats`' names)."""
    out: List[Tuple[str, Dict[str, int]]] = []
    for pool in named_pools():
        if pool.kind is PoolKind.PINNED_HOST:       # zeros until first used, as in PyTorch
            out.append((pool.label(0), dict(host.host_memory_stats())))
            continue
        registry = pool.existing_registry()
        if registry is None:
            continue
        for index, allocator in sorted(registry.initialized().items()):
            out.append((pool.label(index), dict(allocator.memory_stats())))
    return out


class UnimemCollector:
    """A ``prometheus_client`` collector of unimem's statistics."""

    def collect(self) -> Iterator[Any]:
        yield from families(snapshot_statistics())

    def describe(self) -> List[Any]:
        """The families every device's and the pinned pool's statistics make
        (without samples; which devices are in use is known at collect time):
        prometheus_client refuses a second collector whose names clash."""
        keys = dict.fromkeys((*_core.MEMORY_STATS_KEYS, *host.host_memory_stats()), 0)
        described = families([("", keys)])
        for family in described:
            family.samples = []
        return described


def register(registry: Optional[Any] = None) -> UnimemCollector:
    """Register a :class:`UnimemCollector` (into ``prometheus_client.REGISTRY``
    by default) and return it. A second one in the same registry is the
    ``ValueError`` prometheus_client raises for duplicated time series."""
    if registry is None:
        from prometheus_client import REGISTRY as registry  # type: ignore[no-redef]
    collector = UnimemCollector()
    registry.register(collector)
    return collector
