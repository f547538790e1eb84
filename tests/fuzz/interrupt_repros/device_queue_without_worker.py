"""A KeyboardInterrupt that lands in _DeviceThreads.queue_for (Python code,
pyengine/_shared/device_threads.py, run on the main thread by the first
backward that touches a device) between registering the device's queue and
thread.start() leaves the device with a queue and no worker: every later
backward on that device waits forever (the Ctrl-C-able wait; here a
watchdog ends it after 3 s). The interrupt is placed deterministically with
a trace function (a real SIGINT lands there only by chance: the window is a
few bytecodes long; the wider window, thread.start()'s wait, leaves the
graph task registered but unstarted: see stop_after_interrupt.py).

Run: PYTHONPATH=<worktree> python device_queue_without_worker.py  (PYENGINE_PURE=1: the twin)
"""
import signal
import sys
import threading
import time

import numpy as np

import pyengine
from pyengine import fake_device as fd
from pyengine._shared import device_threads

signal.signal(signal.SIGINT, signal.default_int_handler)


class Leaf:
    def __init__(self, data):
        self.data, self.grad, self.grad_fn, self.output_nr, self.requires_grad = data, None, None, 0, True


class OnDevice(pyengine.Node):
    def apply(self, grads):
        return [grads[0].numpy() * 2.0]


def backward_on_device(x):
    node = OnDevice([pyengine.gradient_edge(x)], [pyengine.InputMetadata((2,), np.float64, fd.device(0))])
    pyengine.backward([pyengine.Edge(node, 0)], [fd.to_fake(np.ones(2), fd.device(0))])


START_LINE = next(i for i, line in enumerate(open(device_threads.__file__), 1) if "thread.start()" in line)


def tracer(frame, event, arg):
    if frame.f_code.co_name == "queue_for":
        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == START_LINE:
                sys.settrace(None)
                raise KeyboardInterrupt("as a SIGINT handler would, just before thread.start()")
            return local
        return local
    return None


engine = pyengine.Engine()
pyengine.set_default_engine(engine)
x = Leaf(np.zeros(2))
sys.settrace(tracer)
try:
    backward_on_device(x)
except KeyboardInterrupt as error:
    print("first backward: KeyboardInterrupt", error)
sys.settrace(None)
print("device threads:", [t.name for t in threading.enumerate() if t.name.startswith("pyengine")])
timer = threading.Timer(3.0, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
timer.start()
started = time.monotonic()
try:
    backward_on_device(x)
    print(f"{pyengine.IMPLEMENTATION}: second backward OK, grad {x.grad}")
except KeyboardInterrupt:
    print(f"{pyengine.IMPLEMENTATION}: BUG: second backward on fake:0 hung "
          f"({time.monotonic() - started:.1f} s, ended by the watchdog's SIGINT)")
timer.cancel()
