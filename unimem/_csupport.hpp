// Small C++ helpers for unimem/_core.pyx that Cython cannot express directly.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <sched.h>
#include <time.h>

// The allocator lock: recursive, because Python code run while it is held (a
// backend's malloc, a trace hook) may trigger garbage collection whose
// finalizers hand blocks back to the same allocator on the same thread.
//
// Taking it uncontended is one compare-and-swap and giving it back one
// store (std::recursive_mutex costs several times that, and the hot path
// takes the lock twice per allocation and free). A waiter spins briefly,
// then yields, then sleeps: waiting happens only while another thread runs a
// backend call (the caching core never waits holding the GIL).
struct UMLock {
    std::atomic<int> word{0};              // 0: free, 1: taken
    std::atomic<uintptr_t> owner{0};       // the holder's thread tag
    int depth = 0;                          // written by the holder only

    static uintptr_t self() {
        static thread_local char tag;
        return reinterpret_cast<uintptr_t>(&tag);
    }
    bool try_lock() {
        const uintptr_t me = self();
        if (owner.load(std::memory_order_relaxed) == me) {
            ++depth;
            return true;
        }
        int expected = 0;
        if (word.compare_exchange_strong(expected, 1, std::memory_order_acquire)) {
            owner.store(me, std::memory_order_relaxed);
            depth = 1;
            return true;
        }
        return false;
    }
    void lock() {
        for (unsigned spins = 0; !try_lock(); ++spins) {
            if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
            } else if (spins < 256) {
                sched_yield();
            } else {
                struct timespec pause = {0, 20000};   // 20 us
                nanosleep(&pause, nullptr);
            }
        }
    }
    void unlock() {
        if (--depth == 0) {
            owner.store(0, std::memory_order_relaxed);
            word.store(0, std::memory_order_release);
        }
    }
    // After fork() only the forking thread survives; a lock another thread
    // held would stay held forever in the child.
    void reset_after_fork() {
        word.store(0);
        owner.store(0);
        depth = 0;
    }
};

static inline int64_t um_now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

static inline int um_floor_log2(uint64_t x) { return 63 - __builtin_clzll(x); }

// Make the compiler believe a pointer escapes (benchmark loops): it may then
// not remove a malloc/free pair as having no effect.
static inline void um_escape(void* p) { asm volatile("" : : "g"(p) : "memory"); }

// Per-thread current device index, one slot per device type (registry).
#define UM_MAX_REGISTRIES 16
static thread_local int um_current_device[UM_MAX_REGISTRIES];
