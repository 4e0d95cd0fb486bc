"""The SYCL interposer (``unimem._integrations.sycl_interposer``): dpnp's C++ scratch
buffers from unimem's pools, on the real SYCL device.

It must be installed before dpnp's extensions are loaded and cannot be taken
out again, so everything that installs it runs in a fresh interpreter
(``sys.executable``); this process only computes the plain-dpnp results to
compare with and reads dpnp's object files.
"""
import json
import os
import subprocess
import sys
import textwrap

import numpy
import pytest

from tests.helpers import REPO_ROOT

dpnp = pytest.importorskip("dpnp")

from unimem._integrations import sycl_interposer as si  # noqa: E402
from unimem._runtime import devices  # noqa: E402

if not devices.is_available("xpu"):
    pytest.skip(f"no SYCL device: {devices.unavailable_reason('xpu')}", allow_module_level=True)

ROOT = str(REPO_ROOT)
TIMEOUT = 300

# What every child runs first: the interposer before dpnp, and helpers.
PREAMBLE = textwrap.dedent("""
    import gc, json, sys, time
    import numpy
    import unimem
    from unimem._integrations import sycl_interposer as si
    import unimem.xpu as xpu
    si.install(xpu._pool_for)
    import dpnp

    def allocated():
        return xpu.memory_stats(0).get("allocated_bytes.all.current", 0)

    def settle(baseline, timeout=20.0):
        # every kernel done, every host task's free run: the pool back at baseline
        deadline = time.monotonic() + timeout
        while True:
            gc.collect()
            xpu.synchronize()
            if allocated() == baseline and si.counters()["live.blocks"] == 0 or time.monotonic() > deadline:
                return allocated()
            time.sleep(0.01)

    unraisable = []
    sys.unraisablehook = lambda args: unraisable.append(f"{args.err_msg}: {args.exc_value!r}")

    def report(**fields):
        print("RESULT " + json.dumps(fields))
""")

# The workload: sort, a reduction over an axis, fancy indexing, elementwise
# math on strided views, a linear solve; each needs scratch in dpnp's C++.
WORKLOAD = textwrap.dedent("""
    def workload(dp):
        rng = numpy.random.default_rng(7)
        x = dp.asarray(rng.standard_normal((64, 48)).astype(numpy.float32))
        a = dp.asarray(rng.standard_normal((16, 16)) + 16 * numpy.eye(16))
        b = dp.asarray(rng.standard_normal(16))
        out = {
            "sort": dp.sort(x[:, ::-1], axis=1),
            "argsort": dp.argsort(x[::3], axis=0),
            "sum": dp.sum(x[::2, ::3], axis=0),
            "max": dp.max(x[1::2], axis=1),
            "fancy": x[dp.asarray([3, 1, 4, 1, 5]), ::2],
            "elementwise": dp.exp(x[::2, 1::2]) * x[1::2, ::2] + 1,
            "where": dp.where(x[::2] > 0, x[::2], -x[1::2]),
            "solve": dp.linalg.solve(a, b),
        }
        return {name: dp.asnumpy(value) for name, value in out.items()}
""")


