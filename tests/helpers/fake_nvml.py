"""A stand-in ``pynvml`` module (NVML through ``nvidia-ml-py``), for the tests
of what unimem.cuda reads from NVML on machines without a GPU: per-device
memory and utilisation, running processes, and the errors of a machine
without a driver. A test puts it in ``sys.modules`` with monkeypatch."""
import types


def fake_pynvml(processes=(), driver="loaded", used=(), memory_busy=()):
    """``driver``: "loaded", "not loaded" (``NVMLError_DriverNotLoaded``) or
    "missing" (``NVMLError_LibraryNotFound``: no libnvidia-ml.so). ``used``
    and ``memory_busy``: each NVML device's used bytes and memory
    utilisation (percent), by NVML index. ``module.handles`` records the
    indices asked for."""
    class NVMLError(Exception):
        pass

    class NVMLError_DriverNotLoaded(NVMLError):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    module.NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    module.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    module.handles = []

    def nvmlInit():
        if driver == "not loaded":
            raise NVMLError_DriverNotLoaded()
        if driver == "missing":
            raise NVMLError_LibraryNotFound()

    def nvmlDeviceGetHandleByIndex(index):
        module.handles.append(index)
        return ("handle", index)

    module.nvmlInit = nvmlInit
    module.nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex
    module.nvmlDeviceGetComputeRunningProcesses = lambda handle: list(processes)
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=used[handle[1]])
    module.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(memory=memory_busy[handle[1]])
    return module
