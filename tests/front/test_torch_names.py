"""unimem's namespaces, name by name, against PyTorch's own modules (2.13).

A user ports code from ``torch.cuda.memory``, ``torch.xpu.memory`` or
``torch.accelerator`` by changing the import. Each namespace is compared with
the ``__all__`` of PyTorch's module, so a name PyTorch adds shows up here as a
failing test. What unimem leaves out on purpose is listed below, each name
with its reason; a listed name that unimem has meanwhile, or that PyTorch no
longer has, fails too, so that the list stays true. The parameters of every
shared function are compared as well (names, kinds and defaults), and so are
those of the names that PyTorch's newest source has and the installed release
does not yet (read from PyTorch's repository, recorded below).
"""
import importlib
import inspect
import re

import pytest

import unimem
import unimem.accelerator
import unimem.cuda
import unimem.xpu

torch = pytest.importorskip("torch", reason="the CPU build of PyTorch is in the test extra")
import torch.accelerator.memory  # noqa: E402

NO_GRAPHS = "unimem has no graph capture (CUDA/XPU graphs), so no graph memory pools"

# torch.cuda's (and torch.xpu's) names about memory, beside the ``memory``
# submodule's ``__all__``: the rest of torch.cuda (streams, RNG, graphs,
# device properties) is CuPy's and dpctl's business.
MEMORY_NAME = re.compile(r"mem|alloc|cach|pool|host|process")

# torch.cuda.memory's and torch.xpu.memory's private functions that the
# snapshot tools and users call (each module has its own parameters).
HISTORY_PRIVATE = ("_record_memory_history", "_snapshot", "_dump_snapshot")

# Names of torch.cuda / torch.xpu beside those that code measuring memory
# calls (the regular expression above misses them).
CUDA_BESIDE_MEMORY = ("synchronize", "ipc_collect", "OutOfMemoryError")
XPU_BESIDE_MEMORY = ("synchronize",)

# Names in PyTorch's newest source that the installed release lacks, with
# their parameters as read there: (name, kind, default) as parameters() gives.
NEWER_THAN_INSTALLED = {
    # torch/accelerator/graphs.py: def generate_graph_pool_handle() -> tuple[int, int]
    "accelerator": {"generate_graph_pool_handle": []},
}


def torch_cuda_names():
    return (set(torch.cuda.memory.__all__) | {name for name in torch.cuda.__all__ if MEMORY_NAME.search(name)}
            | set(HISTORY_PRIVATE) | set(CUDA_BESIDE_MEMORY))


def torch_xpu_names():
    return (set(torch.xpu.memory.__all__) | {name for name in torch.xpu.__all__ if MEMORY_NAME.search(name)}
            | set(HISTORY_PRIVATE) | set(XPU_BESIDE_MEMORY))


def torch_accelerator_names():
    return set(torch.accelerator.__all__) | set(torch.accelerator.memory.__all__)


# Each namespace: unimem's module, PyTorch's names, the PyTorch modules the
# functions come from (for their signatures), and the names left out on purpose.
NAMESPACES = {
    "cuda": (unimem.cuda, torch_cuda_names, (torch.cuda.memory, torch.cuda), {
        # torch.cuda.memory is a submodule of torch.cuda; unimem.cuda is both at once
        "memory": "unimem.cuda is torch.cuda.memory's namespace itself, with no submodule",
    }),
    "xpu": (unimem.xpu, torch_xpu_names, (torch.xpu.memory, torch.xpu), {}),
    "accelerator": (unimem.accelerator, torch_accelerator_names, (torch.accelerator, torch.accelerator.memory), {
        "Graph": NO_GRAPHS,
    }),
}

# Shared functions whose parameters differ from PyTorch's, on purpose.
SIGNATURE_DIFFERENCES = {
    # no_split: a pool that hands out whole blocks, on every device type
    ("xpu", "MemPool"): "unimem's XPU pools take no_split too (torch.xpu.MemPool has no such argument)",
}


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_pytorch_name_is_there_or_left_out_with_a_reason(namespace):
    module, pytorch_names, _, left_out = NAMESPACES[namespace]
    missing = sorted(name for name in pytorch_names() - set(left_out) if not hasattr(module, name))
    assert not missing, (f"unimem.{namespace} lacks PyTorch's {missing}: add them, or list them in "
                         f"NAMESPACES[{namespace!r}] with the reason")


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_left_out_list_is_true(namespace):
    module, pytorch_names, _, left_out = NAMESPACES[namespace]
    assert all(reason for reason in left_out.values())
    built_since = sorted(name for name in left_out if hasattr(module, name))
    assert not built_since, f"unimem.{namespace} has {built_since} now: take them off the list"
    gone = sorted(set(left_out) - pytorch_names())
    assert not gone, f"PyTorch no longer has {gone} in its {namespace} modules: take them off the list"


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_what_unimem_has_is_exported(namespace):
    """A PyTorch name unimem has is in its ``__all__`` (a star import brings it)."""
    module, pytorch_names, _, _ = NAMESPACES[namespace]
    public = {name for name in pytorch_names() if hasattr(module, name) and not name.startswith("_")}
    assert public <= set(module.__all__), sorted(public - set(module.__all__))


