"""How low peak reserved memory could go on 2 MiB pages under other
placement rules: a simulation, without the allocator.

Each trace is replayed in one address range whose page is mapped while it
holds a live byte and unmapped the moment it holds none: the best any
unmapping order can do for a given placement. Only where blocks go differs
from rule to rule:

* best fit, at its lowest address: the smallest free span that holds the
  request, else the end of the range (the rule of the allocator's cache,
  PyTorch's and unimem's; on a miss under its ratio unimem places a block
  where the fewest new bytes are mapped, which may differ);
* best fit, either end: as above, at whichever end of the span maps fewer
  new pages;
* fewest new pages: the span and end that map the fewest new pages, the
  smallest span among equals;
* fewest new pages, page-aligned: the same, and a request of a page or more
  may also start at the first page boundary in a span (at the end of the
  range it always does).

Blocks never move once placed (nothing may move memory a kernel can be
using), so no rule can empty a page that holds a live byte. The bench's
``memory`` table places the allocator's own ratio beside the rules': when
none of them reaches a ratio, the fault is not unimem's placement alone.

Beside the rules, a reference no allocator can run because it needs the
future: each block goes to the address range of the blocks freed near it
(:data:`FREES_PER_GROUP` consecutive frees to a range, placed there by
"fewest new pages"). Where it alone reaches a ratio, the pages were kept
live by not knowing when blocks die, which no placement can make up for.

    python -m benchmarks.placement_floor      # the generated traces
"""
from __future__ import annotations

import bisect
from collections import Counter
from typing import Callable, Dict, Iterator, List, Tuple

from .traces import TRACES, Event

MiB = 1 << 20
PAGE = 2 * MiB
ROUND = 512                                # the allocator's smallest block and rounding

# A rule's preference among candidate placements: the lowest key wins.
# Arguments: new pages mapped, size of the free span (None at the end of the
# range), start address.
Key = Callable[[int, "int | None", int], Tuple]
_END = float("inf")


def _best_fit(new_pages: int, span: "int | None", start: int) -> Tuple:
    return (_END if span is None else span, start)


def _best_fit_fewer_pages(new_pages: int, span: "int | None", start: int) -> Tuple:
    return (_END if span is None else span, new_pages, start)


def _fewest_pages(new_pages: int, span: "int | None", start: int) -> Tuple:
    return (new_pages, _END if span is None else span, start)


RULES: Dict[str, Tuple[Key, bool, bool]] = {
    # name: (key, also the high end of a span, page-aligned starts for a page or more)
    "best fit, lowest address": (_best_fit, False, False),
    "best fit, either end": (_best_fit_fewer_pages, True, False),
    "fewest new pages": (_fewest_pages, True, False),
    "fewest new pages, page-aligned": (_fewest_pages, True, True),
}


