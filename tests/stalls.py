"""How long a piece of work keeps other Python threads waiting for the GIL:
the measure of the tests of Note [Long passes let other threads run]
(``pyengine/_interrupts.pxd``)."""

from __future__ import annotations

import threading
import time


def longest_stall_while(work):
    """Run ``work()`` while a thread counts in pure Python; returns
    ``(longest gap between the counter's steps, work's duration)``."""
    started = threading.Event()
    done = threading.Event()
    longest = [0.0]

    def count():
        last = time.perf_counter()
        started.set()
        while not done.is_set():
            now = time.perf_counter()
            if now - last > longest[0]:
                longest[0] = now - last
            last = now

    counter = threading.Thread(target=count)
    counter.start()
    started.wait()
    begin = time.perf_counter()
    try:
        work()
    finally:
        elapsed = time.perf_counter() - begin
        done.set()
        counter.join()
    return longest[0], elapsed
