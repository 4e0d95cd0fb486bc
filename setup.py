"""Builds unimem's Cython extensions; everything else is in pyproject.toml."""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++17", "-fno-strict-aliasing"]
# Benchmark-only loops (benchmarks/_timing.pyx) are built next to their
# sources in a development build (pip install -e, build_ext --inplace) and
# never go into a wheel: they are not part of the library.
BENCHMARK_PREFIX = "benchmarks."


def extension(name: str) -> Extension:
    return Extension(
        name,
        sources=[name.replace(".", "/") + ".pyx"],
        include_dirs=[os.path.join(HERE, "unimem", "_native")],
        language="c++",
        extra_compile_args=CXX_FLAGS,
    )


class BuildExt(build_ext):
    """Leaves the benchmark helpers out of every build that is not in place."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.inplace:
            self.extensions = [e for e in self.extensions if not e.name.startswith(BENCHMARK_PREFIX)]


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=cythonize(
        [extension("unimem._core"), extension("unimem._runtime.registry"),
         extension("unimem.backends._host"), extension("unimem.backends._dpctl_api"),
         extension("unimem._usm_memory"),
         extension("benchmarks._timing")],
        compiler_directives={"language_level": "3"},
        include_path=[HERE],
    ),
)
