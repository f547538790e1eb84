// Doubling an open-addressing table in steps, so that a whole-graph pass
// can let other threads run between them: at a million entries, doubling
// a table at once (zeroing the new one, then moving every entry) holds the
// GIL for tens of milliseconds. See Note [Long passes let other threads
// run] in pyengine/_interrupts.pxd. DependencyMap and ExecInfoMap use it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

// Slots zeroed, or entries moved, per step: a fraction of a millisecond.
constexpr size_t pyengine_TABLE_GROWTH_STEP = size_t{1} << 15;

// Note [Tables kept between backward calls]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every graph task makes its DependencyMap anew and doubles it as the count
// fills it: at a hundred thousand nodes, tables of 4 MB, 2 MB, 1 MB and
// down. glibc hands such blocks out and takes them back whole, from mmap
// or from the top of its heap, which it trims as a threshold it moves
// allows; so whether the next backward's tables come from pages already
// mapped, or from fresh ones the kernel faults in and zeroes, depended on
// what else the process had allocated and freed just before (a grad of
// another size, the search's frames: benchmarks/RESULTS.md, "The
// dependency tables kept"). So each thread keeps the two largest tables
// its maps gave back, up to pyengine_KEPT_TABLE_BYTES each, and a doubling
// takes the smaller kept one that is large enough: the table it grows out
// of is given back in turn, so a count of that size doubles between two
// mapped blocks, zeroing only what it uses. A thread holds at most twice
// pyengine_KEPT_TABLE_BYTES (a count of about a million nodes fills a
// table of that size). Tables are taken and given only by their own
// thread (the map is released on the thread that completes its task), so
// no lock is needed; a nested count on the same thread takes what is left.

constexpr size_t pyengine_KEPT_TABLE_BYTES = size_t{32} << 20;

template <typename Slot>
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

    // Keep `table`'s memory if it is among the two largest given, and no
    // larger than pyengine_KEPT_TABLE_BYTES; else free it. `table` is left
    // empty, with no memory.
    void give(std::vector<Slot> &table) {
        const size_t capacity = table.capacity();
        std::vector<Slot> *smaller = &tables_[0];
        if (tables_[1].capacity() < smaller->capacity()) {
            smaller = &tables_[1];
        }
        if (capacity * sizeof(Slot) <= pyengine_KEPT_TABLE_BYTES && capacity > smaller->capacity()) {
            smaller->swap(table);
        }
        std::vector<Slot>().swap(table);
    }

  private:
    std::vector<Slot> tables_[2];
};

// One step of doubling `slots` (a power of two in size, at least 1) into
// `larger`: first `larger` is zeroed a step at a time, then the entries
// of `slots` move over a step at a time (place(larger, slot) puts one
// where it belongs). `moved` counts the slots moved so far. Returns true
// once `slots` is the doubled table; `larger` and `moved` are then reset
// for the next doubling. Between steps the table stays as it was: lookups
// and inserts must wait until the doubling is done.
//
// With `kept` (See Note [Tables kept between backward calls]), `larger`
// comes from the thread's kept tables when one is large enough, and the
// table `slots` grew out of goes back to them.
template <typename Slot, typename Place>
bool pyengine_grow_step(std::vector<Slot> &slots, std::vector<Slot> &larger, size_t &moved,
                        Place place, pyengine_KeptTables<Slot> *kept = nullptr) {
    const size_t target = slots.size() * 2;
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
        kept->give(larger);
    } else {
        std::vector<Slot>().swap(larger);
    }
    moved = 0;
    return true;
}
