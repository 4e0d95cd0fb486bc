"""A plain-Python model of PyTorch's caching policy, for checking the core.

Written for clarity, not speed: free blocks are found by scanning, statistics
are kept exactly as PyTorch's DeviceCachingAllocator keeps them. Its "device"
hands out addresses as :class:`unimem.backends.simulated.SimulatedBackend`
does (a bump pointer per device), so a correct core returns the very same
addresses as the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

STAT_NAMES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
              "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "small_pool", "large_pool")


class ModelOOM(Exception):
    pass


class ModelFreeFailure(Exception):
    """The device refused to take a segment back."""


@dataclass
class Stat:
    current: int = 0
    peak: int = 0
    allocated: int = 0
    freed: int = 0

    def increase(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)
        self.allocated += n

    def decrease(self, n: int) -> None:
        self.current -= n
        self.freed += n


@dataclass
class Block:
    ptr: int
    size: int
    stream: int
    small: bool
    segment: "Segment"
    allocated: bool = False
    requested: int = 0
    pending_events: int = 0
    mapped: bool = True          # expandable segments: False for an unmapped span


@dataclass
class Segment:
    base: int
    size: int
    stream: int
    small: bool
    blocks: List[Block] = field(default_factory=list)
    expandable: bool = False     # a reserved range, mapped by ``page``
    page: int = 0


class ModelAllocator:
    """PyTorch's policy on a simulated device of ``capacity`` bytes."""

    def __init__(self, capacity: int, device: int = 0, max_split_size: Optional[int] = None,
                 know_capacity: bool = True, max_reserved_ratio: float = 0.0,
                 expandable_segments: bool = False, granularity: int = 2 << 20) -> None:
        self.capacity = capacity
        self.expandable = expandable_segments
        self.granularity = granularity
        self.max_reserved_ratio = max_reserved_ratio
        self.know_capacity = know_capacity
        self.max_split = max_split_size if max_split_size is not None else (1 << 64) - 1
        self.next_address = (device + 1) << 44
        self.used = 0
        self.segments: List[Segment] = []
        self.live: Dict[int, Block] = {}
        self.stats = {name: {pool: Stat() for pool in POOLS} for name in STAT_NAMES}
        self.oversize_allocations = Stat()
        self.oversize_segments = Stat()
        self.counters = dict(num_alloc_retries=0, num_ooms=0, num_sync_all_streams=0,
                             num_device_alloc=0, num_device_free=0)
        # Faults, as unimem.backends.faults.FaultInjectingBackend injects them.
        self.refuse_next = 0           # device mallocs still to refuse
        self.unfreeable = set()        # segment addresses the device will not take back
        self.lost: List[int] = []      # segments forgotten after a failed free (still on the device)

    # -- statistics helpers ---------------------------------------------------
    def _inc(self, name: str, small: bool, n: int) -> None:
        self.stats[name]["all"].increase(n)
        self.stats[name]["small_pool" if small else "large_pool"].increase(n)

    def _dec(self, name: str, small: bool, n: int) -> None:
        self.stats[name]["all"].decrease(n)
        self.stats[name]["small_pool" if small else "large_pool"].decrease(n)

    # -- the simulated device ---------------------------------------------------
    def _device_malloc(self, size: int) -> Optional[int]:
        if self.refuse_next:
            self.refuse_next -= 1
            return None
        if self.used + size > self.capacity:
            return None
        ptr = self.next_address
        self.next_address += -(-size // 512) * 512
        self.used += size
        return ptr

    # -- policy ---------------------------------------------------------------
    @staticmethod
    def round_size(size: int) -> int:
        return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def _free_blocks(self):
        for seg in self.segments:
            for b in seg.blocks:
                if not b.allocated and b.pending_events == 0 and b.mapped:
                    yield b

    def _best_fit(self, size: int, stream: int, small: bool) -> Optional[Block]:
        candidates = [b for b in self._free_blocks()
                      if b.stream == stream and b.small == small and b.size >= size]
        if not candidates:
            return None
        best = min(candidates, key=lambda b: (b.size, b.ptr))
        if size < self.max_split and best.size >= self.max_split:
            return None
        if size >= self.max_split and best.size >= size + LARGE_BUFFER:
            return None
        return best

    def _is_split(self, b: Block) -> bool:
        # PyTorch leaves expandable blocks out of inactive_split.
        return len(b.segment.blocks) > 1 and not b.segment.expandable

    def _new_segment(self, size: int, stream: int, small: bool, retry: bool) -> Optional[Block]:
        if retry:
            self.counters["num_alloc_retries"] += 1
        ptr = self._device_malloc(size)
        if ptr is None:
            return None
        seg = Segment(ptr, size, stream, small)
        block = Block(ptr, size, stream, small, seg)
        seg.blocks.append(block)
        self.segments.append(seg)
        self._inc("segment", small, 1)
        self._inc("reserved_bytes", small, size)
        if size >= self.max_split:
            self.oversize_segments.increase(1)
        self.counters["num_device_alloc"] += 1
        return block

    def _release(self, seg: Segment, device_took_it: bool = True) -> None:
        self.segments.remove(seg)
        if device_took_it:
            self.used -= seg.size
        self.counters["num_device_free"] += 1
        self._dec("segment", seg.small, 1)
        self._dec("reserved_bytes", seg.small, seg.size)
        if seg.size >= self.max_split:
            self.oversize_segments.decrease(1)

    def _whole_free(self, seg: Segment) -> bool:
        return not seg.expandable and len(seg.blocks) == 1 and not seg.blocks[0].allocated and seg.blocks[0].pending_events == 0

    def _release_segments(self, segments: List[Segment]) -> None:
        """Release each of ``segments``. One whose device free fails is
        forgotten all the same (never cached again: the free may have
        happened) and counted as lost; the device keeps it. The failure is
        raised once all were tried."""
        failed = False
        for seg in segments:
            if seg.base in self.unfreeable:
                failed = True
                self.lost.append(seg.base)
                self._release(seg, device_took_it=False)
            else:
                self._release(seg)
        if failed:
            raise ModelFreeFailure()

    def _release_all_free(self) -> None:
        """Release every wholly free segment."""
        self._release_segments([s for s in self.segments if self._whole_free(s)])

    def _release_to_ratio(self, size: int, alloc_size: int) -> None:
        """max_reserved_ratio: wholly free segments go, largest first, while
        reserved memory would exceed the ratio times the memory in use."""
        limit = self.max_reserved_ratio * (self.stats["allocated_bytes"]["all"].current + size)
        reserved = self.stats["reserved_bytes"]["all"].current + alloc_size
        chosen = []
        for seg in sorted((s for s in self.segments if self._whole_free(s)), key=lambda s: (-s.size, s.base)):
            if reserved <= limit:
                break
            reserved -= seg.size
            chosen.append(seg)
        self._release_segments(chosen)

    def _release_available(self, size: int, stream: int) -> bool:
        """PyTorch's release_available_cached_blocks (max_split_size set): the
        smallest free oversize segment of the stream that is big enough, or
        else its free oversize segments, largest first, until as much as
        asked (at least max_split_size) is released."""
        if self.max_split == (1 << 64) - 1:
            return False
        key = max(size, self.max_split)
        candidates = [s for s in self.segments if not s.small and s.stream == stream
                      and self._whole_free(s) and s.size >= self.max_split]
        fitting = [s for s in candidates if s.size >= key]
        if fitting:
            self._release_segments([min(fitting, key=lambda s: (s.size, s.base))])
            return True
        released, chosen = 0, []
        for seg in sorted(candidates, key=lambda s: (s.size, s.base), reverse=True):
            if released >= key:
                break
            released += seg.size
            chosen.append(seg)
        self._release_segments(chosen)
        return released >= key

    def malloc(self, request: int, stream: int = 0) -> int:
        if request == 0:
            return 0
        if self.expandable:
            return self._malloc_expandable(request, stream)
        size = self.round_size(request)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, stream, small)
        if block is None:
            alloc_size = self.allocation_size(size)
            if self.know_capacity and alloc_size > self.capacity:
                self.counters["num_ooms"] += 1
                raise ModelOOM(request)
            if self.max_reserved_ratio:
                self._release_to_ratio(size, alloc_size)
            block = self._new_segment(alloc_size, stream, small, False)
            if block is None and self._release_available(size, stream):
                block = self._new_segment(alloc_size, stream, small, False)
            if block is None:
                self.counters["num_sync_all_streams"] += 1
                self._release_all_free()
                block = self._new_segment(alloc_size, stream, small, True)
            if block is None:
                self.counters["num_ooms"] += 1
                raise ModelOOM(request)
        return self._hand_out(block, size, request)

    def _hand_out(self, block: Block, size: int, request: int) -> int:
        seg = block.segment
        already_split = self._is_split(block)
        remaining = block.size - size
        if block.small or seg.expandable:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self.max_split and remaining > SMALL_SIZE
        if split:
            rest = Block(block.ptr + size, remaining, block.stream, block.small, seg)
            seg.blocks.insert(seg.blocks.index(block) + 1, rest)
            block.size = size
            if seg.expandable:
                pass
            elif already_split:
                self._dec("inactive_split_bytes", block.small, size)
            else:
                self._inc("inactive_split_bytes", block.small, remaining)
                self._inc("inactive_split", block.small, 1)
        elif already_split:
            self._dec("inactive_split_bytes", block.small, block.size)
            self._dec("inactive_split", block.small, 1)
        block.allocated = True
        block.requested = request
        self.live[block.ptr] = block
        for name, n in (("allocation", 1), ("allocated_bytes", block.size), ("active", 1),
                        ("active_bytes", block.size), ("requested_bytes", request)):
            self._inc(name, block.small, n)
        if block.size >= self.max_split:
            self.oversize_allocations.increase(1)
        return block.ptr

    def free(self, ptr: int) -> None:
        block = self.live.pop(ptr)
        block.allocated = False
        self._dec("allocation", block.small, 1)
        self._dec("allocated_bytes", block.small, block.size)
        if block.size >= self.max_split:
            self.oversize_allocations.decrease(1)
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        seg = block.segment
        original, requested = block.size, block.requested
        net_blocks = net_bytes = 0
        i = seg.blocks.index(block)
        for j in (i + 1, i - 1):            # merge the next one first: indices stay valid
            if 0 <= j < len(seg.blocks):
                other = seg.blocks[j]
                if not other.allocated and other.pending_events == 0 and other.mapped:
                    if j < i:
                        block.ptr = other.ptr
                    block.size += other.size
                    seg.blocks.remove(other)
                    net_blocks -= 1
                    net_bytes -= other.size
        block.requested = 0
        if self._is_split(block):
            net_blocks += 1
            net_bytes += block.size
        if seg.expandable:        # PyTorch leaves expandable blocks out of inactive_split
            net_blocks = net_bytes = 0
        if net_blocks > 0:
            self._inc("inactive_split", block.small, net_blocks)
        elif net_blocks < 0:
            self._dec("inactive_split", block.small, -net_blocks)
        if net_bytes > 0:
            self._inc("inactive_split_bytes", block.small, net_bytes)
        elif net_bytes < 0:
            self._dec("inactive_split_bytes", block.small, -net_bytes)
        self._dec("active", block.small, 1)
        self._dec("active_bytes", block.small, original)
        self._dec("requested_bytes", block.small, requested)

    def empty_cache(self) -> None:
        self.counters["num_sync_all_streams"] += 1
        self._unmap_all_free()
        self._release_all_free()

    # -- expandable segments (PyTorch's ExpandableSegment) ---------------------
    # The same policy, written from PyTorch's find_expandable_block,
    # try_allocate_expandable_block, map_block, unmap_block and
    # get_free_block, over plain lists.
    def page(self, small: bool) -> int:
        # Both pools map by 2 MiB (PyTorch's small pool by kSmallBuffer), or
        # by the granularity when larger.
        return max(self.granularity, SMALL_BUFFER)

    def range_size(self, size: int, small: bool) -> int:
        base = self.capacity + self.capacity // 8 if self.know_capacity else 64 << 30
        page = self.page(small)
        return -(-max(base, size) // page) * page

    @staticmethod
    def _allocatable(b: Optional[Block]) -> bool:
        return b is not None and not b.allocated and b.pending_events == 0

    @staticmethod
    def _neighbour(b: Block, step: int) -> Optional[Block]:
        blocks = b.segment.blocks
        i = blocks.index(b) + step
        return blocks[i] if 0 <= i < len(blocks) else None

    def _expandable_size(self, b: Block) -> int:
        nxt = self._neighbour(b, 1)
        return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    def _best_fit_expandable(self, size: int, stream: int, small: bool) -> Optional[Block]:
        ordered = sorted((b for b in self._free_blocks()
                          if b.stream == stream and b.small == small and b.size >= size),
                         key=lambda b: (b.size, b.ptr))
        if not ordered:
            return None
        i = 0
        while i + 1 < len(ordered) and self._expandable_size(ordered[i + 1]) < self._expandable_size(ordered[i]):
            i += 1
        return ordered[i]

    def _find_expandable(self, size: int, stream: int, small: bool) -> Optional[Block]:
        for seg in sorted((s for s in self.segments if s.expandable and s.stream == stream and s.small == small),
                          key=lambda s: s.base):
            for b in seg.blocks:
                if b.mapped:
                    continue
                prev = self._neighbour(b, -1)
                start = prev if self._allocatable(prev) else b
                room, c = 0, start
                while room < size and self._allocatable(c):
                    room += c.size
                    c = self._neighbour(c, 1)
                if room >= size:
                    return start
        return None

    def _reserve(self, size: int, stream: int, small: bool) -> Block:
        g = self.granularity
        base = -(-self.next_address // g) * g
        length = self.range_size(size, small)
        self.next_address = base + length
        seg = Segment(base, length, stream, small, expandable=True, page=self.page(small))
        block = Block(base, length, stream, small, seg, mapped=False)
        seg.blocks.append(block)
        self.segments.append(seg)
        return block

    def _merge_into(self, dst: Block, src: Optional[Block]) -> None:
        if src is None or src.allocated or src.pending_events or src.mapped != dst.mapped:
            return
        if src.ptr < dst.ptr:
            dst.ptr = src.ptr
        dst.size += src.size
        dst.segment.blocks.remove(src)

    def _map(self, b: Block, size: int) -> bool:
        seg = b.segment
        n = -(-size // seg.page) * seg.page
        if self.refuse_next:
            self.refuse_next -= 1
            return False
        if self.used + n > self.capacity:
            return False
        self.used += n
        if n < b.size:
            rest = Block(b.ptr + n, b.size - n, b.stream, b.small, seg, mapped=False)
            seg.blocks.insert(seg.blocks.index(b) + 1, rest)
            b.size = n
        b.mapped = True
        self._merge_into(b, self._neighbour(b, -1))
        self._merge_into(b, self._neighbour(b, 1))
        self._inc("reserved_bytes", b.small, n)
        self.counters["num_device_alloc"] += 1
        return True

    def _grow(self, size: int, stream: int, small: bool, retry: bool) -> Optional[Block]:
        if retry:
            self.counters["num_alloc_retries"] += 1
        c = self._find_expandable(size, stream, small)
        if c is None:
            c = self._reserve(size, stream, small)
        if not c.mapped and not self._map(c, min(c.size, size)):
            return None
        while c.size < size:
            nxt = self._neighbour(c, 1)
            if not self._map(nxt, min(size - c.size, nxt.size)):
                return None
            c = nxt
        return c

    def _malloc_expandable(self, request: int, stream: int) -> int:
        size = self.round_size(request)
        small = size <= SMALL_SIZE
        block = self._best_fit_expandable(size, stream, small)
        if block is None:
            page = self.page(small)
            if self.know_capacity and -(-size // page) * page > self.capacity:
                self.counters["num_ooms"] += 1
                raise ModelOOM(request)
            block = self._grow(size, stream, small, False)
            if block is None:
                self.counters["num_sync_all_streams"] += 1
                self._unmap_all_free()
                self.empty_virt_addr_cache()
                block = self._grow(size, stream, small, True)
            if block is None:
                self.counters["num_ooms"] += 1
                raise ModelOOM(request)
        return self._hand_out(block, size, request)

    def _unmap(self, b: Block) -> None:
        seg = b.segment
        begin = seg.base + -(-(b.ptr - seg.base) // seg.page) * seg.page
        end = seg.base + (b.ptr + b.size - seg.base) // seg.page * seg.page
        if begin >= end:
            return
        i = seg.blocks.index(b)
        pieces = []
        if begin > b.ptr:
            pieces.append(Block(b.ptr, begin - b.ptr, b.stream, b.small, seg))
        middle = Block(begin, end - begin, b.stream, b.small, seg, mapped=False)
        pieces.append(middle)
        if end < b.ptr + b.size:
            pieces.append(Block(end, b.ptr + b.size - end, b.stream, b.small, seg))
        seg.blocks[i:i + 1] = pieces
        self._merge_into(middle, self._neighbour(middle, -1))
        self._merge_into(middle, self._neighbour(middle, 1))
        self.used -= end - begin
        self._dec("reserved_bytes", b.small, end - begin)
        self.counters["num_device_free"] += 1

    def _unmap_all_free(self) -> None:
        for seg in sorted((s for s in self.segments if s.expandable), key=lambda s: s.base):
            for b in [b for b in seg.blocks if b.mapped and self._allocatable(b)]:
                self._unmap(b)

    def empty_virt_addr_cache(self) -> None:
        self.segments = [s for s in self.segments
                         if not (s.expandable and len(s.blocks) == 1 and not s.blocks[0].mapped)]

    def reserved_ranges(self) -> int:
        return sum(1 for s in self.segments if s.expandable)

    def reset_peak(self) -> None:
        for per_pool in self.stats.values():
            for s in per_pool.values():
                s.peak = s.current
        self.oversize_allocations.peak = self.oversize_allocations.current
        self.oversize_segments.peak = self.oversize_segments.current

    def reset_accumulated(self) -> None:
        for per_pool in self.stats.values():
            for s in per_pool.values():
                s.allocated = s.freed = 0
        for s in (self.oversize_allocations, self.oversize_segments):
            s.allocated = s.freed = 0
        for key in self.counters:
            self.counters[key] = 0

    def memory_stats(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for name, per_pool in self.stats.items():
            for pool, s in per_pool.items():
                for metric in ("current", "peak", "allocated", "freed"):
                    out[f"{name}.{pool}.{metric}"] = getattr(s, metric)
                    if name == "allocation":
                        out[f"allocated.{pool}.{metric}"] = getattr(s, metric)
        for name, s in (("oversize_allocations", self.oversize_allocations),
                        ("oversize_segments", self.oversize_segments)):
            for metric in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{metric}"] = getattr(s, metric)
        out.update(self.counters)
        out["max_split_size"] = -1 if self.max_split == (1 << 64) - 1 else self.max_split
        return out
