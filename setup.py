"""Builds unimem's Cython extensions and installs its OpenCL start-up hook (a
.pth file); everything else is in pyproject.toml."""
import os
import sys
from typing import Any, Dict, List

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++17", "-fno-strict-aliasing"]
# Benchmark-only loops (benchmarks/_timing.pyx) are built next to their
# sources in a development build (pip install -e, build_ext --inplace) and
# never go into a wheel: they are not part of the library, and an sdist does
# not carry them.
BENCHMARK_PREFIX = "benchmarks."
BENCHMARK_EXTENSIONS = [name for name in ["benchmarks._timing"]
                        if os.path.exists(os.path.join(HERE, name.replace(".", "/") + ".pyx"))]

# The SYCL interposer (unimem/_integrations/sycl_interposer.pyx) defines SYCL's USM
# functions under their mangled names and is promoted to the global symbol
# scope at install: its link exports those names and its PyInit only, so
# that nothing else of it (the C++ library's template instantiations) can
# take the place of another library's definitions. ELF and dl_iterate_phdr: Linux only.
SYCL_INTERPOSER = "unimem._integrations.sycl_interposer"
SYCL_INTERPOSER_EXPORTS = "{ global: PyInit_sycl_interposer; _ZN4sycl3_V1*; local: *; };\n"


def extension(name: str) -> Extension:
    return Extension(
        name,
        sources=[name.replace(".", "/") + ".pyx"],
        include_dirs=[os.path.join(HERE, "unimem", "_native")],
        language="c++",
        extra_compile_args=CXX_FLAGS,
    )


# The OpenCL start-up hook: a line at the root of site-packages that imports the
# standard-library-only module _unimem_opencl at every interpreter start, so
# that dpctl and dpnp find Intel's OpenCL CPU runtime whatever is imported
# first. The try keeps an editable install whose checkout lost the module (an
# older commit checked out) from printing a traceback at every Python start.
# site runs .pth files in name order, and this name sorts after setuptools'
# __editable__.unimem-*.pth: in an editable install _unimem_opencl is found
# through the import finder that file installs.
HOOK_PTH = "unimem-opencl.pth"
HOOK_LINE = 'import sys; exec("try: import _unimem_opencl\\nexcept ImportError: pass")\n'


class BuildPy(build_py):
    """Puts the hook into a wheel's root (which is site-packages once installed)."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:      # an editable wheel gets it from EditableWheel
            with open(self._hook_path(), "w", encoding="utf-8") as f:
                f.write(HOOK_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> List[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else outputs + [self._hook_path()]

    def _hook_path(self) -> str:
        return os.path.join(self.build_lib, HOOK_PTH)


class _WithHook:
    """An editable-install strategy of setuptools that also writes the hook."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def __enter__(self) -> "_WithHook":
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> Any:
        return self.strategy.__exit__(*exc_info)

    def __call__(self, wheel: Any, files: List[str], mapping: Dict[str, str]) -> None:
        self.strategy(wheel, files, mapping)
        wheel.writestr(HOOK_PTH, HOOK_LINE.encode("utf-8"))


class EditableWheel(editable_wheel):
    """pip install -e (PEP 660): the editable wheel holds no build_py output,
    only what setuptools' strategy writes (its own .pth and finder), so the
    hook is written through that strategy. _select_strategy is setuptools'
    (private) hook for it; tests/backends/test_opencl_hook.py checks that an
    install has the file, so a setuptools that drops it fails the tests."""

    def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
        return _WithHook(super()._select_strategy(name, tag, build_lib))


class BuildExt(build_ext):
    """Leaves the benchmark helpers out of every build that is not in place,
    and links the SYCL interposer with its version script."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:       # the extensions compile side by side (pip passes no -j)
            self.parallel = os.cpu_count() or 1
        if not self.inplace:
            self.extensions = [e for e in self.extensions if not e.name.startswith(BENCHMARK_PREFIX)]

    def build_extension(self, ext: Extension) -> None:
        if ext.name == SYCL_INTERPOSER:
            os.makedirs(self.build_temp, exist_ok=True)
            script = os.path.abspath(os.path.join(self.build_temp, "sycl_interposer.map"))
            with open(script, "w", encoding="utf-8") as f:
                f.write(SYCL_INTERPOSER_EXPORTS)
            ext.extra_link_args = [a for a in ext.extra_link_args if not a.startswith("-Wl,--version-script=")]
            ext.extra_link_args.append(f"-Wl,--version-script={script}")
        super().build_extension(ext)


setup(
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy, "editable_wheel": EditableWheel},
    ext_modules=cythonize(
        [extension("unimem._core"), extension("unimem._runtime.registry"),
         extension("unimem.backends._host"), extension("unimem.backends._dpctl_api"),
         extension("unimem._integrations.usm_memory"), extension("unimem._integrations.cupy"),
         extension("unimem._integrations.capi"),
         *([extension(SYCL_INTERPOSER)] if sys.platform.startswith("linux") else []),
         *[extension(name) for name in BENCHMARK_EXTENSIONS]],
        compiler_directives={"language_level": "3"},
        nthreads=os.cpu_count() or 1,
        include_path=[HERE],
    ),
)
