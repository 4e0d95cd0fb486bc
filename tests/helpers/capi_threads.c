/* A C user of unimem's C ABI, built by tests/front/test_capi.py with the
 * system's cc against unimem.h and linked to unimem's library: pthreads
 * that allocate and free from the cpu pool, each writing its own pattern
 * into every block and reading it back (two threads handed one block at
 * once would see each other's bytes). Loaded with ctypes. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "unimem.h"

#define MAX_THREADS 64

struct work {
    int index;
    int pairs;
    size_t size;
    long failures;      /* a NULL from malloc */
    long corruptions;   /* a block whose pattern changed while this thread held it */
};

static pthread_t threads[MAX_THREADS];
static struct work works[MAX_THREADS];
static int started = 0;
static atomic_int finished;

static void* body(void* argument) {
    struct work* w = (struct work*)argument;
    unsigned char mark = (unsigned char)(w->index + 1);
    for (int i = 0; i < w->pairs; ++i) {
        volatile unsigned char* p = (volatile unsigned char*)unimem_cpu_malloc(w->size, 0, NULL);
        if (p == NULL) {
            ++w->failures;
            continue;
        }
        p[0] = mark;
        p[w->size / 2] = mark;
        p[w->size - 1] = mark;
        if (p[0] != mark || p[w->size / 2] != mark || p[w->size - 1] != mark)
            ++w->corruptions;
        unimem_cpu_free((void*)p, w->size, 0, NULL);
    }
    atomic_fetch_add(&finished, 1);
    return NULL;
}

/* What went wrong in the threads of the last start(). */
long failures(void) {
    long n = 0;
    for (int i = 0; i < started; ++i)
        n += works[i].failures;
    return n;
}

long corruptions(void) {
    long n = 0;
    for (int i = 0; i < started; ++i)
        n += works[i].corruptions;
    return n;
}

/* Start `n` threads doing `pairs` malloc/free pairs of `size` bytes each. */
int start(int n, int pairs, size_t size) {
    if (n < 1 || n > MAX_THREADS || size == 0)
        return -1;
    atomic_store(&finished, 0);
    started = 0;
    for (int i = 0; i < n; ++i) {
        works[i] = (struct work){i, pairs, size, 0, 0};
        if (pthread_create(&threads[i], NULL, body, &works[i]) != 0)
            return -1;
        ++started;
    }
    return 0;
}

/* Wait up to `timeout_ms` for the started threads to finish, joining them:
 * 0 once they all finished, 1 when time ran out (the threads go on: call
 * again). Waiting needs no GIL: a caller may hold it throughout. */
int wait_for(int timeout_ms) {
    struct timespec pause = {0, 1000000};   /* 1 ms */
    for (int waited = 0; atomic_load(&finished) < started; ++waited) {
        if (waited >= timeout_ms)
            return 1;
        nanosleep(&pause, NULL);
    }
    for (int i = 0; i < started; ++i)
        pthread_join(threads[i], NULL);
    return 0;
}

/* start() and wait_for(), as one call: 0, or -1 when the threads could not
 * be started. failures() and corruptions() say what went wrong. */
int run(int n, int pairs, size_t size) {
    if (start(n, pairs, size) != 0)
        return -1;
    return wait_for(600000) == 0 ? 0 : -1;
}

int header_abi_version(void) { return UNIMEM_ABI_VERSION; }
int library_abi_version(void) { return unimem_abi_version(); }
const char* last_error(void) { return unimem_last_error(); }
