/* The SYCL USM functions dpnp's compiled extensions import, defined here so
   that their scratch buffers come from unimem's pools (unimem/_integrations/sycl_interposer.pyx).

   The definitions carry the exact mangled names of libsycl's functions (asm
   labels) and, once the module is promoted to the global scope before dpnp's
   extensions are loaded, the dynamic linker binds those extensions' imports
   to them instead of to libsycl. Each one either serves the request from a
   pool or forwards it, unchanged, to the real function (found with dlsym on
   the loaded libsycl: it sits in dpctl's local scope, so RTLD_NEXT would not
   find it). Exceptions the real functions throw go through these frames
   unchanged: none of them is noexcept.

   No SYCL header is needed: a C++ reference is passed as a pointer (Itanium
   ABI), sycl::usm::alloc is an int-sized enum (host 0, device 1, shared 2,
   unknown 3), and the sycl::device / sycl::context / sycl::queue objects are
   only ever handed to dpctl's C API, whose opaque references are pointers to
   those very objects (dpctl_sycl_type_casters.hpp: wrap/unwrap are
   reinterpret_casts).

   What Python supplies at install (um_si_*): the real functions, dpctl's C
   functions, the devices served (device, context, unimem's index) and four
   callbacks into the pool (allocate, free, find a device's pool, wait for a
   device's queues).

   Its state and routing (what is served, what is forwarded and why) are in
   sycl_interposer_state.hpp. */
#pragma once

#include "sycl_interposer_state.hpp"

/* ---- the definitions the dynamic linker binds dpnp's imports to ---------- */
#define UM_SI_EXPORT __attribute__((visibility("default"), used))

UM_SI_EXPORT void* um_si_aligned_alloc(size_t align, size_t size, const void* device, const void* context,
                                       int kind, const void* properties, const void* location)
    __asm__(UM_SI_ALIGNED_ALLOC);
UM_SI_EXPORT void* um_si_aligned_alloc_device(size_t align, size_t size, const void* device,
                                              const void* context, const void* properties,
                                              const void* location) __asm__(UM_SI_ALIGNED_ALLOC_DEVICE);
UM_SI_EXPORT void* um_si_malloc_device_q(size_t size, const void* queue, const void* location)
    __asm__(UM_SI_MALLOC_DEVICE_Q);
UM_SI_EXPORT void* um_si_malloc_shared_q(size_t size, const void* queue, const void* location)
    __asm__(UM_SI_MALLOC_SHARED_Q);
UM_SI_EXPORT void* um_si_malloc_q(size_t size, const void* queue, int kind, const void* location)
    __asm__(UM_SI_MALLOC_Q);
UM_SI_EXPORT void um_si_free_context(void* ptr, const void* context, const void* location)
    __asm__(UM_SI_FREE_CONTEXT);
UM_SI_EXPORT void um_si_free_queue(void* ptr, const void* queue, const void* location)
    __asm__(UM_SI_FREE_QUEUE);

namespace um_si {

/* The return address of the exported function it is used in: where in
   which object file the call came from. */
#define UM_SI_CALLER reinterpret_cast<std::uintptr_t>(__builtin_return_address(0))

/* The two kinds of request, served or forward()ed to libsycl. */
template <class Forward>
static inline void* device_request(int entry, std::uintptr_t caller, size_t align, size_t size,
                                   const void* device, const void* context, int kind, Forward forward) {
    count_call(entry);
    int reason = precheck(caller, align, size, kind);
    if (reason == SERVE) {
        void* p = from_pool_for_device(device, context, kind, align, size, &reason);
        if (reason == SERVE) return p;
    }
    count_bypass(reason, size);
    return forward();
}

template <class Forward>
static inline void* queue_request(int entry, std::uintptr_t caller, size_t size, const void* queue, int kind,
                                  Forward forward) {
    count_call(entry);
    int reason = precheck(caller, 0, size, kind);
    if (reason == SERVE) {
        void* p = from_pool_for_queue(queue, kind, size, &reason);
        if (reason == SERVE) return p;
    }
    count_bypass(reason, size);
    return forward();
}

}  // namespace um_si

/* The property list is not looked at: dpnp passes an empty one, and a pool
   block has no SYCL properties to honour. */
