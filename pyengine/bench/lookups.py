"""Lookups into a large table: indexed gradients against dense ones (issue 23).

The workload: a ``rows x 64`` float32 table (a leaf of the reference
frontend), three lookups of 10,000 rows each, ``(e * e).sum()`` per lookup,
the three summed; what is timed is ``loss.backward()`` into a ``.grad``
that an earlier backward left (pyengine's own, so added into in place),
as one training step of an embedding would. Three ways, sample by sample
interleaved, in this process (the core this process imported):

- ``indexed``: ``w[indices]``, whose backward is an IndexedGradient;
- ``dense``: ``w[indices, :]``, the same lookup whose backward is the
  dense scatter-add (zeros of the table's shape, ``np.add.at``), as every
  lookup's backward was before indexed gradients;
- ``floor``: ``np.add.at`` of the same 30,000 rows into an existing
  ``.grad``, no engine: what any backward of this workload must do.

Peak memory of one backward: tracemalloc's peak while it runs, over what
was allocated before it (numpy reports its array buffers to tracemalloc),
one backward per way after the timed samples.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc

import numpy as np

COLUMNS = 64
LOOKUPS = 3
ROWS_PER_LOOKUP = 10_000
DEFAULT_TABLE_ROWS = [100_000, 1_000_000]
QUICK_TABLE_ROWS = [10_000, 100_000]
WAYS = ("indexed", "dense", "floor")

GOAL_FLOOR_RATIO = 2.0  # indexed backward <= 2x the np.add.at floor
GOAL_DENSE_SPEEDUP = 20.0  # indexed >= 20x faster than dense at 1M rows


class LookupWorkload:
    """One table and its three lookups; ``step(way)`` times one backward."""

    def __init__(self, table_rows: int, seed: int = 0):
        from pyengine import frontend as pe

        self.pe = pe
        rng = np.random.default_rng(seed)
        self.table_rows = table_rows
        self.table = rng.standard_normal((table_rows, COLUMNS), dtype=np.float32)
        self.indices = [rng.integers(0, table_rows, ROWS_PER_LOOKUP) for _ in range(LOOKUPS)]
        self.weights = {way: pe.Tensor(self.table.copy(), requires_grad=True)
                        for way in ("indexed", "dense")}
        self.floor_grad = np.zeros_like(self.table)
        self.floor_indices = np.concatenate(self.indices)
        self.floor_values = np.concatenate([2 * self.table[i] for i in self.indices])
        # Backward passes into each way's .grad so far (each adds the same).
        self.passes = {"indexed": 0, "dense": 0}
        for way in ("indexed", "dense"):  # the .grad a step adds into
            self._loss(way).backward()
            self.passes[way] += 1
        self.check()

    def _loss(self, way):
        w = self.weights[way]
        loss = None
        for indices in self.indices:
            e = w[indices] if way == "indexed" else w[indices, :]
            term = (e * e).sum()
            loss = term if loss is None else loss + term
        return loss

    def check(self):
        """The oracle: each way's .grad is np.add.at of the looked up rows'
        gradients, once per backward it ran."""
        expected = np.zeros_like(self.table)
        np.add.at(expected, self.floor_indices, self.floor_values)
        for way in ("indexed", "dense"):
            grad = self.weights[way].grad.data
            if type(grad) is not np.ndarray or not np.allclose(grad, self.passes[way] * expected,
                                                                 rtol=1e-5):
                raise AssertionError(f"lookup benchmark: the {way} way's .grad is wrong")

    def step(self, way) -> float:
        """Seconds of one backward (the forward is built first, untimed)."""
        if way == "floor":
            start = time.perf_counter()
            np.add.at(self.floor_grad, self.floor_indices, self.floor_values)
            return time.perf_counter() - start
        loss = self._loss(way)
        start = time.perf_counter()
        loss.backward()
        elapsed = time.perf_counter() - start
        self.passes[way] += 1
        return elapsed

    def peak_bytes(self, way) -> int:
        """tracemalloc's peak over one backward, above what was live before it."""
        loss = self._loss(way) if way != "floor" else None
        tracemalloc.start()
        try:
            before, _ = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            if way == "floor":
                np.add.at(self.floor_grad, self.floor_indices, self.floor_values)
            else:
                loss.backward()
                self.passes[way] += 1
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return peak - before


