"""Configuration: the per-process memory fraction, and the raw memory source
under the caching allocator (``change_current_allocator``,
``get_allocator_backend``)."""
from __future__ import annotations

from .._runtime import devices as _devices
from .._runtime.config import settings_from_env
from .._runtime.devices import DeviceLike, device_index
from ..backends.base import Backend
from ..backends.pluggable import PluggableAllocator
from .arguments import check_fraction
from .device_type import DeviceTypeAPI


class ConfigurationAPI(DeviceTypeAPI):
    """The settings of a device type's caching allocators."""

    def set_per_process_memory_fraction(self, fraction: float, device: DeviceLike = None) -> None:
        r"""Set memory fraction for a process.

        The fraction is used to limit the caching allocator to allocated memory on a device.
        The allowed value equals the total visible memory multiplied fraction.
        If trying to allocate more than the allowed value in a process, will raise an out of
        memory error in allocator.

        Args:
            fraction(float): Range: 0~1 (on XPU, as in ``torch.xpu``: above 0,
                up to 1). Allowed memory equals total_memory * fraction.
            device (int, str or device, optional): selected device. If it is
                ``None`` the default device is used.
        """
        dtype = self._type()
        index = device_index(device, dtype)
        # PyTorch takes a float and nothing else (an int 1 is a TypeError).
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        fraction = check_fraction(fraction)
        if fraction == 0.0 and dtype.name == "xpu":     # torch.xpu's XPUCachingAllocator: (0, 1]
            raise ValueError(f"invalid fraction:{fraction:g}. Please set within (0, 1].")
        dtype.allocator(index).set_memory_fraction(fraction)

    def get_per_process_memory_fraction(self, device: DeviceLike = None) -> float:
        r"""Get memory fraction for a process.

        Args:
            device (int, str or device, optional): selected device. If it is
                ``None`` the default device is used.
        Returns:
            memory fraction, in range 0~1. Allowed memory equals total_memory * fraction.
            Before the first allocation on the device, the fraction its
            allocator will start with (``per_process_memory_fraction`` of
            ``UNIMEM_ALLOC_CONF``, else 1.0), as PyTorch reads its config.
        """
        allocator = self._existing(device)
        if allocator is not None:
            return allocator.get_memory_fraction()
        configured = settings_from_env().per_process_memory_fraction
        return 1.0 if configured is None else configured

    def change_current_allocator(self, allocator: Backend) -> None:
        r"""Change the currently used memory allocator to be the one provided.

        If the current allocator has already been used/initialized, this function will error.

        Args:
            allocator: the raw memory source to use from now on: a
                :class:`unimem.PluggableAllocator` (Python callables), a
                ``CUDAPluggableAllocator`` / ``XPUPluggableAllocator`` (C
                functions in a shared library, as PyTorch's), or any
                :class:`unimem.Backend`. Unlike PyTorch, the caching allocator
                stays on top: ``allocator`` is asked for memory on a cache
                miss only, and statistics, snapshots and the out-of-memory
                retry keep working.

        Raises ``TypeError`` for what is no allocator and ``RuntimeError``
        ("Can't swap an already initialized allocator") after the first
        allocation on this device type, as PyTorch does.
        """
        if not callable(getattr(allocator, "malloc", None)) or not callable(getattr(allocator, "free", None)):
            raise TypeError("change_current_allocator expects an allocator such as unimem.PluggableAllocator, "
                            f"got {type(allocator).__name__}")
        _devices.replace_backend(self.type_name, allocator)

    def get_allocator_backend(self) -> str:
        r"""Return a string describing the active allocator backend. It is
        ``native`` (unimem's caching allocator over the device's own memory
        functions) unless :func:`change_current_allocator` installed an
        allocator: then ``pluggable``, as PyTorch names a
        ``CUDAPluggableAllocator``, or the ``name`` given to
        :class:`unimem.PluggableAllocator`.
        """
        try:
            dtype = self._type()
        except RuntimeError:        # no device of this type: nothing was plugged in
            return "native"
        backend = dtype.backend
        if not dtype.user_backend:
            return "native"
        if not isinstance(backend, PluggableAllocator):
            return "pluggable"
        # Backend.name is a class default ("device"); only a name given to this one counts.
        return str(vars(backend).get("name", "pluggable"))
