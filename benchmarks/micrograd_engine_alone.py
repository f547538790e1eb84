#!/usr/bin/env python
"""micrograd on pyengine, the engine alone, for callgrind.

    valgrind --tool=callgrind python benchmarks/micrograd_engine_alone.py N

Builds the MLP of ``adapters_bench.py`` (``MLP(2, [16, 16, 1])`` on 20
points, squared loss), swaps each non-leaf Value's ``_backward`` for the C
no-op ``int`` and runs ``N`` backward calls with the cyclic GC off: the
instructions of N = 20 less those of N = 0, over 20, are the walk's cost per
backward. Needs micrograd.
"""

import gc
import random
import sys

from micrograd.engine import Value
from micrograd.nn import MLP

from pyengine.adapters import micrograd as adapter


def main():
    random.seed(0)
    adapter.install()
    model = MLP(2, [16, 16, 1])
    points = [[random.uniform(-1, 1), random.uniform(-1, 1)] for _ in range(20)]
    loss = sum(((model(x) - 1.0) ** 2 for x in points), Value(0.0))
    values, seen, stack = [], set(), [loss]
    while stack:
        value = stack.pop()
        if id(value) not in seen:
            seen.add(id(value))
            values.append(value)
            stack.extend(value._prev)
    for value in values:
        if value._prev:
            value._backward = int
    gc.disable()
    for _ in range(int(sys.argv[1])):
        loss.backward()
    print(f"{sum(1 for value in values if value._prev)} non-leaf Values of {len(values)}")


if __name__ == "__main__":
    main()
