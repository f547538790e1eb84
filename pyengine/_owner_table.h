// OwnerTable: for each owner a returns-mode owner-graph walk reached, its
// state in the walk's search, its slot count and its InputBuffer
// (pyengine/_owner_graph.pyx).
//
// The compiled twin of the walk's three dicts keyed by id(owner), the
// search's ``seen`` and the walk's ``slots`` and ``buffers``
// (pyengine/_pure/owner_graph.py): keyed by the owner's address instead, so
// that a lookup makes no int and calls no Python hash, and one table for the
// three, so that the search probes once per edge. The addresses stay unique because
// the walk holds a reference to every owner it reached (its ``held`` list)
// until it returns. Open addressing with linear probing, as
// pyengine/_dependency_map.h, but with its own hash: See Note [The owner
// table hash]. Entries are never removed (a buffer taken leaves its
// owner's entry, with no buffer).
//
// The table owns the buffers and gradients it holds: its destructor releases those left
// (an error in the walk), so it must be destroyed with the GIL held. Its
// memory comes from, and goes back to, the tables its thread keeps: See
// Note [Tables kept between backward calls] in pyengine/_table_growth.h.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "_table_growth.h"

// Note [The owner table hash]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The dependency map hashes a node by its address shifted by 4, so that
// nodes made one after the other take slots one after the other (See its
// hash in pyengine/_dependency_map.h). Owners are a framework's objects,
// made among its other objects: autograd's 48-byte VJPNodes come every
// 192 bytes of their pymalloc pool (the forward makes four objects of that
// size per operation), so the shifted addresses of a pool's owners share
// their two lowest bits, and pools that lie a multiple of the table's span
// (16 bytes per slot) apart fall on the same quarter of the same slots.
// How many do depends on where the process's allocator put the pools, so
// the probes per lookup, and the backward's time, changed from process to
// process (benchmarks/RESULTS.md, "autograd's chain depends on the
// process" and the section after it). Keeping the address order inside a
// span and moving each span by a hash of its place (xor or addition) does
// not help: the owners of two spans that land on the same slots then
// collide all together, and micrograd's graphs, whose values lie densely,
// took runs of hundreds of probes in some processes. So the table hashes
// the whole shifted address multiplicatively (Fibonacci hashing: the top
// bits of its product with 2^64 over the golden ratio), which spreads
// every layout tried; what it gives up is the address order, with which a
// table larger than the caches is read in order. Returns mode pays that on
// graphs of hundreds of thousands of owners, where each owner's own
// backward costs more; writes mode, whose owners' methods cost least, keeps
// its search states in the dependency map (See enter_owner in
// pyengine/_owner_graph.pyx).

// An owner's state in the walk's search (the twin's ``seen``).
enum pyengine_OwnerState : int {
    pyengine_NOT_SEEN = 0,
    pyengine_ON_PATH = 1,
    pyengine_FINISHED = 2,
};

struct pyengine_OwnerEntry {
    PyObject *node = nullptr;    // the owner, borrowed (the walk holds it)
    int slots = 0;               // its slot count (count_slots returns an int)
    int state = pyengine_NOT_SEEN;
    PyObject *buffer = nullptr;  // owned: its InputBuffer, NULL before the first gradient
    // owned: a one-slot owner's only gradient so far, held without an
    // InputBuffer (the twin's one-item tuple in ``buffers``); NULL otherwise.
    PyObject *gradient = nullptr;
};

static_assert(sizeof(pyengine_OwnerEntry) == 32, "an entry is four words");

// The largest owner table a thread keeps: See Note [Tables kept between
// backward calls] in pyengine/_table_growth.h.
constexpr size_t pyengine_KEPT_OWNER_TABLE_BYTES = size_t{8} << 20;

using pyengine_KeptOwnerTables =
    pyengine_KeptTables<pyengine_OwnerEntry, pyengine_KEPT_OWNER_TABLE_BYTES>;

class pyengine_OwnerTable {
  public:
    // Never throws: a walk constructs its table as the function starts,
    // where a C++ exception would end the process. Without the memory the
    // table starts empty, and reserve or grow_step makes one, or throws.
    // See Note [C++ allocations that fail] in pyengine/_engine.pyx.
    pyengine_OwnerTable() noexcept : used_(0), moved_(0) {
        try {
            slots_.assign(16, pyengine_OwnerEntry());
        } catch (const std::bad_alloc &) {
        }
    }

    pyengine_OwnerTable(const pyengine_OwnerTable &) = delete;
    pyengine_OwnerTable &operator=(const pyengine_OwnerTable &) = delete;

    // Releases the buffers and gradients left (an error in the walk), then
    // gives the table's memory to this thread's kept tables, which the
    // table must be destroyed on (See Note [Tables kept between backward
    // calls]).
    ~pyengine_OwnerTable() {
        release();
        pyengine_KeptOwnerTables &kept = pyengine_KeptOwnerTables::of_this_thread();
        kept.give(slots_);
        kept.give(larger_);
    }

    // On a new table: room for count entries without a doubling, but no
    // more than pyengine_TABLE_GROWTH_STEP slots, so that zeroing them
    // stays a fraction of a millisecond (pyengine/_table_growth.h). The
    // memory is a kept table's where one is large enough.
    void reserve(size_t count) {
        if (used_ != 0) {
            return;
        }
        size_t size = slots_.empty() ? 16 : slots_.size();
        while (2 * (count + 1) > size && size < pyengine_TABLE_GROWTH_STEP) {
            size *= 2;
        }
        if (size != slots_.size()) {
            pyengine_KeptOwnerTables &kept = pyengine_KeptOwnerTables::of_this_thread();
            std::vector<pyengine_OwnerEntry> table = kept.take(size);
            table.resize(size);  // zeroes only the slots used
            slots_.swap(table);
            kept.give(table);
        }
    }

