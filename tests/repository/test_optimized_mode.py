"""unimem under ``python -O``: no behaviour may live inside an ``assert``.

``-O`` strips every ``assert`` statement, so an assert whose test calls
something (registering a queue, taking a lock, popping a list) silently
removes that call. Once, under ``-O`` no pool array could be made on any
queue but a device's default one, because the queue was registered inside an
assert.
"""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "unimem"

# The slice of the suite that runs again under -O: the core's rules and the
# XPU backend (the one that had behaviour inside an assert).
OPTIMIZED_SLICE = ("tests/core/policy/test_core_rules.py", "tests/front/test_xpu.py")
OPTIMIZED_TIMEOUT_S = 240


def asserts_that_call(source: str, filename: str):
    """(line, text) of every ``assert`` in ``source`` whose test contains a call."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Assert) and any(isinstance(n, ast.Call) for n in ast.walk(node.test)):
            found.append((node.lineno, ast.get_source_segment(source, node)))
    return found


def test_the_rule_catches_a_call_inside_an_assert():
    # the rule itself, on the shape of that queue registration and on ones it must let through
    assert asserts_that_call("assert raw.add_queue(queue) == handle\n", "x.py") == [
        (1, "assert raw.add_queue(queue) == handle")]
    assert asserts_that_call("assert not [q for q in f()]\n", "x.py")
    assert asserts_that_call("assert x == handle, 'a message'\nif f(): pass\n", "x.py") == []


def test_no_assert_in_the_package_calls_anything():
    """A cheap, strict rule: an assert's test contains no call at all (a
    pure check that needs one is written as ``if ...: raise``)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in asserts_that_call(path.read_text(encoding="utf-8"), str(path)):
            offenders.append(f"{path.relative_to(REPO_ROOT)}:{line}: {text}")
    assert offenders == [], "asserts that vanish under python -O take their calls with them:\n" + \
        "\n".join(offenders)


@pytest.mark.skipif(sys.flags.optimize > 0, reason="already running under -O")
def test_a_slice_of_the_suite_passes_under_python_O():
    env = dict(os.environ)
    env.pop("PYTHONOPTIMIZE", None)
    command = [sys.executable, "-O", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *OPTIMIZED_SLICE]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=OPTIMIZED_TIMEOUT_S)
    assert done.returncode == 0, f"under python -O:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
    # pytest's own asserts are rewritten, so a passing run proves nothing
    # unless the child really ran optimized: check it did
    assert "passed" in done.stdout
    probe = subprocess.run([sys.executable, "-O", "-c", "import sys; print(sys.flags.optimize)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "1"
