// The checks of tests/test_kept_tables.py's test_dependency_map_generations:
// pyengine_DependencyMap (pyengine/_dependency_map.h) driven directly,
// against a std::unordered_map of the counts, over the uses of its kept
// tables that a Python test cannot reach in reasonable time. See Note
// [Generations of a DependencyMap].
//
// - counts of many sizes back to back on one thread (each starts on the
//   table the one before gave back, in a later generation);
// - two maps alive at once, and a map reset while it has entries;
// - a map released on another thread (its table goes to that thread's kept
//   tables and is counted on there);
// - more than 2^24 uses of one table, and more than 2^24 resets of one
//   map, so that the generations run out and the table is replaced.
// - and, before those, the hash on the layout that made the address order
//   alone probe a slot run per key: dense layers of small objects a
//   table's span apart (Note [Hashing an address by its page]).
//
// The keys are addresses 16 bytes apart in a pool the map never reads
// through, drawn again and again, so that a table holds stale slots with
// the very keys of the count under way. Every lookup (remove, needed) is
// given a hint (See Note [A node keeps its slot's index]): the slot the
// count got for the key, another key's slot, or any number, and must
// answer the same whichever. Prints "ok", or what went wrong and exits 1.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "_dependency_map.h"

namespace {

constexpr size_t POOL = 1 << 19;
alignas(16) unsigned char pool[POOL * 16];

PyObject *key(size_t i) { return reinterpret_cast<PyObject *>(pool + 16 * i); }

// A hint for a lookup of a key whose slot add_edge gave as right (or
// SIZE_MAX where none): that slot, the slot of some other key, or any
// number, each as often. None may change the answer.
size_t any_hint(std::mt19937_64 &random, size_t right, size_t other) {
    switch (random() % 3) {
    case 0:
        return right == SIZE_MAX ? random() : right;
    case 1:
        return other;
    default:
        return random();
    }
}

void fail(const char *what, size_t index) {
    std::printf("%s (node %zu)\n", what, index);
    std::exit(1);
}

// n distinct keys from the pool, 1 to 3 edges into each, counted into map
// on the table it has; then each count taken down to nothing through
// remove, and keys left out found in no slot.
void count_and_check(pyengine_DependencyMap &map, std::mt19937_64 &random, size_t n) {
    const size_t start = random() % POOL;
    const size_t stride = 1 + random() % 7;
    std::unordered_map<size_t, int> edges;
    std::unordered_map<size_t, size_t> slots;  // as add_edge gave them
    std::vector<size_t> order;
    for (size_t i = 0; i < n; ++i) {
        const size_t index = (start + i * stride) % POOL;
        if (edges.count(index) == 0) {
            order.push_back(index);
        }
        edges[index] += 1 + static_cast<int>(random() % 3);
    }
    for (size_t index : order) {
        for (int edge = 0; edge < edges[index]; ++edge) {
            while (map.full() && !map.grow_step()) {
            }
            size_t slot;
            const auto before = map.add_edge(key(index), &slot);
            slots[index] = slot;
            const auto expected =
                edge == 0 ? pyengine_DependencyMap::NOT_SEEN : pyengine_DependencyMap::ON_PATH;
            if (before != expected) {
                fail("add_edge saw a state an earlier count left", index);
            }
        }
    }
    if (map.size() != order.size()) {
        fail("the map's size is not the number of keys counted", order.size());
    }
    // A table that grew after a key was counted moved it: its slot as
    // add_edge gave it is then a stale hint, which must not matter either.
    const size_t other = order.empty() ? 0 : slots[order[random() % order.size()]];
    for (size_t index : order) {
        if (map.needed(key(index), slots[index]) ||
            map.needed(key(index), any_hint(random, slots[index], other))) {
            fail("a key is marked needed that no count marked", index);
        }
        for (int edge = edges[index]; edge > 0; --edge) {
            if (map.remove(key(index), any_hint(random, slots[index], other)) !=
                (edge == 1 ? 1 : 0)) {
                fail("remove did not count down the edges added", index);
            }
        }
        if (map.remove(key(index), any_hint(random, slots[index], other)) != -1) {
            fail("remove found a count past its last edge", index);
        }
    }
    for (int probe = 0; probe < 64; ++probe) {
        const size_t index = random() % POOL;
        if (edges.count(index) == 0 &&
            map.remove(key(index), any_hint(random, SIZE_MAX, other)) != -1) {
            fail("a key this count did not add has a count", index);
        }
    }
}

// Near a table's first generations: 80 keys that depend on the
// generation, each counted once and taken down again. On the second pass
// through the generations, the first pass's slots for these keys, of this
// very generation, are still in that table, so no map may count on it
// again (start on it, or reset on it) once its generations ran out: a
// count must not see their search state (ON_PATH) or their count.
void generation_check(pyengine_DependencyMap &map) {
    const size_t first = 100 + map.generation() * 80;
    size_t slot;
    for (size_t index = first; index < first + 80; ++index) {
        if (map.add_edge(key(index), &slot) != pyengine_DependencyMap::NOT_SEEN) {
            fail("add_edge saw a state an earlier pass left", index);
        }
    }
    for (size_t index = first; index < first + 80; ++index) {
        if (map.remove(key(index), index) != 1) {
            fail("remove did not count down the edge added", index);
        }
    }
}

// Between the generation_checks: keys i and i + 1 (i < 32) counted once
// and taken down, where the count before counted keys i - 1 and i: the
// slot of key i is the last count's, and must read as empty.
void quick_check(pyengine_DependencyMap &map, size_t i) {
    size_t slot;
    if (map.add_edge(key(i), &slot) != pyengine_DependencyMap::NOT_SEEN ||
        map.add_edge(key(i + 1), &slot) != pyengine_DependencyMap::NOT_SEEN) {
        fail("add_edge saw a state the count before left", i);
    }
    // Hints that are the other key's slot, or no slot of either.
    if (map.remove(key(i), slot) != 1 || map.remove(key(i + 1), slot) != 1 ||
        map.remove(key(i), i) != -1) {
        fail("remove did not count down the edges added", i);
    }
}

// Whether a sequence of generations went back to the start.
struct Wraparound {
    uint32_t last = 0;
    bool seen = false;

