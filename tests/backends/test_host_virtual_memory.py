"""Virtual memory of the host backend (the ``cpu`` pool's expandable segments):
real address space and real pages, measured with the process's RSS and the
kernel's own description of each mapping (/proc/self/smaps)."""
import ctypes
import os
import subprocess
import sys
import threading

import pytest
from hypothesis import given, settings, strategies as st

from unimem.backends._host import PAGE_SIZE, PageAlignedBackend

from tests.helpers.mappings import vma_flags

MiB = 1 << 20


def rss():
    """Resident bytes of this process, now (not the peak)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


@pytest.fixture
def backend():
    b = PageAlignedBackend("CPU")
    yield b
    # give back whatever a test left: unmap every span, release every range
    ranges = b.address_ranges
    for base, size in ranges.reserved():
        for address, length in ranges.mapped(base):
            b.unmap_pages(address, length, 0)
        b.release_address_range(base, size, 0)


def test_granularity_is_the_host_page(backend):
    assert backend.virtual_memory_granularity(0) == PAGE_SIZE == os.sysconf("SC_PAGESIZE")


def test_rss_rises_with_touched_pages_and_falls_when_they_are_unmapped(backend):
    size = 64 * MiB
    start = rss()
    base = backend.reserve_address_range(4 * size, 0)
    assert base % PAGE_SIZE == 0
    assert rss() - start < 4 * MiB                      # address space only
    backend.map_pages(base + size, size, 0)
    assert rss() - start < 4 * MiB                      # mapped, not yet touched: faulted in on first use
    ctypes.memset(base + size, 0x5A, size)
    touched = rss()
    assert touched - start >= size - 2 * MiB, (start, touched)
    assert ctypes.string_at(base + size + 12345, 4) == b"\x5a" * 4
    backend.unmap_pages(base + size, size, 0)
    after = rss()
    assert touched - after >= size - 2 * MiB, (touched, after)
    print(f"RSS: {start / MiB:.1f} MiB before, {touched / MiB:.1f} MiB mapped and touched, "
          f"{after / MiB:.1f} MiB after unmap")
    # mapped again: fresh zero pages, not the old contents
    backend.map_pages(base + size, size, 0)
    assert ctypes.string_at(base + size + 12345, 4) == b"\0" * 4


def test_kernel_flags_reserved_mapped_and_unmapped_pages(backend):
    """Reserved: no access, no commit charge; mapped: read-write and charged
    (so a span the system cannot back is refused at map time); unmapped: no
    access, and the charge is given back."""
    base = backend.reserve_address_range(16 * PAGE_SIZE, 0)
    middle = base + 4 * PAGE_SIZE
    flags = vma_flags(middle)
    assert "rd" not in flags and "wr" not in flags and "ac" not in flags and "nr" in flags
    backend.map_pages(middle, 4 * PAGE_SIZE, 0)
    flags = vma_flags(middle)
    assert {"rd", "wr", "ac"} <= flags and "nr" not in flags
    assert "rd" not in vma_flags(base)                  # the rest of the range stays reserved only
    backend.unmap_pages(middle, 4 * PAGE_SIZE, 0)
    flags = vma_flags(middle)
    assert "rd" not in flags and "ac" not in flags and "nr" in flags


def test_an_unmapped_page_faults_on_access():
    """Reserved and unmapped pages are really inaccessible (in a child
    process, which dies of SIGSEGV)."""
    code = ("import ctypes\n"
            "from unimem.backends._host import PageAlignedBackend, PAGE_SIZE\n"
            "b = PageAlignedBackend()\n"
            "base = b.reserve_address_range(4 * PAGE_SIZE, 0)\n"
            "b.map_pages(base, 2 * PAGE_SIZE, 0)\n"
            "ctypes.memset(base, 1, 2 * PAGE_SIZE)\n"
            "b.unmap_pages(base + PAGE_SIZE, PAGE_SIZE, 0)\n"
            "print('mapped page readable', ctypes.string_at(base, 1), flush=True)\n"
            "ctypes.string_at(base + PAGE_SIZE, 1)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert "mapped page readable b'\\x01'" in result.stdout, result.stderr
    assert result.returncode == -11, (result.returncode, result.stderr)


def test_spans_map_and_unmap_in_any_page_aligned_pieces(backend):
    base = backend.reserve_address_range(8 * PAGE_SIZE, 0)
    for page in (0, 1, 2, 5, 6, 7):
        backend.map_pages(base + page * PAGE_SIZE, PAGE_SIZE, 0)
    assert backend.address_ranges.mapped(base) == [(base, 3 * PAGE_SIZE), (base + 5 * PAGE_SIZE, 3 * PAGE_SIZE)]
    ctypes.memset(base, 3, 3 * PAGE_SIZE)
    backend.unmap_pages(base + PAGE_SIZE, PAGE_SIZE, 0)     # splits a span
    assert ctypes.string_at(base, 1) == ctypes.string_at(base + 2 * PAGE_SIZE, 1) == b"\x03"
    assert backend.address_ranges.mapped(base) == [
        (base, PAGE_SIZE), (base + 2 * PAGE_SIZE, PAGE_SIZE), (base + 5 * PAGE_SIZE, 3 * PAGE_SIZE)]
    assert backend.address_ranges.mapped_bytes() == 5 * PAGE_SIZE


def misuse_cases(base, size):
    """(call, arguments, expected exception) of every kind of misuse, given a
    range at ``base`` of ``size`` bytes whose pages 2-3 are mapped."""
    P = PAGE_SIZE
    return [
        ("map_pages", (base + 1, P), ValueError),                    # misaligned address
        ("map_pages", (base, P + 1), ValueError),                    # misaligned size
        ("map_pages", (base, 0), ValueError),
        ("map_pages", (base, -P), ValueError),
        ("map_pages", (base - P, P), ValueError),                    # before the range
        ("map_pages", (base + size - P, 2 * P), ValueError),         # runs past its end
        ("map_pages", (base + size, P), ValueError),
        ("map_pages", (0, P), ValueError),                           # never reserved
        ("map_pages", (base + 2 * P, P), ValueError),                # double map
        ("map_pages", (base + P, 2 * P), ValueError),                # overlaps a mapped page
        ("map_pages", (base + 3 * P, 2 * P), ValueError),
        ("map_pages", (base + P, 4 * P), ValueError),                # covers the mapped span
        ("map_pages", (float(base), P), TypeError),
        ("map_pages", (base, "4096"), TypeError),
        ("map_pages", (None, P), TypeError),
        ("map_pages", (True, P), TypeError),
        ("unmap_pages", (base, P), ValueError),                      # not mapped
        ("unmap_pages", (base + P, 2 * P), ValueError),              # partly mapped
        ("unmap_pages", (base + 3 * P, 2 * P), ValueError),
        ("unmap_pages", (base + 2 * P + 1, P), ValueError),
        ("unmap_pages", (base + 2 * P, P + 7), ValueError),
        ("unmap_pages", (base + size, P), ValueError),
        ("unmap_pages", (base + 2 * P, 2.0 * P), TypeError),
        ("release_address_range", (base, size), ValueError),         # pages still mapped
        ("release_address_range", (base + P, size - P), ValueError),  # not as reserved
        ("release_address_range", (base, size - P), ValueError),
        ("release_address_range", (base + size, size), ValueError),
        ("release_address_range", ([base], size), TypeError),
        ("reserve_address_range", (0,), ValueError),
        ("reserve_address_range", (-PAGE_SIZE,), ValueError),
        ("reserve_address_range", (PAGE_SIZE + 1,), ValueError),
        ("reserve_address_range", (1.5,), TypeError),
        ("reserve_address_range", (b"x",), TypeError),
    ]


def test_misuse_is_refused_and_changes_nothing(backend):
    size = 8 * PAGE_SIZE
    base = backend.reserve_address_range(size, 0)
    backend.map_pages(base + 2 * PAGE_SIZE, 2 * PAGE_SIZE, 0)
    ctypes.memset(base + 2 * PAGE_SIZE, 0x77, 2 * PAGE_SIZE)
    ranges = backend.address_ranges
    before = (ranges.reserved(), ranges.mapped(base))
    for name, args, error in misuse_cases(base, size):
        with pytest.raises(error):
            getattr(backend, name)(*args, 0)
        assert (ranges.reserved(), ranges.mapped(base)) == before, (name, args)
        assert ctypes.string_at(base + 2 * PAGE_SIZE, 2 * PAGE_SIZE) == b"\x77" * (2 * PAGE_SIZE), (name, args)
        assert "rd" not in vma_flags(base) and "rd" not in vma_flags(base + 4 * PAGE_SIZE), (name, args)


@pytest.mark.parametrize("device", [1, -1, "0", None, True])
def test_the_host_is_device_0(backend, device):
    with pytest.raises(ValueError if isinstance(device, int) and not isinstance(device, bool) else TypeError):
        backend.reserve_address_range(PAGE_SIZE, device)
    assert backend.address_ranges.reserved() == []


def test_more_address_space_than_exists_is_a_memory_error(backend):
    for size in (1 << 62, 1 << 70):            # past the 47/56-bit user address space; past size_t
        with pytest.raises(MemoryError):
            backend.reserve_address_range(size, 0)
    assert backend.address_ranges.reserved() == []


def overcommit_mode():
    with open("/proc/sys/vm/overcommit_memory") as f:
        return int(f.read())


def test_mapping_more_than_the_system_can_commit_is_a_memory_error(backend):
    """Under the default heuristic (and strict) overcommit, a span larger
    than RAM and swap is refused when mapped, as a MemoryError, and the span
    stays reserved and unmapped (no later SIGSEGV or OOM kill)."""
    if overcommit_mode() == 1:
        pytest.skip("vm.overcommit_memory=1: this kernel commits any amount, so nothing can be refused")
    ram = os.sysconf("SC_PAGESIZE") * os.sysconf("SC_PHYS_PAGES")
    with open("/proc/meminfo") as f:
        swap = next(int(line.split()[1]) * 1024 for line in f if line.startswith("SwapTotal:"))
    too_much = (2 * (ram + swap) + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
    base = backend.reserve_address_range(too_much + 4 * PAGE_SIZE, 0)
    with pytest.raises(MemoryError, match="cannot commit"):
        backend.map_pages(base + 4 * PAGE_SIZE, too_much, 0)
    assert backend.address_ranges.mapped(base) == []
    flags = vma_flags(base + 4 * PAGE_SIZE)
    assert "rd" not in flags and "nr" in flags              # still reserved, inaccessible
    backend.map_pages(base, 4 * PAGE_SIZE, 0)                # the range is usable still
    ctypes.memset(base, 9, 4 * PAGE_SIZE)
    backend.map_pages(base + 4 * PAGE_SIZE, PAGE_SIZE, 0)


def test_two_threads_cannot_both_map_the_same_span(backend):
    base = backend.reserve_address_range(64 * PAGE_SIZE, 0)
    barrier = threading.Barrier(2)
    outcomes = []

    def map_all():
        barrier.wait()
        for page in range(64):
            try:
                backend.map_pages(base + page * PAGE_SIZE, PAGE_SIZE, 0)
                outcomes.append(page)
            except ValueError:
                pass
    threads = [threading.Thread(target=map_all) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == list(range(64))
    assert backend.address_ranges.mapped(base) == [(base, 64 * PAGE_SIZE)]


PAGES = 24


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["map", "unmap"]), st.integers(-2, PAGES + 1),
                          st.integers(1, 6)), max_size=40))
def test_the_record_follows_a_page_model(operations):
    """Any sequence of maps and unmaps, in range or not: each is refused
    exactly when a per-page model says it is misuse; what is mapped is
    writable and keeps its contents; a page mapped anew reads zero."""
    backend = PageAlignedBackend()
    base = backend.reserve_address_range(PAGES * PAGE_SIZE, 0)
    mapped = {}          # page -> the byte written there
    try:
        for step, (op, first, count) in enumerate(operations):
            pages = set(range(first, first + count))
            inside = first >= 0 and first + count <= PAGES
            address, size = base + first * PAGE_SIZE, count * PAGE_SIZE
            if op == "map":
                allowed = inside and not pages & mapped.keys()
            else:
                allowed = inside and pages <= mapped.keys()
            if not allowed:
                with pytest.raises(ValueError):
                    getattr(backend, f"{op}_pages")(address, size, 0)
                continue
            getattr(backend, f"{op}_pages")(address, size, 0)
            for page in sorted(pages):
                if op == "map":
                    at = base + page * PAGE_SIZE
                    assert ctypes.string_at(at, 1) == b"\0"
                    mapped[page] = step % 250 + 1
                    ctypes.memset(at, mapped[page], PAGE_SIZE)
                else:
                    del mapped[page]
            for page, byte in mapped.items():
                assert ctypes.string_at(base + page * PAGE_SIZE + PAGE_SIZE - 1, 1) == bytes([byte])
            assert backend.address_ranges.mapped_bytes() == len(mapped) * PAGE_SIZE
        for page in list(mapped):
            backend.unmap_pages(base + page * PAGE_SIZE, PAGE_SIZE, 0)
    finally:
        for address, length in backend.address_ranges.mapped(base):
            backend.unmap_pages(address, length, 0)
        backend.release_address_range(base, PAGES * PAGE_SIZE, 0)
    assert backend.address_ranges.reserved() == []


def test_the_pinned_fallback_pool_offers_virtual_memory_too():
    host = PageAlignedBackend("CPU").pinned_host_backend()
    base = host.reserve_address_range(2 * PAGE_SIZE, 0)
    host.map_pages(base, PAGE_SIZE, 0)
    ctypes.memset(base, 1, PAGE_SIZE)
    host.unmap_pages(base, PAGE_SIZE, 0)
    host.release_address_range(base, 2 * PAGE_SIZE, 0)
    assert host.address_ranges.reserved() == []
