"""The README and the guide as tests: every Python block and every shell
command in them runs.

The pages are the README, CONTRIBUTING.md and every Markdown page of the
documentation (``docs/``). Their blocks are read by ``pytest-codeblocks`` (its
parser and its markers: ``<!--pytest.mark.skip(reason=...)-->`` before a block,
this suite's own ``<!--pytest.mark.gpu-->`` for a block that needs an NVIDIA GPU,
and ``<!--pytest-codeblocks:expected-output-->`` after one, followed by a plain
block of what it must print). Each block runs in a fresh interpreter or shell,
in a scratch folder that holds what the pages' commands name (``train.py``,
``snapshot.pickle``), so that one block neither sees nor disturbs another's
allocator state, and a Python block runs as a script (``__name__ ==
"__main__"``), as a reader would run it.
"""
import functools
import glob
import os
import subprocess
import sys
import textwrap

import pytest
import pytest_codeblocks
from tests.helpers import REPO_ROOT
from tests.helpers.gpu import cuda_gpu_available

ROOT = str(REPO_ROOT)
README = os.path.join(ROOT, "README.md")
#: The guide's page of UNIMEM_ALLOC_CONF's options, whose claims are run below.
OPTIONS_PAGE = os.path.join(ROOT, "docs", "guide", "options.md")


def pages():
    """The Markdown pages whose blocks run: README.md, CONTRIBUTING.md, docs/**/*.md."""
    found = [README, os.path.join(ROOT, "CONTRIBUTING.md")]
    found += sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return [page for page in found if "_build" not in os.path.relpath(page, ROOT).split(os.sep)]


BLOCK_TIMEOUT = 240




# A small training script for the pages' `python -m unimem run train.py` lines:
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


def _blocks(paths=None):
    params = []
    for path in pages() if paths is None else paths:
        where = os.path.relpath(path, ROOT)
        for block in pytest_codeblocks.extract_from_file(path):
            if block.syntax not in ("python", "sh", "bash"):
                continue
            marks = []
            for mark in block.marks:
                if mark == "pytest.mark.gpu":
                    marks.append(pytest.mark.skipif(not cuda_gpu_available(), reason="needs an NVIDIA GPU"))
                marks.append(eval(mark, {"pytest": pytest, "sys": sys}))
            params.append(pytest.param(block, where, marks=marks, id=f"{where} line {block.lineno}"))
    return params


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "train.py").write_text(TRAIN_PY)
    subprocess.run([sys.executable, "-c", SNAPSHOT_PY], cwd=tmp_path, check=True, timeout=BLOCK_TIMEOUT)
    return tmp_path


def test_the_readme_has_blocks_of_both_kinds():
    kinds = {param.values[0].syntax for param in _blocks([README])}
    assert {"python", "sh"} <= kinds, kinds


def test_the_guide_pages_are_all_read():
    """Every page of the guide is among the pages whose blocks run, and most
    pages have a block to run."""
    read = {os.path.relpath(page, ROOT) for page in pages()}
    guide = {os.path.relpath(page, ROOT) for page in glob.glob(os.path.join(ROOT, "docs", "guide", "*.md"))}
    assert guide and guide <= read
    with_blocks = {param.values[1] for param in _blocks()}
    assert len(guide & with_blocks) >= len(guide) // 2, sorted(guide - with_blocks)


@pytest.mark.parametrize("block, where", _blocks())
def test_page_block(block, where, workdir):
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
    assert done.returncode == 0, (f"{where} line {block.lineno} failed ({done.returncode}):\n"
                                  f"{block.code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n"
                                  f"{done.stderr[-3000:]}")
    if block.expected_output is not None:
        if block.expected_output_ignore_whitespace:
            assert done.stdout.split() == block.expected_output.split(), (where, block.lineno, done.stdout)
        else:
            assert done.stdout == block.expected_output, (
                f"{where} line {block.lineno} printed\n{done.stdout}\ninstead of\n{block.expected_output}")
    if "stats --json" in block.code:
        import json
        for name in ("stats.json",):
            view = json.loads((workdir / name).read_text())
            assert view["memory_stats"]["allocation.all.allocated"] >= 1


# ---------------------------------------------------------------------------
# The options page's claims, run (the README once said
# `expandable_segments:True` was refused long after the option worked)
# ---------------------------------------------------------------------------
def options_section():
    """The text of the guide's options page."""
    with open(OPTIONS_PAGE, encoding="utf-8") as f:
        return f.read()


def options_table():
    """``(option, example, what it does)`` for each row of the page's
    table. (A pipe table without nested pipes: splitting its lines is all the
    parsing it needs, and the test extra has no Markdown parser.)"""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in options_section().splitlines() if line.startswith("|")]
    assert rows and rows[0] == ["Option", "Example", "What it does"], rows[:1]
    return [tuple(cell.strip("`") if i < 2 else cell for i, cell in enumerate(row)) for row in rows[2:]]


def quoted_settings(text):
    """``(setting, said to be refused)`` for every `name:value` quoted in ``text``."""
    import re
    refused = set(re.findall(r"`([a-z0-9_]+:[^`\s]+)`\s+is\s+refused", text))
    return [(setting, setting in refused) for setting in re.findall(r"`([a-z0-9_]+:[^`\s]+)`", text)]


def test_the_options_table_lists_every_option_that_changes_something():
    from unimem._runtime.config import INERT_KEYS, SUPPORTED_KEYS
    listed = [option for option, _, _ in options_table()]
    assert sorted(listed) == sorted(set(SUPPORTED_KEYS) - set(INERT_KEYS))
    for option, example, _ in options_table():
        assert example.split(":", 1)[0] == option, (option, example)


def test_what_the_options_section_quotes_is_parsed_as_it_says():
    """Every `name:value` in the section parses, unless the section says it
    is refused: then it is a ValueError naming the option."""
    from unimem._runtime.config import parse_alloc_conf
    quoted = quoted_settings(options_section())
    for setting, said_refused in quoted:
        if said_refused:
            with pytest.raises(ValueError, match=setting.split(":", 1)[0]):
                parse_alloc_conf(setting)
        else:
            parse_alloc_conf(setting)
    assert len(quoted) >= 2


SETTINGS_OF_A_CPU_ALLOCATOR = textwrap.dedent("""
    import json, unimem
    p = unimem.cpu.caching_allocator_alloc(3 << 20)
    unimem.cpu.caching_allocator_delete(p)
    print(json.dumps(unimem.cpu.caching_allocator(0).settings))
""")


@functools.lru_cache(maxsize=None)
def allocator_settings(conf):
    """The settings of a cpu allocator made in a fresh process under ``conf``."""
    import json
    env = dict(os.environ, UNIMEM_ALLOC_CONF=conf)
    done = subprocess.run([sys.executable, "-c", SETTINGS_OF_A_CPU_ALLOCATOR], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT)
    assert done.returncode == 0, f"UNIMEM_ALLOC_CONF={conf}: {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("option, example, what", options_table())
def test_each_example_of_the_options_table_works(option, example, what):
    """A program run with the example allocates and frees, and the option is
    in force (all but the two that only name what unimem does anyway)."""
    settings = allocator_settings(example)
    if option not in ("backend", "large_segment_size_mb"):
        assert settings != allocator_settings(""), f"{example} changed nothing"