LITERALS = (str, bool, int, float, bytes)


def parameters(function):
    """Each parameter's name, kind and default (a ported call that leaves it
    out must mean the same): a literal, or a tuple, list or frozenset of
    literals, as it is; ``inspect.Parameter.empty`` where there is none; the
    type's name for any other object (such a default is compared by type)."""
    def default(parameter):
        value = parameter.default
        if value is None or value is inspect.Parameter.empty or isinstance(value, LITERALS):
            return value
        if isinstance(value, (tuple, list, frozenset)) and all(
                item is None or isinstance(item, LITERALS) for item in value):
            return value
        return f"({type(value).__name__})"
    return [(parameter.name, parameter.kind, default(parameter))
            for parameter in inspect.signature(function).parameters.values()]


def is_exception_class(value):
    return isinstance(value, type) and issubclass(value, BaseException)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_shared_functions_take_pytorchs_parameters(namespace):
    """Same parameter names and kinds (positional-only, keyword), so calls
    written for PyTorch, keywords included, keep working."""
    module, pytorch_names, pytorch_modules, _ = NAMESPACES[namespace]
    differing = {}
    for name in sorted(pytorch_names()):
        if not hasattr(module, name) or (namespace, name) in SIGNATURE_DIFFERENCES:
            continue
        theirs = next(getattr(m, name) for m in pytorch_modules if hasattr(m, name))
        if not callable(theirs) or inspect.ismodule(theirs) or is_exception_class(theirs):
            continue                # raised, not called: see test_every_namespace_has_an_out_of_memory_error
        if parameters(getattr(module, name)) != parameters(theirs):
            differing[name] = (parameters(theirs), parameters(getattr(module, name)))
    assert not differing, differing


def test_signature_differences_are_still_differences():
    for (namespace, name), reason in SIGNATURE_DIFFERENCES.items():
        module, _, pytorch_modules, _ = NAMESPACES[namespace]
        theirs = next(getattr(m, name) for m in pytorch_modules if hasattr(m, name))
        assert reason and parameters(getattr(module, name)) != parameters(theirs), (namespace, name)


def test_a_signature_difference_is_caught():
    """The comparison sees a default or kind that differs (it is what the
    test above relies on)."""
    def theirs(device=None, abbreviated=False, *, stacks="all"):
        pass

    def default_differs(device=None, abbreviated=True, *, stacks="all"):
        pass

    def kind_differs(device=None, abbreviated=False, stacks="all"):
        pass
    assert parameters(default_differs) != parameters(theirs) != parameters(kind_differs)
    assert parameters(theirs) == parameters(lambda device=None, abbreviated=False, *, stacks="all": None)


@pytest.mark.parametrize("namespace", NEWER_THAN_INSTALLED)
def test_the_newest_pytorchs_names_are_there_with_their_parameters(namespace):
    module, pytorch_names, _, _ = NAMESPACES[namespace]
    for name, expected in NEWER_THAN_INSTALLED[namespace].items():
        assert name not in pytorch_names(), (f"the installed PyTorch has {namespace}.{name} now: take it off "
                                             f"NEWER_THAN_INSTALLED (the tests above compare it)")
        assert name in module.__all__ and parameters(getattr(module, name)) == expected, name


@pytest.mark.parametrize("namespace", ["cuda", "xpu", "cpu"])
def test_every_namespace_has_an_out_of_memory_error(namespace):
    """``except unimem.<namespace>.OutOfMemoryError`` as ``except
    torch.cuda.OutOfMemoryError``: the top-level class, or (unimem.cuda) the
    subclass that is CuPy's OutOfMemoryError too."""
    module = importlib.import_module(f"unimem.{namespace}")
    assert "OutOfMemoryError" in module.__all__
    assert issubclass(module.OutOfMemoryError, unimem.OutOfMemoryError)
    if namespace != "cuda":
        assert module.OutOfMemoryError is unimem.OutOfMemoryError
