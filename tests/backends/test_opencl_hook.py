"""The OpenCL CPU runtime is found whatever is imported first.

An install of unimem puts ``unimem-opencl.pth`` into site-packages; it imports
``_unimem_opencl`` at interpreter start, which points ``OCL_ICD_FILENAMES`` at
the environment's ``libintelocl.so`` (from ``intel-opencl-rt``) before dpctl
can look for devices. The subprocess tests run Python as a user would, with
``OCL_ICD_FILENAMES`` taken out of their environment (this process's has it,
set by the hook) and outside the checkout, so that only the install can make
``_unimem_opencl`` importable.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List, Optional

import pytest

import _unimem_opencl
import unimem

OCL_ENV = "OCL_ICD_FILENAMES"
HOOK_FILE = "unimem-opencl.pth"
RUNTIME = _unimem_opencl.find_runtime()
HAS_DPNP = importlib.util.find_spec("dpnp") is not None


SITE_PACKAGES = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def installed_files() -> Optional[List[Path]]:
    """The files pip installed for unimem, or None when it is not installed
    (a checkout on PYTHONPATH): those setups have no hook to test. Looked up in
    site-packages only: the checkout's own unimem.egg-info (left by a build)
    is on sys.path first under pytest, and lists no installed file."""
    found = list(importlib.metadata.Distribution.discover(name="unimem", path=SITE_PACKAGES))
    if not found:
        return None
    return [Path(str(found[0].locate_file(f))) for f in found[0].files or []]


needs_install = pytest.mark.skipif(installed_files() is None, reason="unimem is not pip-installed")
needs_runtime = pytest.mark.skipif(
    RUNTIME is None or not HAS_DPNP,
    reason='needs the xpu extra (dpnp and intel-opencl-rt): pip install -e ".[xpu]"')


def user_env(**extra: str) -> Dict[str, str]:
    """This process's environment without what the hook and unimem set, as a
    user's shell has it."""
    env = {k: v for k, v in os.environ.items() if k not in (OCL_ENV, "UNIMEM_DEVICE")}
    env.update(extra)
    return env


