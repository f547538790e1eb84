// GradientFreeQueue: the ready nodes of a gradient-free graph, for the
// compiled engine's loop of Note [GradientFreeNode graphs] (pyengine/_engine.pyx).
//
// Beside _node_task.h, whose heap steps it uses, so that every heap of tasks
// in the compiled core is kept the same way (See Note [Ties in the ready
// queue] in pyengine/_pure/ready_queue.py).
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

#include "_node_task.h"

/* The ready nodes of a gradient-free graph: See Note [GradientFreeNode
   graphs]. Pops in the order of a ReadyQueue holding only this graph
   task's tasks (CompareNodeTaskTime at one reentrant depth: the higher
   sequence_nr first; gradient-free nodes never tie, so the insertion
   count only makes the order total, and Note [Ties in the ready queue]
   does not arise), and keeps the best task the last node made ready out
   of the heap: it usually runs next. */
class pyengine_GradientFreeQueue {
  public:
    /* node (an owned reference) is ready. */
    void push(PyObject *node, uint64_t sequence_nr) {
        Task task{node, sequence_nr, insertion_++};
        if (!has_next_) {
            next_ = task;
            has_next_ = true;
        } else if (runs_after(next_, task)) {
            push_heap(next_);
            next_ = task;
        } else {
            push_heap(task);
        }
    }

    /* The node to run next (an owned reference), or NULL when none is left. */
    PyObject *pop() {
        if (has_next_) {
            has_next_ = false;
            if (heap_.empty() || !runs_after(next_, heap_.front())) {
                return next_.node;
            }
            push_heap(next_);
        }
        if (heap_.empty()) {
            return nullptr;
        }
        pyengine::pop_heap(heap_.begin(), heap_.end(), runs_after);
        PyObject *node = heap_.back().node;
        heap_.pop_back();
        return node;
    }

  private:
    struct Task {
        PyObject *node;
        uint64_t sequence_nr;
        uint64_t insertion;
    };

    static bool runs_after(const Task &t1, const Task &t2) {
        if (t1.sequence_nr != t2.sequence_nr) {
            return t1.sequence_nr < t2.sequence_nr;
        }
        return t1.insertion > t2.insertion;
    }

    void push_heap(const Task &task) {
        heap_.push_back(task);
        pyengine::push_heap(heap_.begin(), heap_.end(), runs_after);
    }

    std::vector<Task> heap_;
    Task next_{nullptr, 0, 0};
    bool has_next_ = false;
    uint64_t insertion_ = 0;
};
