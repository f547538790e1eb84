// ExecInfoMap: a graph task's exec_info (which nodes run, and which capture
// gradients, under grad(inputs=) / backward(inputs=)), keyed by node pointer.
//
// The twin's GraphTask.exec_info is a dict from id(node) to an ExecInfo; here
// each node has a flat slot (open addressing with linear probing, as
// DependencyMap), so that init_to_execute allocates nothing per node and the
// engine's lookups touch no Python object: they are nogil. A slot also holds
// init_to_execute's "seen" bit (the twin's set of the same name), so that
// the traversal probes one table. Nodes with an entry (a key of the twin's
// dict) are kept in the order their entries were made, the order of the
// twin's dict.
//
// Guarded by the GIL: only init_to_execute writes it (under the GIL, before
// any task of the graph task runs); the engine reads it with the GIL held.
// Keys are borrowed: they are only compared.
#pragma once

#include <Python.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "_table_growth.h"

struct pyengine_ExecInfo {
    PyObject *node = nullptr;
    // An index into the graph task's list of capture lists, or -1.
    int32_t captures = -1;
    bool needed = false;
    // An entry of exec_info; a slot without one only records "seen".
    bool has_entry = false;
    bool seen = false;
};

class pyengine_ExecInfoMap {
  public:
    // No table until the first slot: most graph tasks never make one.
    pyengine_ExecInfoMap() : used_(0), moved_(0), traversed_(false) {}

    // Whether the next new slot doubles the table: as DependencyMap's.
    bool full() const { return 2 * (used_ + 1) > slots_.size(); }

    // Give the table's memory back (the map is empty after): as
    // DependencyMap's.
    void release() {
        std::vector<pyengine_ExecInfo>().swap(slots_);
        std::vector<pyengine_ExecInfo>().swap(larger_);
        std::vector<PyObject *>().swap(order_);
        used_ = 0;
        moved_ = 0;
        traversed_ = false;
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

    // One step of making room for `entries` slots, so that that many
    // inserts never grow the table: the caller calls it until it returns
    // true, letting other threads run between the calls, as grow_step's.
    // An empty table is zeroed at its final size in steps of
    // pyengine_TABLE_GROWTH_STEP; one with slots doubles in steps. See
    // Note [Sizing exec info up front] in pyengine/_pure/graph_task.py.
    bool reserve_step(size_t entries) {
        size_t wanted = 16;
        while (2 * (entries + 1) > wanted) {
            wanted *= 2;
        }
        if (slots_.size() >= wanted) {
            return true;
        }
        if (used_ != 0) {
            return grow_step() && slots_.size() >= wanted;
        }
        // Nothing to move: no table between the one we have and the last.
        if (larger_.capacity() < wanted) {
            larger_.reserve(wanted);  // address space only: pages are touched as zeroed
        }
        larger_.resize(std::min(wanted, larger_.size() + pyengine_TABLE_GROWTH_STEP));
        if (larger_.size() < wanted) {
            return false;
        }
        slots_.swap(larger_);
        std::vector<pyengine_ExecInfo>().swap(larger_);
        // At most one entry per node: order_ never grows either.
        order_.reserve(entries);
        return true;
    }

    // No entry at all: every node runs.
    bool empty() const { return order_.empty(); }

    Py_ssize_t size() const { return static_cast<Py_ssize_t>(order_.size()); }

    // The node of the i-th entry made, for 0 <= i < size().
    PyObject *entry_node(Py_ssize_t i) const { return order_[static_cast<size_t>(i)]; }

    // node's entry, or nullptr when it has none. Valid until the next call
    // of slot() or make_entry().
    const pyengine_ExecInfo *find(PyObject *node) const {
        if (slots_.empty()) {
            return nullptr;
        }
        const pyengine_ExecInfo &slot = slots_[find_index(slots_, node)];
        return slot.has_entry ? &slot : nullptr;
    }

    // ExecInfo.should_execute of node's entry (false without one).
    bool should_execute(PyObject *node) const {
        if (slots_.empty()) {
            return false;
        }
        const pyengine_ExecInfo &slot = slots_[find_index(slots_, node)];
        return slot.has_entry && (slot.needed || slot.captures >= 0);
    }

    // node's slot, made empty (no entry, not seen) if absent. Valid until
    // the next call of slot() or make_entry().
    pyengine_ExecInfo &slot(PyObject *node) {
        if (full()) {
            while (!grow_step()) {
            }
        }
        pyengine_ExecInfo &slot = slots_[find_index(slots_, node)];
        if (slot.node == nullptr) {
            slot.node = node;
            ++used_;
        }
        return slot;
    }

    // node's entry, made empty if absent. Valid as slot()'s.
    pyengine_ExecInfo &make_entry(PyObject *node) {
        pyengine_ExecInfo &entry = slot(node);
        if (!entry.has_entry) {
            entry.has_entry = true;
            order_.push_back(node);
        }
        return entry;
    }

    // Forget what a traversal has seen, before the next one. Only a table
    // that a traversal used has anything to forget: the first skips the
    // pass over every slot (at a million nodes, tens of megabytes).
    void clear_seen() {
        if (!traversed_) {
            traversed_ = true;
            return;
        }
        for (pyengine_ExecInfo &slot : slots_) {
            slot.seen = false;
        }
    }

  private:
    static size_t hash(PyObject *node) {
        // As DependencyMap's: see there why the address order is kept.
        return static_cast<size_t>(reinterpret_cast<uintptr_t>(node) >> 4);
    }

    static size_t find_index(const std::vector<pyengine_ExecInfo> &slots, PyObject *node) {
        const size_t mask = slots.size() - 1;
        size_t i = hash(node) & mask;
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
    // Whether clear_seen ran since the table was made: a traversal may
    // have set seen bits.
    bool traversed_;
};
