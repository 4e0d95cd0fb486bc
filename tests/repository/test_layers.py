"""The package's layers, checked: imports only run down, and never in a cycle.

Every module of ``unimem`` is read (``.py`` with :mod:`ast`; ``.pyx`` and
``.pxd`` with a regular expression for ``import``, ``cimport``,
``from ... import`` and ``from ... cimport``), function-level imports
included, and mapped to its layer:

====  ==============================================================
0     the provider ABI both sides compile against, no code:
      ``unimem._native.provider`` (and ``unimem.backends._capi`` until it moves)
1     ``unimem.backends.*``: raw memory
2     the core: ``unimem._core``, ``unimem._native.*``
3     the runtime: ``unimem._runtime.*``
4     the framework glue, one module per framework over the core's and the
      runtime's entry points: ``unimem._integrations.*`` (CuPy, dpnp and its
      USM memory, the SYCL interposer, PyTorch, Numba, the C ABI), but
      ``install``
5     the front and observability: ``unimem.accelerator.*``, ``unimem.cpu``,
      ``unimem.cuda``, ``unimem.xpu`` (and its ``unimem._xpu_pools``),
      ``unimem.host``, ``unimem._memory_api``, ``unimem._memory.*``,
      ``unimem._observe.*``, ``unimem.capi``
6     entry points: ``unimem._integrations.install`` (it puts the namespaces'
      allocators into the frameworks, so it imports them), ``unimem.dask``,
      ``unimem.prometheus``, ``unimem.cli.*``, ``unimem`` (its ``__init__``),
      ``unimem.__main__``
====  ==============================================================

The glue imports the runtime and the core; a namespace imports its glue
(``unimem.cuda`` exports ``unimem._integrations.cupy``'s allocator); the glue
never imports a namespace. What a namespace decides, the glue is given:
``unimem.xpu`` hands its pool lookup to the dpnp allocator and to the SYCL
interposer. One call the table cannot see goes up by name, at call time: the
C ABI's ``unimem_empty_cache(type)`` is ``unimem.<type>.empty_cache()``
(``importlib``), the namespace's own emptying (its pools and the private
pools beside them), which the glue does not repeat.

A module may import its own layer and those below. ``from pkg import name``
imports ``pkg.name`` when that is a module, else ``pkg`` itself (so a lower
layer reading a name off ``unimem`` is importing the top layer). Importing a
submodule also runs its packages' ``__init__``; those implicit imports are
not edges. The cycle check uses module-level imports only (a function-level
import runs after every module is loaded), outside ``if TYPE_CHECKING:``.
"""
import ast
import os
import re
import subprocess
import sys
from typing import Dict, List, Set, Tuple

import pytest

import unimem

PACKAGE_DIR = os.path.dirname(unimem.__file__)
REPO_ROOT = os.path.dirname(PACKAGE_DIR)

ABI_MODULES = ("unimem._native.provider", "unimem.backends._capi")
LAYER_OF_PREFIX = (                 # first match wins: more specific first
    ("unimem.backends", 1),
    ("unimem._core", 2),
    ("unimem._native", 2),
    ("unimem._runtime", 3),
    ("unimem._integrations.install", 6),
    ("unimem._integrations", 4),
    ("unimem.accelerator", 5),
    ("unimem.cpu", 5),
    ("unimem.cuda", 5),
    ("unimem.xpu", 5),
    ("unimem._xpu_pools", 5),
    ("unimem.host", 5),
    ("unimem._memory_api", 5),
    ("unimem._memory", 5),
    ("unimem._observe", 5),
    ("unimem.capi", 5),
    ("unimem.dask", 6),
    ("unimem.prometheus", 6),
    ("unimem.cli", 6),
    ("unimem.__main__", 6),
    ("unimem", 6),
)
LAYER_NAMES = {0: "provider ABI", 1: "backends", 2: "core", 3: "runtime", 4: "framework glue",
               5: "front/observe", 6: "entry points/CLI"}


def layer_of(module: str) -> int:
    if module in ABI_MODULES:
        return 0
    for prefix, layer in LAYER_OF_PREFIX:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    raise AssertionError(f"{module} is in no layer: add it to LAYER_OF_PREFIX")


def package_modules() -> Dict[str, str]:
    """Module name -> source path, for every .py, .pyx and .pxd of the package
    (a .pyx and its .pxd are one module: both are listed, under one name)."""
    found: Dict[str, List[str]] = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        if "__pycache__" in folder:
            continue
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext not in (".py", ".pyx", ".pxd"):
                continue
            relative = os.path.relpath(os.path.join(folder, stem), REPO_ROOT).split(os.sep)
            if relative[-1] == "__init__":
                relative.pop()
            found.setdefault(".".join(relative), []).append(os.path.join(folder, name))
    return {module: paths for module, paths in found.items()}


MODULES = package_modules()


def _absolute(module: str, is_package: bool, level: int, target: str) -> str:
    if level == 0:
        return target
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _resolve(imported: str, names: List[str]) -> List[str]:
    """``from imported import names``: the modules that brings in."""
    out = []
    for name in names:
        candidate = f"{imported}.{name}"
        out.append(candidate if candidate in MODULES else imported)
    return out


Import = Tuple[str, int, bool]          # target module, line, module-level


