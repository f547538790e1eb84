/* Python allocations that fail on request, for tests/test_pymem_failures.py.
 *
 * Built as a shared library and loaded with ctypes.PyDLL (the GIL held
 * through each call) into a child interpreter. fail_pymem_install() wraps
 * the PYMEM_DOMAIN_MEM and PYMEM_DOMAIN_OBJ allocators in place (public
 * API: PyMem_GetAllocator, PyMem_SetAllocator; tracemalloc hooks them the
 * same way at run time): every call goes on to the allocator found there,
 * so memory allocated before the hook is freed and reallocated as before.
 * PYMEM_DOMAIN_RAW (allocations made without the GIL) is left alone.
 *
 * Between fail_pymem_arm(n, every_thread) and fail_pymem_disarm(), the
 * malloc, calloc and realloc calls of the two domains are counted, and the
 * n-th returns NULL (n = 0: count only), as an allocation does where the
 * address space runs out: CPython then raises MemoryError. Which calls
 * count: every_thread 0, those of the thread that armed it alone (a
 * thread-local flag), so that the thread that runs the backward fails and
 * no other thread of the interpreter does; every_thread 1, those of every
 * thread, for the engine's device and pool threads. Both domains' calls
 * are made with the GIL held, which orders them; the counters are atomic
 * all the same. free is never counted. See Note [Python allocations that fail]
 * in pyengine/_engine.pyx.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdatomic.h>

static PyMemAllocatorEx original_mem;
static PyMemAllocatorEx original_obj;
static int installed = 0;

static _Thread_local int armed_here = 0;
static atomic_int armed_everywhere = 0;
static atomic_long calls = 0;
static atomic_long failing_call = 0;

/* Whether this call is the one to fail; counts it where counting is on. */
static int fails_now(void) {
    if (!armed_here && !atomic_load_explicit(&armed_everywhere, memory_order_relaxed)) {
        return 0;
    }
    long call = atomic_fetch_add(&calls, 1) + 1;
    return call == atomic_load(&failing_call);
}

static void *hook_malloc(void *ctx, size_t size) {
    PyMemAllocatorEx *original = (PyMemAllocatorEx *)ctx;
    if (fails_now()) {
        return NULL;
    }
    return original->malloc(original->ctx, size);
}

static void *hook_calloc(void *ctx, size_t nelem, size_t elsize) {
    PyMemAllocatorEx *original = (PyMemAllocatorEx *)ctx;
    if (fails_now()) {
        return NULL;
    }
    return original->calloc(original->ctx, nelem, elsize);
}

static void *hook_realloc(void *ctx, void *ptr, size_t new_size) {
    PyMemAllocatorEx *original = (PyMemAllocatorEx *)ctx;
    if (fails_now()) {
        return NULL;  /* ptr stays valid, as realloc's contract says */
    }
    return original->realloc(original->ctx, ptr, new_size);
}

static void hook_free(void *ctx, void *ptr) {
    PyMemAllocatorEx *original = (PyMemAllocatorEx *)ctx;
    original->free(original->ctx, ptr);
}

/* Wraps the two domains' allocators; once per process. Call it with the
 * GIL held (ctypes.PyDLL). */
void fail_pymem_install(void) {
    if (installed) {
        return;
    }
    PyMem_GetAllocator(PYMEM_DOMAIN_MEM, &original_mem);
    PyMem_GetAllocator(PYMEM_DOMAIN_OBJ, &original_obj);
    PyMemAllocatorEx hook_mem = {&original_mem, hook_malloc, hook_calloc, hook_realloc, hook_free};
    PyMemAllocatorEx hook_obj = {&original_obj, hook_malloc, hook_calloc, hook_realloc, hook_free};
    PyMem_SetAllocator(PYMEM_DOMAIN_MEM, &hook_mem);
    PyMem_SetAllocator(PYMEM_DOMAIN_OBJ, &hook_obj);
    installed = 1;
}

void fail_pymem_arm(long n, int every_thread) {
    atomic_store(&calls, 0);
    atomic_store(&failing_call, n);
    if (every_thread) {
        atomic_store(&armed_everywhere, 1);
    } else {
        armed_here = 1;
    }
}

/* Stops counting; returns how many calls were counted since
 * fail_pymem_arm. Call it on the thread that armed. */
long fail_pymem_disarm(void) {
    armed_here = 0;
    atomic_store(&armed_everywhere, 0);
    atomic_store(&failing_call, 0);
    return atomic_load(&calls);
}
