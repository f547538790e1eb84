// DependencyMap: for each node of a graph task, the number of edges into it
// whose gradients have not arrived yet.
//
// Open addressing with linear probing, keyed by node pointer: no allocation
// per node (std::unordered_map allocates and frees one list node per entry,
// about a fifth of the engine's per-node cost), one probe sequence per
// lookup. Entries are never removed: a count that reached zero stays, and a
// further arrival is reported as "not found", as PyTorch reports a node that
// left its map. The table doubles when half full.
//
// Beside its count, each slot holds the node's state in the depth-first
// search of compute_dependencies (not seen, on the search's path, finished):
// a cycle is an edge to a node on the path. See Note [Cycles in the
// backward graph] in pyengine/_pure/dependencies.py. The state takes two bits of
// the count's word, so a slot stays 16 bytes. Under init_to_execute, one
// more bit of the word marks the node needed (it runs: an edge leads to a
// node that runs or captures), set as the search finishes the node. See
// Note [Marking exec info in the dependency search] in
// pyengine/_pure/dependencies.py.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "_address_hash.h"
#include "_table_growth.h"

struct pyengine_DependencySlot {
    PyObject *node = nullptr;
    uint64_t word = 0;  // See pyengine_DependencyMap's constants
};
static_assert(sizeof(pyengine_DependencySlot) == 16, "a slot is a pointer and a word");

// Note [Generations of a DependencyMap]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A map that starts at 16 slots doubles its way up to the graph's size:
// at a hundred thousand nodes, fourteen doublings that zero twice the
// final table and move its entries again, the larger part of the count's
// instructions (benchmarks/RESULTS.md, "Why 2.0x is not reached"). Sizing
// the table from the last graph instead would zero a table of the last
// graph's size for every small graph after a large one.
//
// So a slot says which use of its table wrote it: the top bits of its word
// hold a generation, and a slot of another generation is empty. A graph
// task's count starts on the thread's largest kept table as it was left
// (use_kept_table), in the generation after the last one that table saw:
// no slot is zeroed and, up to the size of the largest graph this thread
// counted recently, no doubling is made. Starting again (reset) is a new
// generation too. A table carries its last generation with it (the
// thread's kept tables keep it beside the table, pyengine/_table_growth.h),
// so it does not matter which thread or module gives it back. When its
// generations run out (2^24 uses), the next map does not start on it: it
// is kept emptied, and a doubling that takes it zeroes it a step at a time
// as for any table (no pass zeroes 32 MB at once). A zeroed slot is of
// generation 0, which no use is.
//
// Entries are never removed, so probing stops at the first empty slot
// whatever its generation, as at a zeroed one. The twin counts in a dict
// made for each graph task (pyengine/_pure/graph_task.py), which has no
// table to keep: a data structure's memory, not a path of the engine, so
// this has no counterpart there.
//
// Note [A node keeps its slot's index]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The count finds each node's slot (add_edge gives its index) and the run
// looks the node up again to deliver its gradients (remove), a probe
// sequence of its own: with nodes 160 bytes or more apart, the addresses
// of a page wrap its block of the table several times (Note [Hashing an
// address by its page]), and a lookup takes two or three probes.
// So the count writes the index it got into the node
// (NodeBase._dependency_slot_, beside the fields it reads), and remove and
// needed look at that slot first. The index is only a hint, never
// trusted: the slot is taken only if it holds the node in this map's
// generation, else the lookup probes as before. So it is right whatever
// the field holds: a graph task that counted the node in another map
// since, a table that grew after the index was written, an index cut to
// 32 bits. The field is C only; no Python code reaches it. Counts and
// runs read and write it with the GIL held (without a GIL, a 4-byte field
// read while another count writes it holds one value or the other, and
// either is only a hint).
//
// The twin counts in a dict, which has no slots: like the generations
// above, this is the memory of one data structure, not a path of the
// engine, and has no counterpart there.
class pyengine_DependencyMap {
  public:
    // Never throws: a GraphTask constructs its map as CPython allocates the
    // object, where a C++ exception would end the process. Without the
    // memory the map starts with no table, and the count's first call
    // (use_kept_table) makes one, or raises MemoryError. See Note [C++
    // allocations that fail] in pyengine/_engine.pyx.
    pyengine_DependencyMap() noexcept : used_(0), moved_(0), generation_(1) {
        try {
            slots_.assign(16, Slot());
        } catch (const std::bad_alloc &) {
        }
    }