def run(code: str, cwd: Path, *flags: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=user_env() if env is None else env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return done


# ---------------------------------------------------------------------------
# what the install produced
# ---------------------------------------------------------------------------
@needs_install
def test_the_install_put_the_hook_at_the_root_of_site_packages():
    files = installed_files()
    assert files is not None
    hooks = [f for f in files if f.name == HOOK_FILE]
    assert len(hooks) == 1, f"{HOOK_FILE} is not among unimem's installed files (RECORD)"
    hook = hooks[0]
    assert hook.parent.resolve() in {Path(p).resolve() for p in SITE_PACKAGES}   # where site reads .pth files
    assert hook.is_file()
    lines = hook.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 and lines[0].startswith("import ") and "import _unimem_opencl" in lines[0]


@needs_install
def test_the_hook_line_is_silent_when_its_module_is_gone(monkeypatch):
    """An editable install whose checkout has no _unimem_opencl (an older
    commit checked out) must not print a traceback at every Python start."""
    files = installed_files()
    assert files is not None
    line = next(f for f in files if f.name == HOOK_FILE).read_text(encoding="utf-8")
    monkeypatch.setitem(sys.modules, "_unimem_opencl", None)      # import raises ImportError
    exec(line, {})                                                 # as site runs the line


@needs_install
def test_the_hook_imports_no_more_than_its_own_module_at_start(tmp_path):
    """It runs in every Python process: no unimem (Cython extensions), and no
    module of its own (typing, __future__) beyond what site has loaded."""
    done = run("pass", tmp_path, "-X", "importtime")
    times = {}
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            self_us, cumulative_us, name = line[len("import time:"):].split("|")
            if self_us.strip().isdigit():
                times[name.strip()] = (int(self_us), int(cumulative_us))
    assert "_unimem_opencl" in times, "the hook did not run at interpreter start"
    self_us, cumulative_us = times["_unimem_opencl"]
    assert self_us == cumulative_us, "_unimem_opencl imported other modules at interpreter start"
    assert not [name for name in times if name == "unimem" or name.startswith("unimem.")]


# ---------------------------------------------------------------------------
# import orders, in fresh interpreters
# ---------------------------------------------------------------------------
@needs_install
@needs_runtime
def test_the_hook_sets_the_variable_at_start(tmp_path):
    done = run("import os, sys\nprint(os.environ.get('OCL_ICD_FILENAMES'))\nprint('unimem' in sys.modules)",
               tmp_path)
    assert done.stdout.split() == [RUNTIME, "False"]


@needs_install
@needs_runtime
def test_dpnp_alone_finds_the_device(tmp_path):
    done = run("import dpnp\nprint(dpnp.ones(3))", tmp_path)
    assert done.stdout.strip() == "[1. 1. 1.]"


@needs_install
@needs_runtime
def test_unimem_after_a_dpctl_device_query_is_xpu(tmp_path):
    code = ("import dpctl\nprint(len(dpctl.get_devices()) > 0)\nimport unimem\n"
            "print(unimem.accelerator.current_accelerator())")
    done = run(code, tmp_path, "-W", "error::RuntimeWarning")
    assert done.stdout.split() == ["True", "xpu"]


@needs_install
@needs_runtime
@pytest.mark.parametrize("user_value, expected", [
    ("/opt/mine/libmine.so", "/opt/mine/libmine.so{sep}{runtime}"),
    ("{runtime}{sep}/opt/mine/libmine.so", "{runtime}{sep}/opt/mine/libmine.so"),   # not repeated
])
def test_the_users_entries_are_kept(tmp_path, user_value, expected):
    def fill(text: str) -> str:
        return text.format(sep=os.pathsep, runtime=RUNTIME)
    code = "import os, dpctl\nprint(os.environ['OCL_ICD_FILENAMES'])\nprint(len(dpctl.get_devices()) > 0)"
    done = run(code, tmp_path, env=user_env(**{OCL_ENV: fill(user_value)}))
    assert done.stdout.split() == [fill(expected), "True"]


def _without_site(code: str) -> str:
    """``code`` for ``python -S`` (no site, so no .pth hook): unimem, its hook
    module and dpctl are put on sys.path by hand, and sys.prefix is set to
    this environment as site sets it for a venv."""
    paths = sorted({os.path.dirname(os.path.dirname(unimem.__file__)),
                    os.path.dirname(_unimem_opencl.__file__), *SITE_PACKAGES})
    return f"import sys\nsys.prefix = {sys.prefix!r}\nsys.path[1:1] = {paths!r}\n{code}"


@needs_runtime
def test_without_the_hook_import_unimem_first_still_finds_the_device(tmp_path):
    """A setup without the hook: import unimem's own call sets the variable."""
    code = _without_site("import unimem, dpnp\nprint(dpnp.ones(3))\nprint(unimem.accelerator.current_accelerator())")
    done = run(code, tmp_path, "-S", "-W", "error::RuntimeWarning")
    assert done.stdout.strip().splitlines() == ["[1. 1. 1.]", "xpu"]


@needs_runtime
def test_without_the_hook_a_late_import_says_what_to_do(tmp_path):
    code = _without_site(
        "import os, dpctl\nassert 'OCL_ICD_FILENAMES' not in os.environ\nprint(len(dpctl.get_devices()))\n"
        "import unimem\nfrom unimem._runtime import devices\n"
        "print(unimem.accelerator.current_accelerator())\n"
        "print(devices.is_available('xpu'), devices.is_available('xpu'))\n"
        "print(devices.unavailable_reason('xpu'))")
    done = run(code, tmp_path, "-S", "-W", "always::RuntimeWarning")
    count, accelerator, available, reason = done.stdout.strip().split("\n", 3)
    assert (count, accelerator, available) == ("0", "cpu", "False False")
    advice = f"export {OCL_ENV}={RUNTIME}"
    assert advice in reason and HOOK_FILE in reason
    assert done.stderr.count("RuntimeWarning: unimem:") == 1, done.stderr     # once, however often asked
    assert advice in done.stderr


# ---------------------------------------------------------------------------
# _unimem_opencl, in this process
# ---------------------------------------------------------------------------
@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """A Linux environment whose lib holds a libintelocl.so, dpctl not imported."""
    (tmp_path / "lib").mkdir()
    library = tmp_path / "lib" / "libintelocl.so"
    library.write_bytes(b"")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", str(tmp_path))
    monkeypatch.delenv(OCL_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "dpctl", raising=False)
    monkeypatch.setattr(_unimem_opencl, "_added_after_dpctl", None)
    return str(library)


def test_ensure_adds_the_runtime_after_the_users_entries_once(fake_env, monkeypatch):
    monkeypatch.setenv(OCL_ENV, "/opt/mine/libmine.so")
    assert _unimem_opencl.ensure_opencl_cpu_runtime() == fake_env
    assert _unimem_opencl.ensure_opencl_cpu_runtime() == fake_env
    assert os.environ[OCL_ENV] == os.pathsep.join(["/opt/mine/libmine.so", fake_env])
    assert _unimem_opencl.added_after_dpctl() is None


def test_ensure_finds_the_base_interpreters_runtime_from_a_venv(fake_env, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    assert _unimem_opencl.ensure_opencl_cpu_runtime() == fake_env


@pytest.mark.parametrize("platform, has_library", [("linux", False), ("darwin", True)])
def test_ensure_leaves_the_variable_alone_without_a_runtime(fake_env, monkeypatch, platform, has_library):
    if not has_library:
        os.remove(fake_env)
    monkeypatch.setattr(sys, "platform", platform)
    assert _unimem_opencl.ensure_opencl_cpu_runtime() is None
    assert OCL_ENV not in os.environ


def test_adding_the_runtime_after_dpctl_is_remembered(fake_env, monkeypatch):
    monkeypatch.setitem(sys.modules, "dpctl", object())
    _unimem_opencl.ensure_opencl_cpu_runtime()
    assert _unimem_opencl.added_after_dpctl() == fake_env
    from unimem.backends import opencl_env
    reason = opencl_env.late_import_reason()
    assert reason is not None and f"export {OCL_ENV}={fake_env}" in reason


def test_dpctl_imported_after_the_variable_is_set_is_not_late(fake_env, monkeypatch):
    _unimem_opencl.ensure_opencl_cpu_runtime()
    monkeypatch.setitem(sys.modules, "dpctl", object())
    _unimem_opencl.ensure_opencl_cpu_runtime()
    assert _unimem_opencl.added_after_dpctl() is None


def test_the_start_up_call_never_raises(monkeypatch):
    def broken() -> None:
        raise OSError("unreadable lib directory")
    monkeypatch.setattr(_unimem_opencl, "ensure_opencl_cpu_runtime", broken)
    _unimem_opencl._on_import()
