/* The SYCL interposer's state and routing (unimem/_integrations/sycl_interposer.hpp
   defines the exported functions on top of it): the installed real
   functions, dpctl's C functions and the devices served; which callers and
   requests the pools serve, why the others are forwarded (counted by
   reason); and the calls into the pools through the callbacks Python set. */
#pragma once

#include <Python.h>
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <unordered_map>

namespace um_si {

/* ---- the functions interposed ----------------------------------------- */
enum Entry {
    ALIGNED_ALLOC,          /* aligned_alloc(align, size, device, context, usm::alloc, property_list, code_location) */
    ALIGNED_ALLOC_DEVICE,   /* aligned_alloc_device(align, size, device, context, property_list, code_location) */
    MALLOC_DEVICE_Q,        /* malloc_device(size, queue, code_location) */
    MALLOC_SHARED_Q,        /* malloc_shared(size, queue, code_location) */
    MALLOC_Q,               /* malloc(size, queue, usm::alloc, code_location) */
    FREE_CONTEXT,           /* free(ptr, context, code_location) */
    FREE_QUEUE,             /* free(ptr, queue, code_location) */
    N_ENTRIES
};

#define UM_SI_ALIGNED_ALLOC "_ZN4sycl3_V113aligned_allocEmmRKNS0_6deviceERKNS0_7contextENS0_3usm5allocERKNS0_13property_listERKNS0_6detail13code_locationE"
#define UM_SI_ALIGNED_ALLOC_DEVICE "_ZN4sycl3_V120aligned_alloc_deviceEmmRKNS0_6deviceERKNS0_7contextERKNS0_13property_listERKNS0_6detail13code_locationE"
#define UM_SI_MALLOC_DEVICE_Q "_ZN4sycl3_V113malloc_deviceEmRKNS0_5queueERKNS0_6detail13code_locationE"
#define UM_SI_MALLOC_SHARED_Q "_ZN4sycl3_V113malloc_sharedEmRKNS0_5queueERKNS0_6detail13code_locationE"
#define UM_SI_MALLOC_Q "_ZN4sycl3_V16mallocEmRKNS0_5queueENS0_3usm5allocERKNS0_6detail13code_locationE"
#define UM_SI_FREE_CONTEXT "_ZN4sycl3_V14freeEPvRKNS0_7contextERKNS0_6detail13code_locationE"
#define UM_SI_FREE_QUEUE "_ZN4sycl3_V14freeEPvRKNS0_5queueERKNS0_6detail13code_locationE"

static const char* const MANGLED[N_ENTRIES] = {
    UM_SI_ALIGNED_ALLOC, UM_SI_ALIGNED_ALLOC_DEVICE, UM_SI_MALLOC_DEVICE_Q, UM_SI_MALLOC_SHARED_Q,
    UM_SI_MALLOC_Q, UM_SI_FREE_CONTEXT, UM_SI_FREE_QUEUE};
static const char* const ENTRY_NAMES[N_ENTRIES] = {
    "aligned_alloc", "aligned_alloc_device", "malloc_device", "malloc_shared", "malloc", "free", "free_queue"};

typedef void* (*aligned_alloc_fn)(size_t, size_t, const void*, const void*, int, const void*, const void*);
typedef void* (*aligned_alloc_device_fn)(size_t, size_t, const void*, const void*, const void*, const void*);
typedef void* (*malloc_queue_fn)(size_t, const void*, const void*);
typedef void* (*malloc_queue_kind_fn)(size_t, const void*, int, const void*);
typedef void (*free_fn)(void*, const void*, const void*);

/* sycl::usm::alloc */
enum { KIND_HOST = 0, KIND_DEVICE = 1, KIND_SHARED = 2, N_KINDS = 3 };

/* Why a request went to libsycl: the order of REASONS in the .pyx. */
enum Reason {
    NOT_INSTALLED, UNIMEM_ITSELF, OTHER_LIBRARY, ZERO_SIZE, ALIGNMENT, OTHER_ARGUMENTS, NO_GIL,
    FOREIGN_CONTEXT, NO_POOL, POOL_ERROR, N_REASONS,
    SERVE = -1
};

/* The pool's blocks start at multiples of 512 bytes (usm_memory.POOL_ALIGNMENT). */
static const size_t POOL_ALIGNMENT = 512;

/* ---- what Python supplies --------------------------------------------- */
typedef bool (*are_eq_fn)(const void*, const void*);
typedef void* (*queue_get_fn)(const void*);
typedef void (*delete_fn)(void*);
/* The pool callbacks (Cython, unimem/_integrations/sycl_interposer.pyx). status: 0 served,
   1 out of memory, 2 another error (already reported). */
typedef std::uintptr_t (*pool_malloc_fn)(void* pool, size_t size, int* status);
typedef void (*pool_free_fn)(void* pool, std::uintptr_t ptr);
typedef void* (*pool_find_fn)(int device, int kind);
typedef void (*wait_fn)(int device, const void* queue);

struct DpctlApi {
    are_eq_fn device_eq, context_eq;
    queue_get_fn queue_device, queue_context;
    delete_fn device_delete, context_delete;
};

struct Callbacks {
    pool_malloc_fn malloc;
    pool_free_fn free;
    pool_find_fn find;
    wait_fn wait;
};

/* A device the pools serve: its sycl::device and the sycl::context of unimem's
   default queue for it (both kept alive by Python objects pinned forever). */
struct Device {
    const void* device;
    const void* context;
    void* pools[N_KINDS];        /* CachingAllocator*, pinned forever; read and filled with the GIL */
    bool looked_up[N_KINDS];
};

static const int MAX_DEVICES = 64;
/* Object files whose calls are told apart by address (dpnp's, oneMKL's, ...). */
static const int MAX_CALLERS = 256;

struct Caller {
    std::uintptr_t start, end;
    bool served;
};

/* A block handed out: its pool and its device, to wait for on a blocking free. */
struct Held {
    void* pool;
    int device;
};

struct State {
    std::atomic<bool> installed{false};
    void* real[N_ENTRIES];
    DpctlApi dpctl;
    Callbacks cb;
    Device devices[MAX_DEVICES];
    int n_devices;
    char served_prefix[PATH_MAX + 2];   /* realpath of dpnp's package folder, with a final '/' */
    size_t served_prefix_len;
    Caller callers[MAX_CALLERS];
    std::atomic<int> n_callers{0};
    std::mutex callers_lock;
    /* ptr -> Held, for every block handed out and not yet freed. Never
       destroyed: frees come from SYCL threads until the process ends. */
    std::unordered_map<std::uintptr_t, Held>* held;
    std::atomic<long long> live{0};
    std::mutex held_lock;
    /* counters */
    std::atomic<long long> calls[N_ENTRIES];
    std::atomic<long long> pooled_calls{0}, pooled_bytes{0};
    std::atomic<long long> refused_calls{0}, refused_bytes{0};
    std::atomic<long long> bypassed_calls[N_REASONS], bypassed_bytes[N_REASONS];
    std::atomic<long long> frees_after_wait{0}, frees_at_once{0}, frees_at_once_gil{0}, frees_bypassed{0};
};

static State* state() {
    /* Allocated once and never destroyed (no static destructor runs while
       SYCL's threads may still call in at exit). */
    static State* s = new State();
    return s;
}

/* Set while unimem itself allocates or frees on this thread: its backend
   goes through dpctl's C API, which may reach SYCL; those calls must get
   the real functions. */
static thread_local int in_unimem = 0;

struct InUnimem {
    InUnimem() { ++in_unimem; }
    ~InUnimem() { --in_unimem; }
};

/* Whether Python can run on this thread: the interpreter is up (not being
   finalized: PyGILState_Check answers 1 on any thread then) and this thread
   holds the GIL. */
static inline bool holds_gil() {
#if PY_VERSION_HEX >= 0x030D0000
    if (!Py_IsInitialized() || Py_IsFinalizing()) return false;
#else
    if (!Py_IsInitialized() || _Py_IsFinalizing()) return false;
#endif
    return PyGILState_Check() != 0;
}

/* ---- which object file called --------------------------------------- */
struct FindObject {
    std::uintptr_t address;
    std::uintptr_t start, end;
    const char* name;
    bool found;
};

static int find_object(struct dl_phdr_info* info, size_t, void* data) {
    FindObject* f = static_cast<FindObject*>(data);
    std::uintptr_t lo = UINTPTR_MAX, hi = 0;
    bool inside = false;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD) continue;
        std::uintptr_t a = info->dlpi_addr + ph.p_vaddr, b = a + ph.p_memsz;
        if (a < lo) lo = a;
        if (b > hi) hi = b;
        if (f->address >= a && f->address < b) inside = true;
    }
    if (!inside) return 0;
    f->start = lo;
    f->end = hi;
    f->name = info->dlpi_name;
    f->found = true;
    return 1;
}

