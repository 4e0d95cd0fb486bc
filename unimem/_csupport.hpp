// Small C++ helpers for unimem/_core.pyx that Cython cannot express directly.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <new>

// The allocator lock. Recursive because Python code run while it is held (a
// backend's malloc, a trace hook) may trigger garbage collection, whose
// finalizers hand blocks back to the same allocator on the same thread.
struct UMLock {
    std::recursive_mutex m;
    bool try_lock() { return m.try_lock(); }
    void lock() { m.lock(); }
    void unlock() { m.unlock(); }
    // After fork() only the forking thread survives; a lock some other thread
    // held would stay held forever in the child. Rebuild it in place.
    void reset_after_fork() { new (&m) std::recursive_mutex(); }
};

static inline int64_t um_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

static inline int um_floor_log2(uint64_t x) { return 63 - __builtin_clzll(x); }

// Per-thread current device index, one slot per device type (registry).
#define UM_MAX_REGISTRIES 16
static thread_local int um_current_device[UM_MAX_REGISTRIES];
