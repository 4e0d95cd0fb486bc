"""Running code that may crash the interpreter, so that a crash is a failed test.

A use-after-free in the compiled core kills the process with SIGSEGV (or
worse, corrupts it quietly); run in pytest's own process, it takes the test
run down with it and says nothing of what led there. Two guards:

* :func:`run_python`: a script in a fresh interpreter at the repository's
  root (for environment variables read at import, ``UNIMEM_DEVICE``...);
  the test fails with the child's output and the signal that ended it.
* :func:`guarded`: a hypothesis state-machine rule is first run, with the
  machine's checks after it, in a forked copy of the test process. Only if
  the copy survived does the rule run for real; if it died or hung, the rule
  raises instead. Hypothesis then shrinks a crash like any other failure and
  prints the smallest sequence of steps that causes it. The copy draws the
  same data as the original would (it is a copy of the same generator state).
"""
import faulthandler
import functools
import os
import resource
import select
import signal
import subprocess
import sys
from typing import Any, Callable, Dict, Optional

from . import REPO_ROOT

#: A step still running after this many seconds in the forked copy is a hang.
STEP_TIMEOUT = 30.0


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


def _wait(pid: int, timeout: float) -> Optional[int]:
    """The wait status of child ``pid``, or None when it is still running
    after ``timeout`` seconds (it is then killed)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):            # no pidfd: wait without a limit
        return os.waitpid(pid, 0)[1]
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    if not ready:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return None
    return os.waitpid(pid, 0)[1]


def survives(call: Callable[[], Any], timeout: float = STEP_TIMEOUT) -> Optional[str]:
    """Run ``call()`` in a forked copy of this process. None when the copy
    ended by itself, ``"raised"`` when ``call`` raised there (the original
    will raise it again, with its traceback, when it runs the same code);
    otherwise what ended it, e.g. ``"killed by SIGSEGV"`` or ``"hung for 30 s"``."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                 # the copy: run, and leave without cleaning up
        status = 0
        try:
            faulthandler.disable()               # a crash here is reported by the original
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            call()
        except BaseException:
            status = 1
        finally:
            os._exit(status)
    status = _wait(pid, timeout)
    if status is None:
        return f"hung for {timeout:.0f} s"
    if os.WIFSIGNALED(status):
        return exit_description(-os.WTERMSIG(status))
    return "raised" if os.WEXITSTATUS(status) else None


#: Machines whose allocator a crash guard found damaged: kept alive, so that
#: no finalizer or deallocator ever walks their bookkeeping in this process.
QUARANTINE: list = []


def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A state-machine rule that is first tried in a forked copy when
    ``self.guard_steps`` is true, followed there (if it returned) by every
    check the machine's ``check_all()`` lists (each one, even after another
    failed, so that a check that would crash is found before the original
    runs any). A copy
    that crashes or hangs makes the rule raise :class:`ChildCrashed`; a copy
    in which something failed lets the original run the rule, to fail the
    same way with a traceback, and keeps the machine out of garbage collection."""
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "guard_steps", False):
            def trial() -> None:
                method(self, *args, **kwargs)         # if it raises, hypothesis checks nothing after
                failed = False
                for check in getattr(self, "check_all", lambda: [])():
                    try:
                        check()
                    except BaseException:
                        failed = True
                if failed:
                    raise AssertionError("a check failed in the copy")
            outcome = survives(trial)
            if outcome is not None:
                QUARANTINE.append(self)
            if outcome not in (None, "raised"):
                raise ChildCrashed(f"{method.__name__} {outcome} (tried in a forked copy, "
                                   f"the machine's checks after it)")
        return method(self, *args, **kwargs)
    return run
