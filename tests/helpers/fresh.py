"""Running code in a new interpreter: the facade's state is per process (the
device types, the allocator configuration read from the environment), and
code that may hang (a fork, the interpreter's exit) runs under a timeout."""
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO_ROOT

#: What stderr must not hold even when the exit status is 0: an exception in a
#: finalizer or at interpreter exit (allocators are collected then).
NOISE = ("Exception ignored", "Error in sys.excepthook", "Traceback")


def run_fresh(code: str, timeout: float = 300, **env: str) -> str:
    """Run ``code`` (dedented) with ``env`` added to the environment, from the
    repository's root; it must exit with 0 and leave no :data:`NOISE` on
    stderr. Returns its standard output."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=dict(os.environ, **env),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    for noise in NOISE:
        assert noise not in result.stderr, result.stderr
    return result.stdout


def run_within_timeout(code, timeout=60, env=None):
    """Run ``code`` (dedented) in a fresh interpreter and return the completed
    process, its exit status unchecked; a hang fails the test, not the suite."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"hung for {timeout} s:\n{expired.stdout}\n{expired.stderr}")