    // Count on the thread's largest kept table instead of the map's first
    // 16 slots, when it is larger: See Note [Generations of a DependencyMap].
    // Only on a map with no entries. Makes the map's first table where the
    // constructor had no memory for it (throws std::bad_alloc).
    void use_kept_table() {
        if (used_ != 0 || !larger_.empty()) {
            return;
        }
        Kept &kept = Kept::of_this_thread();
        uint32_t last_generation = 0;
        std::vector<Slot> table = kept.take_largest(slots_.size(), &last_generation);
        if (table.empty()) {
            make_first_table();
            return;
        }
        if (last_generation == LAST_GENERATION || (table.size() & (table.size() - 1)) != 0) {
            // Its generations ran out (or it was given back in the middle
            // of a doubling, not a power of two in size): kept emptied,
            // for a doubling to take, which zeroes a step at a time.
            table.clear();
            kept.give(table);
            make_first_table();
            return;
        }
        slots_.swap(table);
        generation_ = last_generation + 1;
        used_ = 0;
    }

    // Whether the next new entry doubles the table: a pass that must not
    // hold the GIL that long calls grow_step until it returns true, letting
    // other threads run between the calls (pyengine/_table_growth.h).
    bool full() const { return 2 * (used_ + 1) > slots_.size(); }

    bool grow_step() {
        const uint64_t generation = generation_bits();
        // A lambda, not a function pointer: it inlines into the loop.
        return pyengine_grow_step(
            slots_, larger_, moved_,
            [generation](std::vector<Slot> &slots, const Slot &slot) {
                if (is_live(slot, generation)) {
                    find_slot(slots, slot.node, generation) = slot;
                }
            },
            &Kept::of_this_thread(), generation_);
    }

    // Forget every entry: the map as new, on the same table in the next
    // generation, or on a new table when the generations ran out (or the
    // map was released). A doubling in progress is given up.
    void reset() {
        Kept &kept = Kept::of_this_thread();
        if (!larger_.empty()) {
            kept.give(larger_, generation_);
            moved_ = 0;
        }
        if (generation_ == LAST_GENERATION || slots_.size() < 16) {
            slots_.clear();
            kept.give(slots_);
            slots_.assign(16, Slot());
            generation_ = 1;
        } else {
            ++generation_;
        }
        used_ = 0;
    }

    // Give the table's memory back: the map may then only be reset or
    // destroyed. Touches no
    // Python object: at millions of nodes, unmapping the table takes
    // milliseconds, which GraphTask spends without the GIL.
    void release() {
        // See Note [Tables kept between backward calls] in _table_growth.h.
        Kept &kept = Kept::of_this_thread();
        kept.give(slots_, generation_);
        kept.give(larger_, generation_);
        used_ = 0;
        moved_ = 0;
    }

    // The bytes of the tables release() gives back.
    size_t table_bytes() const {
        return (slots_.capacity() + larger_.capacity()) * sizeof(Slot);
    }

    // The number of nodes with a slot: those the last count reached.
    size_t size() const { return used_; }

    // The generation of the map's entries (for tests/dependency_map_check.cpp).
    uint32_t generation() const { return generation_; }

    // One edge into node delivered: 1 when that was its last, 0 when more are
    // due, -1 when node has no dependencies outstanding. hint: where the
    // count put node, looked at first (See Note [A node keeps its slot's
    // index]).
    int remove(PyObject *node, size_t hint) {
        const uint64_t generation = generation_bits();
        Slot &slot = slot_at(node, hint);
        if (!is_live(slot, generation) || (slot.word & COUNT_MASK) < ONE_EDGE) {
            return -1;
        }
        slot.word -= ONE_EDGE;
        return (slot.word & COUNT_MASK) < ONE_EDGE ? 1 : 0;
    }

    // A node's state in a depth-first search.
    enum State { NOT_SEEN = 0, ON_PATH = 1, FINISHED = 2 };

    // The search starts at root: it is on the path, with no edge into it.
    // Returns its slot's index (a hint for finish).
    size_t enter(PyObject *root) {
        Slot &slot = insert(root);
        if (state_of(slot) == NOT_SEEN) {
            slot.word |= ON_PATH;
        }
        return &slot - slots_.data();
    }

    // One more edge into node, found by the search: returns node's state
    // before it, and puts a node not seen yet on the path. *index: its
    // slot's index (a hint for finish). One probe sequence.
    State add_edge(PyObject *node, size_t *index) {
        Slot &slot = insert(node);
        State before = state_of(slot);
        slot.word += before == NOT_SEEN ? ONE_EDGE + ON_PATH : ONE_EDGE;
        *index = &slot - slots_.data();
        return before;
    }

    // The search below node (in the map, on the path) is done. index: where
    // its slot was when it joined the path; probed again only when the
    // table grew since.
    void finish(PyObject *node, size_t index) {
        Slot &slot = slot_at(node, index);
        slot.word = (slot.word & ~STATE_MASK) | FINISHED;
    }

    // Mark node (in the map) needed; index: a hint, as finish's.
    void mark_needed(PyObject *node, size_t index) { slot_at(node, index).word |= NEEDED; }

    // Whether node is in the map and marked needed; hint: as remove's.
    bool needed(PyObject *node, size_t hint) const {
        if (slots_.empty()) {  // never counted, and made without memory
            return false;
        }
        const uint64_t generation = generation_bits();
        const Slot &slot = slot_at(node, hint);
        return is_live(slot, generation) && (slot.word & NEEDED) != 0;
    }

