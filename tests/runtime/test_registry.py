"""The device registry (unimem/_runtime/registry.pyx): the current device is
per thread, kept in a per-thread table, for however many registries."""
import threading

from unimem import _core
from unimem._runtime.registry import DeviceRegistry
from unimem.backends.simulated import SimulatedBackend


def test_more_registries_than_the_per_thread_table_holds_work():
    registries = [DeviceRegistry(f"pool{i}", 2, lambda i: _core.CachingAllocator(SimulatedBackend(), i))
                  for i in range(100)]
    for i, registry in enumerate(registries):
        registry.set_current_index(i % 2)
    assert [r.current_index() for r in registries] == [i % 2 for i in range(100)]
    seen = []
    thread = threading.Thread(target=lambda: seen.extend(r.current_index() for r in registries))
    thread.start()
    thread.join()
    assert seen == [0] * 100                           # the current device is per thread
