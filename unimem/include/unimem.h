/* unimem's C ABI: allocate from unimem's caching pools from C or C++.
 *
 * The pools are the ones unimem's Python side serves (CuPy's arrays through
 * unimem.cuda.allocator, dpnp's through unimem.xpu.set_allocator, NumPy's
 * through unimem.cpu.empty): memory allocated here is counted in
 * unimem.cuda.memory_stats() and the like, and a block freed by one library
 * is reused by another.
 *
 * The library is unimem's extension module unimem._integrations.capi: its
 * path is unimem.capi.library_path() and this header's folder is
 * unimem.capi.get_include(). Link with
 *     -L<dir> -l:<file name> -Wl,-rpath,<dir>
 * (or dlopen the path). The functions work only in a process whose Python
 * has imported unimem (import unimem.capi loads and sets up the library):
 * called before that, they return NULL / -1 and unimem_last_error() says so.
 *
 * Every function may be called from any thread, holding the GIL or not,
 * concurrently. A cache hit takes neither the GIL nor any Python object, nor
 * does a miss on a thread without the GIL whose new segment comes from a
 * backend with a C interface (unimem's provider ABI: the cpu pool's host
 * memory, dpctl's USM) within every limit. Any other request takes the GIL
 * itself (a backend written in Python, CuPy's, runs then; so do the retries
 * that free cached memory). Out of memory, and every other failure, returns
 * NULL with the reason in unimem_last_error(): PyTorch raises its own error
 * from the NULL.
 *
 * The malloc/free pairs have the signatures PyTorch's pluggable allocators
 * load (torch.cuda.memory.CUDAPluggableAllocator, torch.xpu.memory.
 * XPUPluggableAllocator). unimem.cuda.pluggable_allocator() and
 * unimem.xpu.pluggable_allocator() build those objects over the
 * unimem_torch_* pairs: the same functions, whose blocks say "torch" where
 * the others' say "c" (unimem.cuda.memory_allocated_by_client(), the
 * snapshots' "client").
 */
#ifndef UNIMEM_H
#define UNIMEM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

/* The version of this ABI: unimem_abi_version() returns the library's, which
 * must equal the header's (unimem.capi.ABI_VERSION is the same number). */
#define UNIMEM_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

/* The device types, as unimem's namespaces name them. */
typedef enum {
    UNIMEM_CPU = 0,  /* unimem.cpu: the device-style pool on plain host memory */
    UNIMEM_CUDA = 1, /* unimem.cuda: NVIDIA GPUs (through CuPy's runtime) */
    UNIMEM_XPU = 2   /* unimem.xpu: SYCL devices' device USM (through dpctl) */
} unimem_device_type;

int unimem_abi_version(void);

/* CUDA: `stream` is a cudaStream_t. Blocks are reused in stream order, keyed
 * as unimem.cuda keys them: cudaStreamPerThread (2) names the calling
 * thread's default stream, any other handle itself. `size` 0 gives NULL. */
void* unimem_cuda_malloc(ssize_t size, int device, void* stream);
/* `size`, `device` and `stream` are those of the malloc (PyTorch passes them);
 * the block goes back to the pool it came from. NULL is ignored. */
void unimem_cuda_free(void* ptr, ssize_t size, int device, void* stream);

/* XPU: `queue` is a sycl::queue* (dpctl's DPCTLSyclQueueRef, which
 * dpctl.SyclQueue.addressof_ref() gives): device USM on the queue's device,
 * reused in the order of that queue as unimem.xpu keys it (the device's
 * default queue as 0). The queue's SYCL context must be the one unimem's
 * pool allocates in (that of dpctl's default queue for the device). NULL:
 * device `device` (unimem.xpu's numbering), its default queue. A queue seen
 * here is kept by unimem for the life of the process, as PyTorch keeps its
 * streams' queues. */
void* unimem_xpu_malloc(size_t size, int device, void* queue);
void unimem_xpu_free(void* ptr, size_t size, int device, void* queue);

/* PyTorch's: unimem_cuda_* and unimem_xpu_* for its pluggable allocators
 * (their blocks' client is "torch", not "c"). */
void* unimem_torch_cuda_malloc(ssize_t size, int device, void* stream);
void unimem_torch_cuda_free(void* ptr, ssize_t size, int device, void* stream);
void* unimem_torch_xpu_malloc(size_t size, int device, void* queue);
void unimem_torch_xpu_free(void* ptr, size_t size, int device, void* queue);

/* CPU: unimem.cpu's pool; `stream` is an opaque key (NULL: the default). */
void* unimem_cpu_malloc(size_t size, int device, void* stream);
void unimem_cpu_free(void* ptr, size_t size, int device, void* stream);

/* What unimem.<type>.memory_allocated(device) / memory_reserved(device)
 * return (0 before the device's first allocation); -1 on error. */
int64_t unimem_memory_allocated(unimem_device_type type, int device);
int64_t unimem_memory_reserved(unimem_device_type type, int device);

/* unimem.<type>.empty_cache(): the cached blocks no one uses go back to the
 * device. Takes the GIL. 0, or -1 on error. */
int unimem_empty_cache(unimem_device_type type);

/* The reason for this thread's last failed call ("" if none failed); valid
 * until this thread's next failed call. */
const char* unimem_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* UNIMEM_H */