def run_child(body, *args, env=None):
    """Run PREAMBLE + body in a fresh interpreter; returns its report and output."""
    done = subprocess.run([sys.executable, "-c", PREAMBLE + WORKLOAD + textwrap.dedent(body), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT,
                          env=dict(os.environ, **(env or {})))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, output
    return json.loads(lines[-1][len("RESULT "):]), output


def workload_in_this_process():
    namespace = {"numpy": numpy}
    exec(WORKLOAD, namespace)
    return namespace["workload"](dpnp)


@pytest.fixture(scope="module", params=["dpctl arrays", "pool arrays"])
def interposed(request, tmp_path_factory):
    """The workload with the interposer, with dpnp's arrays from dpctl or
    (set_allocator) from the pools too; then dpnp.random.permutation, whose
    C++ (libdpnp_backend_c) frees its scratch synchronously on the calling
    thread: the free that must wait for the device's queues."""
    path = tmp_path_factory.mktemp("interposed") / "results.npz"
    report, output = run_child("""
        if sys.argv[1] == "pool arrays":
            xpu.set_allocator()
        settle(allocated())
        before = allocated()
        results = workload(dpnp)
        after_workload = si.counters()
        permuted = dpnp.asnumpy(dpnp.random.permutation(50))
        after = settle(before)
        numpy.savez(sys.argv[2], **results)
        report(before=before, after=after, workload=after_workload, counters=si.counters(),
               permuted=sorted(permuted.tolist()), unraisable=unraisable,
               dpnp_arrays=xpu.allocator_counters()["pooled.allocations"])
    """, request.param, str(path))
    with numpy.load(path) as saved:
        results = {name: saved[name] for name in saved.files}
    return request.param, report, results, output


def test_results_are_plain_dpnps_and_the_scratch_came_from_the_pools(interposed):
    mode, report, results, output = interposed
    plain = workload_in_this_process()
    assert sorted(results) == sorted(plain)
    for name, expected in plain.items():
        assert results[name].dtype == expected.dtype and numpy.array_equal(results[name], expected), name
    counters = report["workload"]
    # dpnp's extensions were bound to the interposer, and it served them
    assert counters["pooled.calls"] > 10 and counters["pooled.bytes"] > 0, counters
    assert counters["calls.aligned_alloc"] > 0 and counters["calls.aligned_alloc_device"] > 0, counters
    assert counters["refused.calls"] == 0 and counters["bypassed.pool_error.calls"] == 0
    if mode == "pool arrays":
        assert report["dpnp_arrays"] > 0
    # every block back in the pool once the kernels are done: nothing leaked
    assert report["after"] == report["before"], report
    assert report["counters"]["live.blocks"] == 0
    assert report["unraisable"] == []


def test_frees_take_both_paths(interposed):
    """Host tasks (no GIL) give blocks back at once; a free from Python code
    (libdpnp_backend_c's synchronous free after dpnp.random.permutation)
    waits for the device's queues first. Every served block came back."""
    _, report, _, _ = interposed
    counters = report["counters"]
    assert report["permuted"] == list(range(50))
    assert counters["frees.at_once"] > 0, counters
    assert counters["frees.after_wait"] > 0, counters
    assert counters["calls.malloc_device"] + counters["calls.malloc_shared"] + counters["calls.malloc"] > 0
    returned = counters["frees.at_once"] + counters["frees.after_wait"] + counters["frees.at_once_holding_gil"]
    assert returned == counters["pooled.calls"], counters


def test_the_scratch_blocks_are_dpnps():
    """The history names dpnp as the client of every block the interposer
    served (dpnp's arrays are dpctl's here: only its C++ scratch is pooled)."""
    report, _ = run_child("""
        xpu._record_memory_history()
        workload(dpnp)
        settle(0)
        trace = xpu._snapshot()["device_traces"][0]
        report(clients=sorted({str(e.get("client")) for e in trace if e["action"] == "alloc"}),
               served=si.counters()["pooled.calls"])
    """)
    assert report["served"] > 0 and report["clients"] == ["dpnp"], report


def test_installing_after_dpnp_is_refused_and_changes_nothing():
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json
        import dpnp
        import unimem.xpu as xpu
        from unimem._integrations import sycl_interposer as si
        try:
            si.install(xpu._pool_for)
        except RuntimeError as exc:
            message = str(exc)
        else:
            message = None
        x = dpnp.sum(dpnp.arange(100.0).reshape(10, 10)[:, ::3], axis=1)
        print(json.dumps({"message": message, "installed": si.installed(), "counters": si.counters(),
                          "global": si._global_definitions(), "sum": float(x[0])}))
    """)], capture_output=True, text=True, cwd=ROOT, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["message"] and "before dpnp is imported" in report["message"]
    assert report["installed"] is False
    assert all(value == 0 for value in report["counters"].values()), report["counters"]
    assert report["global"] == {}                   # nothing was put in the global scope
    assert report["sum"] == 0 + 3 + 6 + 9


def test_installing_without_a_pool_lookup_is_refused_and_changes_nothing():
    """The pools it serves from come from the caller (unimem.xpu's lookup):
    anything but a callable is refused before anything is looked at."""
    for bad in (None, "xpu", 0):
        with pytest.raises(TypeError, match="pool_for must be callable"):
            si.install(bad)
    assert not si.installed() and si._global_definitions() == {}


def test_other_pointers_and_other_callers_go_to_libsycl():
    """A pointer the interposer did not hand out is freed by libsycl (it would
    crash the pool), and a caller outside dpnp (here ctypes) gets libsycl's
    memory; dpctl memory made before the install is freed as before."""
    report, _ = run_child("""
        import ctypes, os
        import dpctl, dpctl.memory
        before_install = dpctl.memory.MemoryUSMDevice(4096)     # (dpctl was imported by install)
        queue = xpu.default_queue()
        me = ctypes.CDLL(si.__file__)
        malloc_device = me[si.MANGLED_NAMES[si.ENTRY_POINTS.index("malloc_device")]]
        malloc_device.restype = ctypes.c_void_p
        malloc_device.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
        free_queue = me[si.MANGLED_NAMES[si.ENTRY_POINTS.index("free_queue")]]
        free_queue.restype = None
        free_queue.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        location = ctypes.create_string_buffer(64)             # an empty sycl::detail::code_location
        dpctl_lib = ctypes.CDLL(os.path.join(os.path.dirname(dpctl.__file__), "libDPCTLSyclInterface.so"))
        dpctl_lib.DPCTLmalloc_device.restype = ctypes.c_void_p
        dpctl_lib.DPCTLmalloc_device.argtypes = [ctypes.c_size_t, ctypes.c_void_p]
        c0 = si.counters()
        foreign = dpctl_lib.DPCTLmalloc_device(256, queue.addressof_ref())   # libsycl's own memory
        free_queue(foreign, queue.addressof_ref(), ctypes.addressof(location))
        c1 = si.counters()
        theirs = malloc_device(256, queue.addressof_ref(), ctypes.addressof(location))
        c2 = si.counters()
        free_queue(theirs, queue.addressof_ref(), ctypes.addressof(location))
        c3 = si.counters()
        del before_install
        x = dpnp.sum(dpnp.arange(100.0).reshape(10, 10)[:, ::3], axis=1)
        delta = lambda a, b: {k: b[k] - a[k] for k in b if b[k] != a[k]}
        report(foreign=bool(foreign), theirs=bool(theirs), free_foreign=delta(c0, c1),
               malloc_other=delta(c1, c2), free_other=delta(c2, c3), sum=float(x[1]), unraisable=unraisable)
    """)
    assert report["foreign"] and report["theirs"]
    assert report["free_foreign"] == {"calls.free_queue": 1, "frees.bypassed": 1}
    assert report["malloc_other"] == {"calls.malloc_device": 1, "bypassed.calls": 1, "bypassed.bytes": 256,
                                      "bypassed.other_library.calls": 1, "bypassed.other_library.bytes": 256}
    assert report["free_other"] == {"calls.free_queue": 1, "frees.bypassed": 1}
    assert report["sum"] == 10 + 13 + 16 + 19
    assert report["unraisable"] == []


def test_a_pool_out_of_memory_is_dpnps_own_error_and_leaks_nothing():
    """A pool that refuses: the interposed function answers nullptr, as SYCL
    does, dpnp raises its own error, no Python error is left pending and the
    blocks of the failed call go back; with room again, the same call works."""
    report, _ = run_child("""
        x = dpnp.asarray(numpy.arange(400.0).reshape(20, 20))
        expected = dpnp.asnumpy(dpnp.sum(x[:, ::3], axis=1))
        before = settle(allocated())
        pool = xpu.allocator_for("device", 0)
        pool.empty_cache()
        stats = dict(pool.memory_stats())
        pool.set_memory_limit(1)                 # no segment fits: every new block is refused
        c0 = si.counters()
        try:
            dpnp.sum(x[:, ::3], axis=1)
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
        else:
            error = None
        pending = sys.exc_info()[0] is not None
        c1 = si.counters()
        pool.set_memory_limit(0)
        again = dpnp.asnumpy(dpnp.sum(x[:, ::3], axis=1))
        after = settle(before)
        report(error=error, pending=pending, refused=c1["refused.calls"] - c0["refused.calls"],
               pooled=c1["pooled.calls"] - c0["pooled.calls"],
               ooms=pool.memory_stats().get("num_ooms", 0) - stats.get("num_ooms", 0),
               same=bool(numpy.array_equal(again, expected)), before=before, after=after,
               live=si.counters()["live.blocks"], unraisable=unraisable)
    """)
    assert report["error"] is not None and report["error"][0] == "RuntimeError", report
    assert "allocate" in report["error"][1]
    assert report["pending"] is False
    assert report["refused"] >= 1 and report["ooms"] >= 1, report
    assert report["same"], "after the limit is lifted, the same reduction gives the same result"
    assert report["after"] == report["before"] and report["live"] == 0, report
    assert report["unraisable"] == []


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_run_sycl_interpose_prints_what_it_served(tmp_path, how):
    script = tmp_path / "scratch.py"
    script.write_text("import dpnp\nx = dpnp.arange(1000.0).reshape(10, 100)\n"
                      "print(float(dpnp.sum(x[:, ::3], axis=1)[0]), float(dpnp.sort(x[::-1], axis=1)[0, 0]))\n")
    args = ["run", "--sycl-interpose", str(script)] if how == "flag" else ["run", str(script)]
    env = dict(os.environ, UNIMEM_SYCL_INTERPOSE="1") if how == "environment" else None
    done = subprocess.run([sys.executable, "-m", "unimem", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "1683.0 900.0\n"                 # the script's own output; the summary on stderr
    assert "dpnp arrays:" in done.stderr
    line = next((text for text in done.stderr.splitlines() if text.startswith("dpnp C++ scratch:")), None)
    assert line is not None, done.stderr
    served = int(line.split()[3])
    assert served > 0, line
    assert "dpnp's C++ scratch buffers" in done.stderr


def test_without_the_flag_there_is_no_scratch_line(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import dpnp\nprint(float(dpnp.sum(dpnp.ones((4, 4))[:, ::2], axis=1)[0]))\n")
    done = subprocess.run([sys.executable, "-m", "unimem", "run", str(script)], capture_output=True, text=True,
                          cwd=ROOT, timeout=TIMEOUT, env=dict(os.environ, UNIMEM_SYCL_INTERPOSE="0"))
    assert done.returncode == 0, done.stderr
    assert "dpnp arrays:" in done.stderr and "dpnp C++ scratch" not in done.stderr


def test_stats_json_has_the_interposers_counters(tmp_path):
    script = tmp_path / "scratch.py"
    script.write_text("import dpnp\nprint(float(dpnp.sum(dpnp.ones((8, 8))[:, ::2], axis=1)[0]))\n")
    done = subprocess.run([sys.executable, "-m", "unimem", "stats", "--json", str(script)], capture_output=True,
                          text=True, cwd=ROOT, timeout=TIMEOUT, env=dict(os.environ, UNIMEM_SYCL_INTERPOSE="1"))
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["sycl_interposer"]["pooled.calls"] > 0, view.get("sycl_interposer")
    assert view["sycl_interposer"]["live.blocks"] == 0


def test_the_benchmark_runs_and_reports_its_targets(tmp_path):
    """``python -m benchmarks --quick sycl_interposer``: not its timings, but
    what holds however fast the machine is: identical results, the pools
    served C++ calls in every workload, nothing held after the runs."""
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "sycl_interposer"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, UNIMEM_BENCHMARK_RESULTS=str(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / "sycl_interposer.json") as f:
        result = json.load(f)
    assert len(result["targets"]) == 3 and all(isinstance(t["met"], bool) for t in result["targets"])
    assert {"mlp", "kmeans", "linalg_fft_sort"} <= {row["workload"] for row in result["workloads"]}
    for row in result["workloads"]:
        assert row["identical"], row
        assert row["cxx_calls_per_iteration"] > 0 and row["pooled_calls_share"] > 0.5, row
    assert next(t for t in result["targets"] if "held" in t["measured"])["met"]


def test_dpnps_imports_are_exactly_the_interposed_functions(tmp_path):
    """The install-time check reads dpnp's object files: every SYCL USM
    function they import is one the interposer defines; a library importing
    another one (oneMKL's BLAS imports sycl::malloc_device(size, device,
    context)) is refused by name."""
    folder = si.dpnp_directory()
    imports = si.check_dpnp_imports(folder, _loaded_libsycl_soname())
    assert any(name.startswith("tensor/_tensor_impl") for name in imports), sorted(imports)
    used = {name for names in imports.values() for name in names}
    assert used == set(si.MANGLED_NAMES), sorted(set(si.MANGLED_NAMES) ^ used)
    blas = [path for path in si.loaded_objects() if os.path.basename(path).startswith("libmkl_sycl_blas")]
    if not blas:
        blas = [os.path.join(sys.prefix, "lib", name) for name in os.listdir(os.path.join(sys.prefix, "lib"))
                if name.startswith("libmkl_sycl_blas.so")]
    if not blas:
        pytest.skip("no oneMKL SYCL BLAS library to try the refusal with")
    (tmp_path / "libother.so").symlink_to(blas[0])
    with pytest.raises(RuntimeError, match="malloc_deviceEmRKNS0_6deviceERKNS0_7context"):
        si.check_dpnp_imports(str(tmp_path), _loaded_libsycl_soname())


def _loaded_libsycl_soname():
    import dpctl  # noqa: F401  (loads libsycl)
    path = next(p for p in si.loaded_objects() if os.path.basename(p).startswith("libsycl.so"))
    return si._soname(path)