    void see(uint32_t generation) {
        seen = seen || generation < last;
        last = generation;
    }
};

// The mean number of slots a key of keys lies past its hash's slot, in a
// table of size slots that grows no more (linear probing, without wrapping
// at the end: a bound, not the table's exact figure). The total over the
// keys does not depend on the order they came in, so it is found from the
// sorted hashes: each key takes the first slot free at or after its own.
template <typename Hash>
double mean_displacement(const std::vector<uintptr_t> &keys, size_t size, Hash hash) {
    std::vector<size_t> hashes;
    hashes.reserve(keys.size());
    for (uintptr_t key : keys) {
        hashes.push_back(hash(reinterpret_cast<PyObject *>(key), size));
    }
    std::sort(hashes.begin(), hashes.end());
    double total = 0;
    size_t next_free = 0;
    for (size_t h : hashes) {
        const size_t slot = std::max(h, next_free);
        total += static_cast<double>(slot - h);
        next_free = slot + 1;
    }
    return total / static_cast<double>(keys.size());
}

// 2^20 keys in a table of 2^22 slots (as a count of them gets): eight
// layers of 32-byte objects, one after the other in each, the layers a
// table's span (16 bytes a slot) apart; and the same keys in one run.
void dense_layers_check() {
    constexpr size_t keys_count = size_t{1} << 20;
    constexpr size_t size = size_t{1} << 22;
    constexpr size_t layers = 8;
    const uintptr_t base = uintptr_t{1} << 40;
    std::vector<uintptr_t> layered;
    std::vector<uintptr_t> run;
    for (size_t i = 0; i < keys_count; ++i) {
        layered.push_back(base + (i % layers) * 16 * size + (i / layers) * 32);
        run.push_back(base + i * 32);
    }
    auto address_order = [](PyObject *node, size_t slots) {
        return (reinterpret_cast<uintptr_t>(node) >> 4) & (slots - 1);
    };
    // The layout is the bad one: the address order alone walks hundreds of
    // thousands of slots a key.
    if (mean_displacement(layered, size, address_order) < 100000) {
        fail("the layered keys do not pile up under the address order", 0);
    }
    if (mean_displacement(layered, size, pyengine_address_hash) > 1.0) {
        fail("dense layers pile up under pyengine_address_hash", 0);
    }
    if (mean_displacement(run, size, pyengine_address_hash) > 1.0) {
        fail("one run of keys piles up under pyengine_address_hash", 0);
    }
    // A table of one page or less keeps the address order.
    for (size_t slots : {size_t{16}, size_t{256}}) {
        for (size_t i = 0; i < 1000; ++i) {
            PyObject *node = reinterpret_cast<PyObject *>(base + 16 * i);
            if (pyengine_address_hash(node, slots) != address_order(node, slots)) {
                fail("a small table does not keep the address order", i);
            }
        }
    }
}

void one_count(std::mt19937_64 &random, size_t n) {
    pyengine_DependencyMap map;
    map.use_kept_table();
    count_and_check(map, random, n);
    map.release();
}

}  // namespace

