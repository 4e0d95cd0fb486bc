"""Device telemetry: what the driver says about a whole device, every process
included, beside the pools' own statistics. ``torch.cuda``'s
``device_memory_used``, ``memory_usage`` and ``list_gpu_processes`` read NVML
(the ``pynvml`` module of ``nvidia-ml-py``) as PyTorch's do; ``torch.xpu``'s
``device_memory_used`` and ``memory_usage`` read what dpctl reports (PyTorch
asks Level Zero Sysman through ``pyzes``)."""
from __future__ import annotations

import os
from typing import Any, Tuple

from .._runtime.devices import DeviceLike, device_index, get_type


def nvml_device_index(index: int) -> int:
    """The NVML index of CUDA device ``index``: CUDA counts only the devices
    in ``CUDA_VISIBLE_DEVICES`` (when it lists indices), NVML counts them all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    listed = [entry.strip() for entry in visible.split(",")]
    try:
        return int(listed[index])
    except (IndexError, ValueError):    # UUIDs or a short list: the order CUDA sees
        return index


def _cuda_index(device: DeviceLike) -> int:
    dtype = get_type("cuda")
    return device_index(device, dtype)


def _nvml_handle(device: DeviceLike) -> Tuple[Any, Any]:
    """NVML (initialised) and its handle of the CUDA device ``device``,
    failing as PyTorch's ``_get_pynvml_handler`` does: ``ModuleNotFoundError``
    without ``nvidia-ml-py``, ``RuntimeError`` without a driver."""
    try:
        import pynvml
    except ImportError as error:
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed or it can't be imported.") from error
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_DriverNotLoaded as error:
        raise RuntimeError("cuda driver can't be loaded, is cuda enabled?") from error
    except getattr(pynvml, "NVMLError_LibraryNotFound", ()) as error:
        # libnvidia-ml.so comes with the driver: PyTorch lets NVML's own error out
        raise RuntimeError("no NVIDIA driver was found (NVML's library, libnvidia-ml.so, is missing)") from error
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(nvml_device_index(_cuda_index(device)))


def cuda_device_memory_used(device: DeviceLike = None) -> int:
    r"""Return used global (device) memory in bytes as given by `nvidia-smi` or `amd-smi`.

    Args:
        device (torch.device or int, optional): selected device. Returns
            statistic for the current device, given by :func:`~unimem.cuda.current_device`,
            if :attr:`device` is ``None`` (default).

    Read from NVML (``nvidia-ml-py``), every process on the device included.
    """
    pynvml, handle = _nvml_handle(device)
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def cuda_memory_usage(device: DeviceLike = None) -> int:
    r"""Return the percent of time over the past sample period during which global (device)
    memory was being read or written as given by `nvidia-smi`.

    Args:
        device (torch.device or int, optional): selected device. Returns
            statistic for the current device, given by :func:`~unimem.cuda.current_device`,
            if :attr:`device` is ``None`` (default).

    Warning: Each sample period may be between 1 second and 1/6 second,
    depending on the product being queried.
    """
    pynvml, handle = _nvml_handle(device)
    return int(pynvml.nvmlDeviceGetUtilizationRates(handle).memory)


def list_gpu_processes(device: DeviceLike = None) -> str:
    r"""Return a human-readable printout of the running processes and their GPU memory use for a given device.

    This can be useful to display periodically during training, or when
    handling out-of-memory exceptions. It reads NVML (the ``pynvml`` module
    of ``nvidia-ml-py``); without it, a one-line message says so, as PyTorch's.

    Args:
        device (int, str or device, optional): selected device. Returns
            printout for the current device, given by :func:`current_device`,
            if :attr:`device` is ``None`` (default).
    """
    try:
        import pynvml
    except ImportError:
        return "pynvml module not found, please install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_DriverNotLoaded:
        return "cuda driver can't be loaded, is cuda enabled?"
    index = nvml_device_index(_cuda_index(device))
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    lines = [f"GPU:{index}"]
    if not processes:
        lines.append("no processes are running")
    for process in processes:
        megabytes = process.usedGpuMemory / (1024 * 1024)
        lines.append(f"process {process.pid:>10d} uses {megabytes:>12.3f} MB GPU memory")
    return "\n".join(lines)


def xpu_device_memory_used(index: int) -> int:
    """``torch.xpu.device_memory_used`` for XPU device ``index``: its global
    memory less the free memory its driver reports (every process included);
    ``RuntimeError``, as PyTorch's where Level Zero Sysman cannot say, on a
    device that reports none."""
    backend = get_type("xpu").backend
    reported = getattr(backend, "reported_free_memory", None)     # a user backend may not say
    free = None if reported is None else reported(index)
    if free is None:
        raise RuntimeError("GPU memory usage querying is not available: the device reports no free memory "
                           "(dpctl.utils.intel_device_info gives it for Level Zero devices, where "
                           "ZES_ENABLE_SYSMAN=1 may be needed)")
    _, total = backend.memory_info(index)
    return max(total - free, 0)


#: Why ``torch.xpu.memory_usage`` cannot be answered: PyTorch samples Level
#: Zero Sysman's memory bandwidth counters, which dpctl does not expose.
XPU_BANDWIDTH_UNAVAILABLE = ("GPU memory bandwidth usage querying is not available: dpctl reports no memory "
                             "bandwidth counters (Level Zero Sysman's, which PyTorch samples through pyzes)")
