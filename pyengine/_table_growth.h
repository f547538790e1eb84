// Doubling an open-addressing table in steps, so that a whole-graph pass
// can let other threads run between them: at a million entries, doubling
// a table at once (zeroing the new one, then moving every entry) holds the
// GIL for tens of milliseconds. See Note [Long passes let other threads
// run] in pyengine/_interrupts.pxd. DependencyMap, ExecInfoMap and
// OwnerTable use it; DependencyMap and OwnerTable also keep their tables'
// memory between calls here (See Note [Tables kept between backward calls]).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

// Slots zeroed, or entries moved, per step: a fraction of a millisecond.
constexpr size_t pyengine_TABLE_GROWTH_STEP = size_t{1} << 15;

// Note [Tables kept between backward calls]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every graph task makes its DependencyMap anew, and every returns-mode
// owner-graph walk its OwnerTable (pyengine/_owner_table.h), and doubles it
// as the search fills it: at a hundred thousand nodes, tables of 4 MB, 2
// MB, 1 MB and down. glibc hands such blocks out and takes them back whole,
// from mmap or from the top of its heap, which it trims as a threshold it
// moves allows; so whether the next call's tables come from pages already
// mapped, or from fresh ones the kernel faults in and zeroes, depended on
// what else the process had allocated and freed just before (a grad of
// another size, the search's frames; on autograd's fan-in every walk
// faulted its owner table in again, on its chain none: benchmarks/
// RESULTS.md, "The dependency tables kept" and "Issue 18: why autograd's
// chain depended on the process, and the owner table").
//
// So each thread keeps, per kind of table, the two largest tables given
// back, and a new table or a doubling takes the smallest kept one that is
// large enough: the table it grows out of is given back in turn, so a
// search of that size doubles between two mapped blocks, zeroing only what
// it uses. A graph task's count goes further: it starts on the largest
// kept table as it was left, zeroing nothing, since its slots say which
// count wrote them (See Note [Generations of a DependencyMap] in
// _dependency_map.h). A DependencyMap gives its tables back when
// released (GraphTask releases it on the thread that completes the task),
// with the last generation of their slots; an OwnerTable when
// destroyed, after releasing the buffers and gradients its entries own (a
// kept table holds no reference), on a walk's return or error alike.
//
// A writes-mode owner-graph search keeps its states in a DependencyMap
// that it does not release: it doubles into kept tables, but frees the one
// it ends with. Keeping that one too made micrograd's large chains slower,
// with more page faults: with no large block ever freed, glibc's mmap
// threshold stays low, and the walk's other vectors (its frames, its
// order, its owners held) came from fresh pages at every walk
// (benchmarks/RESULTS.md, "One mechanism for the tables kept").
//
// A thread keeps a table only up to a size per kind, so that what it holds
// is bounded whatever it ran: DependencyMap tables up to
// pyengine_KEPT_TABLE_BYTES (32 MB, a count of about a million nodes) and
// OwnerTables up to pyengine_KEPT_OWNER_TABLE_BYTES (8 MB, a walk of up to
// 131,071 owners). Owner tables are kept smaller because each owner of a
// returns-mode walk costs a call to a framework's own backward in Python
// (where a node's count costs a few memory accesses), so fresh pages cost
// a larger walk a smaller share, and the framework's graphs
// that take them are a model's, mostly of thousands of owners. So a thread
// holds at most 2 x 32 + 2 x 8 = 80 MB of tables (on Linux the kept
// objects are unique in the process, GNU unique symbols: every extension
// module that counts or walks on a thread shares that thread's), and
// little after small calls. Tables are
// taken and given only by their own thread, so no lock is needed; a call
// nested on the same thread (a reentrant backward, a walk inside an
// owner's backward) takes what is left, and the two largest are kept when
// both are done.

constexpr size_t pyengine_KEPT_TABLE_BYTES = size_t{32} << 20;

// The tables of one kind (Slot) a thread keeps, each of at most KeptBytes.
template <typename Slot, size_t KeptBytes = pyengine_KEPT_TABLE_BYTES>
class pyengine_KeptTables {
  public:
    // This thread's kept tables.
    static pyengine_KeptTables &of_this_thread() {
        static thread_local pyengine_KeptTables kept;
        return kept;
    }

