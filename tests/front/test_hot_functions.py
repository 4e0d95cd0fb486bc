"""The builtin fast path of ``caching_allocator_alloc``/``delete``
(unimem/_runtime/registry_hot.pxi): the one-positional-argument call is
handled in C, every other call goes to the full-signature function; both must
behave as one function with PyTorch's signature, and the address int kept for
the next call must never free the wrong block."""
import inspect

import pytest

import unimem
import unimem.cpu
from unimem import accelerator as acc
from unimem._runtime import devices as _devices
from unimem.backends.simulated import SimulatedBackend

PAIRS = {
    "accelerator": (acc.caching_allocator_alloc, acc.caching_allocator_delete),
    "cpu": (unimem.cpu.caching_allocator_alloc, unimem.cpu.caching_allocator_delete),
}
if _devices.is_available("xpu"):
    import unimem.xpu
    PAIRS["xpu"] = (unimem.xpu.caching_allocator_alloc, unimem.xpu.caching_allocator_delete)


def allocated(name):
    module = acc if name == "accelerator" else getattr(unimem, name)
    return module.memory_allocated(0)


@pytest.fixture
def two_device_cpu():
    """``unimem.cpu`` on a simulated two-device backend (swapped into the live
    device table, as change_current_allocator does, and back after)."""
    swapped = _devices.DeviceType("cpu", SimulatedBackend(capacity=1 << 30, devices=2, name="CPU"))
    previous = _devices.types_by_name().get("cpu")
    _devices.install_type("cpu", swapped)
    yield swapped
    _devices.install_type("cpu", previous)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_pytorchs_signatures_names_and_docs(name):
    alloc, delete = PAIRS[name]
    assert alloc.__name__ == "caching_allocator_alloc" and delete.__name__ == "caching_allocator_delete"
    assert str(inspect.signature(alloc)) == "(size, device=None, stream=None)"
    assert str(inspect.signature(delete)) == "(mem_ptr)"
    assert "allocation" in alloc.__doc__ and "mem_ptr" in delete.__doc__


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_every_call_shape_allocates_and_frees_alike(name):
    alloc, delete = PAIRS[name]
    before = allocated(name)
    calls = [lambda: alloc(4096), lambda: alloc(size=4096), lambda: alloc(4096, None),
             lambda: alloc(4096, None, None), lambda: alloc(4096, device=None, stream=None),
             lambda: alloc(4096, 0), lambda: alloc(4096, device=0)]
    for make in calls:
        p = make()
        assert isinstance(p, int) and p > 0
        assert allocated(name) == before + 4096
        delete(p)
        assert allocated(name) == before
        p = make()
        delete(mem_ptr=p)
        assert allocated(name) == before
    assert alloc(0) == 0
    delete(0)
    delete(mem_ptr=0)
    assert allocated(name) == before


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_bad_calls_raise_typeerror_and_change_nothing(name):
    alloc, delete = PAIRS[name]
    p = alloc(4096)
    before = allocated(name)
    for call in (lambda: alloc(), lambda: alloc(1, None, None, None), lambda: alloc(4096, size=4096),
                 lambda: alloc(4096, devise=0), lambda: alloc(size=4096, stream="default"),
                 lambda: alloc(True), lambda: alloc(4096.0), lambda: alloc("4096"), lambda: alloc(None),
                 lambda: delete(), lambda: delete(p, p), lambda: delete(ptr=p), lambda: delete(p, mem_ptr=p),
                 lambda: delete(float(p)), lambda: delete(str(p)), lambda: delete(None)):
        with pytest.raises(TypeError):
            call()
    for call in (lambda: alloc(-1), lambda: alloc(4096, device=99), lambda: alloc(4096, 99),
                 lambda: delete(-1), lambda: delete(p + 512), lambda: delete(1 << 64)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(MemoryError):
        alloc(1 << 64)
    assert allocated(name) == before
    delete(p)


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_the_address_int_kept_for_the_next_call_frees_only_its_block(name):
    alloc, delete = PAIRS[name]
    before = allocated(name)
    p = alloc(4096)
    delete(p)
    q = alloc(4096)                       # the same block again: its int may be shared
    assert q == p
    delete(q)
    with pytest.raises(ValueError, match="already freed"):
        delete(q)                         # the kept int, its block freed
    with pytest.raises(ValueError, match="already freed"):
        delete(int(str(p)))               # an equal int made apart
    a, b = alloc(4096), alloc(4096)
    assert a != b
    delete(int(str(b)))                   # not the kept int: read by value
    with pytest.raises(ValueError):
        delete(b)
    delete(a)
    assert allocated(name) == before


def test_int_subclasses_go_through_the_checked_path():
    class Address(int):
        pass
    before = acc.memory_allocated(0)
    p = acc.caching_allocator_alloc(Address(4096))
    assert acc.memory_allocated(0) == before + 4096
    acc.caching_allocator_delete(Address(p))
    assert acc.memory_allocated(0) == before


def test_a_namespace_and_the_accelerator_free_each_others_blocks():
    """Cross-namespace frees: the current accelerator's namespace and
    ``unimem.accelerator`` share one registry."""
    namespace = getattr(unimem, str(acc.current_accelerator()))
    before = acc.memory_allocated(0)
    p = namespace.caching_allocator_alloc(4096)
    acc.caching_allocator_delete(p)
    p = acc.caching_allocator_alloc(4096)
    namespace.caching_allocator_delete(p)
    assert acc.memory_allocated(0) == before


def test_another_registrys_delete_refuses_the_kept_int(two_device_cpu):
    """The accelerator's last address, handed to a namespace of another
    registry: refused there (the block is not its), kept live in its own."""
    p = acc.caching_allocator_alloc(4096)
    before = acc.memory_allocated(0)
    with pytest.raises(ValueError, match="not allocated by the unimem cpu allocator"):
        unimem.cpu.caching_allocator_delete(p)
    assert acc.memory_allocated(0) == before
    acc.caching_allocator_delete(p)
    assert acc.memory_allocated(0) == before - 4096


def test_a_registry_of_several_devices_uses_the_current_one(two_device_cpu):
    alloc, delete = unimem.cpu.caching_allocator_alloc, unimem.cpu.caching_allocator_delete
    first = alloc(1000)
    unimem.cpu.set_device(1)
    try:
        second = alloc(1000)
        assert unimem.cpu.memory_allocated(1) == 1024
        delete(first)                       # found on device 0 from device 1
        delete(second)
    finally:
        unimem.cpu.set_device(0)
    assert unimem.cpu.memory_allocated(0) == unimem.cpu.memory_allocated(1) == 0
