"""unimem's namespaces, name by name, against PyTorch's own modules (2.13).

A user ports code from ``torch.cuda.memory``, ``torch.xpu.memory`` or
``torch.accelerator`` by changing the import. Each namespace is compared with
the ``__all__`` of PyTorch's module, so a name PyTorch adds shows up here as a
failing test. What unimem leaves out on purpose is listed below, each name
with its reason; a listed name that unimem has meanwhile, or that PyTorch no
longer has, fails too, so that the list stays true. The parameters of every
shared function are compared as well (names and kinds).
"""
import inspect
import re

import pytest

import unimem.accelerator
import unimem.cuda
import unimem.xpu

torch = pytest.importorskip("torch", reason="the CPU build of PyTorch is in the test extra")
import torch.accelerator.memory  # noqa: E402

TELEMETRY = ("device telemetry (NVML, amdsmi, Level Zero sysman), not the allocator's: "
             "mem_get_info gives free and total memory")
NO_GRAPHS = "unimem has no graph capture (CUDA/XPU graphs), so no graph memory pools"

# torch.cuda's (and torch.xpu's) names about memory, beside the ``memory``
# submodule's ``__all__``: the rest of torch.cuda (streams, RNG, graphs,
# device properties) is CuPy's and dpctl's business.
MEMORY_NAME = re.compile(r"mem|alloc|cach|pool|host|process")

# torch.cuda.memory's and torch.xpu.memory's private functions that the
# snapshot tools and users call (each module has its own parameters).
HISTORY_PRIVATE = ("_record_memory_history", "_snapshot", "_dump_snapshot")


def torch_cuda_names():
    return (set(torch.cuda.memory.__all__) | {name for name in torch.cuda.__all__ if MEMORY_NAME.search(name)}
            | set(HISTORY_PRIVATE))


def torch_xpu_names():
    return (set(torch.xpu.memory.__all__) | {name for name in torch.xpu.__all__ if MEMORY_NAME.search(name)}
            | set(HISTORY_PRIVATE))


def torch_accelerator_names():
    return set(torch.accelerator.__all__) | set(torch.accelerator.memory.__all__)


# Each namespace: unimem's module, PyTorch's names, the PyTorch modules the
# functions come from (for their signatures), and the names left out on purpose.
NAMESPACES = {
    "cuda": (unimem.cuda, torch_cuda_names, (torch.cuda.memory, torch.cuda), {
        "device_memory_used": TELEMETRY,
        "memory_usage": TELEMETRY,
        "graph_pool_handle": NO_GRAPHS,
        # torch.cuda.memory is a submodule of torch.cuda; unimem.cuda is both at once
        "memory": "unimem.cuda is torch.cuda.memory's namespace itself, with no submodule",
    }),
    "xpu": (unimem.xpu, torch_xpu_names, (torch.xpu.memory, torch.xpu), {
        "device_memory_used": TELEMETRY,
        "memory_usage": TELEMETRY,
        "graph_pool_handle": NO_GRAPHS,
    }),
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


def parameters(function):
    """Each parameter's name, kind and default (a literal default: a
    ported call that leaves it out must mean the same)."""
    def default(parameter):
        value = parameter.default
        return value if value is None or isinstance(value, (str, bool, int, float)) else "(object)"
    return [(parameter.name, parameter.kind, default(parameter))
            for parameter in inspect.signature(function).parameters.values()]


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
        if not callable(theirs) or inspect.ismodule(theirs):
            continue
        if parameters(getattr(module, name)) != parameters(theirs):
            differing[name] = (parameters(theirs), parameters(getattr(module, name)))
    assert not differing, differing


def test_signature_differences_are_still_differences():
    for (namespace, name), reason in SIGNATURE_DIFFERENCES.items():
        module, _, pytorch_modules, _ = NAMESPACES[namespace]
        theirs = next(getattr(m, name) for m in pytorch_modules if hasattr(m, name))
        assert reason and parameters(getattr(module, name)) != parameters(theirs), (namespace, name)
