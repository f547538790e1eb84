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

// One step of doubling `slots` (a power of two in size, at least 1) into
// `larger`: first `larger` is zeroed a step at a time, then the entries
// of `slots` move over a step at a time (place(larger, slot) puts one
// where it belongs). `moved` counts the slots moved so far. Returns true
// once `slots` is the doubled table; `larger` and `moved` are then reset
// for the next doubling. Between steps the table stays as it was: lookups
// and inserts must wait until the doubling is done.
template <typename Slot, typename Place>
bool pyengine_grow_step(std::vector<Slot> &slots, std::vector<Slot> &larger, size_t &moved,
                        Place place) {
    const size_t target = slots.size() * 2;
    if (larger.size() < target) {
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
    std::vector<Slot>().swap(larger);
    moved = 0;
    return true;
}
