"""The namespaces as type checkers see them, and one ``record_stream`` contract.

``unimem.cpu``, ``unimem.cuda`` and ``unimem.xpu`` build their memory functions
at import; their ``.pyi`` stubs declare them. stubtest keeps every stub of the
package in step with its module, and mypy --strict checks a user's script
against them. Then ``record_stream`` takes the same things in every namespace:
an array, a memory object, or an address.
"""
import ast
import contextlib
import pathlib
import subprocess
import sys
import textwrap

import numpy
import pytest

import unimem
import unimem.accelerator
import unimem.cpu
import unimem.host
from unimem import _memory_api
from unimem._runtime import devices as _devices

from tests.helpers.fake_cuda import FakeCudaRuntime, serving_cuda
from tests.helpers import REPO_ROOT

REPO = REPO_ROOT
PACKAGE = REPO / "unimem"
ALLOWLIST = REPO_ROOT / "tests" / "helpers" / "stubtest_allowlist.txt"
# Array libraries without type information; the stubs never import them.
UNTYPED_LIBRARIES = ("cupy", "cupy_backends", "cupyx", "dpctl", "dpnp", "distributed", "dask",
                     "pandas", "prometheus_client", "matplotlib", "psutil")
NAMESPACE_STUBS = ("cpu", "cuda", "xpu")


def stubbed_modules():
    """Every module of the package with a ``.pyi`` (a new stub is covered at once)."""
    return sorted(".".join(path.relative_to(REPO).with_suffix("").parts)
                  for path in PACKAGE.rglob("*.pyi"))


def mypy_config(path, cache_dir, checked_modules=(), strict=False):
    """A mypy config: errors reported in ``checked_modules`` only (the rest of
    the package is read, as from an installed package, not judged here)."""
    lines = ["[mypy]", f"cache_dir = {cache_dir}", f"mypy_path = {REPO}"]
    if strict:
        lines.append("strict = True")
    lines += ["[mypy-unimem.*]", "follow_imports = silent", "ignore_errors = True"]
    for module in checked_modules:
        lines += [f"[mypy-{module}]", "follow_imports = normal", "ignore_errors = False"]
    lines += [f"[mypy-{','.join(name + '.*' for name in UNTYPED_LIBRARIES)}]", "ignore_missing_imports = True"]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("mypy_cache")


@pytest.fixture(scope="module")
def stubtest_run(tmp_path_factory, mypy_cache):
    """stubtest over every stubbed module, once for the tests below."""
    modules = stubbed_modules()
    config = mypy_config(tmp_path_factory.mktemp("stubtest") / "mypy.ini", mypy_cache, modules)
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "--mypy-config-file", str(config),
         "--allowlist", str(ALLOWLIST), *modules],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    return modules, result


def test_every_stub_matches_its_module(stubtest_run):
    modules, result = stubtest_run
    assert {"unimem._core", "unimem.cpu", "unimem.cuda", "unimem.xpu"} <= set(modules)
    assert result.returncode == 0, f"stubtest:\n{result.stdout}\n{result.stderr}"


def stub_aliases(name):
    """``{name: attribute}`` for each ``name = _api.attribute`` line of a namespace stub."""
    tree = ast.parse((PACKAGE / f"{name}.pyi").read_text())
    return {node.targets[0].id: node.value.attr for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name) and node.value.value.id == "_api"}


def stub_functions(name):
    tree = ast.parse((PACKAGE / f"{name}.pyi").read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("name", NAMESPACE_STUBS)
def test_namespace_stubs_declare_the_generated_functions_by_their_own_names(name):
    """The signatures come from MemoryAPI (one source); each name must be
    bound to the method of that name, and each generated function declared
    once: as an alias, or as the module's own function."""
    aliases = stub_aliases(name)
    assert {alias: alias for alias in aliases} == aliases
    own = stub_functions(name)
    assert not set(aliases) & own
    assert set(aliases) | (own & set(_memory_api.PUBLIC_FUNCTIONS)) == set(_memory_api.PUBLIC_FUNCTIONS)


def test_no_namespace_exports_a_name_twice():
    import unimem.accelerator.memory
    import unimem.cuda
    import unimem.xpu
    for module in (unimem, unimem.accelerator, unimem.accelerator.memory, unimem.cpu, unimem.cuda,
                   unimem.xpu, unimem.host):
        names = getattr(module, "__all__", [])
        assert len(names) == len(set(names)), f"{module.__name__}.__all__ repeats a name"
        for name in names:
            assert getattr(module, name) is not None


# ---------------------------------------------------------------------------
# mypy --strict on a user's script
# ---------------------------------------------------------------------------
USER_SCRIPT = """
    import numpy
    import numpy.typing
    import unimem
    import unimem.accelerator
    import unimem.cpu
    import unimem.cuda
    import unimem.host
    import unimem.xpu

    stats = unimem.accelerator.memory_stats(0)
    used: int = stats.get("allocated_bytes.all.current", 0)
    ptr: int = unimem.accelerator.caching_allocator_alloc(1024)
    unimem.accelerator.record_stream(ptr, None)
    unimem.accelerator.caching_allocator_delete(ptr)
    with unimem.accelerator.device_index(0):
        count: int = unimem.accelerator.device_count()
    array: numpy.typing.NDArray[numpy.float64] = unimem.cpu.zeros(4)
    unimem.cpu.record_stream(array, 0)
    free, total = unimem.cpu.mem_get_info(0)
    summary: str = unimem.cpu.memory_summary(0, abbreviated=True)
    unimem.cpu._record_memory_history("all", max_entries=100)
    reserved: int = unimem.cuda.max_memory_reserved(0)
    limit: int = unimem.cuda.MemoryPool().get_limit()
    block = unimem.xpu.empty((2, 2), "f4")
    unimem.xpu.record_stream(block, unimem.xpu.default_queue())
    fraction: float = unimem.xpu.get_per_process_memory_fraction(0)
    host_stats = unimem.host.host_memory_stats()
    pinned: int = unimem.host.caching_host_alloc(64)
    unimem.host.caching_host_delete(pinned)
"""


def run_mypy_strict(tmp_path, mypy_cache, source):
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(source))
    config = mypy_config(tmp_path / "mypy.ini", mypy_cache, strict=True)
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(config), str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)


