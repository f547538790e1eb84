// Where a node's address starts its probe in the tables keyed by address
// that keep the address order: the dependency map
// (pyengine/_dependency_map.h) and the exec-info map
// (pyengine/_exec_info_map.h).
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>

// Note [Hashing an address by its page]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Objects are 16-byte aligned, and nodes made one after the other lie
// close together in memory and run one after the other. A table that
// hashes a node to its address over 16 keeps their slots close, in cache,
// too: a scrambling hash made the 1M chain 1.7x slower
// (benchmarks/RESULTS.md, "Figures moved out of code comments").
//
// But the address order alone is not safe. Two objects collide when their
// addresses are a multiple of the table's span (16 bytes a slot) apart,
// and in a process whose heap is larger than that span, objects of one
// size lie in layers the span apart, one per region the allocator took
// them from. Where the layers are dense (the smallest objects: 32 bytes,
// a slot in two) two of them fill every slot of a stretch, and linear
// probing turns that into a run of taken slots that every later key in
// the stretch walks to its end. In the test suite's process, a million
// leaves made after a few hundred megabytes of other objects lay in 1.2
// GB, and the count of them probed about 140,000 slots a key where a new
// process probes none: an owner-graph search that takes 0.05 s took a
// minute (benchmarks/RESULTS.md, "Dense layers of small objects").
//
// So the hash keeps the order only inside a page: an address's slot within
// its block of PAGE_SLOTS slots (4 KiB of addresses, as of the table) is
// its address over 16, and the block lands where a Fibonacci hash of the
// page's number sends it (the top bits of its product with 2^64 over the
// golden ratio, as Note [The owner table hash] does for each address).
// Nodes made together still take slots together, one page of the table at
// a time; the layers of two pages of addresses meet only where their
// blocks do, as random keys would.
constexpr int pyengine_PAGE_SLOT_BITS = 8;
constexpr size_t pyengine_PAGE_SLOTS = size_t{1} << pyengine_PAGE_SLOT_BITS;

// node's first slot in a table of size slots (a power of two, 16 or more).
static inline size_t pyengine_address_hash(PyObject *node, size_t size) {
    const uint64_t address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(node)) >> 4;
    const size_t in_page = static_cast<size_t>(address) & (pyengine_PAGE_SLOTS - 1);
    const int bits = __builtin_ctzll(static_cast<unsigned long long>(size));
    if (bits <= pyengine_PAGE_SLOT_BITS) {
        // A table of one block or less: the order alone, wrapped.
        return static_cast<size_t>(address) & (size - 1);
    }
    const uint64_t page = address >> pyengine_PAGE_SLOT_BITS;
    const int block_bits = bits - pyengine_PAGE_SLOT_BITS;
    const size_t block = static_cast<size_t>((page * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - block_bits));
    return (block << pyengine_PAGE_SLOT_BITS) | in_page;
}
