// An operator new that fails on request, for tests/test_allocation_failures.py.
//
// Preloaded (LD_PRELOAD) into a child interpreter, it replaces the C++
// allocation functions of every library there, pyengine's compiled core and
// the libstdc++ containers it instantiates among them; Python's own
// allocator is C (malloc) and is not affected. Between fail_new_arm(n) and
// fail_new_disarm(), it counts the calls, on every thread, and the n-th
// throws std::bad_alloc, as an allocation does where the address space
// runs out (n = 0: count only). See Note [C++ allocations that fail] in
// pyengine/_engine.pyx.

#include <atomic>
#include <cstdlib>
#include <new>

namespace {

std::atomic<bool> armed{false};
std::atomic<long> calls{0};
std::atomic<long> failing_call{0};

void *allocate(std::size_t size) {
    if (armed.load(std::memory_order_relaxed)) {
        long call = calls.fetch_add(1) + 1;
        if (call == failing_call.load()) {
            throw std::bad_alloc();
        }
    }
    void *memory = std::malloc(size != 0 ? size : 1);
    if (memory == nullptr) {
        throw std::bad_alloc();
    }
    return memory;
}

}  // namespace

extern "C" void fail_new_arm(long n) {
    calls = 0;
    failing_call = n;
    armed = true;
}

// Stops counting; returns how many calls were made since fail_new_arm.
extern "C" long fail_new_disarm() {
    armed = false;
    failing_call = 0;
    return calls.load();
}

void *operator new(std::size_t size) { return allocate(size); }
void *operator new[](std::size_t size) { return allocate(size); }
void operator delete(void *memory) noexcept { std::free(memory); }
void operator delete[](void *memory) noexcept { std::free(memory); }
void operator delete(void *memory, std::size_t) noexcept { std::free(memory); }
void operator delete[](void *memory, std::size_t) noexcept { std::free(memory); }