def test_mypy_strict_accepts_a_script_using_every_namespace(tmp_path, mypy_cache):
    result = run_mypy_strict(tmp_path, mypy_cache, USER_SCRIPT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("line, error", [
    ("unimem.cuda.memory_stat(0)", 'Module has no attribute "memory_stat"'),
    ("unimem.xpu.emtpy(4)", 'Module has no attribute "emtpy"'),
    ("unimem.cpu.memory_allocated(0) + ''", "Unsupported operand types"),
    ("unimem.cpu.record_stream(1.5, 0)", 'Argument 1 has incompatible type "float"'),
    ("unimem.accelerator.memory_reserve()", 'Module has no attribute "memory_reserve"'),
    ('unimem.cpu._record_memory_history("everything")', 'Argument 1 has incompatible type'),
])
def test_mypy_strict_rejects_a_misused_namespace(tmp_path, mypy_cache, line, error):
    source = "import unimem.accelerator, unimem.cpu, unimem.cuda, unimem.xpu\n" + line + "\n"
    result = run_mypy_strict(tmp_path, mypy_cache, source)
    assert result.returncode == 1 and error in result.stdout, result.stdout + result.stderr


def test_mypy_strict_sees_the_lazy_namespaces_after_a_bare_import(tmp_path, mypy_cache):
    result = run_mypy_strict(tmp_path, mypy_cache, "import unimem\nunimem.cuda.memory_stat(0)\n")
    assert result.returncode == 1 and "memory_stat" in result.stdout, result.stdout + result.stderr


# ---------------------------------------------------------------------------
# record_stream: one contract in every namespace
# ---------------------------------------------------------------------------
class Namespace:
    """A namespace's record_stream, what it accepts, and how to see a record."""

    def __init__(self, record_stream, allocators, new_stream, forms, empty, foreign, release):
        self.record_stream = record_stream
        self.allocators = allocators      # () -> the allocators the namespace's blocks come from
        self.new_stream = new_stream      # () -> a stream not yet used
        self.forms = forms                # {name: memory}, all on one live block
        self.empty = empty                # an array with no memory
        self.foreign = foreign            # memory not from unimem
        self.release = release            # gives back the address in forms

    def state(self):
        return [(a.memory_stats(), a._stream_count()) for a in self.allocators()]

    def stream_counts(self):
        return sum(a._stream_count() for a in self.allocators())


def cpu_namespace():
    array = unimem.cpu.empty(64, dtype="f8")
    allocation = unimem.cpu.caching_allocator().allocate(256)
    address = unimem.cpu.caching_allocator_alloc(512)
    streams = iter(range(1000, 2000))
    forms = {"numpy array": array, "view inside it": array[3:], "Allocation": allocation,
             "address": address, "NumPy integer address": numpy.uint64(address)}
    return Namespace(unimem.cpu.record_stream, lambda: [unimem.cpu.caching_allocator(0)],
                     lambda: next(streams), forms, unimem.cpu.empty(0), numpy.ones(8),
                     release=lambda: unimem.cpu.caching_allocator_delete(address))


def cuda_namespace(cupy):
    import unimem.cuda as ucuda
    pointer = ucuda.allocator(4096)
    array = cupy.ndarray((1024,), numpy.float32, memptr=ucuda.allocator(4096))
    address = ucuda.caching_allocator_alloc(512)
    streams = iter(range(0x5000, 0x6000, 0x10))
    forms = {"cupy array": array, "view inside it": array[3:], "MemoryPointer": pointer,
             "PooledMemory": pointer.mem, "Allocation": pointer.mem.allocation,
             "address": address, "NumPy integer address": numpy.int64(address)}
    empty = cupy.ndarray((0,), numpy.float32, memptr=ucuda.allocator(0))
    registry = _devices.get_type("cuda").registry
    return Namespace(ucuda.record_stream, lambda: list(registry.initialized().values()),
                     lambda: next(streams), forms, empty, numpy.ones(8),
                     release=lambda: ucuda.caching_allocator_delete(address))


def xpu_namespace():
    import dpctl
    import unimem.xpu as uxpu
    array = uxpu.empty(64, dtype="f4")
    usm = uxpu.empty(64, dtype="f4").get_array()
    allocation = uxpu.allocator_for("device").allocate(256)
    address = uxpu.caching_allocator_alloc(512)
    forms = {"dpnp array": array, "view inside it": array[3:], "usm_ndarray": usm,
             "MemoryUSMDevice": usm.usm_data, "Allocation": allocation,
             "address": address, "shared USM array": uxpu.ones(8, usm_type="shared"),
             "host USM array": uxpu.ones(8, usm_type="host")}
    device = uxpu.default_queue().sycl_device

    def allocators():
        return [uxpu.allocator_for(kind) for kind in ("device", "shared", "host")]
    return Namespace(uxpu.record_stream, allocators, lambda: dpctl.SyclQueue(device), forms,
                     uxpu.empty(0), numpy.ones(8),
                     release=lambda: uxpu.caching_allocator_delete(address))


@pytest.fixture(params=["cpu", "cuda", "xpu"])
def namespace(request):
    with contextlib.ExitStack() as stack:
        if request.param == "cpu":
            ns = cpu_namespace()
        elif request.param == "cuda":
            cupy = pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")
            stack.enter_context(serving_cuda(FakeCudaRuntime(devices=2, capacity=1 << 30)))
            ns = cuda_namespace(cupy)
        else:
            if not _devices.is_available("xpu"):
                pytest.fail(f"no SYCL device: {_devices.unavailable_reason('xpu')}")
            ns = xpu_namespace()
        yield ns
        ns.release()
        del ns


def test_record_stream_takes_an_array_a_memory_object_or_an_address(namespace):
    for name, memory in namespace.forms.items():
        before = namespace.stream_counts()
        assert namespace.record_stream(memory, namespace.new_stream()) is None
        assert namespace.stream_counts() == before + 1, f"{name}: no stream recorded"


def test_record_stream_of_an_empty_array_does_nothing(namespace):
    before = namespace.state()
    namespace.record_stream(namespace.empty, namespace.new_stream())
    assert namespace.state() == before


def test_record_stream_refuses_what_is_not_unimem_memory_and_changes_nothing(namespace):
    address = namespace.forms["address"]
    bad = {True: TypeError, 1.5: TypeError, None: TypeError, "0x1000": TypeError,
           b"\x00": TypeError, object(): TypeError, -1: ValueError, 1 << 64: ValueError,
           0x10: ValueError, address + 8: ValueError, id(namespace): ValueError}
    before = namespace.state()
    for memory, error in bad.items():
        with pytest.raises(error):
            namespace.record_stream(memory, namespace.new_stream())
    with pytest.raises(ValueError, match="not a live block"):
        namespace.record_stream(namespace.foreign, namespace.new_stream())
    assert namespace.state() == before


def test_accelerator_record_stream_follows_the_same_contract():
    accelerator = unimem.accelerator
    dtype = _devices.current_type()
    address = accelerator.caching_allocator_alloc(512)
    allocation = dtype.allocator(0).allocate(256)
    try:
        before = dtype.allocator(0)._stream_count()
        stream = unimem.xpu.default_queue() if dtype.name == "xpu" else None
        for memory in (address, allocation, numpy.int64(address)):
            accelerator.record_stream(memory, stream)
        with pytest.raises(TypeError):
            accelerator.record_stream(1.5, stream)
        with pytest.raises(ValueError, match="not a live block"):
            accelerator.record_stream(address + 8, stream)
        assert dtype.allocator(0)._stream_count() == before     # the current stream: no new one
    finally:
        accelerator.caching_allocator_delete(address)


def test_the_address_of_each_form_is_where_its_block_starts():
    array = unimem.cpu.empty((4, 4), dtype="f4")
    start = array.__array_interface__["data"][0]
    assert _memory_api.block_address(array) == start
    assert _memory_api.block_address(array[1:, 2:]) == start
    assert _memory_api.block_address(array.T) == start
    holder = array.base
    while not hasattr(holder, "block"):       # the pool's Allocation, under NumPy's bases
        holder = holder.base
    assert _memory_api.block_address(holder.block) == start
    assert _memory_api.block_address(numpy.ones(0)) == 0
    with pytest.raises(TypeError, match="expected an array, a memory object"):
        _memory_api.block_address(False)
