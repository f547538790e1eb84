// GILGuardedLock: mutual exclusion for code that holds the GIL both when it
// locks and when it unlocks: the GraphTask's mutex_. See Note [A lock the
// GIL guards].
//
// Note [A lock the GIL guards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every node's routing takes its graph task's lock (See Note [Accumulating
// under the graph task lock] in pyengine/_engine.pyx). A std::mutex costs
// two atomic read-modify-write instructions for that (the try_lock and the
// unlock), tens of cycles each here whatever the caches hold, on every
// node, although the lock is almost never contended: the threads that
// route into one graph task hold the GIL while they do, so they only
// meet when a holder gives the GIL away in the middle (a large numpy add
// does; so may a framework's add).
//
// So the lock's state is two plain fields that only a thread holding the
// GIL reads or writes: whether it is held, and how many threads wait for
// it. The GIL's own acquire and release order those accesses between
// threads. Locking a free lock is a load and a store; unlocking one that
// nobody waits for, a store and a load. A thread that finds it held counts
// itself a waiter and waits without the GIL on a condition variable until
// an unlock that saw it waiting has counted one more wake-up (wakeups_,
// written under both the GIL and wake_mutex_, so that a wake-up between
// its giving the GIL away and its wait is not lost); it then takes the GIL
// again and looks again. An unlock with no waiter touches neither the
// mutex nor the condition variable.
//
// Where the interpreter has no GIL (a free-threaded build), nothing guards
// the fields, so the lock is a std::mutex taken as before (try it; if it
// is held, wait for it without holding the thread state).
//
// The twin's graph task lock is a threading.Lock: a data structure's
// cost, not a path of the engine, so this has no counterpart there.
#pragma once

#include <Python.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>

class pyengine_GILGuardedLock {
  public:
    // With the GIL held (the calling thread's thread state attached).
    void lock() {
#ifdef Py_GIL_DISABLED
        if (!fallback_.try_lock()) {
            PyThreadState *saved = PyEval_SaveThread();
            fallback_.lock();
            PyEval_RestoreThread(saved);
        }
#else
        if (!held_) {
            held_ = true;
            return;
        }
        wait_until_free();
#endif
    }

    // With the GIL held, by the thread that locked.
    void unlock() {
#ifdef Py_GIL_DISABLED
        fallback_.unlock();
#else
        held_ = false;
        if (waiters_ != 0) {
            {
                std::lock_guard<std::mutex> guard(wake_mutex_);
                ++wakeups_;
            }
            woken_.notify_all();
        }
#endif
    }

  private:
#ifdef Py_GIL_DISABLED
    std::mutex fallback_;
#else
    // Out of line: only a contended lock comes here.
    __attribute__((noinline)) void wait_until_free() {
        ++waiters_;
        while (held_) {
            const uint64_t seen = wakeups_;
            PyThreadState *saved = PyEval_SaveThread();
            {
                std::unique_lock<std::mutex> guard(wake_mutex_);
                woken_.wait(guard, [this, seen] { return wakeups_ != seen; });
            }
            PyEval_RestoreThread(saved);
        }
        --waiters_;
        held_ = true;
    }

    bool held_ = false;     // read and written with the GIL held
    size_t waiters_ = 0;    // read and written with the GIL held
    uint64_t wakeups_ = 0;  // written with the GIL and wake_mutex_ held
    std::mutex wake_mutex_;
    std::condition_variable woken_;
#endif
};