void* um_si_aligned_alloc(size_t align, size_t size, const void* device, const void* context, int kind,
                          const void* properties, const void* location) {
    using namespace um_si;
    return device_request(ALIGNED_ALLOC, UM_SI_CALLER, align, size, device, context, kind, [&] {
        return reinterpret_cast<aligned_alloc_fn>(state()->real[ALIGNED_ALLOC])(
            align, size, device, context, kind, properties, location);
    });
}

void* um_si_aligned_alloc_device(size_t align, size_t size, const void* device, const void* context,
                                 const void* properties, const void* location) {
    using namespace um_si;
    return device_request(ALIGNED_ALLOC_DEVICE, UM_SI_CALLER, align, size, device, context, KIND_DEVICE, [&] {
        return reinterpret_cast<aligned_alloc_device_fn>(state()->real[ALIGNED_ALLOC_DEVICE])(
            align, size, device, context, properties, location);
    });
}

void* um_si_malloc_device_q(size_t size, const void* queue, const void* location) {
    using namespace um_si;
    return queue_request(MALLOC_DEVICE_Q, UM_SI_CALLER, size, queue, KIND_DEVICE, [&] {
        return reinterpret_cast<malloc_queue_fn>(state()->real[MALLOC_DEVICE_Q])(size, queue, location);
    });
}

void* um_si_malloc_shared_q(size_t size, const void* queue, const void* location) {
    using namespace um_si;
    return queue_request(MALLOC_SHARED_Q, UM_SI_CALLER, size, queue, KIND_SHARED, [&] {
        return reinterpret_cast<malloc_queue_fn>(state()->real[MALLOC_SHARED_Q])(size, queue, location);
    });
}

void* um_si_malloc_q(size_t size, const void* queue, int kind, const void* location) {
    using namespace um_si;
    return queue_request(MALLOC_Q, UM_SI_CALLER, size, queue, kind, [&] {
        return reinterpret_cast<malloc_queue_kind_fn>(state()->real[MALLOC_Q])(size, queue, kind, location);
    });
}

/* Frees are looked up whoever calls: a pool block may be freed from any
   object file bound to these definitions. `queue`: the queue the caller
   named, if any; `where`: the context or queue argument, for libsycl. */
static inline void um_si_free_request(int entry, void* ptr, const void* queue, const void* where,
                                      const void* location) {
    using namespace um_si;
    count_call(entry);
    if (give_back(ptr, queue)) return;
    state()->frees_bypassed.fetch_add(1, std::memory_order_relaxed);
    reinterpret_cast<free_fn>(state()->real[entry])(ptr, where, location);
}

void um_si_free_context(void* ptr, const void* context, const void* location) {
    um_si_free_request(um_si::FREE_CONTEXT, ptr, nullptr, context, location);
}

void um_si_free_queue(void* ptr, const void* queue, const void* location) {
    um_si_free_request(um_si::FREE_QUEUE, ptr, queue, queue, location);
}

/* ---- set-up, from Python --------------------------------------------------- */
static void* um_si_defined(int entry) {
    static void* const defined[um_si::N_ENTRIES] = {
        (void*)&um_si_aligned_alloc, (void*)&um_si_aligned_alloc_device, (void*)&um_si_malloc_device_q,
        (void*)&um_si_malloc_shared_q, (void*)&um_si_malloc_q, (void*)&um_si_free_context,
        (void*)&um_si_free_queue};
    return defined[entry];
}

static const char* um_si_mangled(int entry) { return um_si::MANGLED[entry]; }
static const char* um_si_entry_name(int entry) { return um_si::ENTRY_NAMES[entry]; }
static int um_si_n_entries() { return um_si::N_ENTRIES; }
static int um_si_n_reasons() { return um_si::N_REASONS; }

static void um_si_set_real(int entry, void* fn) { um_si::state()->real[entry] = fn; }

