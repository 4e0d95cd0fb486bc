"""Device strings and indices as the front reads them, and the front modules'
locks across fork."""
import os
import subprocess
import sys
import textwrap

import pytest

import unimem
import unimem.cpu
import unimem.xpu

from unimem._runtime import devices as _devices

from tests.helpers import REPO_ROOT as _REPO_ROOT

REPO_ROOT = str(_REPO_ROOT)


# ---------------------------------------------------------------------------
# device strings take ASCII digits only; __index__ must give an int
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "xpu:\u0660",        # ARABIC-INDIC DIGIT ZERO: str.isdigit() and int() take it
    "cpu:\u00b2",        # SUPERSCRIPT TWO: str.isdigit() takes it, int() does not
    "cpu:\uff11",        # FULLWIDTH DIGIT ONE
    "cpu:\u0967",        # DEVANAGARI DIGIT ONE
    "cpu:", "cpu:-1", "cpu:+0", "cpu: 0", "cpu:0x0",
])
def test_device_string_index_is_ascii_digits_only(text):
    with pytest.raises(ValueError, match="Invalid device string"):
        _devices.device(text)


@pytest.mark.parametrize("args", [("cpu:x",), ("cpu:-1",), ("cpu", -1), ("CPU",), ("cpu:0", 0)])
def test_a_malformed_device_is_the_runtime_error_torch_device_raises(args):
    """torch.device raises RuntimeError for each; unimem raised a plain
    ValueError, which code written for PyTorch (except RuntimeError) missed.
    It is both, as InvalidDeviceError is."""
    import torch
    with pytest.raises(RuntimeError):
        torch.device(*args)
    with pytest.raises(RuntimeError) as raised:
        _devices.device(*args)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(RuntimeError):
        unimem.cpu.memory_stats("cpu:x")


@pytest.mark.parametrize("set_device", ["accelerator.set_device_index", "cpu.set_device", "xpu.set_device"])
def test_setting_a_negative_device_index_does_nothing(set_device, xpu):
    """torch.accelerator.set_device_index, torch.cuda.set_device and
    torch.xpu.set_device are no-ops for a negative index; unimem raised
    InvalidDeviceError."""
    namespace, name = set_device.split(".")
    function = getattr(getattr(unimem, namespace), name)
    current = getattr(unimem, namespace).current_device() if namespace != "accelerator" \
        else unimem.accelerator.current_device_index()
    function(-1)
    function(-7)
    after = getattr(unimem, namespace).current_device() if namespace != "accelerator" \
        else unimem.accelerator.current_device_index()
    assert after == current
    with pytest.raises(RuntimeError):
        function(f"{'cpu' if namespace == 'cpu' else 'xpu'}:-1")      # a string is no index: malformed


def test_device_string_with_ascii_index_still_parses():
    assert _devices.device("cpu:0") == _devices.device("cpu", 0)
    assert _devices.device("xpu:12").index == 12


class IndexReturning:
    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value


def test_device_index_refuses_an_index_method_returning_a_non_int():
    cpu = _devices.get_type("cpu")
    with pytest.raises(TypeError, match="non-int"):
        _devices.device_index(IndexReturning(0.0), cpu)
    with pytest.raises(TypeError, match="non-int"):
        _devices.device_index(IndexReturning("0"), cpu)
    assert _devices.device_index(IndexReturning(0), cpu) == 0


def test_device_index_of_an_unicode_digit_string_is_refused():
    with pytest.raises(ValueError):
        _devices.device_index("cpu:\u0660", _devices.get_type("cpu"))


# ---------------------------------------------------------------------------
# the front modules: a lock held by another thread at fork() must not
# hang the child
# ---------------------------------------------------------------------------
FORK_WHILE_LOCKED = textwrap.dedent("""
    import os, sys, threading, time
    from unimem._runtime import devices as _devices
    from unimem.backends import xpu as xpu_backend

    def lock_of(which):
        return _devices._lock if which == "devices" else xpu_backend._SyclRuntime._lock

    which = sys.argv[1]
    held, release = threading.Event(), threading.Event()

    def holder():                 # another thread, inside the lock at fork time
        with lock_of(which):
            held.set()
            release.wait()

    threading.Thread(target=holder, daemon=True).start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        if which == "devices":
            _devices.probed_types()           # takes the table's lock
            _devices.get_type("cpu")
        else:
            with lock_of(which):
                pass
        os._exit(0)
    release.set()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            sys.exit(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    print("the forked child hung on the lock")
    sys.exit(3)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("which", ["devices", "sycl_runtime"])
def test_a_lock_held_by_another_thread_at_fork_is_free_in_the_child(which):
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_LOCKED, which], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("made", [lambda: unimem.device("cpu"), lambda: unimem.device("xpu", 1),
                                  lambda: unimem.device("cuda:0")], ids=["cpu", "xpu:1", "cuda:0"])
def test_a_device_pickles_and_copies_as_torch_device_does(made):
    import copy
    import pickle
    dev = made()
    for again in (pickle.loads(pickle.dumps(dev)), copy.copy(dev), copy.deepcopy(dev)):
        assert again == dev and type(again) is type(dev) and repr(again) == repr(dev)
