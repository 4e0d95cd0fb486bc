"""The backend conformance suite: what every backend unimem ships must do, as
RMM's and oneAPI UMF's shared provider tests hold every memory resource to
one contract.

Each test runs once per backend of tests/helpers/backend_cases.py (host,
simulated, pluggable, shared library, fault injection, CUDA on the simulated
runtime, XPU on the SYCL device, CUDA on a GPU), skipping where that runtime
is absent. The contract is the one ``unimem/backends/base.py`` writes down:
``malloc`` gives distinct, non-overlapping segments aligned as the runtime
promises, says "full" with 0 or ``MemoryError``, and is thread-safe (the
core calls it without its lock); the optional capabilities (events, stream
checks, capacity, virtual memory) do what their docstrings say where the
backend has them; and the backend serves a real caching allocator whose
statistics come back to zero.
"""
import ctypes
import random
import threading

import pytest

from unimem import _core
from unimem.backends.base import Backend

from tests.helpers.backend_cases import IMPOSSIBLE_SIZE

MiB = 1 << 20
#: Sizes a cache miss asks for, and ones it never does (not multiples of 512).
SIZES = (1, 100, 511, 512, 4097, 65536, 1 * MiB + 1, 3 * MiB)
STREAM = 0


def held(case, backend):
    return case.held(backend) if case.held is not None else None


def assert_disjoint(spans):
    """No two ``(address, size)`` spans share a byte."""
    ordered = sorted(spans)
    for (a, n), (b, _) in zip(ordered, ordered[1:]):
        assert a + n <= b, f"[{a:#x}, {a + n:#x}) overlaps the segment at {b:#x}"


def writable(case, backend):
    return case.real_memory and backend.host_accessible


def fill(address, size, byte):
    ctypes.memset(address, byte, size)


def holds(address, size, byte):
    return ctypes.string_at(address, size) == bytes([byte]) * size


# ---------------------------------------------------------------------------
# what it is
# ---------------------------------------------------------------------------
def test_it_is_a_backend(conforming_backend):
    backend = conforming_backend
    assert isinstance(backend, Backend)
    assert isinstance(backend.name, str) and backend.name
    assert backend.api_name is None or isinstance(backend.api_name, str)
    assert isinstance(backend.host_accessible, bool)
    assert isinstance(backend.survives_fork, bool)
    assert backend.unmap_idle_pages is None or callable(backend.unmap_idle_pages)


def test_device_count_is_a_positive_int(conforming_backend):
    count = conforming_backend.device_count()
    assert type(count) is int and count >= 1


def test_memory_info_is_free_and_total_or_not_known(conforming_backend):
    for device in range(min(conforming_backend.device_count(), 2)):
        try:
            info = conforming_backend.memory_info(device)
        except NotImplementedError:
            continue                        # the documented "not known"
        assert type(info) is tuple and len(info) == 2
        free, total = info
        assert type(free) is int and type(total) is int
        assert 0 <= free <= total and total > 0


def test_max_allocation_size_is_a_byte_count(conforming_backend):
    limit = conforming_backend.max_allocation_size(0)
    assert type(limit) is int and limit >= 0           # 0: no limit known


# ---------------------------------------------------------------------------
# malloc and free
# ---------------------------------------------------------------------------
def test_malloc_gives_distinct_aligned_segments_and_free_takes_each_back(backend_case, conforming_backend):
    backend, before = conforming_backend, held(backend_case, conforming_backend)
    segments = []
    for size in SIZES * 2:
        address = backend.malloc(size, 0, STREAM)
        assert type(address) is int and address > 0, f"malloc({size}) gave {address!r}"
        assert address % backend_case.alignment == 0, (
            f"malloc({size}) gave {address:#x}, not a multiple of {backend_case.alignment} "
            f"({backend_case.why_aligned})")
        segments.append((address, size))
    assert_disjoint(segments)
    if before is not None:
        assert held(backend_case, backend) >= before + sum(SIZES) * 2
    for address, size in segments:
        backend.free(address, size, 0, STREAM)
    if before is not None:
        assert held(backend_case, backend) == before


