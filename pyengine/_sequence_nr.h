// The next sequence number a node made on this thread gets, included by
// pyengine/_node.pyx only: C, because Cython cannot declare a thread_local
// variable. Per thread, as PyTorch's at::sequence_number.
#pragma once

#include <cstdint>

static thread_local uint64_t pyengine_next_sequence_nr = 0;