    // Whether the node at slot index (as add_edge gave it, the table not
    // grown since) is marked needed.
    bool needed_at(size_t index) const { return (slots_[index].word & NEEDED) != 0; }

  private:
    using Slot = pyengine_DependencySlot;
    using Kept = pyengine_KeptTables<Slot>;

    // A slot's word holds, from the top: the generation that wrote it (24
    // bits), the count (37 bits: an edge is a pointer in a next_edges
    // tuple, so 2^37 of them into one node would take a terabyte), the
    // needed bit and two bits of search state.
    static constexpr int GENERATION_SHIFT = 40;
    static constexpr uint32_t LAST_GENERATION = (uint32_t{1} << 24) - 1;
    static constexpr uint64_t STATE_MASK = 3;
    static constexpr uint64_t NEEDED = 4;
    static constexpr uint64_t ONE_EDGE = 8;
    static constexpr uint64_t COUNT_MASK = (uint64_t{1} << GENERATION_SHIFT) - ONE_EDGE;

    uint64_t generation_bits() const { return uint64_t{generation_} << GENERATION_SHIFT; }

    // Whether slot holds an entry of the generation whose bits are given.
    static bool is_live(const Slot &slot, uint64_t generation) {
        return (slot.word >> GENERATION_SHIFT << GENERATION_SHIFT) == generation;
    }

    static State state_of(const Slot &slot) {
        return static_cast<State>(slot.word & STATE_MASK);
    }

    // node's slot, made with a count of 0 when node was not in the map.
    Slot &insert(PyObject *node) {
        if (full()) {
            grow();
        }
        const uint64_t generation = generation_bits();
        Slot &slot = find_slot(slots_, node, generation);
        if (!is_live(slot, generation)) {
            slot.node = node;
            slot.word = generation;
            ++used_;
        }
        return slot;
    }

    // node's slot, or the empty slot where it would go.
    static size_t find_index(const std::vector<Slot> &slots, PyObject *node, uint64_t generation) {
        const size_t mask = slots.size() - 1;
        // See Note [Hashing an address by its page].
        size_t i = pyengine_address_hash(node, slots.size());
        while (slots[i].node != node && is_live(slots[i], generation)) {
            i = (i + 1) & mask;
        }
        return i;
    }

    static Slot &find_slot(std::vector<Slot> &slots, PyObject *node, uint64_t generation) {
        return slots[find_index(slots, node, generation)];
    }

    static const Slot &find_slot(const std::vector<Slot> &slots, PyObject *node,
                                 uint64_t generation) {
        return slots[find_index(slots, node, generation)];
    }

    // node's slot, looked for first at index (any value: only a slot
    // that holds node in this generation is taken there); else found by
    // probing, or the empty slot where node would go.
    Slot &slot_at(PyObject *node, size_t index) {
        const uint64_t generation = generation_bits();
        Slot *slot = &slots_[index & (slots_.size() - 1)];
        return slot->node == node && is_live(*slot, generation)
                   ? *slot
                   : find_slot(slots_, node, generation);
    }

    const Slot &slot_at(PyObject *node, size_t index) const {
        return const_cast<pyengine_DependencyMap *>(this)->slot_at(node, index);
    }

    void make_first_table() {
        if (slots_.empty()) {
            slots_.assign(16, Slot());
            generation_ = 1;
        }
    }

    // Out of line, so that insert, on every edge's path, inlines.
    __attribute__((noinline)) void grow() {
        while (!grow_step()) {
        }
    }

    std::vector<Slot> slots_;  // a power of two in size
    size_t used_;
    // A doubling in progress: See pyengine_grow_step.
    std::vector<Slot> larger_;
    size_t moved_;
    // Of the entries in slots_ (and larger_): See Note [Generations of a
    // DependencyMap].
    uint32_t generation_;
};


// A frame of compute_dependencies' search (pyengine/_dependencies.pyx): its place
// in one node's next edges.
struct pyengine_DependencyFrame {
    // Owned: the Edge that led here may go while the search yields (another
    // thread may replace the edges of the node before it), and the frame
    // reads the node's fields when it starts.
    PyObject *node;
    // Owned: other threads run while the search yields, and may replace the
    // node's edges. The tuple of next edges, or, where only_edge, the node
    // of the node's only next edge (See Note [A node's only next edge] in
    // pyengine/_pure/node.py). NULL once the search took the last of them.
    PyObject *edges;
    Py_ssize_t next;  // the index of the next edge to follow
    size_t slot;      // node's slot index in the DependencyMap: a hint
    // Under init_to_execute: whether an edge followed so far leads to a
    // node that runs or captures, so that this one runs (is needed).
    bool needed;
    bool only_edge;
};
// _frame_stack.h states its kept block's size for frames of this size.
static_assert(sizeof(pyengine_DependencyFrame) == 40, "a frame is five words");