def _python_imports(module: str, path: str) -> List[Import]:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    top_level: Set[int] = set()

    def mark_top(statements: List[ast.stmt]) -> None:
        for node in statements:
            top_level.add(id(node))
            if isinstance(node, ast.If) and not _is_type_checking(node.test):
                mark_top(node.body)
                mark_top(node.orelse)
            elif isinstance(node, ast.Try):
                mark_top(node.body)
                for handler in node.handlers:
                    mark_top(handler.body)
                mark_top(node.orelse)
                mark_top(node.finalbody)

    mark_top(tree.body)
    out: List[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported = _absolute(module, is_package, node.level, node.module or "")
            out += [(target, node.lineno, id(node) in top_level)
                    for target in _resolve(imported, [alias.name for alias in node.names])]
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


CYTHON_FROM = re.compile(r"^(\s*)from\s+(\.*[\w.]*)\s+c?import\s+\(?([^#]*)")
CYTHON_IMPORT = re.compile(r"^(\s*)c?import\s+([\w., ]+)")


def _cython_imports(module: str, path: str) -> List[Import]:
    is_package = os.path.basename(path).startswith("__init__.")
    out: List[Import] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            match = CYTHON_FROM.match(line)
            if match:
                indent, source, names = match.groups()
                level = len(source) - len(source.lstrip("."))
                imported = _absolute(module, is_package, level, source.lstrip("."))
                names_list = [n.split(" as ")[0].strip() for n in names.replace(")", "").split(",")]
                out += [(target, number, not indent)
                        for target in _resolve(imported, [n for n in names_list if n])]
                continue
            match = CYTHON_IMPORT.match(line)
            if match:
                indent, names = match.groups()
                out += [(n.split(" as ")[0].strip(), number, not indent) for n in names.split(",") if n.strip()]
    return out


def imports_of(module: str) -> List[Tuple[str, str, int, bool]]:
    """``(target, file, line, module-level)`` for each unimem module ``module`` imports."""
    out = []
    for path in MODULES[module]:
        parse = _python_imports if path.endswith(".py") else _cython_imports
        for target, line, top in parse(module, path):
            if target == "unimem" or target.startswith("unimem."):
                out.append((target, os.path.relpath(path, REPO_ROOT), line, top))
    return out


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_runs_up_a_layer():
    upward = []
    for module in sorted(MODULES):
        for target, path, line, _ in imports_of(module):
            if layer_of(target) > layer_of(module):
                upward.append(f"{path}:{line}: {module} ({LAYER_NAMES[layer_of(module)]}) imports "
                              f"{target} ({LAYER_NAMES[layer_of(target)]})")
    assert not upward, "imports that run up a layer:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = {module: sorted({target for target, _, _, top in imports_of(module)
                             if top and target != module and target in MODULES})
             for module in MODULES}
    cycles = []
    state: Dict[str, int] = {}          # 1: on the stack, 2: done
    stack: List[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles (module-level imports):\n" + "\n".join(cycles)


def test_the_checker_sees_an_upward_and_a_function_level_import(tmp_path):
    """The parsers find what the layering test relies on."""
    source = tmp_path / "probe.py"
    source.write_text("from .. import _core\n\ndef f():\n    from ..cli import main\n")
    found = _python_imports("unimem.backends.probe", str(source))
    assert ("unimem._core", 1, True) in found and ("unimem.cli.main", 4, False) in found
    cython = tmp_path / "probe.pyx"
    cython.write_text("from unimem._native.provider cimport RawAllocatorAPI\n"
                      "def f():\n    from .._runtime import devices\n")
    found = _cython_imports("unimem.backends.probe", str(cython))
    assert ("unimem._native.provider", 1, True) in found
    assert ("unimem._runtime.devices", 3, False) in found


def test_the_framework_glue_sits_below_every_namespace_and_above_the_runtime():
    """Every module of unimem/_integrations/ but the installer is glue (a
    new one is too, without a line here), below each namespace and the
    front, above the runtime and the core: so a glue module importing a
    namespace, even inside a function, is an upward import (the CuPy glue
    imported unimem.cuda to be bound by it)."""
    glue = sorted(m for m in MODULES if m.startswith("unimem._integrations.") and m != "unimem._integrations.install")
    assert {"unimem._integrations.cupy", "unimem._integrations.dpnp", "unimem._integrations.usm_memory",
            "unimem._integrations.torch", "unimem._integrations.numba", "unimem._integrations.capi"} <= set(glue)
    front = [m for m in MODULES if LAYER_NAMES[layer_of(m)] == "front/observe"]
    assert {"unimem.cuda", "unimem.xpu", "unimem.capi"} <= set(front)
    for module in glue:
        assert layer_of("unimem._runtime.devices") < layer_of(module) < min(layer_of(m) for m in front), module
    assert layer_of("unimem._integrations.install") > layer_of("unimem.xpu")


def test_import_unimem_imports_neither_cupy_nor_dpctl():
    code = ("import sys, unimem\n"
            "print(sorted(m for m in ('cupy', 'dpctl', 'dpnp', 'unimem.backends.xpu') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the OpenCL runtime setup is for Linux")
def test_import_unimem_still_sets_up_the_opencl_runtime_first():
    code = ("import os, sys\nos.environ.pop('OCL_ICD_FILENAMES', None)\nimport unimem\n"
            "from unimem.backends.opencl_env import _runtime_library_dirs\n"
            "lib = [d for d in _runtime_library_dirs() if os.path.exists(os.path.join(d, 'libintelocl.so'))]\n"
            "print(bool(lib) == ('libintelocl.so' in os.environ.get('OCL_ICD_FILENAMES', '')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.stdout.strip() == "True", done.stderr
