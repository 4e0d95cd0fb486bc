"""unimem on Dask: the worker plugin and the cluster's statistics, on a real
LocalCluster of worker processes over loopback."""
import os
import signal
import subprocess
import sys

import dask
import pytest
from distributed import Client, LocalCluster

import unimem
import unimem.dask as unimem_dask
from unimem import _core
from unimem._runtime import devices as _devices
from unimem._integrations import install as _install

MiB = 1 << 20
ALLOC_CONF = "max_split_size_mb:256,garbage_collection_threshold:0.8"
POOL_SIZE = 64 * MiB
# Per task: a small-pool array, a large one carved from the pre-reserved pool, ...
TASK_ARRAY_BYTES = (4096, 512 * 1024, 3 * MiB, 12 * MiB)
TASKS_PER_WORKER = 12


# ---------------------------------------------------------------------------
# run on the workers (module-level functions: Dask pickles them by reference)
# ---------------------------------------------------------------------------
def _library():
    """The worker's array library: what the plugin routed to unimem."""
    name = _devices.current_type_name()
    if name == "cuda":
        import cupy
        return cupy
    if name == "xpu":
        import dpnp
        return dpnp
    return unimem.cpu


def array_task(i):
    """Make arrays with the worker's library, compute on them, drop them."""
    from distributed import get_worker
    library = _library()
    arrays = [library.zeros(nbytes // 4, dtype="float32") for nbytes in TASK_ARRAY_BYTES]
    for array in arrays:
        array += i
    total = sum(float(array.sum()) for array in arrays)
    return get_worker().address, len(arrays), sum(TASK_ARRAY_BYTES), total


def plugin_state(dask_worker):
    dtype = _devices.current_type()
    index = dtype.current_index()
    allocator = dtype.registry.peek(index)
    return {
        "plugin": "unimem" in dask_worker.plugins,
        "installed": unimem.installed_allocators(),
        "device_type": dtype.name,
        "env": os.environ.get("UNIMEM_ALLOC_CONF"),
        "max_split_size": None if allocator is None else allocator.settings["max_split_size"],
        "fraction": allocator.get_memory_fraction() if allocator is not None else None,
        "reserved": unimem.accelerator.memory_reserved(index),
    }


def local_stats():
    """What the worker itself reports, through the public facade."""
    name = unimem.accelerator.current_accelerator().type
    index = unimem.accelerator.current_device_index()
    return f"{name}:{index}", dict(unimem.accelerator.memory_stats(index))


EXPECTED_LIBRARY = {"cuda": ["cupy"], "xpu": ["dpnp"], "cpu": []}


@pytest.fixture(scope="module")
def cluster():
    # The scheduler runs in this process: dead workers are given up on quickly.
    with dask.config.set({"distributed.comm.timeouts.connect": "5s"}):
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                          dashboard_address=None, worker_dashboard_address=None) as local_cluster:
            with Client(local_cluster) as client:
                client.register_plugin(unimem_dask.UnimemPlugin(
                    ALLOC_CONF, memory_fraction=0.5, pool_size="64 MiB"))
                yield local_cluster, client


def workers_of(client):
    return sorted(client.scheduler_info(n_workers=-1)["workers"])


def assert_plugin_on(state):
    assert state["plugin"]
    assert state["installed"] == EXPECTED_LIBRARY[state["device_type"]]
    assert state["env"] == ALLOC_CONF
    assert state["max_split_size"] == 256 * MiB
    assert state["fraction"] == 0.5
    assert state["reserved"] >= POOL_SIZE


# ---------------------------------------------------------------------------
# the cluster
# ---------------------------------------------------------------------------
def test_plugin_is_on_every_worker(cluster):
    _, client = cluster
    states = client.run(plugin_state)
    assert len(states) == 2
    for state in states.values():
        assert_plugin_on(state)
    # A SYCL device is the default here; a host fallback would test less.
    if _devices.current_type_name() == "xpu":
        assert {s["device_type"] for s in states.values()} == {"xpu"}


def test_workload_allocates_through_unimem(cluster):
    _, client = cluster
    workers = workers_of(client)
    before = {w: r["devices"] for w, r in client.run(unimem_dask.worker_report).items()}
    futures = [client.submit(array_task, i, workers=[w], pure=False)
               for w in workers for i in range(TASKS_PER_WORKER)]
    results = client.gather(futures)
    assert all(address in workers for address, *_ in results)

    frame = unimem_dask.memory_stats(client, workers=workers)
    assert frame.attrs["missing_workers"] == {}
    assert list(frame.columns) == ["worker", "device", "statistic", "value"]
    for worker in workers:
        device = next(d for d in before[worker] if d != unimem_dask.HOST_POOL)
        rows = frame[(frame.worker == worker) & (frame.device == device)]
        stats = dict(zip(rows.statistic, rows.value))
        old = before[worker][device]
        arrays = sum(n for address, n, _, _ in results if address == worker)
        nbytes = sum(b for address, _, b, _ in results if address == worker)
        assert arrays == len(TASK_ARRAY_BYTES) * TASKS_PER_WORKER
        # Every array came from the pool ...
        assert stats["allocation.all.allocated"] - old["allocation.all.allocated"] >= arrays
        assert stats["requested_bytes.all.allocated"] - old["requested_bytes.all.allocated"] >= nbytes
        assert stats["allocated_bytes.all.peak"] >= sum(TASK_ARRAY_BYTES)
        # ... and almost none from the device: the 12 MiB arrays are carved
        # from the pre-reserved pool, the small ones share one 2 MiB segment.
        assert stats["num_device_alloc"] <= 3, stats["num_device_alloc"]
        assert stats["allocated_bytes.all.current"] == old["allocated_bytes.all.current"]


def test_gathered_statistics_equal_what_each_worker_reports(cluster):
    _, client = cluster
    client.gather([client.submit(array_task, i, pure=False) for i in range(4)])
    local = client.run(local_stats)
    frame = unimem_dask.memory_stats(client)
    assert set(frame.worker) == set(local)
    for worker, (device, stats) in local.items():
        rows = frame[(frame.worker == worker) & (frame.device == device)]
        assert dict(zip(rows.statistic, (int(v) for v in rows.value))) == stats


def use_host_pool():
    unimem.host.caching_host_delete(unimem.host.caching_host_alloc(4096))
    return dict(unimem.host_memory_stats())


def test_the_pinned_host_pool_is_reported_as_device_host(cluster):
    _, client = cluster
    worker = workers_of(client)[-1]
    local = client.run(use_host_pool, workers=[worker])[worker]
    frame = unimem_dask.memory_stats(client, workers=[worker])
    rows = frame[frame.device == unimem_dask.HOST_POOL]
    assert dict(zip(rows.statistic, rows.value)) == local
    assert local["allocated_bytes.allocated"] >= 4096


def test_summary_table_and_cli(cluster):
    local_cluster, client = cluster
    workers = workers_of(client)
    reserved = client.run(lambda: unimem.accelerator.memory_reserved())
    table = unimem_dask.memory_summary(client)
    assert f"{len(workers)} answered, 0 missing" in table
    for worker in workers:
        line = next(line for line in table.splitlines() if line.startswith(worker))
        assert _core.format_size(reserved[worker]) in line
    total = next(line for line in table.splitlines() if line.startswith("total ("))
    assert _core.format_size(sum(reserved.values())) in total

    done = subprocess.run([sys.executable, "-m", "unimem", "cluster", local_cluster.scheduler_address,
                           "--timeout", "30"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for worker in workers:
        assert worker in done.stdout
    assert "0 missing" in done.stdout


def test_cli_reports_an_unreachable_scheduler():
    done = subprocess.run([sys.executable, "-m", "unimem", "cluster", "tcp://127.0.0.1:9", "--timeout", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "cannot read the Dask cluster at tcp://127.0.0.1:9" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_added_later_gets_the_plugin(cluster):
    local_cluster, client = cluster
    old = set(workers_of(client))
    local_cluster.scale(len(old) + 1)
    client.wait_for_workers(len(old) + 1, timeout=120)
    new = sorted(set(workers_of(client)) - old)
    assert new
    assert_plugin_on(client.run(plugin_state, workers=new)[new[0]])
    address, arrays, _, _ = client.submit(array_task, 1, workers=new, pure=False).result()
    assert address == new[0]
    frame = unimem_dask.memory_stats(client, workers=new)
    rows = frame[frame.statistic == "allocation.all.allocated"]
    assert rows.value.max() >= arrays


def test_an_asynchronous_client_is_refused_clearly(cluster):
    import asyncio
    local_cluster, _ = cluster

    async def ask():
        async with Client(local_cluster.scheduler_address, asynchronous=True) as client:
            with pytest.raises(TypeError, match="synchronous"):
                unimem_dask.memory_stats(client)
    asyncio.run(ask())


def test_bad_gather_arguments(cluster):
    _, client = cluster
    with pytest.raises(ValueError, match="timeout"):
        unimem_dask.memory_stats(client, timeout=0)
    with pytest.raises(TypeError, match="list of worker addresses"):
        unimem_dask.memory_stats(client, workers="tcp://127.0.0.1:1")


def test_unregistering_removes_it_cleanly(cluster):
    _, client = cluster
    client.unregister_worker_plugin("unimem")
    for state in client.run(plugin_state).values():
        assert not state["plugin"]
        assert state["installed"] == []
        assert state["env"] is None
        assert state["fraction"] == 1.0
        assert state["reserved"] == 0          # the pre-reserved pool went back
    # Registered again (same options): every worker is back as it was.
    client.register_plugin(unimem_dask.UnimemPlugin(ALLOC_CONF, memory_fraction=0.5, pool_size="64 MiB"))
    for state in client.run(plugin_state).values():
        assert_plugin_on(state)


def test_a_killed_worker_is_reported_missing(cluster):
    _, client = cluster
    workers = workers_of(client)
    assert len(workers) >= 2
    victim = workers[0]
    pid = client.run(os.getpid, workers=[victim])[victim]
    os.kill(pid, signal.SIGKILL)

    frame = unimem_dask.memory_stats(client, workers=workers, timeout=3)
    missing = frame.attrs["missing_workers"]
    assert list(missing) == [victim]
    assert missing[victim]                     # says why
    assert set(frame.worker) == set(workers) - {victim}
    table = unimem_dask.memory_summary(client, workers=workers, timeout=3)
    assert f"missing: {victim}" in table
    assert f"{len(workers) - 1} answered, 1 missing" in table
    # Asking the scheduler for its workers while it notices does not break either.
    frame = unimem_dask.memory_stats(client, timeout=3)
    assert victim not in set(frame.worker)


# ---------------------------------------------------------------------------
# the plugin in this process: its options, setup, teardown, and failures
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error", [
    ({"alloc_conf": "max_split_size_mb:10"}, ValueError),
    ({"alloc_conf": "no_such_option:1"}, ValueError),
    ({"alloc_conf": 42}, TypeError),
    ({"alloc_conf": {1: 2}}, TypeError),
    ({"memory_fraction": 1.5}, ValueError),
    ({"memory_fraction": "half"}, TypeError),
    ({"pool_size": "lots"}, ValueError),
    ({"pool_size": -1}, ValueError),
    ({"pool_size": True}, TypeError),
    ({"pool_size": 1.5}, TypeError),
    ({"alloc_conf": "max_split_size_mb:20", "pool_size": "1 GiB"}, ValueError),
    ({"device_type": "tpu"}, ValueError),
])
def test_bad_options_are_refused_before_any_worker_sees_them(kwargs, error):
    with pytest.raises(error):
        unimem_dask.UnimemPlugin(**kwargs)


def test_options_as_a_mapping():
    plugin = unimem_dask.UnimemPlugin({"max_split_size_mb": 64, "roundup_power2_divisions": {256: 1, ">": 4},
                                       "expandable_segments": False})
    assert plugin.alloc_conf == "max_split_size_mb:64,roundup_power2_divisions:[256:1,>:4],expandable_segments:False"
    assert unimem_dask.UnimemPlugin(pool_size="2 MiB").pool_size == 2 * MiB
    assert unimem_dask.UnimemPlugin(pool_size="2 MB").pool_size == 2_000_000


def _process_state():
    import dpnp
    cpu = unimem.cpu.caching_allocator(0)
    stats = unimem.cpu.memory_stats(0)
    return {
        "env": os.environ.get("UNIMEM_ALLOC_CONF"),
        "installed": unimem.installed_allocators(),
        "dpnp.empty": dpnp.empty,
        "fraction": cpu.get_memory_fraction(),
        "allocated": stats["allocated_bytes.all.current"],
        "reserved": stats["reserved_bytes.all.current"],
    }


def test_setup_and_teardown_in_process(monkeypatch):
    monkeypatch.delenv("UNIMEM_ALLOC_CONF", raising=False)
    unimem.cpu.empty_cache()
    before = _process_state()
    # Options the existing cpu allocator already has: accepted, and set for new ones.
    plugin = unimem_dask.UnimemPlugin("expandable_segments:False", pool_size=8 * MiB, memory_fraction=0.25,
                                      device_type="cpu")
    plugin.setup(None)
    try:
        during = _process_state()
        assert during["env"] == "expandable_segments:False"
        assert during["fraction"] == 0.25
        assert during["reserved"] >= before["reserved"] + 8 * MiB
        assert during["allocated"] == before["allocated"]
        if _devices.is_available("xpu"):
            assert "dpnp" in during["installed"]
    finally:
        plugin.teardown(None)
    after = _process_state()
    assert after["reserved"] == before["reserved"]
    assert after == before


def test_failed_setup_leaves_the_process_as_it_was(monkeypatch):
    monkeypatch.setenv("UNIMEM_ALLOC_CONF", "max_split_size_mb:40")
    unimem.cpu.empty_cache()
    before = _process_state()
    # More than the machine has: the reservation fails after the rest was done.
    plugin = unimem_dask.UnimemPlugin(pool_size=1 << 60, memory_fraction=0.5, device_type="cpu")
    with pytest.raises(unimem.OutOfMemoryError):
        plugin.setup(None)
    assert _process_state() == before


def test_setup_refuses_other_options_on_an_allocator_already_in_use(monkeypatch):
    monkeypatch.delenv("UNIMEM_ALLOC_CONF", raising=False)
    unimem.cpu.caching_allocator(0)                      # made with the defaults
    before = _process_state()
    plugin = unimem_dask.UnimemPlugin("max_split_size_mb:64", device_type="cpu")
    with pytest.raises(RuntimeError, match="already allocates with other options"):
        plugin.setup(None)
    assert _process_state() == before


def test_a_refused_setup_with_other_options_keeps_the_processs_setup(monkeypatch):
    """The plugin registered again with another alloc_conf, on a process whose
    allocator the first setup made (its pool_size): the new setup undid the
    first one (environment, installed libraries, reservation) and only then
    was refused, leaving the workers still running the first without it."""
    monkeypatch.delenv("UNIMEM_ALLOC_CONF", raising=False)
    unimem.cpu.empty_cache()
    before = _process_state()
    first, second = object(), object()
    # the defaults, spelled out: the process's cpu allocator (made by earlier
    # tests, or by pool_size here) keeps them for the tests after this one
    plugin = unimem_dask.UnimemPlugin("expandable_segments:False", pool_size=8 * MiB, device_type="cpu")
    plugin.setup(first)
    plugin.setup(second)
    try:
        set_up = _process_state()
        other = unimem_dask.UnimemPlugin("max_split_size_mb:128", device_type="cpu")
        with pytest.raises(RuntimeError, match="already allocates with other options"):
            other.setup(first)
        assert _process_state() == set_up
        assert unimem_dask._in_process is not None and unimem_dask._in_process.workers == {id(first), id(second)}
    finally:
        plugin.teardown(first)
        plugin.teardown(second)
    assert _process_state() == before


def test_uninstall_only_what_was_named():
    with pytest.raises(ValueError, match="unknown array libraries"):
        _install.uninstall_allocators(["numpy"])


def test_workers_that_share_a_process_set_it_up_once_and_undo_it_once(monkeypatch):
    """LocalCluster(processes=False) runs every worker in one process, on
    one set of allocators: the second worker's setup saved the first one's
    environment (so UNIMEM_ALLOC_CONF stayed set after unregistering), and
    reserved pool_size again."""
    monkeypatch.delenv("UNIMEM_ALLOC_CONF", raising=False)
    unimem.cpu.empty_cache()
    before = _process_state()
    first, second = object(), object()
    plugin = unimem_dask.UnimemPlugin("expandable_segments:False", pool_size=8 * MiB, device_type="cpu")
    plugin.setup(first)
    try:
        reserved = _process_state()["reserved"]
        unimem_dask.UnimemPlugin("expandable_segments:False", pool_size=8 * MiB, device_type="cpu").setup(second)
        assert _process_state()["reserved"] == reserved
        plugin.teardown(first)
        assert _process_state()["env"] == "expandable_segments:False"     # the second worker still runs
        # The same options spelled otherwise: nothing is set up again.
        same = unimem_dask.UnimemPlugin(" expandable_segments: False ", pool_size="8 MiB", device_type="cpu")
        same.setup(first)
        assert _process_state()["reserved"] == reserved
    finally:
        plugin.teardown(first)
        plugin.teardown(second)
    assert _process_state() == before


def test_a_setup_with_other_options_replaces_the_processs_for_every_worker(monkeypatch):
    """Registering the plugin again with other options: Dask sets the new one
    up worker by worker, so the first worker's new setup met the second
    worker's old one and was refused."""
    monkeypatch.delenv("UNIMEM_ALLOC_CONF", raising=False)
    unimem.cpu.empty_cache()
    before = _process_state()
    first, second = object(), object()
    old = unimem_dask.UnimemPlugin("expandable_segments:False", memory_fraction=0.5, device_type="cpu")
    new = unimem_dask.UnimemPlugin(memory_fraction=0.25, device_type="cpu")
    old.setup(first)
    old.setup(second)
    try:
        old.teardown(first)
        new.setup(first)                      # the old options are undone, the new ones applied
        state = _process_state()
        assert state["env"] is None and state["fraction"] == 0.25
        old.teardown(second)                  # the second worker's old plugin: still counted, nothing undone
        assert _process_state()["fraction"] == 0.25
        new.setup(second)
        new.teardown(first)
        assert _process_state()["fraction"] == 0.25
    finally:
        new.teardown(first)
        new.teardown(second)
    assert _process_state() == before


def test_an_in_process_cluster_counts_its_one_pool_once(monkeypatch):
    monkeypatch.delenv("UNIMEM_ALLOC_CONF", raising=False)
    unimem.cpu.empty_cache()
    before = _process_state()
    with LocalCluster(n_workers=2, processes=False, threads_per_worker=1, dashboard_address=":0") as local:
        with Client(local) as client:
            client.register_plugin(unimem_dask.UnimemPlugin(pool_size="4 MiB", device_type="cpu"))
            client.register_plugin(unimem_dask.UnimemPlugin(pool_size="8 MiB", device_type="cpu"))   # again
            assert os.environ.get("UNIMEM_ALLOC_CONF") is None
            reports, _ = unimem_dask._gather(client, None, 10.0)
            assert len(reports) == 2 and len({r["process"] for r in reports.values()}) == 1
            reserved = unimem.cpu.memory_reserved(0)
            total = next(line for line in unimem_dask.memory_summary(client).splitlines()
                         if line.startswith("total (cpu)"))
            assert total.split()[6:8] == _core.format_size(reserved).split()
            client.unregister_worker_plugin(unimem_dask.PLUGIN_NAME)
    assert _process_state() == before


def test_the_totals_count_each_process_once_by_a_token_no_other_process_has():
    """Two containers may share a host name and a process id: the totals
    took hostname:pid for a process and dropped one of them."""
    stats = {"allocated_bytes.all.current": 0, "allocated_bytes.all.peak": 0,
             "reserved_bytes.all.current": 10 << 30, "reserved_bytes.all.peak": 10 << 30, "num_device_alloc": 1}
    report = {"devices": {"cpu:0": stats}, "installed": [], "plugin": True}
    reports = {"tcp://a:1": dict(report, process=unimem_dask.process_token()),
               "tcp://a:2": dict(report, process=unimem_dask.process_token()),
               "tcp://b:1": dict(report, process="another process")}
    total = next(line for line in unimem_dask._summary_table(reports, {}).splitlines()
                 if line.startswith("total (cpu)"))
    assert total.split()[6:8] == ["20.00", "GiB"]
    child = subprocess.run([sys.executable, "-c", "import os, unimem.dask as d; t = d.process_token()\n"
                            "pid = os.fork()\n"
                            "if pid == 0:\n    os._exit(0 if d.process_token() != t else 1)\n"
                            "_, status = os.waitpid(pid, 0); raise SystemExit(os.waitstatus_to_exitcode(status))"],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == 0, child.stderr


def test_the_summary_shows_the_pinned_host_pool():
    """host_memory_stats has no ".all." in its keys and counts num_host_alloc:
    the summary's "host" row and "total (host)" read the device keys and
    showed 0 bytes and 0 raw allocations for a pool holding memory."""
    import unimem.host
    # A miss whatever earlier tests left cached (num_host_alloc counts misses
    # since the last reset): the free segments go back first, and the request
    # is one no leftover holds.
    unimem.host.empty_host_cache()
    block = unimem.host.caching_host_alloc(24 << 20)
    try:
        report = unimem_dask.worker_report()
        stats = report["devices"]["host"]
        table = unimem_dask._summary_table({"tcp://w:1": report}, {})
    finally:
        unimem.host.caching_host_delete(block)
    row = next(line for line in table.splitlines() if line.startswith("tcp://w:1") and " host " in line)
    total = next(line for line in table.splitlines() if line.startswith("total (host)"))
    expected = [_core.format_size(stats["allocated_bytes.current"]), _core.format_size(stats["allocated_bytes.peak"]),
                _core.format_size(stats["reserved_bytes.current"]), _core.format_size(stats["reserved_bytes.peak"]),
                str(stats["num_host_alloc"])]
    assert stats["allocated_bytes.current"] > 0 and stats["num_host_alloc"] >= 1
    assert " ".join(row.split()[2:]) == " ".join(expected)
    assert " ".join(total.split()[2:]) == " ".join(expected)