/* Whether the code at `address` (a return address) belongs to dpnp's
   package: only its extensions' requests are served. oneMKL's SYCL libraries
   are loaded after the interposer too and so also bind to it, but their
   allocations are theirs to manage (some are cached for the process's life).
   Object files are looked up once (dl_iterate_phdr, under the loader's lock)
   and remembered by address range; Python never unloads an extension. */
static bool caller_is_served(std::uintptr_t address) {
    State* s = state();
    int n = s->n_callers.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
        const Caller& c = s->callers[i];
        if (address >= c.start && address < c.end) return c.served;
    }
    FindObject f = {address, 0, 0, nullptr, false};
    dl_iterate_phdr(find_object, &f);
    if (!f.found) return false;
    bool served = false;
    if (f.name && f.name[0]) {
        char resolved[PATH_MAX];
        if (realpath(f.name, resolved))
            served = std::strncmp(resolved, s->served_prefix, s->served_prefix_len) == 0;
    }
    std::lock_guard<std::mutex> guard(s->callers_lock);
    n = s->n_callers.load(std::memory_order_relaxed);
    for (int i = 0; i < n; ++i)
        if (s->callers[i].start == f.start) return s->callers[i].served;
    if (n < MAX_CALLERS) {
        s->callers[n] = Caller{f.start, f.end, served};
        s->n_callers.store(n + 1, std::memory_order_release);
    }
    return served;
}

