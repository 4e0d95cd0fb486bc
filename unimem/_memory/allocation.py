"""Allocation: ``caching_allocator_alloc``/``delete``, ``record_stream``, and
giving cached memory back (``empty_cache``, ``empty_virt_addr_cache``)."""
from __future__ import annotations

from typing import Any, Optional

from .. import _core
from .._runtime.devices import DeviceLike, device_index, pool_of
from .arguments import MemoryLike, record_stream_on_pools
from .device_type import DeviceTypeAPI


def _carried_allocation(memory: MemoryLike) -> Optional[_core.Allocation]:
    """The unimem :class:`~unimem.Allocation` behind a memory object: itself,
    a ``PooledMemory``'s, a ``MemoryPointer``'s memory's or a CuPy array's
    data's; None for the rest (an address, a NumPy or dpnp array)."""
    for _ in range(4):          # array -> MemoryPointer -> PooledMemory -> Allocation
        if isinstance(memory, _core.Allocation):
            return memory
        for link in ("allocation", "mem", "data"):
            found = getattr(memory, link, None)
            if found is not None and not isinstance(found, (memoryview, int)):
                memory = found
                break
        else:
            return None
    return None


class AllocationAPI(DeviceTypeAPI):
    """Allocating and freeing through a device type's caching allocators."""

    def caching_allocator_alloc(self, size: int, device: DeviceLike = None, stream: Any = None) -> int:
        r"""Perform a memory allocation using the caching allocator.

        Memory is allocated for a given device and a stream, this
        function is intended to be used for interoperability with other
        frameworks. Allocated memory is released through
        :func:`caching_allocator_delete`.

        Args:
            size (int): number of bytes to be allocated.
            device (int, str or device, optional): selected device. If it is
                ``None`` the default device is used.
            stream (int or stream object, optional): selected stream. If is ``None`` then
                the default stream for the selected device is used.
        """
        dtype = self._type()
        index = None if device is None else device_index(device, dtype)
        return dtype.registry.alloc(size, index, stream)

    def caching_allocator_delete(self, mem_ptr: int) -> None:
        r"""Delete memory allocated using the caching allocator.

        Memory allocated with :func:`caching_allocator_alloc`.
        is freed here. The associated device and stream are tracked inside
        the allocator.

        Args:
            mem_ptr (int): memory address to be freed by the allocator.
        """
        self._type().registry.delete(mem_ptr)

    def record_stream(self, memory: MemoryLike, stream: Any) -> None:
        r"""Mark the memory as used by the stream ``stream``.

        When the memory is deallocated, ensure the block is not reused for
        another allocation until all work queued on ``stream`` at the time of
        deallocation is complete (``torch.Tensor.record_stream``).

        Args:
            memory: an array whose memory comes from this device type's pool
                (a CuPy ndarray, a dpnp ndarray or dpctl ``usm_ndarray``, a
                NumPy array from :mod:`unimem.cpu`), a memory object (a CuPy
                ``MemoryPointer`` or ``PooledMemory``, a dpctl ``MemoryUSM*``,
                an :class:`unimem.Allocation`) or the address of a block, as
                :func:`caching_allocator_alloc` returns. An empty array (no
                memory) is left alone. A memory object of a pool with
                allocators of its own (``unimem.cuda.MemoryPool(allocator)``)
                is found through the block it holds.
            stream: a stream of this device type (a CuPy or PyTorch stream or
                a ``cudaStream_t`` as an int; a ``dpctl.SyclQueue``; an int
                handle), or ``None`` for the current stream.

        Raises ``TypeError`` for what is no memory and ``ValueError`` for an
        address that is not a live block of this device type's pool; nothing
        is recorded then.
        """
        registry = self._type().registry

        def carried_owner(address: int) -> Optional[_core.CachingAllocator]:
            # A block of a pool of its own (unimem.cuda.MemoryPool(allocator)),
            # found through the unimem Allocation the memory object holds.
            allocation = _carried_allocation(memory)
            if allocation is None:
                return None
            owner = allocation.allocator
            pool = pool_of(owner)
            if pool is None or pool.device_type != self.type_name or not owner.owns(address):
                return None
            return owner

        record_stream_on_pools(memory, stream, [registry.find_owner, carried_owner],
                               lambda owner: registry.stream_handle_of(stream, owner.device),
                               f"the {self.type_name} allocator")

    def empty_cache(self) -> None:
        r"""Release all unoccupied cached memory currently held by the caching
        allocator so that those can be used in other application.

        .. note:: This function is a no-op if the memory allocator has not been initialized.
        """
        for allocator in self._initialized() + self.pools_beside(None):
            allocator.empty_cache()

    def empty_virt_addr_cache(self, device: DeviceLike = None) -> None:
        r"""Release the virtual address ranges reserved by expandable segments
        that no longer have any physical memory mapped into them.

        With ``expandable_segments:True`` in ``UNIMEM_ALLOC_CONF``, each
        stream and pool reserves a large range of virtual addresses once and
        maps memory at its end as needed; :func:`empty_cache` unmaps the free
        pages but keeps the addresses reserved, so that the segment can grow
        again in place. This function gives the fully unmapped ranges back
        (torch_npu's ``torch_npu.npu.empty_virt_addr_cache``). Call
        :func:`empty_cache` first to unmap what is cached.

        Args:
            device (torch.device or int, optional): selected device. Every
                initialized device if ``None`` (default).

        .. note:: This function is a no-op if the memory allocator has not
            been initialized, or does not use expandable segments.
        """
        if device is not None:
            allocator = self._existing(device)
            if allocator is not None:
                allocator.empty_virt_addr_cache()
            return
        for allocator in self._initialized():
            allocator.empty_virt_addr_cache()
