"""unimem's C ABI from the tests: its library through ctypes, and C code
built against ``unimem.h`` and linked to it with the system's compiler."""
import ctypes
import os
import shutil
import subprocess

import pytest

import unimem.capi

HERE = os.path.dirname(os.path.abspath(__file__))
#: The C user of the ABI that the thread tests load (capi_threads.c).
THREADS_SOURCE = os.path.join(HERE, "capi_threads.c")

# unimem_device_type
CPU, CUDA, XPU = 0, 1, 2


def bind(library):
    """Give ``library``'s unimem.h functions their C signatures (ctypes
    guesses int for everything otherwise)."""
    pointer, size, ssize, void_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_ssize_t, ctypes.c_void_p
    signatures = {
        "unimem_abi_version": (ctypes.c_int, []),
        "unimem_cuda_malloc": (pointer, [ssize, ctypes.c_int, void_p]),
        "unimem_cuda_free": (None, [pointer, ssize, ctypes.c_int, void_p]),
        "unimem_xpu_malloc": (pointer, [size, ctypes.c_int, void_p]),
        "unimem_xpu_free": (None, [pointer, size, ctypes.c_int, void_p]),
        "unimem_torch_cuda_malloc": (pointer, [ssize, ctypes.c_int, void_p]),
        "unimem_torch_cuda_free": (None, [pointer, ssize, ctypes.c_int, void_p]),
        "unimem_torch_xpu_malloc": (pointer, [size, ctypes.c_int, void_p]),
        "unimem_torch_xpu_free": (None, [pointer, size, ctypes.c_int, void_p]),
        "unimem_cpu_malloc": (pointer, [size, ctypes.c_int, void_p]),
        "unimem_cpu_free": (None, [pointer, size, ctypes.c_int, void_p]),
        "unimem_memory_allocated": (ctypes.c_int64, [ctypes.c_int, ctypes.c_int]),
        "unimem_memory_reserved": (ctypes.c_int64, [ctypes.c_int, ctypes.c_int]),
        "unimem_empty_cache": (ctypes.c_int, [ctypes.c_int]),
        "unimem_last_error": (ctypes.c_char_p, []),
    }
    for name, (restype, argtypes) in signatures.items():
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library


def library():
    """unimem's C ABI library, loaded with ctypes (calls let the GIL go)."""
    return bind(ctypes.CDLL(unimem.capi.library_path()))


def last_error(lib) -> str:
    return lib.unimem_last_error().decode()


def build_c_user(source, out_dir):
    """Compile ``source`` into a shared library that includes ``unimem.h``
    and links to unimem's library, as a C user would; skips without ``cc``."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc) on this machine")
    library_dir, library_file = os.path.split(unimem.capi.library_path())
    output = os.path.join(str(out_dir), "lib" + os.path.splitext(os.path.basename(source))[0] + ".so")
    command = [compiler, "-shared", "-fPIC", "-pthread", "-O2", "-Wall", "-Werror",
               "-I", unimem.capi.get_include(), source, "-o", output,
               "-L", library_dir, f"-l:{library_file}", f"-Wl,-rpath,{library_dir}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}{done.stderr}"
    return output


def bind_threads(library):
    """capi_threads.c's functions."""
    for name, restype, argtypes in (
            ("start", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t]),
            ("wait_for", ctypes.c_int, [ctypes.c_int]),
            ("run", ctypes.c_int, [ctypes.c_int, ctypes.c_int, ctypes.c_size_t]),
            ("failures", ctypes.c_long, []), ("corruptions", ctypes.c_long, []),
            ("header_abi_version", ctypes.c_int, []), ("library_abi_version", ctypes.c_int, []),
            ("last_error", ctypes.c_char_p, [])):
        function = getattr(library, name)
        function.restype, function.argtypes = restype, argtypes
    return library
