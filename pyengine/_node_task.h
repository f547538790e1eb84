// NodeTaskRecord and CompareNodeTaskTime: what a ReadyQueue holds, and its order.
//
// In C++ rather than Cython so that std::push_heap and std::pop_heap inline
// the comparator, as PyTorch's engine does with its CompareNodeTaskTime.
#pragma once

#include <Python.h>

#include <cstdint>

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
    // Insertion order: first in, first out among equals.
    uint64_t insertion;
};

// True when t1 runs after t2: the comparator of a max-heap. See Note [Ready
// queue order] in pyengine/_pure/ready_queue.py: shutdown tasks first, then
// empty wake-up tasks, then higher reentrant depth, then higher sequence_nr,
// then first in. A strict weak order; with distinct insertion counters, a
// total one, so both cores pop in exactly the same order.
struct pyengine_CompareNodeTaskTime {
    bool operator()(const pyengine_NodeTaskRecord &t1,
                    const pyengine_NodeTaskRecord &t2) const {
        if (t2.is_shutdown) {
            return !t1.is_shutdown || t2.insertion < t1.insertion;
        }
        if (t1.is_shutdown) {
            return false;
        }
        if (t1.node == nullptr) {
            return t2.node == nullptr && t2.insertion < t1.insertion;
        }
        if (t2.node == nullptr) {
            return true;
        }
        if (t1.reentrant_depth != t2.reentrant_depth) {
            return t1.reentrant_depth < t2.reentrant_depth;
        }
        if (t1.sequence_nr != t2.sequence_nr) {
            return t1.sequence_nr < t2.sequence_nr;
        }
        return t1.insertion > t2.insertion;
    }
};