/* ---- serving ------------------------------------------------------------ */
static inline void count_bypass(int reason, size_t size) {
    State* s = state();
    s->bypassed_calls[reason].fetch_add(1, std::memory_order_relaxed);
    s->bypassed_bytes[reason].fetch_add((long long)size, std::memory_order_relaxed);
}

/* The checks that need no device: SERVE or why not. */
static inline int precheck(std::uintptr_t caller, size_t align, size_t size, int kind) {
    State* s = state();
    if (!s->installed.load(std::memory_order_acquire)) return NOT_INSTALLED;
    if (in_unimem) return UNIMEM_ITSELF;
    if (!caller_is_served(caller)) return OTHER_LIBRARY;
    if (size == 0) return ZERO_SIZE;
    if (align > POOL_ALIGNMENT || (align & (align - 1)) != 0) return ALIGNMENT;
    if (kind < 0 || kind >= N_KINDS) return OTHER_ARGUMENTS;
    /* c_malloc may run Python on its slow path (a backend miss, the
       out-of-memory retry, history hooks). */
    if (!holds_gil()) return NO_GIL;
    return SERVE;
}

static int find_device(const void* device, const void* context, int kind) {
    State* s = state();
    for (int i = 0; i < s->n_devices; ++i) {
        const Device& d = s->devices[i];
        if (!s->dpctl.context_eq(context, d.context)) continue;
        /* host USM belongs to the context, whatever device is named */
        if (kind == KIND_HOST || s->dpctl.device_eq(device, d.device)) return i;
    }
    return -1;
}

/* Calls into Python code keep whatever error the caller had pending (a
   C++ frame called from Python may run with one set) and leave none. */
struct KeepPythonError {
    PyObject *type, *value, *traceback;
    KeepPythonError() { PyErr_Fetch(&type, &value, &traceback); }
    ~KeepPythonError() { PyErr_Restore(type, value, traceback); }
};

/* A block from device d's pool of `kind` (the GIL is held): the pointer,
   nullptr with *reason SERVE when the pool is out of memory (what SYCL's
   functions return then), or nullptr with the reason to forward. */
