// The engine's per-thread state: one struct per thread, owned by
// pyengine/_state.pyx (pyengine/_state_variables.h holds the instance).
// Modules that cimport pyengine._state see only this type and reach the
// instance through _state's functions.
#pragma once

#include <Python.h>

struct pyengine_ThreadState {
    int grad_enabled;
    // False while a node of a pruning graph task (grad, inputs=) runs, and
    // in every backward nested below it.
    int checkpoint_valid;
    // Borrowed: the graph task whose node runs on this thread, or NULL.
    PyObject *current_graph_task;
    // Whether device work goes to device threads (else all on the caller).
    int multithreading_enabled;
    // Borrowed: the node the engine runs on this thread and the graph task
    // running it, or NULL. A query of a running node answers only while
    // the latter is current_graph_task: See Note [Queries a running node
    // makes] in pyengine/_shared/task_queries.py.
    PyObject *current_node;
    PyObject *current_node_graph_task;
    // Owned: this thread's WorkerState (pyengine/_engine.pyx), or NULL
    // until the thread's first backward. See Note [The worker state's
    // thread-local pointer] there.
    PyObject *worker_state;
};
