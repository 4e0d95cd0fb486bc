"""Prometheus metrics: every unimem statistic of every device in use.

::

    import unimem.prometheus
    unimem.prometheus.register()                 # into prometheus_client's default registry
    prometheus_client.start_http_server(8000)

Each statistic is a gauge named after its key, with labels ``device``
(``xpu:0``, ``cuda:1``, ``cpu:0``, ``host`` for the pinned pool,
``xpu-shared:0``), ``pool`` (``all``, ``large_pool``, ``small_pool``, or
empty) and ``metric`` (``current``, ``peak``, ``allocated``, ``freed``, or
``value`` for counters, ``total``/``max``/``min``/``count``/``avg`` for the
host timing counters). For example::

    unimem_allocated_bytes{device="xpu:0",pool="large_pool",metric="peak"} 2.097152e+06
    unimem_num_ooms{device="xpu:0",pool="",metric="value"} 0.0

Only allocators that exist are reported; nothing is created by scraping.
Needs ``prometheus_client``: ``pip install -e ".[prometheus]"`` in a checkout
of unimem (the name ``unimem`` on PyPI is another project).
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

try:
    import prometheus_client  # noqa: F401
except ImportError as exc:
    raise ImportError("unimem.prometheus needs prometheus_client: pip install prometheus_client, "
                      "or pip install -e \".[prometheus]\" in unimem's checkout") from exc

from . import _core, host
from ._runtime.pools import PoolKind, named_pools

LABELS = ["device", "pool", "metric"]


def _split(key: str) -> Tuple[str, str, str]:
    """A statistic's key as (name, pool, metric)."""
    parts = key.split(".")
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    if len(parts) == 2:
        return parts[0], "", parts[1]
    return key, "", "value"


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
        from prometheus_client.core import GaugeMetricFamily
        families: Dict[str, Any] = {}
        for device, stats in snapshot_statistics():
            for key, value in stats.items():
                name, pool, metric = _split(key)
                family = families.get(name)
                if family is None:
                    family = families[name] = GaugeMetricFamily(
                        f"unimem_{name}", f"unimem memory statistic {name!r} (see memory_stats)",
                        labels=LABELS)
                family.add_metric([device, pool, metric], float(value))
        yield from families.values()

    def describe(self) -> List[Any]:
        """The families every device's and the pinned pool's statistics make
        (without samples; which devices are in use is known at collect time):
        prometheus_client refuses a second collector whose names clash."""
        from prometheus_client.core import GaugeMetricFamily
        names = {_split(key)[0] for key in (*_core.MEMORY_STATS_KEYS, *host.host_memory_stats())}
        return [GaugeMetricFamily(f"unimem_{name}", f"unimem memory statistic {name!r} (see memory_stats)",
                                  labels=LABELS) for name in sorted(names)]


def register(registry: Optional[Any] = None) -> UnimemCollector:
    """Register a :class:`UnimemCollector` (into ``prometheus_client.REGISTRY``
    by default) and return it. A second one in the same registry is the
    ``ValueError`` prometheus_client raises for duplicated time series."""
    if registry is None:
        from prometheus_client import REGISTRY as registry  # type: ignore[no-redef]
    collector = UnimemCollector()
    registry.register(collector)
    return collector