static void* from_pool(int d, int kind, size_t align, size_t size, int* reason) {
    State* s = state();
    Device& dev = s->devices[d];
    if (!dev.looked_up[kind]) {
        KeepPythonError keep;
        InUnimem in;
        dev.pools[kind] = s->cb.find(d, kind);
        dev.looked_up[kind] = true;
    }
    void* pool = dev.pools[kind];
    if (!pool) {
        *reason = NO_POOL;
        return nullptr;
    }
    int status;
    std::uintptr_t p;
    {
        KeepPythonError keep;
        InUnimem in;
        p = s->cb.malloc(pool, size, &status);
    }
    if (status == 1) {
        s->refused_calls.fetch_add(1, std::memory_order_relaxed);
        s->refused_bytes.fetch_add((long long)size, std::memory_order_relaxed);
        *reason = SERVE;
        return nullptr;
    }
    if (status != 0 || p == 0 || (align && p % align)) {
        if (p) {
            InUnimem in;
            s->cb.free(pool, p);
        }
        *reason = POOL_ERROR;
        return nullptr;
    }
    try {
        std::lock_guard<std::mutex> guard(s->held_lock);
        s->held->emplace(p, Held{pool, d});
        s->live.fetch_add(1, std::memory_order_release);
    } catch (...) {                 /* no host memory for the table entry */
        InUnimem in;
        s->cb.free(pool, p);
        *reason = POOL_ERROR;
        return nullptr;
    }
    s->pooled_calls.fetch_add(1, std::memory_order_relaxed);
    s->pooled_bytes.fetch_add((long long)size, std::memory_order_relaxed);
    *reason = SERVE;
    return reinterpret_cast<void*>(p);
}

/* The queue overloads: the queue's device and context, through dpctl. */
static void* from_pool_for_queue(const void* queue, int kind, size_t size, int* reason) {
    State* s = state();
    void* device = s->dpctl.queue_device(queue);
    void* context = s->dpctl.queue_context(queue);
    int d = (device && context) ? find_device(device, context, kind) : -1;
    if (device) s->dpctl.device_delete(device);
    if (context) s->dpctl.context_delete(context);
    if (d < 0) {
        *reason = FOREIGN_CONTEXT;
        return nullptr;
    }
    return from_pool(d, kind, 0, size, reason);
}

static void* from_pool_for_device(const void* device, const void* context, int kind, size_t align,
                                  size_t size, int* reason) {
    int d = find_device(device, context, kind);
    if (d < 0) {
        *reason = FOREIGN_CONTEXT;
        return nullptr;
    }
    return from_pool(d, kind, align, size, reason);
}

/* ---- freeing ------------------------------------------------------------ */
/* Whether this thread is running Python code: the C++ frame freeing was
   called from Python (a dpnp function's error path, or a synchronous
   free after a wait), not from a SYCL host task that took the GIL to drop
   Python references. */
static inline bool python_frame_on_this_thread() {
    return PyEval_GetFrame() != nullptr;
}

/* Returns true when `ptr` was a pool block (now given back). `queue`: the
   queue the caller named (free(ptr, queue)), or nullptr.

   A block may only go back to the pool when no kernel can still use it:
   - on a thread without the GIL (a SYCL host task: dpctl's async_smart_free
     runs after the kernels it depends on) it goes back at once;
   - on a thread running Python code the free may follow a kernel submission
     at once (an error path), where the real sycl::free would block until
     the kernels using the memory are done (the OpenCL backend frees with
     clMemBlockingFreeINTEL): the device's queues are waited for first,
     without the GIL (the wait callback), then the block goes back. */
static bool give_back(void* ptr, const void* queue) {
    State* s = state();
    if (ptr == nullptr || s->live.load(std::memory_order_acquire) == 0) return false;
    Held h;
    {
        std::lock_guard<std::mutex> guard(s->held_lock);
        auto it = s->held->find(reinterpret_cast<std::uintptr_t>(ptr));
        if (it == s->held->end()) return false;
        h = it->second;
        s->held->erase(it);
        s->live.fetch_sub(1, std::memory_order_relaxed);
    }
    InUnimem in;
    if (holds_gil()) {
        if (python_frame_on_this_thread()) {
            KeepPythonError keep;
            s->cb.wait(h.device, queue);
            s->frees_after_wait.fetch_add(1, std::memory_order_relaxed);
        } else {
            s->frees_at_once_gil.fetch_add(1, std::memory_order_relaxed);
        }
        KeepPythonError keep;
        s->cb.free(h.pool, reinterpret_cast<std::uintptr_t>(ptr));
    } else {
        s->frees_at_once.fetch_add(1, std::memory_order_relaxed);
        s->cb.free(h.pool, reinterpret_cast<std::uintptr_t>(ptr));
    }
    return true;
}

static inline void count_call(int entry) {
    state()->calls[entry].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace um_si
