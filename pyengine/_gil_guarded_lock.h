// GILGuardedLock: mutual exclusion for code that holds the GIL both when it
// locks and when it unlocks: the GraphTask's mutex_, and a leaf's GradLock
// (See Note [The lock of a leaf's .grad] in pyengine/_pure/node.py). See
// Note [A lock the GIL guards].
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
// So the lock's state is plain fields that only a thread holding the GIL
// reads or writes: whether it is held, by which thread, and how many
// threads wait for it. The GIL's own acquire and release order those
// accesses between threads. Locking a free lock is a load and two stores
// (and a call for the thread state); unlocking one that nobody waits for,
// a store and a load. A thread that finds it held counts
// itself a waiter and waits without the GIL on a condition variable until
// an unlock that saw it waiting has counted one more wake-up (wakeups_,
// written under both the GIL and wake_mutex_, so that a wake-up between
// its giving the GIL away and its wait is not lost); it then takes the GIL
// again and looks again. An unlock with no waiter touches neither the
// mutex nor the condition variable.
//
// Python code may run under the lock (a backend's add, the __del__ of a
// gradient the buffer replaces: See Note [Accumulating under the graph
// task lock] in pyengine/_engine.pyx), so two things a plain mutex does
// wrong are done here:
// - a thread that asks for the lock while it holds it would wait for
//   itself forever: lock() returns TAKEN_AGAIN instead (the lock knows its
//   holder's thread state), and the caller raises RuntimeError;
// - a thread that waits for another's hold waits in slices of
//   WAIT_SLICE_MS, and between slices runs pending signal handlers
//   (PyErr_CheckSignals, a no-op but on the main thread): lock() returns
//   INTERRUPTED with their exception set (KeyboardInterrupt), so Ctrl-C
//   does not wait for the holder (See Note [Waits honour signals] in
//   pyengine/_locks.pxd). Slices only cost a contended lock, which is rare.
//
// Where the interpreter has no GIL (a free-threaded build), nothing guards
// the fields, so the lock is a std::timed_mutex, tried first and else
// waited for in the same slices without the thread state; its holder is
// an atomic field.
//
// The twin's graph task lock and GradLock are threading.RLocks asked their
// owner (refuse_lock_taken_again in pyengine/_pure/graph_task.py, and
// GradLock in pyengine/_pure/node.py): the same two answers,
// since a threading lock's wait runs signal handlers; held_, waiters_ and
// the wake-ups are this data structure's own, with no counterpart there.
#pragma once

#include <Python.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>

class pyengine_GILGuardedLock {
  public:
    enum Result { LOCKED = 0, TAKEN_AGAIN = 1, INTERRUPTED = -1 };

    // With the GIL held (the calling thread's thread state attached).
    // LOCKED, or TAKEN_AGAIN (this thread holds it: nothing changed), or
    // INTERRUPTED (a signal handler raised while it waited: its exception
    // is set, the lock is not held).
    Result lock() {
        PyThreadState *self = PyThreadState_Get();
#ifdef Py_GIL_DISABLED
        if (holder_.load(std::memory_order_relaxed) == self) {
            return TAKEN_AGAIN;
        }
        if (!fallback_.try_lock()) {
            for (;;) {
                PyThreadState *saved = PyEval_SaveThread();
                const bool locked = fallback_.try_lock_for(std::chrono::milliseconds(WAIT_SLICE_MS));
                PyEval_RestoreThread(saved);
                if (locked) {
                    break;
                }
                if (PyErr_CheckSignals() < 0) {
                    return INTERRUPTED;
                }
            }
        }
        holder_.store(self, std::memory_order_relaxed);
        return LOCKED;
#else
        if (!held_) {
            held_ = true;
            holder_ = self;
            return LOCKED;
        }
        if (holder_ == self) {
            return TAKEN_AGAIN;
        }
        return wait_until_free(self);
#endif
    }

    // With the GIL held: take the lock where it is free; never waits. False
    // where any thread holds it, this one included.
    bool try_lock() {
        PyThreadState *self = PyThreadState_Get();
#ifdef Py_GIL_DISABLED
        if (holder_.load(std::memory_order_relaxed) == self || !fallback_.try_lock()) {
            return false;
        }
        holder_.store(self, std::memory_order_relaxed);
        return true;
#else
        if (held_) {
            return false;
        }
        held_ = true;
        holder_ = self;
        return true;
#endif
    }

    // With the GIL held: whether the thread of `tstate` holds the lock (a
    // caller that lets Python code unlock checks this first).
    bool held_by(PyThreadState *tstate) const {
#ifdef Py_GIL_DISABLED
        return holder_.load(std::memory_order_relaxed) == tstate;
#else
        return held_ && holder_ == tstate;
#endif
    }

    // With the GIL held, by the thread that locked.
    void unlock() {
#ifdef Py_GIL_DISABLED
        holder_.store(nullptr, std::memory_order_relaxed);
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
    // As WAIT_SLICE_MS in pyengine/_locks.pxd.
    static constexpr int WAIT_SLICE_MS = 20;

#ifdef Py_GIL_DISABLED
    std::timed_mutex fallback_;
    std::atomic<PyThreadState *> holder_{nullptr};
#else
    // Out of line: only a contended lock comes here.
    __attribute__((noinline)) Result wait_until_free(PyThreadState *self) {
        ++waiters_;
        while (held_) {
            const uint64_t seen = wakeups_;
            PyThreadState *saved = PyEval_SaveThread();
            {
                std::unique_lock<std::mutex> guard(wake_mutex_);
                woken_.wait_for(guard, std::chrono::milliseconds(WAIT_SLICE_MS),
                                [this, seen] { return wakeups_ != seen; });
            }
            PyEval_RestoreThread(saved);
            if (held_ && PyErr_CheckSignals() < 0) {
                --waiters_;
                return INTERRUPTED;
            }
        }
        --waiters_;
        held_ = true;
        holder_ = self;
        return LOCKED;
    }

    bool held_ = false;                // read and written with the GIL held
    PyThreadState *holder_ = nullptr;  // valid while held_; with the GIL held
    size_t waiters_ = 0;               // read and written with the GIL held
    uint64_t wakeups_ = 0;             // written with the GIL and wake_mutex_ held
    std::mutex wake_mutex_;
    std::condition_variable woken_;
#endif
};
