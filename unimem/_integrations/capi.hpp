// unimem's C ABI (include/unimem.h): the exported functions, and the C state
// their cache hits read without the GIL. Included by unimem/_integrations/capi.pyx, which
// fills in the entries (um_capi::Entries) when it is imported; the functions
// defined here only check for them and pass the call on.
//
// The state read on a hit, each written only by a thread holding the GIL
// (so one writer at a time) and read by any thread without it:
//  * the allocator of each (device type, device index): a CachingAllocator
//    that capi.pyx keeps alive for the rest of the process once published;
//  * for XPU, which allocator and stream key each sycl::queue* maps to, with
//    the queue's identity (dpctl's DPCTLQueue_Hash: its sycl::queue_impl) to
//    tell a queue from a later one at the same address;
//  * the calling thread's CUDA per-thread stream key, and its error text.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <sys/types.h>

#include "../include/unimem.h"

#define UM_CAPI_EXPORT extern "C" __attribute__((visibility("default")))

namespace um_capi {

enum { N_TYPES = 3, MAX_DEVICES = 64, ERROR_SIZE = 1024 };

// capi.pyx's functions; NULL until unimem._integrations.capi is imported.
// malloc's `for_torch`: the request is PyTorch's (unimem_torch_*), not plain C's.
struct Entries {
    void* (*malloc)(int type, size_t size, int device, void* stream, int for_torch);
    void (*free)(int type, void* ptr, int device, void* stream);
    int64_t (*stat)(int which, int type, int device);
    int (*empty_cache)(int type);
};
static std::atomic<const Entries*> entries{nullptr};

static thread_local char last_error[ERROR_SIZE];
static thread_local uintptr_t per_thread_key = 0;

static inline char* error_buffer() { return last_error; }
static inline void set_error(const char* text) {
    std::snprintf(last_error, ERROR_SIZE, "%s", text);
}
static inline uintptr_t thread_key() { return per_thread_key; }
static inline void set_thread_key(uintptr_t key) { per_thread_key = key; }

// ---- the allocator of each (type, device) ----------------------------------
static std::atomic<void*> allocators[N_TYPES][MAX_DEVICES];

static inline void* allocator_of(int type, int device) {
    if (type < 0 || type >= N_TYPES || device < 0 || device >= MAX_DEVICES)
        return nullptr;
    return allocators[type][device].load(std::memory_order_acquire);
}
static inline void publish_allocator(int type, int device, void* allocator) {
    if (type >= 0 && type < N_TYPES && device >= 0 && device < MAX_DEVICES)
        allocators[type][device].store(allocator, std::memory_order_release);
}
static inline void forget_allocators(int type) {
    for (int d = 0; d < MAX_DEVICES; ++d)
        allocators[type][d].store(nullptr, std::memory_order_release);
}

// ---- XPU: sycl::queue* -> (allocator, stream key) --------------------------
// Open addressing over the queue's address. An entry is never changed once
// published and never freed (a reader may still hold it): a queue at an
// address seen before with another identity gets a new entry in the same
// slot, and the old one (32 bytes) is left behind. At most MAX_QUEUES
// entries are made; queues past them take the GIL on every call.
struct QueueEntry {
    const void* queue;
    size_t identity;
    void* allocator;
    uintptr_t stream;
};
enum { QUEUE_SLOTS = 4096, MAX_QUEUES = 2048, MAX_ENTRIES_MADE = 1 << 16 };
static std::atomic<QueueEntry*> queue_slots[QUEUE_SLOTS];
static int queue_entries_made = 0;          // written with the GIL held
static int queue_slots_used = 0;            // likewise
static std::atomic<size_t (*)(const void*)> queue_identity{nullptr};   // DPCTLQueue_Hash

static inline size_t queue_slot(const void* queue) {
    uintptr_t a = reinterpret_cast<uintptr_t>(queue);
    a ^= a >> 17;
    a *= 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(a >> 52) & (QUEUE_SLOTS - 1);
}

// 1 and the entry's allocator and stream when `queue` is known with the
// identity it has now; 0 otherwise (the caller takes the GIL).
static inline int find_queue(const void* queue, void** allocator, uintptr_t* stream) {
    size_t (*identity)(const void*) = queue_identity.load(std::memory_order_acquire);
    if (identity == nullptr)
        return 0;
    size_t i = queue_slot(queue);
    for (int probe = 0; probe < QUEUE_SLOTS; ++probe, i = (i + 1) & (QUEUE_SLOTS - 1)) {
        QueueEntry* e = queue_slots[i].load(std::memory_order_acquire);
        if (e == nullptr)
            return 0;
        if (e->queue == queue) {
            if (e->identity != identity(queue))
                return 0;
            *allocator = e->allocator;
            *stream = e->stream;
            return 1;
        }
    }
    return 0;
}

// Record `queue` (the GIL held). 1: recorded; 0: the table is full (nothing
// changed); -1: no memory.
static inline int record_queue(const void* queue, size_t identity, void* allocator, uintptr_t stream) {
    if (queue_entries_made >= MAX_ENTRIES_MADE)
        return 0;
    size_t i = queue_slot(queue);
    for (int probe = 0; probe < QUEUE_SLOTS; ++probe, i = (i + 1) & (QUEUE_SLOTS - 1)) {
        QueueEntry* e = queue_slots[i].load(std::memory_order_relaxed);
        if (e != nullptr && e->queue != queue)
            continue;
        if (e == nullptr && queue_slots_used >= MAX_QUEUES)
            return 0;
        QueueEntry* made = new (std::nothrow) QueueEntry{queue, identity, allocator, stream};
        if (made == nullptr)
            return -1;
        ++queue_entries_made;
        if (e == nullptr)
            ++queue_slots_used;
        queue_slots[i].store(made, std::memory_order_release);
        return 1;
    }
    return 0;
}

static inline void forget_queues() {
    for (int i = 0; i < QUEUE_SLOTS; ++i)
        queue_slots[i].store(nullptr, std::memory_order_release);
    queue_slots_used = 0;
}

static inline void set_queue_identity(size_t (*fn)(const void*)) {
    queue_identity.store(fn, std::memory_order_release);
}

static inline void set_entries(const Entries* e) { entries.store(e, std::memory_order_release); }

static inline const Entries* get_entries() {
    const Entries* e = entries.load(std::memory_order_acquire);
    if (e == nullptr)
        set_error("unimem's C ABI is not set up: import unimem (or unimem.capi) in this process first; "
                  "the library is unimem's extension module and runs on its Python side");
    return e;
}

}  // namespace um_capi

