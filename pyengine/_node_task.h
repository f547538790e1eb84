// NodeTaskRecord, CompareNodeTaskTime and the heap algorithms of a ReadyQueue:
// what it holds, and the order it pops them in.
//
// In C++ rather than Cython so that the heap algorithms inline the
// comparator, as PyTorch's engine does with its CompareNodeTaskTime.
#pragma once

#include <Python.h>

#include <cstdint>
#include <iterator>
#include <new>
#include <vector>

struct pyengine_NodeTaskRecord {
    // Owned references (NULL where absent), handed over with the record.
    PyObject *graph_task;
    PyObject *node;
    // The node's gradients: the list its InputBuffer summed.
    PyObject *inputs;
    // Copied in when the task is made, so that ordering never touches a node.
    uint64_t sequence_nr;
    int reentrant_depth;
    int is_shutdown;
};

// True when t1 runs after t2: the comparator of a max-heap, exactly PyTorch's
// CompareNodeTaskTime (engine.cpp). See Note [Ready queue order] in
// pyengine/_pure/ready_queue.py: shutdown tasks first, then empty wake-up
// tasks, then higher reentrant depth, then higher sequence_nr. It has no
// tiebreak, on purpose: See Note [Ties in the ready queue].
struct pyengine_CompareNodeTaskTime {
    bool operator()(const pyengine_NodeTaskRecord &t1,
                    const pyengine_NodeTaskRecord &t2) const {
        if (t2.is_shutdown) {
            return true;
        }
        if (t1.node == nullptr || t1.is_shutdown) {
            return false;
        }
        if (t2.node == nullptr) {
            return true;
        }
        if (t1.reentrant_depth == t2.reentrant_depth) {
            return t1.sequence_nr < t2.sequence_nr;
        }
        return t1.reentrant_depth < t2.reentrant_depth;
    }
};