    // Whether the next new entry doubles the table: the search calls
    // grow_step until it returns true, letting other threads run between
    // the calls (pyengine/_table_growth.h).
    bool full() const { return 2 * (used_ + 1) > slots_.size(); }

    bool grow_step() {
        return pyengine_grow_step(slots_, larger_, moved_,
                                  [](std::vector<pyengine_OwnerEntry> &slots,
                                     const pyengine_OwnerEntry &entry) {
                                      find_slot(slots, entry.node) = entry;
                                  },
                                  &pyengine_KeptOwnerTables::of_this_thread());
    }

    // owner's entry, made (not seen, no slots) where the walk had not
    // reached it; *index: its index in the table (a hint for at). The
    // caller made room first (full, grow_step). Invalidates entries.
    pyengine_OwnerEntry *add(PyObject *owner, size_t *index) {
        pyengine_OwnerEntry &entry = find_slot(slots_, owner);
        if (entry.node == nullptr) {
            entry.node = owner;
            ++used_;
        }
        *index = static_cast<size_t>(&entry - slots_.data());
        return &entry;
    }

    // owner's entry (in the table), found at index when the table has not
    // grown since add gave that index, else probed for again.
    pyengine_OwnerEntry *at(PyObject *owner, size_t index) {
        pyengine_OwnerEntry *entry = &slots_[index & (slots_.size() - 1)];
        return entry->node == owner ? entry : &find_slot(slots_, owner);
    }

    // owner's entry, or NULL where the walk did not reach it. Valid until
    // the next add.
    pyengine_OwnerEntry *find(PyObject *owner) {
        pyengine_OwnerEntry &entry = find_slot(slots_, owner);
        return entry.node == nullptr ? nullptr : &entry;
    }

  private:
    void release() {
        // Only slots_ owns buffers: a doubling in progress copied entries
        // into larger_, and buffers are set only once the search (the only
        // one to add entries) is over. Each reference leaves its entry
        // before its release, which may run Python code.
        for (pyengine_OwnerEntry &entry : slots_) {
            PyObject *buffer = entry.buffer;
            PyObject *gradient = entry.gradient;
            entry.buffer = nullptr;
            entry.gradient = nullptr;
            Py_XDECREF(buffer);
            Py_XDECREF(gradient);
        }
    }

    // See Note [The owner table hash].
    static size_t hash(PyObject *node, size_t size) {
        const uint64_t address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(node)) >> 4;
        const int bits = __builtin_ctzll(static_cast<unsigned long long>(size));
        // bits >= 4: a table has 16 slots or more.
        return static_cast<size_t>((address * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - bits));
    }

    static pyengine_OwnerEntry &find_slot(std::vector<pyengine_OwnerEntry> &slots,
                                          PyObject *node) {
        const size_t mask = slots.size() - 1;
        size_t i = hash(node, slots.size()) & mask;
        while (slots[i].node != nullptr && slots[i].node != node) {
            i = (i + 1) & mask;
        }
        return slots[i];
    }

    std::vector<pyengine_OwnerEntry> slots_;  // a power of two in size
    size_t used_;
    // A doubling in progress: See pyengine_grow_step.
    std::vector<pyengine_OwnerEntry> larger_;
    size_t moved_;
};


// OwnerItems: the parent items of every owner a returns-mode walk reached,
// in the search's post-order (an owner's index in its order), in one array:
// the compiled twin of the twin's ``items_of``, a tuple per owner. Owns a
// reference to each item (released by its destructor, with the GIL held).
class pyengine_OwnerItems {
  public:
    // Never throws, as OwnerTable's: without the memory, start_ stays empty
    // until the first append_owner.
    pyengine_OwnerItems() noexcept {
        try {
            start_.assign(1, 0);
        } catch (const std::bad_alloc &) {
        }
    }

    pyengine_OwnerItems(const pyengine_OwnerItems &) = delete;
    pyengine_OwnerItems &operator=(const pyengine_OwnerItems &) = delete;

    ~pyengine_OwnerItems() {
        for (PyObject *item : items_) {
            Py_DECREF(item);
        }
    }

    // The next owner's items: count references move in from first. Throws
    // (std::bad_alloc) before any moved.
    void append_owner(PyObject *const *first, size_t count) {
        if (start_.empty()) {
            start_.assign(1, 0);
        }
        make_room(items_, count);
        make_room(start_, 1);
        items_.insert(items_.end(), first, first + count);
        start_.push_back(items_.size());
    }

    size_t owners() const { return start_.empty() ? 0 : start_.size() - 1; }

    // Borrowed: owner index's items, valid until the next append_owner.
    PyObject **of(size_t index) { return items_.data() + start_[index]; }
    Py_ssize_t count(size_t index) const {
        return static_cast<Py_ssize_t>(start_[index + 1] - start_[index]);
    }

  private:
    // Room for count more, doubling (reserve alone would allocate exactly,
    // and copy the whole array at every owner).
    template <typename T>
    static void make_room(std::vector<T> &vector, size_t count) {
        if (vector.size() + count > vector.capacity()) {
            vector.reserve(std::max(2 * vector.capacity(), vector.size() + count));
        }
    }

    std::vector<PyObject *> items_;
    std::vector<size_t> start_;  // owner i's items are items_[start_[i]:start_[i + 1]]
};