def run_lookups(table_rows_list, repeats, log):
    """``[{"rows", "seconds": {way: [...]}, "peak_bytes": {way: int}}]``."""
    results = []
    for table_rows in table_rows_list:
        log(f"lookups: {LOOKUPS} x {ROWS_PER_LOOKUP:,} rows of a {table_rows:,} x {COLUMNS} table")
        workload = LookupWorkload(table_rows)
        seconds = {way: [] for way in WAYS}
        for _ in range(repeats):
            for way in WAYS:
                seconds[way].append(workload.step(way))
        peaks = {way: workload.peak_bytes(way) for way in WAYS}
        workload.check()
        results.append({"rows": table_rows, "seconds": seconds, "peak_bytes": peaks,
                        "looked_up": LOOKUPS * ROWS_PER_LOOKUP,
                        "table_bytes": int(workload.table.nbytes)})
        del workload
    return results


def _median_ms(entry, way):
    return statistics.median(entry["seconds"][way]) * 1e3


def lookup_rows(lookups):
    """Table rows: per table size, each way's median ms (min-max) and peak MB."""
    rows = []
    for entry in lookups:
        cells = [f"{entry['rows']:,} x {COLUMNS}"]
        for way in WAYS:
            samples = [s * 1e3 for s in entry["seconds"][way]]
            cells.append(f"{statistics.median(samples):.1f} ({min(samples):.1f}-{max(samples):.1f})")
        cells.append(f"{_median_ms(entry, 'indexed') / _median_ms(entry, 'floor'):.2f}x")
        cells.append(f"{_median_ms(entry, 'dense') / _median_ms(entry, 'indexed'):.1f}x")
        cells.append(" / ".join(f"{entry['peak_bytes'][way] / 2**20:.1f}" for way in WAYS))
        rows.append(cells)
    return rows


LOOKUP_HEADERS = ["table", "indexed ms", "dense ms", "np.add.at floor ms", "indexed / floor",
                  "dense / indexed", "peak MB indexed / dense / floor"]


def lookup_goals(lookups):
    """``[label, measured, status]`` rows for the report's goals."""
    rows = []
    for entry in lookups:
        ratio = _median_ms(entry, "indexed") / _median_ms(entry, "floor")
        rows.append([f"lookups, {entry['rows']:,} rows: indexed backward <= "
                     f"{GOAL_FLOOR_RATIO:.0f}x the np.add.at floor", f"{ratio:.2f}x",
                     "met" if ratio <= GOAL_FLOOR_RATIO else "MISSED"])
    largest = max(lookups, key=lambda entry: entry["rows"], default=None)
    if largest is not None and largest["rows"] >= 1_000_000:
        speedup = _median_ms(largest, "dense") / _median_ms(largest, "indexed")
        rows.append([f"lookups, {largest['rows']:,} rows: indexed >= {GOAL_DENSE_SPEEDUP:.0f}x "
                     "faster than dense", f"{speedup:.1f}x",
                     "met" if speedup >= GOAL_DENSE_SPEEDUP else "MISSED"])
    if len(lookups) >= 2:
        small, large = min(lookups, key=lambda e: e["rows"]), largest
        growth = large["peak_bytes"]["indexed"] / max(small["peak_bytes"]["indexed"], 1)
        table_growth = large["rows"] / small["rows"]
        # Proportional to the rows looked up (the same at both sizes), not to
        # the table: the peak may not grow with the table.
        rows.append([f"lookups: indexed peak memory independent of the table "
                     f"({small['rows']:,} -> {large['rows']:,} rows, table x{table_growth:.0f})",
                     f"x{growth:.2f} ({large['peak_bytes']['indexed'] / large['looked_up']:.0f} "
                     "bytes per row looked up)", "met" if growth <= 1.5 else "MISSED"])
    return rows
