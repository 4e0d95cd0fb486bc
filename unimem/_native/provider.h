// The provider ABI: how a raw-memory backend written in C, C++ or Cython
// lets the caching core call its malloc and free without Python and without
// the GIL. Both sides compile against this header; it holds no code that
// either side owns.
//
// A backend publishes one UMRawAllocatorAPI in a PyCapsule named
// UM_PROVIDER_CAPSULE, as its attribute ``_raw_api``. The struct (and what
// ``ctx`` points to) must stay valid while the object named by the backend's
// ``_raw_owner`` attribute (the backend itself when there is none) lives:
// the core keeps a reference to it. The core uses the struct only when
// ``version`` equals the UM_PROVIDER_VERSION it was built with; otherwise it
// calls the backend's Python ``malloc``/``free`` methods, as it does for
// backends that publish nothing.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>

#define UM_PROVIDER_CAPSULE "unimem.RawAllocatorAPI"
#define UM_PROVIDER_VERSION 2

enum UMRawStatus {
    UM_RAW_OK = 0,
    UM_RAW_OUT_OF_MEMORY = 1,
    UM_RAW_ERROR = 2,      // anything else; the core then asks the Python method
};

typedef int (*um_raw_malloc_fn)(void* ctx, size_t size, int device, uintptr_t stream,
                                uintptr_t* out);
typedef int (*um_raw_free_fn)(void* ctx, uintptr_t ptr, size_t size, int device,
                              uintptr_t stream);

struct UMRawAllocatorAPI {
    int version;           // UM_PROVIDER_VERSION
    void* ctx;
    um_raw_malloc_fn malloc;
    um_raw_free_fn free;
};

// The clock of backend_timing(): providers and the core time with the same one.
static inline int64_t um_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
