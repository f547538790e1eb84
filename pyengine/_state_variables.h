// The variables behind pyengine/_state.pyx, included by that module only:
// C, because Cython cannot declare a thread_local variable.
#pragma once

#include "_thread_state.h"

// One per thread, as PyTorch's thread-local grad mode and graph task.
static thread_local pyengine_ThreadState pyengine_thread_state = {1, 1, NULL, 1, NULL, NULL, NULL};
// Global; written under the GIL, read per node.
static int pyengine_anomaly_enabled = 0;
static int pyengine_anomaly_check_nan = 1;
// Owned; NULL when no profiler listens. Written under the GIL.
static PyObject *pyengine_profiler = NULL;
