// Small C++ helpers for the caching core that Cython cannot express directly:
// its lock and a bit trick.
#pragma once
#include <atomic>
#include "provider.h"      // um_now_ns(): one clock for the core and the providers
#include <chrono>
#include <cstdint>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The allocator lock: recursive, because Python code run while it is held (a
// backend's malloc, a trace hook) may trigger garbage collection whose
// finalizers hand blocks back to the same allocator on the same thread.
//
// Taking it uncontended is one compare-and-swap and giving it back one
// store and one load (std::recursive_mutex costs several times that, and
// the hot path takes the lock twice per allocation and free).
//
// A waiter first reads the word (a failed compare-and-swap would take the
// cache line from the holder) with exponential backoff: the holder then runs
// many short critical sections in a row on its own core instead of both
// threads passing the allocator's cache lines back and forth on every call.
// If that is not enough (the holder was preempted, or is in a backend call),
// the waiter sleeps on a futex until the holder lets go, so the holder gets
// the core. The wake-up could be missed in one narrow race (the holder's
// load of ``waiters`` may pass its store of the word); the sleep has a
// timeout, so that costs at most 50 us, never a hang.
struct UMLock {
    char before[64];                        // a cache line of its own: waiters read
    std::atomic<int> word{0};              // 0: free, 1: taken
    std::atomic<int> waiters{0};           // threads asleep (or about to be) on word
    std::atomic<int> waking{0};            // a wake-up is on its way (one is enough)
    std::atomic<uintptr_t> owner{0};       // the holder's thread tag
    int depth = 0;                          // written by the holder only
    char after[64];                         // it, and should not slow the fields around

    // A tag unique to the calling thread. The thread pointer is one register
    // read; a thread_local variable in a shared library would cost a call
    // to __tls_get_addr on every lock.
    static uintptr_t self() {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__aarch64__))
        return reinterpret_cast<uintptr_t>(__builtin_thread_pointer());
#else
        return static_cast<uintptr_t>(pthread_self());
#endif
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
    // Whether the calling thread holds the lock (at any depth).
    bool held_here() const {
        return owner.load(std::memory_order_relaxed) == self();
    }
    bool try_lock_if_free() {
        return word.load(std::memory_order_relaxed) == 0 && try_lock();
    }
    void lock() {
        if (try_lock())
            return;
        unsigned backoff = 1;
        for (int round = 0; round < 8; ++round) {
            for (unsigned i = 0; i < backoff; ++i) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
            }
            backoff *= 2;
            if (try_lock_if_free())
                return;
        }
        for (int round = 0; round < 16; ++round) {
            sched_yield();                     // the holder may be waiting for this core
            if (try_lock_if_free())
                return;
        }
        waiters.fetch_add(1);
        while (!try_lock_if_free()) {
            sleep_while_taken();
            waking.store(0, std::memory_order_relaxed);
        }
        waiters.fetch_sub(1);
    }
    // lock(), giving up after ``timeout_ns`` (before fork(): a holder that
    // waits on something must not hang the fork).
    bool lock_for(int64_t timeout_ns) {
        if (try_lock())
            return true;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
        while (std::chrono::steady_clock::now() < deadline) {
            if (try_lock_if_free())
                return true;
            struct timespec pause = {0, 100000};
            nanosleep(&pause, nullptr);
        }
        return false;
    }
    void unlock() {
        if (--depth == 0) {
            owner.store(0, std::memory_order_relaxed);
            word.store(0, std::memory_order_release);
            // One wake-up syscall per sleep, not one per unlock: the holder
            // may unlock many times before the sleeper gets to run.
            if (waiters.load(std::memory_order_relaxed) != 0 &&
                waking.load(std::memory_order_relaxed) == 0 && waking.exchange(1) == 0)
                wake_one();
        }
    }
#ifdef __linux__
    void sleep_while_taken() {
        struct timespec timeout = {0, 50000};
        syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 1, &timeout, nullptr, 0);
    }
    void wake_one() { syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0); }
#else
    void sleep_while_taken() {
        struct timespec pause = {0, 20000};
        nanosleep(&pause, nullptr);
    }
    void wake_one() {}
#endif
    // After fork() only the forking thread survives; a lock another thread
    // held would stay held forever in the child.
    void reset_after_fork() {
        word.store(0);
        waiters.store(0);
        waking.store(0);
        owner.store(0);
        depth = 0;
    }
};

static inline int um_floor_log2(uint64_t x) { return 63 - __builtin_clzll(x); }
