"""Sleep mode: give a device's memory back between jobs and keep every live
block at its address (vLLM's ``CuMemAllocator.sleep``/``wake_up``).

The state machine is the core's (``unimem/_core_sleep.pxi``); these are the
namespace functions, one device at a time."""
from __future__ import annotations

from .._runtime.devices import DeviceLike
from .arguments import check_bool
from .device_type import DeviceTypeAPI


class SleepAPI(DeviceTypeAPI):
    """``sleep``, ``wake_up`` and ``is_sleeping`` of a device type."""

    def sleep(self, offload: bool = True, device: DeviceLike = None) -> None:
        r"""Give the device's memory back while every live block keeps its address.

        Asleep, ``memory_reserved()`` is what is still backed by memory (0),
        ``memory_allocated()`` is unchanged (the blocks still exist), and
        allocating raises ``RuntimeError`` until :func:`wake_up`. Freeing a
        block meanwhile works (it is bookkeeping). Waits for the device's
        work first. Asleep already: nothing is done.

        Args:
            offload (bool): copy the bytes of every live block to host
                memory first, for :func:`wake_up` to copy back (default).
                ``False`` keeps no contents (faster).
            device (int, str or device, optional): selected device. If it is
                ``None`` the current device is used.

        Needs memory that can be given back while its addresses stay
        reserved: on ``cpu`` always, on CUDA with ``expandable_segments:True``
        in ``UNIMEM_ALLOC_CONF``; elsewhere ``NotImplementedError`` says why.
        Cached free memory is given back too and mapped again (without its
        contents) at :func:`wake_up`: call :func:`empty_cache` first to give
        it back for good. A ``MemPool`` with its own allocator sleeps through
        that allocator (see ``MemPool.sleep``); while one whose allocator
        cannot give memory back holds memory, ``NotImplementedError`` says
        so and nothing changes.
        """
        check_bool("offload", offload)
        self.caching_allocator(device).sleep(offload)

    def wake_up(self, device: DeviceLike = None) -> None:
        r"""Back the memory :func:`sleep` gave back again, at the same addresses.

        Every live block is where it was, with its bytes when the sleep
        offloaded them; allocation works again. Awake: nothing is done. If
        the device cannot hold it all, the error is raised and what could not
        be mapped stays asleep (the device too): call it again.

        Args:
            device (int, str or device, optional): selected device. If it is
                ``None`` the current device is used.
        """
        allocator = self._existing(device)
        if allocator is not None:
            allocator.wake_up()

    def is_sleeping(self, device: DeviceLike = None) -> bool:
        r"""Return whether the device is asleep (:func:`sleep` without :func:`wake_up`).

        Args:
            device (int, str or device, optional): selected device. If it is
                ``None`` the current device is used.
        """
        allocator = self._existing(device)
        return allocator is not None and allocator.is_sleeping()
