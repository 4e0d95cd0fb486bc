"""Shared libraries built from C source for a test (PyTorch's pluggable
allocators load their malloc and free from one)."""
import shutil
import subprocess

import pytest


def build_shared_library(tmp_path_factory, name, source):
    """``source`` compiled with the system's C compiler into ``name.so`` in
    a fresh temporary folder: its path. Skips the test without a compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip(f"no C compiler to build the {name} library")
    folder = tmp_path_factory.mktemp(name)
    (folder / f"{name}.c").write_text(source)
    library = folder / f"{name}.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(folder / f"{name}.c")], check=True)
    return str(library)
