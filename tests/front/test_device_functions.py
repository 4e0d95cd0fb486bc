"""``torch.cuda``'s device functions that code measuring memory calls beside
the memory ones (``synchronize``, ``ipc_collect``) and the graph pool handles
(``torch.accelerator.generate_graph_pool_handle``, ``torch.cuda`` and
``torch.xpu``'s ``graph_pool_handle``): ids no memory pool has, from the ids
``MemPool`` objects take.

CUDA runs on the simulated runtime (tests/helpers/fake_cuda.py)."""
import pytest

import unimem
import unimem.accelerator
import unimem.cpu

from tests.helpers.fake_cuda import fake  # noqa: F401  (fixture)

pytest.importorskip("cupy", reason="CuPy (cupy-cuda12x) is in the test extra")
import unimem.cuda as ucuda  # noqa: E402

OTHER_STREAM = 0x3000


def freed_while_another_stream_uses_it(fake, device):
    """A block of ``device`` freed while work queued on another stream still
    uses it: the pool keeps it (as active) until that work is done."""
    fake.setDevice(device)
    try:
        address = ucuda.caching_allocator_alloc(4096, device)
        fake.launch(stream=OTHER_STREAM)
        ucuda.record_stream(address, OTHER_STREAM)
        ucuda.caching_allocator_delete(address)
    finally:
        fake.setDevice(0)
    assert ucuda.memory_stats(device)["active_bytes.all.current"] == 4096


@pytest.mark.parametrize("device", [None, 1, "cuda:1"])
def test_synchronize_waits_for_the_device_and_the_pool_takes_its_blocks_back(fake, device):
    index = 0 if device is None else 1
    freed_while_another_stream_uses_it(fake, index)
    ucuda.synchronize(device)
    assert ucuda.memory_stats(index)["active_bytes.all.current"] == 0
    assert fake.events_alive() == 0


def test_synchronize_of_one_device_leaves_the_other_waiting(fake):
    freed_while_another_stream_uses_it(fake, 0)
    ucuda.synchronize(1)
    assert ucuda.memory_stats(0)["active_bytes.all.current"] == 4096
    ucuda.synchronize(0)
    assert ucuda.memory_stats(0)["active_bytes.all.current"] == 0


def test_synchronize_refuses_a_device_that_is_not_there(fake):
    with pytest.raises(unimem.InvalidDeviceError):
        ucuda.synchronize(2)
    with pytest.raises(TypeError):
        ucuda.synchronize(1.5)


def test_ipc_collect_has_nothing_to_collect_and_leaves_the_pools_alone(fake):
    address = ucuda.caching_allocator_alloc(4096)
    before = ucuda.memory_stats(0)
    assert ucuda.ipc_collect() is None
    assert ucuda.memory_stats(0) == before
    ucuda.caching_allocator_delete(address)


def test_graph_pool_handles_are_ids_no_pool_has(xpu):
    handles = [unimem.accelerator.generate_graph_pool_handle(), ucuda.graph_pool_handle(),
               xpu.graph_pool_handle()]
    pool = unimem.cpu.MemPool()
    handles.append(ucuda.graph_pool_handle())
    for handle in handles + [pool.id]:
        assert type(handle) is tuple and len(handle) == 2 and all(type(part) is int for part in handle)
        assert handle[0] == 0           # PyTorch's user-created ids: (0, n), n counting up from 1
    counts = [handle[1] for handle in handles]
    assert len(set(counts + [pool.id[1]])) == 5
    assert counts[:3] == sorted(counts[:3]) and counts[2] < pool.id[1] < counts[3]   # one id space
    assert unimem.cpu.memory_snapshot(mempool_id=handles[0]) == []      # it names no pool