    // An empty table with room for `wanted` slots when one is kept (the
    // smaller such), else an empty table with no room.
    std::vector<Slot> take(size_t wanted) {
        std::vector<Slot> *best = nullptr;
        for (std::vector<Slot> &table : tables_) {
            if (table.capacity() >= wanted &&
                (best == nullptr || table.capacity() < best->capacity())) {
                best = &table;
            }
        }
        std::vector<Slot> taken;
        if (best != nullptr) {
            taken.swap(*best);
            taken.clear();
        }
        return taken;
    }

    // The largest kept table, with its slots as they were given (unzeroed),
    // when it has more than `slots` slots; else an empty table with no room.
    // *last_generation: what was given with it. For a table whose slots say
    // which use of it wrote them (See Note [Generations of a DependencyMap]
    // in _dependency_map.h).
    std::vector<Slot> take_largest(size_t slots, uint32_t *last_generation) {
        const size_t largest = tables_[1].size() > tables_[0].size() ? 1 : 0;
        std::vector<Slot> taken;
        if (tables_[largest].size() > slots) {
            taken.swap(tables_[largest]);
            *last_generation = last_generations_[largest];
        }
        return taken;
    }

    // Keep `table`'s memory if it is among the two largest given, and no
    // larger than KeptBytes; else free it. Its slots must own nothing. `table` is left
    // empty, with no memory. last_generation: kept beside it for
    // take_largest.
    void give(std::vector<Slot> &table, uint32_t last_generation = 0) {
        const size_t capacity = table.capacity();
        const size_t smaller = tables_[1].capacity() < tables_[0].capacity() ? 1 : 0;
        if (capacity * sizeof(Slot) <= KeptBytes && capacity > tables_[smaller].capacity()) {
            tables_[smaller].swap(table);
            last_generations_[smaller] = last_generation;
        }
        std::vector<Slot>().swap(table);
    }

  private:
    std::vector<Slot> tables_[2];
    uint32_t last_generations_[2] = {0, 0};
};

// One step of doubling `slots` (a power of two in size; an empty table,
// one whose constructor had no memory for it, grows to 16 slots) into
// `larger`: first `larger` is zeroed a step at a time, then the entries
// of `slots` move over a step at a time (place(larger, slot) puts one
// where it belongs). `moved` counts the slots moved so far. Returns true
// once `slots` is the doubled table; `larger` and `moved` are then reset
// for the next doubling. Between steps the table stays as it was: lookups
// and inserts must wait until the doubling is done.
//
// With `kept` (See Note [Tables kept between backward calls]), `larger`
// comes from the thread's kept tables when one is large enough, and the
// table `slots` grew out of goes back to them, with last_generation.
template <typename Slot, typename Place, typename Kept = pyengine_KeptTables<Slot>>
bool pyengine_grow_step(std::vector<Slot> &slots, std::vector<Slot> &larger, size_t &moved,
                        Place place, Kept *kept = nullptr, uint32_t last_generation = 0) {
    const size_t target = slots.empty() ? 16 : slots.size() * 2;
    if (larger.size() < target) {
        if (larger.capacity() < target && kept != nullptr) {
            larger = kept->take(target);
        }
        if (larger.capacity() < target) {
            larger.reserve(target);  // address space only: pages are touched as zeroed
        }
        larger.resize(std::min(target, larger.size() + pyengine_TABLE_GROWTH_STEP));
        return false;
    }
    const size_t end = std::min(slots.size(), moved + pyengine_TABLE_GROWTH_STEP);
    for (; moved < end; ++moved) {
        if (slots[moved].node != nullptr) {
            place(larger, slots[moved]);
        }
    }
    if (moved < slots.size()) {
        return false;
    }
    slots.swap(larger);
    if (kept != nullptr) {
        kept->give(larger, last_generation);
    } else {
        std::vector<Slot>().swap(larger);
    }
    moved = 0;
    return true;
}
