"""Builds unimem's Cython extensions; everything else is in pyproject.toml."""
import os

from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++17", "-fno-strict-aliasing"]


def extension(name: str) -> Extension:
    return Extension(
        name,
        sources=[name.replace(".", "/") + ".pyx"],
        include_dirs=[os.path.join(HERE, "unimem")],
        language="c++",
        extra_compile_args=CXX_FLAGS,
    )


setup(
    ext_modules=cythonize(
        [extension("unimem._core"), extension("unimem.backends._host"),
         extension("unimem.backends._dpctl_api")],
        compiler_directives={"language_level": "3"},
        include_path=[HERE],
    ),
)
