"""Ctrl-C while a backward starts a fresh Engine's device worker leaves a
graph task registered with the engine's devices but never started (owner
NO_DEVICE, future not completed); while anything keeps it alive (the
KeyboardInterrupt's traceback, kept here as a REPL keeps sys.last_value),
Engine.stop() pushes its wake-up to ready_queue_by_index(owner=-2):
IndexError with one device queue (with two or more, queues[-2] is another
device's queue), and stop() ends there, leaving the device worker and pool
threads running.

Run: PYTHONPATH=<worktree> python stop_after_interrupt.py  (PYENGINE_PURE=1: the twin)
"""
import gc
import random
import signal
import sys
import threading
import time

import numpy as np

import pyengine
from pyengine import fake_device as fd

signal.signal(signal.SIGINT, signal.default_int_handler)
random.seed(0)


class Leaf:
    def __init__(self, data):
        self.data, self.grad, self.grad_fn, self.output_nr, self.requires_grad = data, None, None, 0, True


class OnDevice(pyengine.Node):
    def apply(self, grads):
        time.sleep(0.002)
        return [grads[0].numpy() * 2.0]


main = threading.main_thread().ident
failures = interrupted = 0
trials = int(sys.argv[1]) if len(sys.argv) > 1 else 200
for trial in range(trials):
    engine = pyengine.Engine(2, 3, 0)
    previous = pyengine.set_default_engine(engine)
    x = Leaf(np.zeros(2))
    node = OnDevice([pyengine.gradient_edge(x)], [pyengine.InputMetadata((2,), np.float64, fd.device(0))])
    timer = threading.Timer(random.uniform(0.0, 0.002), signal.pthread_kill, (main, signal.SIGINT))
    kept = None
    try:
        timer.start()
        pyengine.grad([pyengine.Edge(node, 0)], [x], [fd.to_fake(np.ones(2), fd.device(0))])
        time.sleep(0.01)  # a signal after the call lands here
    except KeyboardInterrupt as error:
        kept = error  # the caller keeps the error
        interrupted += 1
    timer.join()
    time.sleep(0.01)
    pyengine.set_default_engine(previous)
    try:
        engine.stop()
    except Exception as error:
        failures += 1
        if failures == 1:
            print(f"trial {trial}: Engine.stop() raised {type(error).__name__}: {error}")
            for o in gc.get_objects():
                if type(o).__name__ == "GraphTask":
                    print("  GraphTask alive: completed", o.future_completed, "owner", o.owner)
    del kept
print(f"{pyengine.IMPLEMENTATION}: {interrupted} of {trials} interrupted, Engine.stop() raised in {failures}")
print("threads left:", len([t for t in threading.enumerate() if t.name.startswith("pyengine")]))
