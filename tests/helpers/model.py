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


@dataclass
class Segment:
    base: int
    size: int
    stream: int
    small: bool
    blocks: List[Block] = field(default_factory=list)


class ModelAllocator:
    """PyTorch's policy on a simulated device of ``capacity`` bytes."""

    def __init__(self, capacity: int, device: int = 0, max_split_size: Optional[int] = None,
                 know_capacity: bool = True, max_reserved_ratio: float = 0.0) -> None:
        self.capacity = capacity
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
                if not b.allocated and b.pending_events == 0:
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
        return len(b.segment.blocks) > 1

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
        return len(seg.blocks) == 1 and not seg.blocks[0].allocated and seg.blocks[0].pending_events == 0

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

    def malloc(self, request: int, stream: int = 0) -> int:
        if request == 0:
            return 0
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
            if block is None and self.max_split != (1 << 64) - 1:
                raise NotImplementedError("the model does not cover max_split release")
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
        if block.small:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self.max_split and remaining > SMALL_SIZE
        if split:
            rest = Block(block.ptr + size, remaining, block.stream, block.small, seg)
            seg.blocks.insert(seg.blocks.index(block) + 1, rest)
            block.size = size
            if already_split:
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
                if not other.allocated and other.pending_events == 0:
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
        self._release_all_free()

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
