"""Let the OpenCL loader find the pip-installed Intel CPU runtime.

The one implementation is the top-level module ``_unimem_opencl`` (standard
library only), which unimem's ``unimem-opencl.pth`` imports at interpreter
start so that dpctl and dpnp find the SYCL CPU device whatever is imported
first. ``import unimem`` runs :func:`ensure_opencl_cpu_runtime` again, for
setups without the hook; :func:`late_import_reason` says what to do when that
came after dpctl had already looked for devices.
"""
from __future__ import annotations

from typing import Optional

from _unimem_opencl import (OCL_ENV, added_after_dpctl, ensure_opencl_cpu_runtime, find_runtime,
                            runtime_library_dirs)

__all__ = ["OCL_ENV", "ensure_opencl_cpu_runtime", "find_runtime", "late_import_reason"]

_runtime_library_dirs = runtime_library_dirs      # the name tests/repository/test_layers.py reads

HOOK_FILE = "unimem-opencl.pth"


def late_import_reason() -> Optional[str]:
    """Why dpctl sees no device when the runtime exists but was put on
    ``OCL_ICD_FILENAMES`` only after dpctl was imported (so, when dpctl sees
    none, after its first device query), saying what to do; else None."""
    path = added_after_dpctl()
    if path is None:
        return None
    return (f"dpctl was imported before {OCL_ENV} named Intel's OpenCL CPU runtime ({path}), "
            f"and the OpenCL loader reads {OCL_ENV} once, at dpctl's first device query, so no SYCL "
            f"device is seen and unimem falls back to the cpu accelerator. Start Python with "
            f"`export {OCL_ENV}={path}`, or reinstall unimem (pip install -e \".[xpu]\") so that its "
            f"start-up hook {HOOK_FILE} is in site-packages (and do not run Python with -S), "
            f"or import unimem before dpctl and dpnp")
