"""Running code that may crash the interpreter, so that a crash is a failed test.

A use-after-free in the compiled core kills the process with SIGSEGV (or
worse, corrupts it quietly); run in pytest's own process, it takes the test
run down with it and says nothing of what led there. Two guards:

* :func:`run_python`: a script in a fresh interpreter at the repository's
  root (for environment variables read at import, ``UNIMEM_DEVICE``...);
  the test fails with the child's output and the signal that ended it.
* :func:`guarded` (rules), :func:`guarded_check` (invariants) and
  :func:`guarded_teardown`, for a hypothesis state machine with
  ``guard_steps = True``: at its first step, each example is run to its end
  in a forked copy of the test process, which tells through a pipe which
  step or check it is in. Then the original runs the example: if the copy
  died or hung, the step it died in raises :class:`ChildCrashed` instead of
  running (the steps before it are safe: the copy survived them). Hypothesis
  then shrinks a crash like any other failure and prints the smallest
  sequence of steps that causes it. The copy draws the same data as the
  original (a copy of the same generator state), so it runs the same steps.
  One fork per example: a fork costs milliseconds here.
"""
import faulthandler
import functools
import os
import resource
import select
import signal
import subprocess
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from . import REPO_ROOT

#: A copy that tells nothing new for this many seconds hangs.
STEP_TIMEOUT = 10.0


class ChildCrashed(AssertionError):
    """A step that killed (or hung) the forked copy of the test process."""


def exit_description(returncode: int) -> str:
    """``"killed by SIGSEGV"`` for a negative return code, else the status."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def run_python(code: str, *, env: Optional[Dict[str, str]] = None, marker: str = "PASSED",
               timeout: float = 120.0) -> str:
    """Run ``code`` with ``python -X faulthandler -c`` at the repository's root
    (the checkout's ``unimem`` first on the path, whatever is installed),
    with ``env`` added to the environment; assert that it exits with 0 and
    prints ``marker``. Returns its standard output."""
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p])
    try:
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], cwd=REPO_ROOT,
                              env=child_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ChildCrashed(f"the child hung for {timeout:.0f} s:\n{exc.stdout}\n{exc.stderr}") from None
    output = f"--- stdout\n{done.stdout[-6000:]}\n--- stderr\n{done.stderr[-6000:]}"
    assert done.returncode == 0, f"the child process failed ({exit_description(done.returncode)}):\n{output}"
    assert marker in done.stdout, f"the child exited without printing {marker!r}:\n{output}"
    return done.stdout


def answer_of_forked_child(child: Callable[[], str]) -> str:
    """Run ``child`` in a forked copy of this process (the threads of this
    one are gone there, as after any fork) and return what it returned, or
    its exception as ``"Type: message"``; the copy exits at once after."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        told = "?"
        try:
            told = child()
        except BaseException as exc:
            told = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write, told.encode())
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        told = pipe.read()
    os.waitpid(pid, 0)
    return told


#: Machines whose copy failed: kept alive, so that no finalizer or
#: deallocator ever walks a damaged allocator's bookkeeping in this process.
QUARANTINE: list = []

_COPY = "copy"          # the machine's _probe in the forked copy
_in_a_copy = False      # true in a forked copy: it never forks again


def _run_copy(machine: Any) -> Any:
    """Fork. In the copy: return :data:`_COPY`, with the machine set to report
    its steps through a pipe. In the original: wait for the
    copy to end the example and return ``(where, how)``, the last step or
    check it began and what ended it there, or ``("", "")`` if it ended by
    itself; ``how`` is ``"raised"`` when something failed in it."""
    global _in_a_copy
    if _in_a_copy:
        raise RuntimeError("a forked copy may not fork again")
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _in_a_copy = True
        os.close(read_end)
        faulthandler.disable()                   # a crash here is reported by the original
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        machine._probe_pipe = write_end
        return _COPY
    os.close(write_end)
    told, hung = b"", False
    try:
        while True:
            ready, _, _ = select.select([read_end], [], [], STEP_TIMEOUT)
            if not ready:
                hung = True
                os.kill(pid, signal.SIGKILL)
                break
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            told += chunk
    finally:
        os.close(read_end)
    status = os.waitpid(pid, 0)[1]
    lines = told.decode().splitlines()
    where = lines[-1] if lines else "the start of the example"
    if hung:
        return where, f"hung for {STEP_TIMEOUT:.0f} s"
    if os.WIFSIGNALED(status):
        return where, exit_description(-os.WTERMSIG(status))
    return ("", "raised") if os.WEXITSTATUS(status) else ("", "")


def _checkpoint(machine: Any, where: str) -> None:
    """In the copy: tell the original where it is. In the original: raise
    if the copy died there."""
    if machine._probe == _COPY:
        os.write(machine._probe_pipe, f"{where}\n".encode())
        return
    died_at, how = machine._probe
    if where == died_at:
        raise ChildCrashed(f"{where}: {how} (in a forked copy of this example)")


def _in_copy(machine: Any, where: str, call: Callable[[], Any]) -> Any:
    """Run ``call``, part of the example, after a checkpoint at ``where``;
    in the copy, remember a failure for the exit status."""
    if getattr(machine, "_probe", None) is None:     # the example's first step: run it in a copy first
        if _in_a_copy:                               # the copy went past its example's end
            os._exit(1)
        machine._probe = _run_copy(machine)
        if machine._probe not in (_COPY, ("", "")):
            QUARANTINE.append(machine)
    _checkpoint(machine, where)
    try:
        return call()
    except BaseException:
        machine._copy_failed = True
        raise


def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A state-machine rule, checked by the copy first (see the module's
    docstring) when ``self.guard_steps`` is true. A guarded rule called by
    another runs as part of it."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(self, "guard_steps", False) or getattr(self, "_guarding", False):
            return method(self, *args, **kwargs)
        self._steps = getattr(self, "_steps", 0) + 1
        self._guarding = True
        try:
            return _in_copy(self, f"step {self._steps}: {method.__name__}",
                            lambda: method(self, *args, **kwargs))
        finally:
            self._guarding = False
    return run


def guarded_check(method: Callable[..., Any]) -> Callable[..., Any]:
    """An invariant, checked by the copy first once the example's first
    step has begun (before it, nothing was done that could crash)."""
    @functools.wraps(method)
    def run(self: Any) -> Any:
        if not getattr(self, "guard_steps", False) or getattr(self, "_probe", None) is None:
            return method(self)
        return _in_copy(self, f"after step {self._steps}: {method.__name__}", lambda: method(self))
    return run


def guarded_teardown(machine: Any, drain: Callable[[], Any]) -> None:
    """The end of an example: ``drain()``, checked by the copy first; the copy
    leaves here, with status 1 if anything failed in it."""
    if not getattr(machine, "guard_steps", False):
        drain()
        return
    try:
        _in_copy(machine, "teardown", drain)
    finally:
        if _in_a_copy:
            os._exit(1 if getattr(machine, "_copy_failed", False) else 0)