// ---- the exported functions (their declarations: include/unimem.h) --------
UM_CAPI_EXPORT int unimem_abi_version(void) { return UNIMEM_ABI_VERSION; }

namespace um_capi {
static inline void* sized_malloc(int type, ssize_t size, int device, void* stream, int for_torch) {
    const Entries* e = get_entries();
    if (e == nullptr)
        return nullptr;
    if (size < 0) {
        set_error("ValueError: a negative size");
        return nullptr;
    }
    return e->malloc(type, static_cast<size_t>(size), device, stream, for_torch);
}

static inline void* unsigned_malloc(int type, size_t size, int device, void* stream, int for_torch) {
    const Entries* e = get_entries();
    return e == nullptr ? nullptr : e->malloc(type, size, device, stream, for_torch);
}

static inline void typed_free(int type, void* ptr, int device, void* stream) {
    const Entries* e = get_entries();
    if (e != nullptr && ptr != nullptr)
        e->free(type, ptr, device, stream);
}
}  // namespace um_capi

UM_CAPI_EXPORT void* unimem_cuda_malloc(ssize_t size, int device, void* stream) {
    return um_capi::sized_malloc(UNIMEM_CUDA, size, device, stream, 0);
}

UM_CAPI_EXPORT void unimem_cuda_free(void* ptr, ssize_t, int device, void* stream) {
    um_capi::typed_free(UNIMEM_CUDA, ptr, device, stream);
}

UM_CAPI_EXPORT void* unimem_xpu_malloc(size_t size, int device, void* queue) {
    return um_capi::unsigned_malloc(UNIMEM_XPU, size, device, queue, 0);
}

UM_CAPI_EXPORT void unimem_xpu_free(void* ptr, size_t, int device, void* queue) {
    um_capi::typed_free(UNIMEM_XPU, ptr, device, queue);
}

// PyTorch's pluggable allocators' pairs: unimem_cuda_* / unimem_xpu_* whose
// blocks say "torch" (unimem.capi.pluggable_allocator loads these).
UM_CAPI_EXPORT void* unimem_torch_cuda_malloc(ssize_t size, int device, void* stream) {
    return um_capi::sized_malloc(UNIMEM_CUDA, size, device, stream, 1);
}

UM_CAPI_EXPORT void unimem_torch_cuda_free(void* ptr, ssize_t, int device, void* stream) {
    um_capi::typed_free(UNIMEM_CUDA, ptr, device, stream);
}

UM_CAPI_EXPORT void* unimem_torch_xpu_malloc(size_t size, int device, void* queue) {
    return um_capi::unsigned_malloc(UNIMEM_XPU, size, device, queue, 1);
}

UM_CAPI_EXPORT void unimem_torch_xpu_free(void* ptr, size_t, int device, void* queue) {
    um_capi::typed_free(UNIMEM_XPU, ptr, device, queue);
}

UM_CAPI_EXPORT void* unimem_cpu_malloc(size_t size, int device, void* stream) {
    return um_capi::unsigned_malloc(UNIMEM_CPU, size, device, stream, 0);
}

UM_CAPI_EXPORT void unimem_cpu_free(void* ptr, size_t, int device, void* stream) {
    um_capi::typed_free(UNIMEM_CPU, ptr, device, stream);
}

UM_CAPI_EXPORT int64_t unimem_memory_allocated(unimem_device_type type, int device) {
    const um_capi::Entries* e = um_capi::get_entries();
    return e == nullptr ? -1 : e->stat(0, static_cast<int>(type), device);
}

UM_CAPI_EXPORT int64_t unimem_memory_reserved(unimem_device_type type, int device) {
    const um_capi::Entries* e = um_capi::get_entries();
    return e == nullptr ? -1 : e->stat(1, static_cast<int>(type), device);
}

UM_CAPI_EXPORT int unimem_empty_cache(unimem_device_type type) {
    const um_capi::Entries* e = um_capi::get_entries();
    return e == nullptr ? -1 : e->empty_cache(static_cast<int>(type));
}

UM_CAPI_EXPORT const char* unimem_last_error(void) { return um_capi::last_error; }
