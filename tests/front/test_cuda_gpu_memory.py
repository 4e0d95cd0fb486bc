"""Expandable segments, sleep mode and private pools on a real GPU,
each in a fresh interpreter (``UNIMEM_ALLOC_CONF`` is read when the pool is
made). The driver's own free-memory figure is the judge of what was given
back. Skipped without an NVIDIA GPU and cuda-bindings."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO_ROOT
from tests.helpers.fresh import run_fresh
from tests.helpers.gpu import needs_gpu_and_driver_bindings


pytestmark = needs_gpu_and_driver_bindings

MiB = 1 << 20


def run_script(body, conf="expandable_segments:True"):
    return run_fresh(textwrap.dedent("""
        import cupy, numpy as np
        import unimem.cuda as ucuda
        MiB = 1 << 20
        def free_on_device():
            cupy.cuda.Device().synchronize()
            return cupy.cuda.runtime.memGetInfo()[0]
        cupy.cuda.set_allocator(ucuda.allocator)
    """) + textwrap.dedent(body), UNIMEM_ALLOC_CONF=conf)


def test_gpu_expandable_segments_map_and_unmap_on_the_driver():
    run_script("""
        before = free_on_device()
        a = cupy.arange(64 * MiB, dtype=cupy.int32)                # 256 MiB (int32: float32 cannot hold 2**26 - 1)
        holes = [cupy.ones(3 * MiB, cupy.float32) for _ in range(8)]
        b = cupy.full(16 * MiB, 2, cupy.float32)
        del holes                                                  # 96 MiB free between a and b
        segments = ucuda.memory_snapshot()
        assert segments and all(s["is_expandable"] for s in segments), segments
        reserved = ucuda.memory_reserved()
        assert before - free_on_device() >= reserved - 2 * MiB
        ucuda.empty_cache()                                        # the hole's pages go back, a and b stay
        assert ucuda.memory_reserved() <= reserved - 94 * MiB
        assert before - free_on_device() <= ucuda.memory_reserved() + 64 * MiB
        assert int(a[-1]) == 64 * MiB - 1 and float(b.sum()) == 32.0 * MiB
        c = cupy.full(20 * MiB, 5, cupy.float32)                   # maps pages again
        assert float(c.sum()) == 100.0 * MiB and int(a[12345]) == 12345
        del a, b, c
        ucuda.empty_cache()
        ucuda.empty_virt_addr_cache()
        assert ucuda.memory_reserved() == 0
        assert before - free_on_device() <= 64 * MiB
        print("ok")
    """)


def test_gpu_sleep_gives_memory_back_and_wake_up_restores_it():
    run_script("""
        before = free_on_device()
        a = cupy.arange(64 * MiB, dtype=cupy.int32)
        t = cupy.ones(8 * MiB, cupy.float32)
        del t                                                      # cached free memory sleeps too
        reserved = ucuda.memory_reserved()
        allocated = ucuda.memory_allocated()
        awake = free_on_device()
        ucuda.sleep()
        assert ucuda.is_sleeping() and ucuda.memory_reserved() == 0
        assert ucuda.memory_allocated() == allocated
        assert free_on_device() - awake >= reserved - 2 * MiB, (free_on_device() - awake, reserved)
        ucuda.wake_up()
        assert not ucuda.is_sleeping() and ucuda.memory_reserved() == reserved
        assert int(a[-1]) == 64 * MiB - 1 and int(a[:1000].sum()) == 499500
        ucuda.sleep(offload=False)
        ucuda.wake_up()
        b = cupy.ones(MiB, cupy.float32)
        assert float(b.sum()) == float(MiB)
        print("ok")
    """)


def test_gpu_a_private_pool_refuses_to_sleep_and_changes_nothing():
    """A MemPool's segments come from cudaMalloc even with expandable
    segments (as PyTorch's private pools), and cudaMalloc'ed memory cannot
    be given back while its addresses stay reserved: ``pool.sleep()`` says
    so and leaves the pool as it was. (The first GPU run, which expected the
    pool to sleep, found this; see docs/guide/sleep.md.)"""
    run_script("""
        pool = ucuda.MemPool()
        with ucuda.use_mem_pool(pool):
            cache = cupy.full(32 * MiB, 3, cupy.float32)
        assert {s["segment_pool_id"] for s in pool.snapshot()} == {tuple(pool.id)}
        reserved, awake = ucuda.memory_reserved(), free_on_device()
        try:
            pool.sleep()
        except NotImplementedError as error:
            assert "not an expandable segment" in str(error), error
        else:
            raise AssertionError("a pool of cudaMalloc'ed segments slept")
        assert not pool.is_sleeping() and not ucuda.is_sleeping()
        assert ucuda.memory_reserved() == reserved and abs(free_on_device() - awake) <= 2 * MiB
        assert float(cache.sum()) == 96.0 * MiB
        with ucuda.use_mem_pool(pool):
            more = cupy.full(MiB, 2, cupy.float32)
        assert float(more.sum()) == 2.0 * MiB
        print("ok")
    """)


def test_gpu_expandable_segments_beside_pytorchs_own():
    """The same creeping-size trace through PyTorch's expandable segments and
    through unimem's: unimem's peak reserved is no higher."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here")
    repo = str(REPO_ROOT)
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_cuda_expandable", "--json-only"], cwd=repo,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=repo))
    assert done.returncode == 0, done.stdout + done.stderr
    import json
    rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
    for row in rows:
        assert row["unimem_peak_reserved"] <= row["torch_peak_reserved"] * 1.02, row