def test_every_device_gets_its_own_segments(backend_case, conforming_backend):
    backend = conforming_backend
    segments = [(d, backend.malloc(MiB, d, STREAM)) for d in range(min(backend.device_count(), 2))]
    assert_disjoint([(address, MiB) for _, address in segments])
    for device, address in segments:
        backend.free(address, MiB, device, STREAM)


def test_an_impossible_size_is_refused_as_a_full_device(backend_case, conforming_backend):
    """0 or MemoryError (the core then releases its cache and retries), with
    nothing allocated; the next malloc is served as before."""
    backend, before = conforming_backend, held(backend_case, conforming_backend)
    try:
        address = backend.malloc(IMPOSSIBLE_SIZE, 0, STREAM)
    except MemoryError:
        pass
    else:
        assert address == 0, f"malloc(2**60) gave {address:#x}"
    assert held(backend_case, backend) == before
    address = backend.malloc(4096, 0, STREAM)
    assert address > 0
    backend.free(address, 4096, 0, STREAM)


def test_host_accessible_memory_keeps_what_is_written(backend_case, conforming_backend):
    backend = conforming_backend
    if not writable(backend_case, backend):
        pytest.skip("the host cannot touch this memory here")
    segments = [(backend.malloc(size, 0, STREAM), size) for size in SIZES]
    for i, (address, size) in enumerate(segments):
        fill(address, size, i + 1)
    for i, (address, size) in enumerate(segments):
        assert holds(address, size, i + 1), f"segment {i} ({size} bytes) lost what was written"
        backend.free(address, size, 0, STREAM)