int main() {
    dense_layers_check();
    std::mt19937_64 random(20261201);
    const size_t sizes[] = {5000, 3, 70000, 1, 140000, 20, 300000, 7, 9000};
    for (int round = 0; round < 3; ++round) {
        for (size_t n : sizes) {
            one_count(random, n);
        }
    }

    // Two at once: the inner map takes the other kept table, or none.
    {
        pyengine_DependencyMap outer;
        outer.use_kept_table();
        count_and_check(outer, random, 50000);
        one_count(random, 80000);
        one_count(random, 10);
        // Reset with entries: a new generation on the same table.
        outer.reset();
        count_and_check(outer, random, 60000);
        outer.release();
    }

    // Released on another thread, then counted on there.
    {
        pyengine_DependencyMap map;
        map.use_kept_table();
        count_and_check(map, random, 100000);
        std::thread([&map, &sizes] {
            map.release();
            std::mt19937_64 thread_random(7);
            for (size_t n : sizes) {
                one_count(thread_random, n);
            }
        }).join();
        one_count(random, 100000);
    }

    // One table through all its generations, on a thread of its own: after
    // a count of 3,000 keys, every small count takes the table the one
    // before gave back (8,192 slots), one generation later. The
    // quick_checks touch keys below 32 only, so the slots the
    // generation_checks wrote (keys 100 to 4,099) stay as they were until
    // the generations run out.
    std::thread([] {
        std::mt19937_64 thread_random(11);
        one_count(thread_random, 3000);
        Wraparound wraparound;
        for (size_t use = 0; use < (size_t{1} << 24) + 1000; ++use) {
            pyengine_DependencyMap map;
            map.use_kept_table();
            wraparound.see(map.generation());
            if (map.generation() < 50) {
                generation_check(map);
            } else if (map.generation() > (1u << 24) - 50) {
                count_and_check(map, thread_random, 40);
            } else {
                quick_check(map, use % 32);
            }
            map.release();
        }
        if (!wraparound.seen) {
            fail("no table ran through its generations", wraparound.last);
        }
        for (size_t n : {5000, 3, 70000}) {
            one_count(thread_random, n);
        }
    }).join();

    // One map reset again and again: each reset is a generation of its
    // table, until they run out and the map takes a new table.
    std::thread([] {
        pyengine_DependencyMap map;
        Wraparound wraparound;
        for (size_t use = 0; use < (size_t{1} << 24) + 1000; ++use) {
            map.reset();
            wraparound.see(map.generation());
            if (map.generation() < 50) {
                generation_check(map);
            } else {
                quick_check(map, use % 32);
            }
        }
        if (!wraparound.seen) {
            fail("no map's resets ran through the generations", wraparound.last);
        }
        map.release();
    }).join();

    for (size_t n : sizes) {
        one_count(random, n);
    }
    std::printf("ok\n");
    return 0;
}
