"""The README as a test: every Python block and every shell command in it runs.

The blocks are read by ``pytest-codeblocks`` (its parser and its markers:
``<!--pytest.mark.skip(reason=...)-->`` before a block, and this suite's own
``<!--pytest.mark.gpu-->`` for a block that needs an NVIDIA GPU). Each block
runs in a fresh interpreter or shell, in a scratch folder that holds what the
README's commands name (``train.py``, ``snapshot.pickle``), so that one block
neither sees nor disturbs another's allocator state, and a Python block runs as
a script (``__name__ == "__main__"``), as a reader would run it.
"""
import os
import subprocess
import sys
import textwrap

import pytest
import pytest_codeblocks
from tests.helpers import REPO_ROOT

ROOT = str(REPO_ROOT)
README = os.path.join(ROOT, "README.md")
BLOCK_TIMEOUT = 240


def real_gpu_available():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# A small training script for the README's `python -m unimem run train.py` lines:
# dpnp's creation functions on a SYCL device (what `run` routes to the pool),
# NumPy through unimem's cpu pool otherwise.
TRAIN_PY = textwrap.dedent("""
    import argparse
    import unimem
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    epochs = parser.parse_args().epochs
    try:
        import dpnp as xp
        xp.ones(1)
    except Exception:
        import numpy as xp
    for epoch in range(epochs):
        x = xp.ones((512, 512), dtype="f4")
        y = x @ x
        print(f"epoch {epoch}: {float(y[0, 0])}")
        p = unimem.accelerator.caching_allocator_alloc(3 << 20)
        unimem.accelerator.caching_allocator_delete(p)
""")

SNAPSHOT_PY = textwrap.dedent("""
    import unimem
    unimem.accelerator._record_memory_history(max_entries=1000)
    p = unimem.accelerator.caching_allocator_alloc(3 << 20)
    unimem.accelerator._dump_snapshot("snapshot.pickle")
""")


def _blocks():
    params = []
    for block in pytest_codeblocks.extract_from_file(README):
        if block.syntax not in ("python", "sh", "bash"):
            continue
        marks = []
        for mark in block.marks:
            if mark == "pytest.mark.gpu":
                marks.append(pytest.mark.skipif(not real_gpu_available(), reason="needs an NVIDIA GPU"))
            marks.append(eval(mark, {"pytest": pytest, "sys": sys}))
        params.append(pytest.param(block, marks=marks, id=f"README.md line {block.lineno}"))
    return params


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_PY)
    subprocess.run([sys.executable, "-c", SNAPSHOT_PY], cwd=tmp_path, check=True, timeout=BLOCK_TIMEOUT)
    return tmp_path


def test_the_readme_has_blocks_of_both_kinds():
    kinds = {param.values[0].syntax for param in _blocks()}
    assert {"python", "sh"} <= kinds, kinds


@pytest.mark.parametrize("block", _blocks())
def test_readme_block(block, workdir):
    env = dict(os.environ,
               # `python` and `unimem` in a shell block: this interpreter's.
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               # `python -m benchmarks` runs from the checkout; its results go to the scratch folder.
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               UNIMEM_BENCHMARK_RESULTS=str(workdir / "results"),
               MPLBACKEND="Agg")
    if block.syntax == "python":
        script = workdir / "block.py"
        script.write_text(block.code)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-e", "-o", "pipefail", "-c", block.code]
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT)
    assert done.returncode == 0, (f"README.md line {block.lineno} failed ({done.returncode}):\n"
                                  f"{block.code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n"
                                  f"{done.stderr[-3000:]}")
    if "stats --json" in block.code:
        import json
        for name in ("stats.json",):
            view = json.loads((workdir / name).read_text())
            assert view["memory_stats"]["allocation.all.allocated"] >= 1