def test_a_bad_free_is_refused_and_changes_nothing(backend_case, conforming_backend):
    """Where the backend documents an error for a free of what it did not
    hand out (an unknown address, a part of a segment, the wrong size, a
    segment twice), it raises that and frees nothing."""
    backend, error = conforming_backend, backend_case.bad_free_error
    if error is None:
        pytest.skip("a bad free is undefined behaviour of this runtime, not a documented error")
    size = 64 << 10
    address = backend.malloc(size, 0, STREAM)
    if writable(backend_case, backend):
        fill(address, size, 0x5A)
    before = held(backend_case, backend)
    for bad_address, bad_size in ((address + size * 16, size), (address + 4096, size - 4096),
                                  (address, size // 2), (address, size * 2)):
        with pytest.raises(error):
            backend.free(bad_address, bad_size, 0, STREAM)
    assert held(backend_case, backend) == before
    if writable(backend_case, backend):
        assert holds(address, size, 0x5A)
    backend.free(address, size, 0, STREAM)
    with pytest.raises(error):
        backend.free(address, size, 0, STREAM)               # twice
    assert held(backend_case, backend) == (None if before is None else before - size)


THREADS = 6
ROUNDS = 40


def test_malloc_and_free_from_several_threads_at_once(backend_case, conforming_backend):
    """The core asks for a segment without its lock: calls from several
    threads must each get their own memory, and every free its own."""
    backend, before = conforming_backend, held(backend_case, conforming_backend)
    live = {}                          # thread -> [(address, size)] held at the barrier
    errors = []
    halfway = threading.Barrier(THREADS)
    write = writable(backend_case, backend)

    def work(index):
        rng = random.Random(index)
        mine = []
        try:
            for round_ in range(ROUNDS):
                size = rng.choice(SIZES)
                address = backend.malloc(size, 0, STREAM)
                assert address > 0
                if write:
                    fill(address, size, index + 1)
                mine.append((address, size))
                if round_ == ROUNDS // 2:
                    live[index] = list(mine)
                    halfway.wait(timeout=60)
                if len(mine) > 4 or rng.random() < 0.3:
                    address, size = mine.pop(rng.randrange(len(mine)))
                    if write:
                        assert holds(address, size, index + 1), "another thread wrote into this segment"
                    backend.free(address, size, 0, STREAM)
        except BaseException as exc:
            errors.append(exc)
            halfway.abort()
        finally:
            for address, size in mine:
                backend.free(address, size, 0, STREAM)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert_disjoint([span for spans in live.values() for span in spans])
    assert held(backend_case, backend) == before


# ---------------------------------------------------------------------------
# streams and events
# ---------------------------------------------------------------------------
def test_an_event_waits_for_the_work_before_it(backend_case, conforming_backend):
    """``event_done`` never blocks (False while the stream's work runs, where
    the case can hold a stream busy), and answers True once the work is done
    (``synchronize``); ``event_synchronize`` waits for the work before its
    event, and so before every earlier event of the stream; ``release_event``
    gives back one nobody waits for. Each event's life ends with one of these
    three, as the core ends it: none is used after."""
    backend, queue_work = conforming_backend, backend_case.queue_work
    alive = backend_case.live_events(backend) if backend_case.live_events else None

    def recorded():
        if queue_work is not None:
            queue_work(backend, STREAM, 0)
        event = backend.record_event(STREAM, 0)
        if queue_work is not None:
            assert backend.event_done(event) is False, "done before its stream's work is"
        return event

    event = recorded()
    backend.synchronize(0)
    assert backend.event_done(event) is True
    earlier, later = recorded(), recorded()
    backend.event_synchronize(later)
    assert backend.event_done(earlier) is True, "a stream's work completes in order"
    backend.release_event(recorded())
    if alive is not None:
        assert backend_case.live_events(backend) == alive, "an event outlived its end"


def test_check_stream_takes_a_stream_and_refuses_what_names_none(backend_case, conforming_backend):
    backend = conforming_backend
    backend.check_stream(STREAM, 0)
    if backend_case.bad_stream is None:
        pytest.skip("this backend takes every handle (no stream to check)")
    with pytest.raises(ValueError):
        backend.check_stream(backend_case.bad_stream, 0)


def test_streams_are_let_go_of_without_waiting(backend_case, conforming_backend):
    """``abandoned_streams`` names none of the streams it is asked about
    while their caller still holds them (the default stream never goes);
    ``release_stream`` and ``sweep_released_streams`` then let go of one."""
    backend = conforming_backend
    other = backend_case.new_stream(backend)          # the case keeps the stream
    assert backend.abandoned_streams([], 0) == []
    assert backend.abandoned_streams([STREAM, other], 0) == []
    backend.release_stream(other, 0)
    backend.sweep_released_streams()


# ---------------------------------------------------------------------------
# virtual memory (expandable segments)
# ---------------------------------------------------------------------------
def granularity_of(backend):
    """The backend's virtual memory page; skips the test where it has none
    (0, or NotImplementedError saying why)."""
    try:
        granularity = backend.virtual_memory_granularity(0)
    except NotImplementedError as reason:
        pytest.skip(f"no virtual memory: {reason}")
    if granularity == 0:
        pytest.skip("no virtual memory")
    assert type(granularity) is int and granularity > 0 and granularity & (granularity - 1) == 0
    return granularity


def test_virtual_memory_reserve_map_unmap_map_again_release(backend_case, conforming_backend):
    backend, before = conforming_backend, held(backend_case, conforming_backend)
    g = granularity_of(backend)
    write = writable(backend_case, backend)
    base = backend.reserve_address_range(4 * g, 0)
    other = backend.reserve_address_range(g, 0)
    assert backend.unmap_idle_pages is None or callable(backend.unmap_idle_pages)
    assert base > 0 and base % g == 0 and other % g == 0
    assert_disjoint([(base, 4 * g), (other, g)])
    assert held(backend_case, backend) == before                   # address space costs no memory
    backend.map_pages(base, 2 * g, 0)
    backend.map_pages(base + 3 * g, g, 0)
    if before is not None:
        assert held(backend_case, backend) == before + 3 * g
    if write:
        fill(base, 2 * g, 1)
        fill(base + 3 * g, g, 3)
    backend.unmap_pages(base + g, g, 0)                            # one page of a span mapped at once
    backend.map_pages(base + g, 2 * g, 0)                          # and back, with the hole beside it
    if write:
        assert holds(base, g, 1) and holds(base + 3 * g, g, 3)
        fill(base + g, 2 * g, 2)
        assert holds(base + g, 2 * g, 2)
    for at in range(base, base + 4 * g, g):
        backend.unmap_pages(at, g, 0)
    assert held(backend_case, backend) == before
    backend.release_address_range(base, 4 * g, 0)
    backend.release_address_range(other, g, 0)


def test_virtual_memory_on_every_device(conforming_backend):
    backend = conforming_backend
    g = granularity_of(backend)
    ranges = []
    for device in range(min(backend.device_count(), 2)):
        assert backend.virtual_memory_granularity(device) == g
        base = backend.reserve_address_range(2 * g, device)
        backend.map_pages(base + g, g, device)
        ranges.append((device, base))
    assert_disjoint([(base, 2 * g) for _, base in ranges])
    for device, base in ranges:
        backend.unmap_pages(base + g, g, device)
        backend.release_address_range(base, 2 * g, device)


def test_virtual_memory_misuse_is_refused_and_changes_nothing(backend_case, conforming_backend):
    """Mapping a mapped page, unmapping an unmapped one, a span that is not
    aligned or not reserved, and releasing a range with pages mapped: the
    documented error, with the record and the memory as they were."""
    backend, error = conforming_backend, backend_case.misuse_error
    g = granularity_of(backend)
    write = writable(backend_case, backend)
    base = backend.reserve_address_range(2 * g, 0)
    backend.map_pages(base, g, 0)
    if write:
        fill(base, g, 7)
    before = held(backend_case, backend)
    for misuse in (lambda: backend.map_pages(base, g, 0),
                   lambda: backend.map_pages(base, 2 * g, 0),
                   lambda: backend.unmap_pages(base + g, g, 0),
                   lambda: backend.unmap_pages(base, 2 * g, 0),
                   lambda: backend.map_pages(base + g + g // 2, g // 2, 0),
                   lambda: backend.map_pages(base + 2 * g, g, 0),
                   lambda: backend.release_address_range(base, 2 * g, 0),
                   lambda: backend.release_address_range(base, g, 0)):
        with pytest.raises(error):
            misuse()
    assert held(backend_case, backend) == before
    if write:
        assert holds(base, g, 7)
    backend.map_pages(base + g, g, 0)
    backend.unmap_pages(base, 2 * g, 0)
    backend.release_address_range(base, 2 * g, 0)


def test_mapping_past_the_capacity_is_a_memory_error_with_nothing_mapped(backend_case, conforming_backend):
    backend = conforming_backend
    g = granularity_of(backend)
    if not backend_case.bounded:
        pytest.skip("its capacity is not small enough to fill")
    free, total = backend.memory_info(0)
    pages = total // g + 1
    base = backend.reserve_address_range(pages * g, 0)
    before = held(backend_case, backend)
    with pytest.raises(MemoryError):
        backend.map_pages(base, pages * g, 0)
    assert held(backend_case, backend) == before
    backend.map_pages(base, g, 0)                                  # nothing of the refused span stayed mapped
    backend.unmap_pages(base, g, 0)
    backend.release_address_range(base, pages * g, 0)


# ---------------------------------------------------------------------------
# sleep mode: a segment's memory given back, its addresses kept
# ---------------------------------------------------------------------------
def test_a_segments_pages_go_back_and_come_back_where_it_can(backend_case, conforming_backend):
    """Where ``page_release_unavailable_reason`` is "", ``release_pages``
    gives a segment's memory back and ``restore_pages`` backs it again at
    the same addresses; elsewhere both refuse with that reason."""
    backend = conforming_backend
    reason = backend.page_release_unavailable_reason(0)
    assert isinstance(reason, str)
    size = 5 * 4096
    address = backend.malloc(size, 0, STREAM)
    try:
        if reason:
            for call in (backend.release_pages, backend.restore_pages):
                with pytest.raises(NotImplementedError):
                    call(address, size, 0)
            return
        before = held(backend_case, backend)
        backend.release_pages(address, size, 0)
        backend.restore_pages(address, size, 0)
        assert held(backend_case, backend) == before
        if writable(backend_case, backend):
            fill(address, size, 9)
            assert holds(address, size, 9)
        if backend_case.bad_free_error is not None:         # only a whole segment
            with pytest.raises(backend_case.bad_free_error):
                backend.release_pages(address + 4096, size - 4096, 0)
    finally:
        backend.free(address, size, 0, STREAM)


def test_its_pinned_host_backend_is_a_host_accessible_backend(conforming_backend):
    make = getattr(conforming_backend, "pinned_host_backend", None)
    if make is None:
        pytest.skip("no pinned host memory of its own (unimem.host uses page-aligned memory)")
    pinned = make()
    assert isinstance(pinned, Backend) and pinned.host_accessible is True
    assert isinstance(pinned.pinning, str)
    address = pinned.malloc(4096, 0, STREAM)
    assert address > 0
    pinned.free(address, 4096, 0, STREAM)


# ---------------------------------------------------------------------------
# under a caching allocator
# ---------------------------------------------------------------------------
def cycle(allocator, backend_case, backend, expandable):
    """A short life of a caching allocator: blocks of every size, some used on
    a second stream (record_stream), freed, the cache emptied; every
    statistic comes back to zero and the backend holds what it held."""
    before = held(backend_case, backend)
    other = backend_case.new_stream(backend)
    blocks = [allocator.malloc(size) for size in SIZES * 3]
    assert len(set(blocks)) == len(blocks)
    block_alignment = min(backend_case.alignment, 512)       # blocks lie at multiples of 512 in a segment
    assert all(block % block_alignment == 0 for block in blocks)
    allocator._check_invariants()
    for block in blocks[::4]:
        allocator.record_stream(block, other)
    if writable(backend_case, backend):
        for i, (block, size) in enumerate(zip(blocks, SIZES * 3)):
            fill(block, size, i % 250 + 1)
        for i, (block, size) in enumerate(zip(blocks, SIZES * 3)):
            assert holds(block, size, i % 250 + 1)
    for block in blocks:
        allocator.free(block)
    allocator._check_invariants()
    assert allocator.memory_allocated() == 0
    allocator.empty_cache()
    if expandable:
        allocator.empty_virt_addr_cache()
        assert allocator.reserved_address_space() == {"ranges": 0, "bytes": 0}
    allocator._check_invariants()
    stats = allocator.memory_stats()
    current = {key: value for key, value in stats.items() if key.endswith(".current") and value}
    assert current == {}, current
    assert allocator.memory_reserved() == 0
    assert held(backend_case, backend) == before


@pytest.mark.parametrize("options", [{}, {"exact_segments": True}], ids=["pooled", "exact-segments"])
def test_it_serves_a_caching_allocator(backend_case, conforming_backend, options):
    """Also with a segment per request (``exact_segments``), where a block
    is as aligned as the backend's malloc (XPU blocks were 128-aligned so,
    below the 512 the dpnp allocator honours: DPCTLmalloc_device aligns
    small allocations no further on the OpenCL CPU device)."""
    allocator = _core.CachingAllocator(conforming_backend, 0, **options)
    cycle(allocator, backend_case, conforming_backend, expandable=False)


def test_it_serves_a_caching_allocator_with_expandable_segments(backend_case, conforming_backend):
    granularity_of(conforming_backend)
    allocator = _core.CachingAllocator(conforming_backend, 0, expandable_segments=True)
    cycle(allocator, backend_case, conforming_backend, expandable=True)


def test_a_full_device_is_an_out_of_memory_error_of_the_allocator(backend_case, conforming_backend):
    """The backend's "full" (0 or MemoryError) reaches the caller as
    ``OutOfMemoryError`` after the core's retry, with nothing changed."""
    allocator = _core.CachingAllocator(conforming_backend, 0)
    kept = allocator.malloc(4096)
    before = allocator.memory_stats()
    with pytest.raises(_core.OutOfMemoryError):
        allocator.malloc(1 << 45)                  # 32 TiB: more than any device here holds
    allocator._check_invariants()
    after = allocator.memory_stats()
    changed = {key for key in before if before[key] != after[key] and not key.startswith("num_")}
    assert changed == set(), changed
    allocator.free(kept)
    allocator.empty_cache()
    assert allocator.memory_reserved() == 0