static void um_si_set_dpctl(void* device_eq, void* context_eq, void* queue_device, void* queue_context,
                            void* device_delete, void* context_delete) {
    um_si::DpctlApi& a = um_si::state()->dpctl;
    a.device_eq = reinterpret_cast<um_si::are_eq_fn>(device_eq);
    a.context_eq = reinterpret_cast<um_si::are_eq_fn>(context_eq);
    a.queue_device = reinterpret_cast<um_si::queue_get_fn>(queue_device);
    a.queue_context = reinterpret_cast<um_si::queue_get_fn>(queue_context);
    a.device_delete = reinterpret_cast<um_si::delete_fn>(device_delete);
    a.context_delete = reinterpret_cast<um_si::delete_fn>(context_delete);
}

static void um_si_set_callbacks(um_si::pool_malloc_fn m, um_si::pool_free_fn f, um_si::pool_find_fn p,
                                um_si::wait_fn w) {
    um_si::state()->cb = um_si::Callbacks{m, f, p, w};
}

/* -1: the table is full. */
static int um_si_add_device(const void* device, const void* context) {
    um_si::State* s = um_si::state();
    if (s->n_devices >= um_si::MAX_DEVICES) return -1;
    um_si::Device& d = s->devices[s->n_devices];
    d.device = device;
    d.context = context;
    for (int k = 0; k < um_si::N_KINDS; ++k) {
        d.pools[k] = nullptr;
        d.looked_up[k] = false;
    }
    return s->n_devices++;
}

/* A child of fork has only the forking thread: a lock another thread held
   at the fork would never be let go. */
static void um_si_after_fork_child() {
    um_si::State* s = um_si::state();
    new (&s->held_lock) std::mutex();
    new (&s->callers_lock) std::mutex();
}

/* 0, or -1 when the prefix is too long or there is no memory for the table. */
static int um_si_prepare(const char* served_prefix) {
    um_si::State* s = um_si::state();
    size_t n = std::strlen(served_prefix);
    if (n + 1 >= sizeof(s->served_prefix)) return -1;
    std::memcpy(s->served_prefix, served_prefix, n + 1);
    s->served_prefix_len = n;
    if (!s->held) {
        s->held = new (std::nothrow) std::unordered_map<std::uintptr_t, um_si::Held>();
        if (!s->held) return -1;
        if (pthread_atfork(nullptr, nullptr, um_si_after_fork_child) != 0) return -1;
    }
    return 0;
}

static void um_si_set_installed(bool on) { um_si::state()->installed.store(on, std::memory_order_release); }
static bool um_si_installed() { return um_si::state()->installed.load(std::memory_order_acquire); }

/* The loaded library whose file name starts with `prefix` (e.g. "libsycl.so"),
   as the loader names it, or nullptr. */
struct UmSiFindLibrary {
    const char* prefix;
    const char* found;
};

static int um_si_find_library_cb(struct dl_phdr_info* info, size_t, void* data) {
    UmSiFindLibrary* f = static_cast<UmSiFindLibrary*>(data);
    const char* name = info->dlpi_name;
    if (!name || !name[0]) return 0;
    const char* base = std::strrchr(name, '/');
    base = base ? base + 1 : name;
    if (std::strncmp(base, f->prefix, std::strlen(f->prefix)) == 0) {
        f->found = name;
        return 1;
    }
    return 0;
}

static const char* um_si_find_library(const char* prefix) {
    UmSiFindLibrary f = {prefix, nullptr};
    dl_iterate_phdr(um_si_find_library_cb, &f);
    return f.found;
}

/* Counters, by index (see the .pyx's counters()). */
static long long um_si_calls(int entry) { return um_si::state()->calls[entry].load(); }
static long long um_si_bypassed_calls(int reason) { return um_si::state()->bypassed_calls[reason].load(); }
static long long um_si_bypassed_bytes(int reason) { return um_si::state()->bypassed_bytes[reason].load(); }
static long long um_si_counter(int which) {
    um_si::State* s = um_si::state();
    switch (which) {
        case 0: return s->pooled_calls.load();
        case 1: return s->pooled_bytes.load();
        case 2: return s->refused_calls.load();
        case 3: return s->refused_bytes.load();
        case 4: return s->frees_after_wait.load();
        case 5: return s->frees_at_once.load();
        case 6: return s->frees_at_once_gil.load();
        case 7: return s->frees_bypassed.load();
        case 8: return s->live.load();
        default: return 0;
    }
}
