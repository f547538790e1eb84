// A hint to the memory system for the passes that follow a node's only
// next edge: the count and the search of pyengine/_dependencies.pyx.
#pragma once
#include <Python.h>
#include <cstddef>
#include <cstdint>

// Note [Prefetching along a chain's stride]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The count learns a node's address only from the node before it, so on a
// graph out of the caches each step waits for the load of the step before:
// at a million nodes the count costs several times what it does on a graph
// the caches hold (benchmarks/RESULTS.md, "Issue 19: the count's cold
// walk, and a prefetch along the stride").
//
// Nodes a forward made one after the other are blocks of one size that
// the allocator gave out in address order, so the step from a node to its
// only next node is most often the step the next ones take too. The count
// therefore asks the memory system, at each such step, for the node the
// same step would reach PREFETCH_AHEAD nodes further on: the line of its
// reference count and the line of the fields the count reads (given as an
// offset). Nothing is ever read from that address: a prefetch neither
// faults nor changes what the count does, so a wrong guess (a graph built
// in another order, an address no object lies at) costs a line of memory
// traffic and nothing else. The arithmetic is on integers, not pointers,
// so no guess is undefined behaviour.
//
// The twin has no counterpart: a hint to the hardware is not a path of the
// engine, as the DependencyMap's memory is not (Note [Generations of a
// DependencyMap] in _dependency_map.h).
constexpr uintptr_t pyengine_PREFETCH_AHEAD = 8;

static inline void pyengine_prefetch_along_stride(PyObject *node, PyObject *next_node,
                                                  size_t fields_offset) {
    const uintptr_t here = reinterpret_cast<uintptr_t>(next_node);
    const uintptr_t step = here - reinterpret_cast<uintptr_t>(node);  // modulo 2^64
    const uintptr_t guess = here + pyengine_PREFETCH_AHEAD * step;
    // For writing: the count takes a reference to each node it reaches.
    __builtin_prefetch(reinterpret_cast<const void *>(guess), 1, 3);
    __builtin_prefetch(reinterpret_cast<const void *>(guess + fields_offset), 0, 3);
}
