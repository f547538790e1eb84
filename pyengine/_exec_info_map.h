// ExecInfoMap: a graph task's exec_info (which nodes run, and which capture
// gradients, under grad(inputs=) / backward(inputs=)), keyed by node pointer.
//
// The twin's GraphTask.exec_info is a dict from id(node) to an ExecInfo; here
// each node has a flat slot (open addressing with linear probing, as
// DependencyMap), so that init_to_execute allocates nothing per node and the
// engine's lookups touch no Python object: they are nogil. Entries are kept
// in the order they were made, the order of the twin's dict.
//
// The table holds the entries init_to_execute makes before its search (the
// outputs' and the root's). A node the search marks needed has its needed
// bit in the DependencyMap's slot instead, beside its count (See Note
// [Marking exec info in the dependency search] in
// pyengine/_pure/dependencies.py); here it is only listed, in order, after
// the table's entries, for exec_info's copy for Python.
//
// Guarded by the GIL: only init_to_execute writes it (under the GIL, before
// any task of the graph task runs); the engine reads it with the GIL held.
// Keys are borrowed: they are only compared.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "_address_hash.h"
#include "_table_growth.h"

struct pyengine_ExecInfo {
    PyObject *node = nullptr;
    // An index into the graph task's list of capture lists, or -1.
    int32_t captures = -1;
    bool needed = false;
};

class pyengine_ExecInfoMap {
  public:
    // No table until the first slot: most graph tasks never make one.
    pyengine_ExecInfoMap() : used_(0), moved_(0) {}

    // Whether the next new slot doubles the table: as DependencyMap's.
    bool full() const { return 2 * (used_ + 1) > slots_.size(); }

    // Give the table's memory back (the map is empty after): as
    // DependencyMap's.
    void release() {
        std::vector<pyengine_ExecInfo>().swap(slots_);
        std::vector<pyengine_ExecInfo>().swap(larger_);
        std::vector<PyObject *>().swap(order_);
        std::vector<PyObject *>().swap(marked_);
        used_ = 0;
        moved_ = 0;
    }

    // The bytes of the tables release() frees.
    size_t table_bytes() const {
        return (slots_.capacity() + larger_.capacity()) * sizeof(pyengine_ExecInfo) +
               (order_.capacity() + marked_.capacity()) * sizeof(PyObject *);
    }

    bool grow_step() {
        if (slots_.empty()) {
            slots_.resize(16);
            return true;
        }
        // A lambda, not a function pointer: it inlines into the loop.
        return pyengine_grow_step(slots_, larger_, moved_,
                                  [](std::vector<pyengine_ExecInfo> &slots,
                                     const pyengine_ExecInfo &slot) {
                                      slots[find_index(slots, slot.node)] = slot;
                                  });
    }

    // No entry at all: every node runs.
    bool empty() const { return order_.empty(); }

    // The entries: the table's, then the marked nodes without one.
    Py_ssize_t size() const { return static_cast<Py_ssize_t>(order_.size() + marked_.size()); }

    // The node of the i-th entry made, for 0 <= i < size().
    PyObject *entry_node(Py_ssize_t i) const {
        const size_t index = static_cast<size_t>(i);
        return index < order_.size() ? order_[index] : marked_[index - order_.size()];
    }

    // A node without an entry in the table, which the search marked needed.
    void record_marked(PyObject *node) { marked_.push_back(node); }

    // node's entry, or nullptr when it has none. Valid until the next call
    // of make_entry().
    const pyengine_ExecInfo *find(PyObject *node) const {
        if (slots_.empty()) {
            return nullptr;
        }
        const pyengine_ExecInfo &slot = slots_[find_index(slots_, node)];
        return slot.node != nullptr ? &slot : nullptr;
    }

    // ExecInfo.should_execute of node's entry (false without one).
    bool should_execute(PyObject *node) const {
        if (slots_.empty()) {
            return false;
        }
        const pyengine_ExecInfo &slot = slots_[find_index(slots_, node)];
        return slot.node != nullptr && (slot.needed || slot.captures >= 0);
    }

    // node's entry, made empty if absent. Valid until the next call.
    pyengine_ExecInfo &make_entry(PyObject *node) {
        if (full()) {
            while (!grow_step()) {
            }
        }
        pyengine_ExecInfo &entry = slots_[find_index(slots_, node)];
        if (entry.node == nullptr) {
            // First: where it throws (std::bad_alloc), the map is unchanged.
            order_.push_back(node);
            entry.node = node;
            ++used_;
        }
        return entry;
    }

  private:
    static size_t find_index(const std::vector<pyengine_ExecInfo> &slots, PyObject *node) {
        const size_t mask = slots.size() - 1;
        // See Note [Hashing an address by its page].
        size_t i = pyengine_address_hash(node, slots.size());
        while (slots[i].node != nullptr && slots[i].node != node) {
            i = (i + 1) & mask;
        }
        return i;
    }


    std::vector<pyengine_ExecInfo> slots_;  // empty, or a power of two in size
    size_t used_;
    // A doubling in progress: See pyengine_grow_step.
    std::vector<pyengine_ExecInfo> larger_;
    size_t moved_;
    std::vector<PyObject *> order_;
    std::vector<PyObject *> marked_;
};
