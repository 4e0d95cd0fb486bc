"""unimem.cli.paired: the demo's paired, interleaved timing rounds and the
verdict they give (made-up seconds: no timing is measured here)."""
import math

import pytest

from unimem.cli import demo
from unimem.cli.paired import MIN_ROUNDS, Comparison, count_rounds, interleaved


def comparison(*speedups):
    """Rounds whose baseline took ``speedup`` seconds and the pool 1."""
    return Comparison(tuple((float(s), 1.0) for s in speedups))


def test_interleaved_alternates_which_side_goes_first_and_reports_each_round():
    calls, reported = [], []

    def side(name, seconds):
        def measure(i):
            calls.append((i, name))
            return seconds
        return measure

    result = interleaved(side("baseline", 2.0), side("pooled", 1.0), 4,
                         lambda i, b, p: reported.append((i, b, p)))
    assert calls == [(0, "baseline"), (0, "pooled"), (1, "pooled"), (1, "baseline"),
                     (2, "baseline"), (2, "pooled"), (3, "pooled"), (3, "baseline")]
    assert result.rounds == ((2.0, 1.0),) * 4               # (baseline, pooled) whichever went first
    assert reported == [(i, 2.0, 1.0) for i in range(4)]


@pytest.mark.parametrize("speedups, head, median, low, high", [
    ((1.1, 1.3, 1.2), "unimem is faster than the own allocation: 1.20x", 1.20, 1.10, 1.30),
    ((0.8, 0.9, 0.85, 0.95), "unimem is slower than the own allocation: 0.88x", 0.875, 0.80, 0.95),
    ((0.95, 1.1, 1.2), "no clear difference between unimem and the own allocation: unimem 1.10x", 1.1, 0.95, 1.2),
    ((1.0, 1.1, 1.2), "no clear difference between unimem and the own allocation: unimem 1.10x", 1.1, 1.0, 1.2),
    ((1.8, 1.0, 1 / 1.52, 1.0), "no clear difference", 1.0, 1 / 1.52, 1.8),   # the four single timings
])
def test_the_verdict_is_the_median_with_its_range(speedups, head, median, low, high):
    compared = comparison(*speedups)
    assert compared.median == pytest.approx(median)
    text = compared.verdict("unimem", "the own allocation")
    assert text.startswith(head), text
    assert f"(median of {len(speedups)} rounds; range {low:.2f}x to {high:.2f}x" in text, text
    assert ("which straddles 1" in text) == text.startswith("no clear difference"), text


@pytest.mark.parametrize("count", range(1, MIN_ROUNDS))
def test_too_few_rounds_give_no_verdict(count):
    text = comparison(*[1.5] * count).verdict("unimem", "the own allocation")
    assert text.startswith("too few rounds to tell unimem from the own allocation: unimem 1.50x as fast"), text
    assert f"median of {count_rounds(count)};" in text and f"at least {MIN_ROUNDS} needed" in text


def test_medians_and_totals_of_the_seconds():
    compared = Comparison(((3.0, 1.0), (1.0, 2.0), (2.0, 4.0)))
    assert compared.median_seconds() == (2.0, 2.0)
    assert compared.total_seconds() == (6.0, 7.0)
    assert compared.speedups == [3.0, 0.5, 0.5]


def test_count_rounds():
    assert count_rounds(1) == "1 round" and count_rounds(6) == "6 rounds"


@pytest.mark.parametrize("steps", [1, 2, 5, 6, 7, 12, 299, 300, 301])
def test_the_demos_steps_are_cut_into_nearly_equal_rounds(steps):
    sizes = demo.round_steps(steps)
    assert sum(sizes) == steps and len(sizes) == min(demo.ROUNDS, steps)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_the_demos_training_taken_in_rounds_ends_where_one_run_ends():
    """Training in rounds takes the same steps, batches and loss as one run
    of as many steps (NumPy, host memory: no device needed)."""
    work = demo.Workload("NumPy", demo.numpy, demo.numpy.array, demo.contextlib.nullcontext,
                         demo.contextlib.nullcontext, "", "", lambda: None, None, None)
    _, whole = demo.train(work, work.own, 7)
    training = demo.Training(work, work.own, 7)
    for size in demo.round_steps(7, rounds=3):
        training.advance(size)
    training.finish()
    assert training.done == 7 and not math.isnan(whole) and training.loss == whole
