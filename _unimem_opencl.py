"""Let the OpenCL loader find Intel's pip-installed OpenCL CPU runtime.

The ``intel-opencl-rt`` wheels install ``libintelocl.so`` into ``<env>/lib``
but register it under a path that does not exist, so dpctl and dpnp see no
SYCL CPU device unless ``OCL_ICD_FILENAMES`` names the library before their
first device query: the OpenCL loader reads the variable once, then never
again.

unimem installs ``unimem-opencl.pth`` next to this module in site-packages;
that line imports it at interpreter start, so the runtime is found whatever
the program imports first (dpnp, dpctl or unimem). ``import unimem`` calls
:func:`ensure_opencl_cpu_runtime` again, for setups that skip ``.pth`` files
(``python -S``, a checkout on ``PYTHONPATH``), and remembers when that came
after dpctl was imported: the one case where it may be too late.

It runs in every Python process of the environment, hence: a top-level module
(importing anything from ``unimem`` would load its Cython extensions at every
start), nothing imported that ``site`` has not already loaded (``os``,
``sys``; annotations are strings so that neither ``typing`` nor
``__future__`` is imported), a few ``stat`` calls, and no exception out of
the start-up call (``site`` would print it at every start).
"""
import os
import sys

OCL_ENV = "OCL_ICD_FILENAMES"
LIBRARY = "libintelocl.so"

# The runtime path ensure_opencl_cpu_runtime added to OCL_ICD_FILENAMES when
# dpctl was already imported: if dpctl had queried its devices by then, the
# loader never saw the runtime (unimem's xpu probe reports it).
_added_after_dpctl: "str | None" = None


def runtime_library_dirs() -> "list[str]":
    """Where ``intel-opencl-rt`` puts ``libintelocl.so``: this environment's
    ``lib``, then the base interpreter's (a venv may see the base's packages)."""
    dirs = [os.path.join(sys.prefix, "lib")]
    if sys.base_prefix != sys.prefix:
        dirs.append(os.path.join(sys.base_prefix, "lib"))
    return dirs


def find_runtime() -> "str | None":
    """The path of this environment's ``libintelocl.so``, or None."""
    if not sys.platform.startswith("linux"):    # the pip runtime is Linux-only: no stat elsewhere
        return None
    for directory in runtime_library_dirs():
        path = os.path.join(directory, LIBRARY)
        if os.path.exists(path):
            return path
    return None


def ensure_opencl_cpu_runtime() -> "str | None":
    """Add this environment's ``libintelocl.so`` to ``OCL_ICD_FILENAMES``,
    after the entries already there (the user's are kept, none is repeated).

    It must run before dpctl's first device query; returns the library path,
    or None when there is none to add."""
    global _added_after_dpctl
    path = find_runtime()
    if path is None:
        return None
    current = [p for p in os.environ.get(OCL_ENV, "").split(os.pathsep) if p]
    if path not in current:
        if "dpctl" in sys.modules and _added_after_dpctl is None:
            _added_after_dpctl = path
        os.environ[OCL_ENV] = os.pathsep.join(current + [path])
    return path


def added_after_dpctl() -> "str | None":
    """The runtime path this process added to ``OCL_ICD_FILENAMES`` only once
    dpctl was imported (so possibly after its first device query), or None."""
    return _added_after_dpctl


def _on_import() -> None:
    try:
        ensure_opencl_cpu_runtime()
    except Exception:  # noqa: BLE001 - from the .pth, an error would print at every Python start
        pass


# The .pth line only imports this module (it must stay one short line).
_on_import()
