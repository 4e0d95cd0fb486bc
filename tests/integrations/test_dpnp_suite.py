"""dpnp's own tests, run with and without ``unimem.xpu.set_allocator()``.

A slice of the test suite dpnp ships (tests.helpers.dpnp_suite.SLICE: array
creation and the usm_ndarray, elementwise math, reductions, indexing, fancy
indexing, manipulation, sorting, linalg, FFT, random) runs twice in
subprocesses, at the same time: once with dpnp's own allocator, once with
unimem's installed for the whole session. Every test must have the same
outcome both ways: the same passes, failures and skips.
"""
import concurrent.futures

import pytest

from tests.helpers import dpnp_suite

pytest.importorskip("dpnp")

# The two runs are the first test's setup: about 2 minutes on 2 idle cores,
# more on a busy machine.
pytestmark = pytest.mark.timeout(1500)

# dpnp's tests that look at the memory object behind an array (usm_data): they
# must pass both ways.
MEMORY_OBJECT_TESTS = [
    "tests/test_ndarray.py::TestUsmNdarrayProtocol::test_basic",      # usm_data.reference_obj is None
    "tests/tensor/test_tensor_asarray.py::test_asarray_support_for_usm_ndarray_protocol[device]",
    "tests/tensor/test_tensor_asarray.py::test_asarray_support_for_usm_ndarray_protocol[shared]",
    "tests/tensor/test_tensor_asarray.py::test_asarray_support_for_usm_ndarray_protocol[host]",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs, side by side (each is mostly one Python thread)."""
    workdir = tmp_path_factory.mktemp("dpnp-suite")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        without = pool.submit(dpnp_suite.run_slice, False, str(workdir))
        with_ = pool.submit(dpnp_suite.run_slice, True, str(workdir))
        runs = without.result(), with_.result()
    for run in runs:
        print(f"dpnp's tests {'with' if run.hooked else 'without'} unimem's allocator: "
              f"{run.counts()} in {run.seconds:.0f} s")
    return runs


def test_both_runs_ran_the_whole_slice(runs):
    without, with_ = runs
    for run in runs:
        assert run.session is not None, f"the run did not finish:\n{run.output[-6000:]}"
        assert run.session["problem"] is None, run.session["problem"]
        # thousands of tests, most of them passing: the slice was collected and ran
        assert run.counts().get("passed", 0) > 6500, (run.counts(), run.output[-6000:])
    assert not without.session["installed"]
    assert without.session["counters"]["pooled.allocations"] == 0


def test_the_with_run_was_served_by_unimems_pools(runs):
    _, with_ = runs
    assert with_.start["installed"] and with_.session["installed"]
    counters = with_.session["counters"]
    # the slice allocates about 57,000 arrays through Python (a run with the
    # allocator, dpnp 0.20); almost all of them must have come from the pools
    assert counters["pooled.allocations"] > 10_000, counters
    assert counters["pooled.allocations"] > 10 * counters["bypassed.allocations"], counters


def test_every_test_has_the_same_outcome_with_and_without_the_allocator(runs):
    without, with_ = runs
    different = dpnp_suite.differences(without, with_)
    assert not different, dpnp_suite.describe(different, without, with_)


@pytest.mark.parametrize("test_id", MEMORY_OBJECT_TESTS)
def test_dpnps_memory_object_tests_pass_both_ways(runs, test_id):
    for run in runs:
        assert run.outcomes.get(test_id) == "passed", (
            f"{'with' if run.hooked else 'without'} the allocator: {run.outcomes.get(test_id, 'not run')}\n"
            + "\n".join(run.texts.get(test_id, [])))
