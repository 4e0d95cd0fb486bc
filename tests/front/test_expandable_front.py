"""``expandable_segments:True`` through the namespaces, and
``empty_virt_addr_cache`` on every one of them (a fresh interpreter each:
the option is read when a device's allocator is made)."""
import unimem
import unimem.accelerator
import unimem.cpu
import unimem.cuda
import unimem.xpu

from tests.helpers import fresh


def run_fresh(code, **env):
    return fresh.run_fresh(code, **env).split()


def test_every_namespace_has_empty_virt_addr_cache():
    for namespace in (unimem.cpu, unimem.cuda, unimem.xpu, unimem.accelerator, unimem.accelerator.memory):
        assert callable(namespace.empty_virt_addr_cache), namespace.__name__
        assert "empty_virt_addr_cache" in namespace.__all__, namespace.__name__
    assert "virtual address" in unimem.cpu.empty_virt_addr_cache.__doc__


def test_the_cpu_pool_grows_one_range_and_gives_everything_back():
    out = run_fresh("""
        import unimem, unimem.cpu as cpu
        unimem.cpu.empty_virt_addr_cache()            # no allocator yet: nothing to do
        a = cpu.caching_allocator_alloc(3 << 20)
        b = cpu.caching_allocator_alloc(5 << 20)
        allocator = cpu.caching_allocator()
        print(b - a, cpu.memory_reserved(), cpu.memory_stats()["num_device_alloc"],
              cpu.memory_stats()["segment.all.current"],
              all(s["is_expandable"] for s in cpu.memory_snapshot()))
        cpu.caching_allocator_delete(a)
        cpu.caching_allocator_delete(b)
        cpu.empty_cache()
        print(cpu.memory_reserved(), allocator.reserved_address_space()["ranges"])
        cpu.empty_virt_addr_cache(0)
        print(allocator.reserved_address_space()["ranges"])
        p = unimem.accelerator.caching_allocator_alloc(1 << 20)
        unimem.accelerator.caching_allocator_delete(p)
        unimem.accelerator.empty_cache()
        unimem.accelerator.empty_virt_addr_cache()
        print(allocator.reserved_address_space()["ranges"], allocator.settings["expandable_segments"])
    """, UNIMEM_ALLOC_CONF="expandable_segments:True", UNIMEM_DEVICE="cpu")
    assert out == [str(3 << 20), str(8 << 20), "2", "0", "True", "0", "1", "0", "0", "True"]


def test_without_the_option_empty_virt_addr_cache_changes_nothing():
    out = run_fresh("""
        import unimem.cpu as cpu
        cpu.caching_allocator_delete(cpu.caching_allocator_alloc(1000))
        cpu.empty_virt_addr_cache()
        print(cpu.memory_reserved(), cpu.memory_snapshot()[0]["is_expandable"])
    """, UNIMEM_DEVICE="cpu")
    assert out == [str(2 << 20), "False"]


def test_the_memory_history_shows_maps_and_unmaps_as_reserved_memory():
    out = run_fresh("""
        import unimem.cpu as cpu
        from unimem._observe.plot import Timeline
        cpu._record_memory_history("all")
        p = cpu.caching_allocator_alloc(3 << 20)
        cpu.caching_allocator_delete(p)
        cpu.empty_cache()
        snapshot = cpu._snapshot()
        print(*[e["action"] for e in snapshot["device_traces"][0]])
        timeline = Timeline(snapshot, 0)
        print(max(timeline.reserved), timeline.reserved[-1])
    """, UNIMEM_ALLOC_CONF="expandable_segments:True", UNIMEM_DEVICE="cpu")
    assert out == ["segment_map", "alloc", "free_requested", "free_completed", "segment_unmap",
                   str(4 << 20), "0"]
