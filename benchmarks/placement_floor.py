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


def peak_live_pages(events: List[Event], rule: str, page: int = PAGE) -> int:
    """The peak bytes of the pages that hold a live byte when ``events`` are
    placed by ``rule`` (a key of :data:`RULES`)."""
    key, high_end, aligned = RULES[rule]
    where = _Range(page)
    placed: Dict[int, Tuple[int, int]] = {}
    peak = 0
    for event in events:
        if event[0] == "alloc":
            size = max(ROUND, -(-event[2] // ROUND) * ROUND)       # type: ignore[operator]
            start = min(where.candidates(size, high_end, aligned),
                        key=lambda c: key(where.new_pages(c[0], size), c[1], c[0]))[0]
            where.take(start, size)
            placed[event[1]] = (start, size)
            peak = max(peak, where.live_pages)
        else:
            where.give_back(*placed.pop(event[1]))
    return peak * page


def main() -> None:
    from ._common import print_table
    from .bench_memory import peak_requested
    rows = []
    for name, generate in TRACES.items():
        events = generate()
        requested = peak_requested(events)
        rows.append([name] + [f"{peak_live_pages(events, rule) / requested:.3f}" for rule in RULES])
    print_table("2 MiB pages, every whole free page unmapped at once: peak reserved / peak requested "
                "by placement rule", ["trace", *RULES], rows)


if __name__ == "__main__":
    main()