class _Range:
    """One address range: free spans by address, the end of what is in use,
    and how many live blocks touch each page."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.starts: List[int] = []         # free spans, sorted and coalesced
        self.ends: List[int] = []
        self.top = 0                         # everything from here on is free
        self.blocks_on_page: Counter = Counter()
        self.live_pages = 0

    def _pages(self, start: int, size: int) -> range:
        return range(start // self.page, (start + size - 1) // self.page + 1)

    def new_pages(self, start: int, size: int) -> int:
        return sum(1 for p in self._pages(start, size) if not self.blocks_on_page[p])

    def candidates(self, size: int, high_end: bool, aligned: bool) -> Iterator[Tuple[int, "int | None"]]:
        """``(start, span size)`` of every placement the rule may take."""
        for lo, hi in zip(self.starts, self.ends):
            if hi - lo < size:
                continue
            yield lo, hi - lo
            if high_end:
                yield hi - size, hi - lo
            if aligned and size >= self.page:
                boundary = -(-lo // self.page) * self.page
                if boundary + size <= hi:
                    yield boundary, hi - lo
        top = -(-self.top // self.page) * self.page if aligned and size >= self.page else self.top
        yield top, None

    def take(self, start: int, size: int) -> None:
        if start >= self.top:
            if start > self.top:
                self._add_free(self.top, start)
            self.top = start + size
        else:
            i = bisect.bisect_right(self.starts, start) - 1
            lo, hi = self.starts.pop(i), self.ends.pop(i)
            if start + size < hi:
                self._add_free(start + size, hi)
            if lo < start:
                self._add_free(lo, start)
        for p in self._pages(start, size):
            if not self.blocks_on_page[p]:
                self.live_pages += 1
            self.blocks_on_page[p] += 1

    def give_back(self, start: int, size: int) -> None:
        for p in self._pages(start, size):
            self.blocks_on_page[p] -= 1
            if not self.blocks_on_page[p]:
                self.live_pages -= 1
        self._add_free(start, start + size)
        if self.ends and self.ends[-1] == self.top:    # the free end of the range shrinks back
            self.top = self.starts.pop()
            self.ends.pop()

    def _add_free(self, lo: int, hi: int) -> None:
        i = bisect.bisect_left(self.starts, lo)
        if i < len(self.starts) and self.starts[i] == hi:      # joins the span after
            hi = self.ends[i]
            del self.starts[i], self.ends[i]
        if i > 0 and self.ends[i - 1] == lo:                    # and the span before
            self.ends[i - 1] = hi
        else:
            self.starts.insert(i, lo)
            self.ends.insert(i, hi)


def peak_live_pages(events: List[Event], rule: str, page: int = PAGE,
                    range_of: "Callable[[int], int] | None" = None) -> int:
    """The peak bytes of the pages that hold a live byte when ``events`` are
    placed by ``rule`` (a key of :data:`RULES`), in one address range or, with
    ``range_of``, in the range it names for each block's key."""
    key, high_end, aligned = RULES[rule]
    ranges: Dict[int, _Range] = {}
    placed: Dict[int, Tuple[_Range, int, int]] = {}
    live_pages = peak = 0
    for event in events:
        if event[0] == "alloc":
            where = ranges.setdefault(range_of(event[1]) if range_of else 0, _Range(page))
            size = max(ROUND, -(-event[2] // ROUND) * ROUND)       # type: ignore[operator]
            start = min(where.candidates(size, high_end, aligned),
                        key=lambda c: key(where.new_pages(c[0], size), c[1], c[0]))[0]
            live_pages -= where.live_pages
            where.take(start, size)
            live_pages += where.live_pages
            placed[event[1]] = (where, start, size)
            peak = max(peak, live_pages)
        else:
            where, start, size = placed.pop(event[1])
            live_pages -= where.live_pages
            where.give_back(start, size)
            live_pages += where.live_pages
    return peak * page


# Found on the generated traces (random frees: 1.33 with 16, 1.14 with 64,
# 1.20 with 256): fewer frees to a range leave more part-filled pages at the
# ends of the ranges, more mix lifetimes in a range again.
FREES_PER_GROUP = 64
GROUPED_BY_FREE_TIME = "grouped by free time (needs the future)"


def peak_live_pages_grouped_by_free_time(events: List[Event], frees_per_group: int = FREES_PER_GROUP,
                                         page: int = PAGE) -> int:
    """The reference that knows the future: :func:`peak_live_pages` with
    "fewest new pages", each block in the range of its free's group of
    ``frees_per_group`` consecutive frees (blocks never freed share a last
    range)."""
    frees = [event[1] for event in events if event[0] == "free"]
    group = {key: i // frees_per_group for i, key in enumerate(frees)}
    never = len(frees) // frees_per_group + 1
    return peak_live_pages(events, "fewest new pages", page, lambda key: group.get(key, never))


def main() -> None:
    from ._common import print_table
    from .bench_memory import peak_requested
    rows = []
    for name, generate in TRACES.items():
        events = generate()
        requested = peak_requested(events)
        rows.append([name] + [f"{peak_live_pages(events, rule) / requested:.3f}" for rule in RULES]
                    + [f"{peak_live_pages_grouped_by_free_time(events) / requested:.3f}"])
    print_table("2 MiB pages, every whole free page unmapped at once: peak reserved / peak requested "
                "by placement rule", ["trace", *RULES, GROUPED_BY_FREE_TIME], rows)


if __name__ == "__main__":
    main()
