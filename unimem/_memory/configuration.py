"""Configuration: the per-process memory fraction."""
from __future__ import annotations

from .._runtime.config import settings_from_env
from .._runtime.devices import DeviceLike, device_index
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
            fraction(float): Range: 0~1. Allowed memory equals total_memory * fraction.
            device (int, str or device, optional): selected device. If it is
                ``None`` the default device is used.
        """
        dtype = self._type()
        index = device_index(device, dtype)
        # PyTorch takes a float and nothing else (an int 1 is a TypeError).
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        fraction = check_fraction(fraction)
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
