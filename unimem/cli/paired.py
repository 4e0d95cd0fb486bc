"""Paired, interleaved timing rounds: how the demo compares unimem's pool with
the device's own allocation.

One timing of each side says little on a shared machine: four runs of the
demo that timed each side once read, on the cpu path, 1.8x faster, 1.0x,
1.52x slower and 1.0x. So each round times
both sides on the same work, one after the other, the order alternating from
round to round (drift and warm-up then favour neither), and the comparison is
the median of the rounds' speed-ups with their range: a range that straddles
1.0 is no clear difference, and too few rounds tell nothing.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

#: Fewer rounds than this give no verdict: a range of one or two is no spread.
MIN_ROUNDS = 3


def count_rounds(count: int) -> str:
    """'1 round', '6 rounds'."""
    return f"{count} round{'' if count == 1 else 's'}"


@dataclass(frozen=True)
class Comparison:
    """``rounds``: (baseline seconds, pooled seconds) of each round, in order."""

    rounds: Tuple[Tuple[float, float], ...]

    @property
    def speedups(self) -> List[float]:
        """Each round's baseline time over its pooled time: above 1, the pool was faster."""
        return [baseline / max(pooled, 1e-12) for baseline, pooled in self.rounds]

    @property
    def median(self) -> float:
        return statistics.median(self.speedups)

    def median_seconds(self) -> Tuple[float, float]:
        """The median (baseline, pooled) seconds of a round."""
        return (statistics.median(b for b, _ in self.rounds), statistics.median(p for _, p in self.rounds))

    def total_seconds(self) -> Tuple[float, float]:
        return sum(b for b, _ in self.rounds), sum(p for _, p in self.rounds)

    def verdict(self, pooled: str, baseline: str) -> str:
        """'<pooled> is faster than <baseline>: 1.08x as fast (median of 6
        rounds; range 1.02x to 1.15x)', or 'is slower than', or 'no clear
        difference between ...' where the range straddles 1.0, or 'too few
        rounds to tell ...' with fewer than :data:`MIN_ROUNDS`."""
        speedups = self.speedups
        low, high = min(speedups), max(speedups)
        subject, note = f"{pooled} ", ""
        if len(speedups) < MIN_ROUNDS:
            head = f"too few rounds to tell {pooled} from {baseline}"
            note = f"; at least {MIN_ROUNDS} needed"
        elif low > 1.0:
            head, subject = f"{pooled} is faster than {baseline}", ""
        elif high < 1.0:
            head, subject = f"{pooled} is slower than {baseline}", ""
        else:
            head = f"no clear difference between {pooled} and {baseline}"
            note = ", which straddles 1"
        return (f"{head}: {subject}{self.median:.2f}x as fast (median of {count_rounds(len(speedups))}; "
                f"range {low:.2f}x to {high:.2f}x{note})")


def interleaved(baseline: Callable[[int], float], pooled: Callable[[int], float], rounds: int,
                report: Optional[Callable[[int, float, float], None]] = None) -> Comparison:
    """Time ``baseline(i)`` and ``pooled(i)`` (each returns its seconds) in
    ``rounds`` rounds, the baseline first in even rounds, the pool first in
    odd ones; ``report(i, baseline seconds, pooled seconds)`` after each."""
    results = []
    for i in range(rounds):
        if i % 2 == 0:
            first = baseline(i)
            pair = (first, pooled(i))
        else:
            second = pooled(i)
            pair = (baseline(i), second)
        results.append(pair)
        if report is not None:
            report(i, *pair)
    return Comparison(tuple(results))