// The binary-heap algorithms of libstdc++ (bits/stl_heap.h: __push_heap,
// __adjust_heap, pop_heap, __make_heap), step for step, comparisons in the
// same order and with the same arguments. PyTorch's ReadyQueue is a
// std::priority_queue, and its Linux wheels are built against libstdc++, so
// these decide the order in which tasks that tie in CompareNodeTaskTime pop,
// and with it the order of leaf hooks; the std:: ones would differ where the
// standard library does (libc++ pops with Floyd's method). See Note [Ties in
// the ready queue] in pyengine/_pure/ready_queue.py, whose ReadyQueue runs
// the same steps. Header-only and templated, so that they inline and
// allocate nothing; calls between them are qualified, so that
// argument-dependent lookup never brings in a standard library's own.
namespace pyengine {

// libstdc++'s __push_heap: the hole at `hole` moves up, towards `top`, while
// its parent runs after `value`; `value` then fills it.
template <typename RandomAccessIterator, typename Distance, typename T, typename Compare>
inline void push_heap_hole(RandomAccessIterator first, Distance hole, Distance top, T value,
                           Compare comp) {
    Distance parent = (hole - 1) / 2;
    while (hole > top && comp(*(first + parent), value)) {
        *(first + hole) = *(first + parent);
        hole = parent;
        parent = (hole - 1) / 2;
    }
    *(first + hole) = value;
}

// libstdc++'s __adjust_heap: the hole at `hole` walks down to a leaf, always
// to the child that runs first (the right one unless it runs after the left),
// then `value` goes in as by push_heap_hole, no higher than where the hole
// started.
template <typename RandomAccessIterator, typename Distance, typename T, typename Compare>
inline void adjust_heap(RandomAccessIterator first, Distance hole, Distance len, T value,
                        Compare comp) {
    const Distance top = hole;
    Distance second_child = hole;
    while (second_child < (len - 1) / 2) {
        second_child = 2 * (second_child + 1);
        if (comp(*(first + second_child), *(first + (second_child - 1)))) {
            second_child--;
        }
        *(first + hole) = *(first + second_child);
        hole = second_child;
    }
    // An even length leaves one parent with a left child only.
    if ((len & 1) == 0 && second_child == (len - 2) / 2) {
        second_child = 2 * (second_child + 1);
        *(first + hole) = *(first + (second_child - 1));
        hole = second_child - 1;
    }
    pyengine::push_heap_hole(first, hole, top, value, comp);
}

// std::push_heap: [first, last - 1) is a heap; add *(last - 1) to it.
template <typename RandomAccessIterator, typename Compare>
inline void push_heap(RandomAccessIterator first, RandomAccessIterator last, Compare comp) {
    typedef typename std::iterator_traits<RandomAccessIterator>::difference_type Distance;
    pyengine::push_heap_hole(first, Distance((last - first) - 1), Distance(0), *(last - 1), comp);
}

// std::pop_heap: move the front of the heap [first, last) to last - 1, and
// make [first, last - 1) a heap again.
template <typename RandomAccessIterator, typename Compare>
inline void pop_heap(RandomAccessIterator first, RandomAccessIterator last, Compare comp) {
    typedef typename std::iterator_traits<RandomAccessIterator>::difference_type Distance;
    if (last - first > 1) {
        --last;
        auto value = *last;
        *last = *first;
        pyengine::adjust_heap(first, Distance(0), Distance(last - first), value, comp);
    }
}

// std::make_heap (libstdc++'s __make_heap): sift each parent down, the last
// one first.
template <typename RandomAccessIterator, typename Compare>
inline void make_heap(RandomAccessIterator first, RandomAccessIterator last, Compare comp) {
    typedef typename std::iterator_traits<RandomAccessIterator>::difference_type Distance;
    const Distance len = last - first;
    if (len < 2) {
        return;
    }
    for (Distance parent = (len - 2) / 2;; parent--) {
        pyengine::adjust_heap(first, parent, len, *(first + parent), comp);
        if (parent == 0) {
            return;
        }
    }
}

// A ReadyQueue's push and pop, with CompareNodeTaskTime: they touch no
// Python object, so they run with or without the GIL (the records'
// references are taken and released by the callers, with the GIL); the
// caller holds the queue's mutex. Inline, so that a push or pop costs no
// call and copies no record more than the heap algorithms do.
typedef std::vector<pyengine_NodeTaskRecord> NodeTaskHeap;

// False, the heap unchanged, where it could not grow (std::bad_alloc): See
// Note [C++ allocations that fail] in pyengine/_engine.pyx.
inline bool heap_push(NodeTaskHeap &heap, const pyengine_NodeTaskRecord &record) noexcept {
    try {
        heap.push_back(record);
    } catch (const std::bad_alloc &) {
        return false;
    }
    pyengine::push_heap(heap.begin(), heap.end(), pyengine_CompareNodeTaskTime());
    return true;
}

// The next task of a ready queue: its heap's front, but where a flag stands
// for a task its heap could not take (See Note [C++ allocations that fail]
// in pyengine/_engine.pyx), that task in its place, as CompareNodeTaskTime
// would order it: a shutdown (`shutdown_pending`) first, a wake-up
// (`woken`) after any shutdown. The caller holds the queue's mutex, and
// the heap or a flag holds a task.
inline pyengine_NodeTaskRecord pop_next(NodeTaskHeap &heap, int &woken, int &shutdown_pending) noexcept;

// Remove and return the front of a non-empty heap.
inline pyengine_NodeTaskRecord heap_pop(NodeTaskHeap &heap) noexcept {
    pyengine::pop_heap(heap.begin(), heap.end(), pyengine_CompareNodeTaskTime());
    pyengine_NodeTaskRecord record = heap.back();
    heap.pop_back();
    return record;
}

inline pyengine_NodeTaskRecord pop_next(NodeTaskHeap &heap, int &woken, int &shutdown_pending) noexcept {
    if (shutdown_pending) {
        shutdown_pending = 0;
        pyengine_NodeTaskRecord shutdown{};
        shutdown.is_shutdown = 1;
        return shutdown;
    }
    if (woken && (heap.empty() || !heap.front().is_shutdown)) {
        woken = 0;
        return pyengine_NodeTaskRecord{};  // a wake-up: no graph task, node or inputs
    }
    return heap_pop(heap);
}

}  // namespace pyengine
