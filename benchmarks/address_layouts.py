"""How far linear probing walks, per key, for the addresses of a million
objects, under the hashes the dependency map could use.

Makes a million objects of each kind (32-byte ``Bare`` owners, as
``tests/test_graph_passes.py`` makes them, and ``pyengine.Node``s), takes
their addresses, and prints the mean and largest displacement of a key
from its hash's slot in a table of 2^22 slots (what a count of a million
nodes gets), for: the address order (address over 16), a Fibonacci hash
of the address, and the order kept within blocks of 16 to 1024 slots whose
places a Fibonacci hash of the block's addresses scatters (what
``pyengine/_address_hash.h`` does with blocks of 256: See Note [Hashing
an address by its page]). Linear probing's total displacement does not
depend on the order the keys came in, so it is computed from the sorted
hashes, without a table.

``--after`` first runs pytest in this process on the given arguments: the
heap they leave behind is where the address order went wrong
(benchmarks/RESULTS.md, "Dense layers of small objects").

    python benchmarks/address_layouts.py
    python benchmarks/address_layouts.py --after tests/test_cli.py -q -m "not slow and not stress"
"""

from __future__ import annotations

import argparse

import numpy as np

import pyengine

TABLE_BITS = 22
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class Bare:
    __slots__ = ()


class Pass(pyengine.Node):
    def apply(self, grads):
        return grads


def displacement(hashes, size):
    """Mean and largest distance from each key's slot to the slot it takes
    (linear probing, not wrapping at the table's end)."""
    hashes = np.sort(hashes % size)
    order = np.arange(len(hashes))
    # Each key takes the first slot free at or after its own:
    # slot_i = max(hash_i, slot_(i-1) + 1), that is slot_i - i = cummax(hash_i - i).
    slots = np.maximum.accumulate(hashes - order) + order
    distance = slots - hashes
    return float(distance.mean()), int(distance.max())


def fibonacci(values, bits):
    return (values * GOLDEN) >> np.uint64(64 - bits)


def report(name, addresses):
    addresses = np.array(addresses, dtype=np.uint64)
    size = 1 << TABLE_BITS
    slots = addresses >> np.uint64(4)
    cells = [f"address order {displacement(slots.astype(np.int64), size)}",
             f"Fibonacci {displacement(fibonacci(slots, TABLE_BITS).astype(np.int64), size)}"]
    for block_bits in (4, 6, 8, 10):
        block = fibonacci(slots >> np.uint64(block_bits), TABLE_BITS - block_bits)
        within = slots & np.uint64((1 << block_bits) - 1)
        hashes = (block << np.uint64(block_bits)) | within
        cells.append(f"blocks of {1 << block_bits} {displacement(hashes.astype(np.int64), size)}")
    extent = (int(addresses.max()) - int(addresses.min())) / 2**20
    print(f"{name} in {extent:,.0f} MB: " + "; ".join(cells))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--after", nargs=argparse.REMAINDER, default=None,
                        help="pytest arguments to run in this process first")
    args = parser.parse_args(argv)
    if args.after:
        import pytest

        pytest.main(args.after)
    print("mean and largest displacement per key, table of 2^22 slots")
    objects = [Bare() for _ in range(1_000_000)]
    report("1M Bare", [id(value) for value in objects])
    del objects
    objects = [Pass() for _ in range(1_000_000)]
    report("1M pyengine.Node", [id(value) for value in objects])


if __name__ == "__main__":
    main()
