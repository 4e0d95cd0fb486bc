"""Let the OpenCL loader find the pip-installed Intel CPU runtime.

The pip wheels of the Intel OpenCL CPU runtime (``intel-opencl-rt``) install
``libintelocl.so`` but register it under a path that does not exist, so the
OpenCL loader would not find the SYCL CPU device. This module imports nothing
but the standard library: ``import unimem`` runs :func:`ensure_opencl_cpu_runtime`
before anything can import dpctl, without importing a backend.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

OCL_ENV = "OCL_ICD_FILENAMES"


def _runtime_library_dirs() -> List[str]:
    dirs = [os.path.join(sys.prefix, "lib")]
    if sys.base_prefix != sys.prefix:
        dirs.append(os.path.join(sys.base_prefix, "lib"))
    return dirs


def ensure_opencl_cpu_runtime() -> Optional[str]:
    """Let the OpenCL loader find the pip-installed Intel CPU runtime.

    Adds ``libintelocl.so`` from this environment to ``OCL_ICD_FILENAMES``
    (keeping what the user set there). Must run before dpctl's first device
    query; returns the library path, or None when there is none to add."""
    for directory in _runtime_library_dirs():
        path = os.path.join(directory, "libintelocl.so")
        if os.path.exists(path):
            current = [p for p in os.environ.get(OCL_ENV, "").split(os.pathsep) if p]
            if path not in current:
                os.environ[OCL_ENV] = os.pathsep.join(current + [path])
            return path
    return None
