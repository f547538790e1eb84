"""Adapters: pyengine as the backward engine of frameworks that already exist.

Each adapter is a module that patches one framework so that its own
``backward`` runs on pyengine, with the framework's results:

- :mod:`pyengine.adapters.dezero`: DeZero's ``Variable.backward(retain_grad,
  create_graph)``;
- :mod:`pyengine.adapters.micrograd`: micrograd's ``Value.backward()``;
- :mod:`pyengine.adapters.autograd`: HIPS autograd's reverse mode
  (``autograd.core.backward_pass``, under ``grad``, ``jacobian``, ...);
- :mod:`pyengine.adapters.chainer`: Chainer's ``Variable.backward``,
  ``chainer.backward`` and ``chainer.grad``.

Each offers ``install()``, ``uninstall()``, ``is_installed()`` and the
context manager ``installed()``. Importing this package imports no
framework; importing an adapter module imports its framework (and raises
``ImportError`` naming the package to install when it is missing)::

    from pyengine.adapters import dezero as pyengine_dezero
    pyengine_dezero.install()

Adapters are frontends: they import the engine, never the reverse.
"""

import contextlib
import threading

from .._shared.uninterrupted import run_all

# No names: ``from pyengine.adapters import *`` must not import a framework.
__all__: list = []

# Note [What an adapter sets around a backward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An adapter's backward sets per-call state around its graph task (a
# thread's stack of runs, a ContextVar, a framework's global flag, the
# thread's multithreading switch) and puts it back in a ``finally``. On the
# main thread Ctrl-C's KeyboardInterrupt comes out as any call returns, so
# a state set by a call before the ``try`` (``append``, a ContextVar's
# ``set``, the switch) could stay set after an interrupt, and one kept only
# as the token that call returned could not be put back. So each previous
# value (a stack's depth) is read before the ``try``, where an interrupt
# has changed nothing, every change is made inside it, and the ``finally``
# puts the values back (cuts the stack back to its depth) rather than
# resetting tokens or popping once.


# Note [Patches under an interrupt]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An adapter's install replaces several attributes of a framework's
# classes and records the originals; uninstall puts them back. One setattr
# call after another, Ctrl-C could come out between two (after a call
# returns: See pyengine/_shared/uninterrupted.py): a class left half
# patched, with no record to undo it by, or installed for good after an
# ``installed()`` block. So each does all its setattr calls in one C call
# (``run_all`` over a ``map`` made before), with the record changed just
# before it and nothing between: the patches and the record change
# together or not at all, and ``installed()`` installs inside its ``try``.
# tests/adapters/test_adapters_interrupt_sweep.py found both. Left: an
# interrupt as ``installed()``'s block ends, at the start of its uninstall
# (Python code), before that changed anything, leaves the adapter
# installed, as any with block's Python exit would; ``uninstall()`` puts
# it right.


class Patches:
    """The attributes an adapter replaces on a framework's classes, and what
    ``install()`` and ``uninstall()`` do with them: replace them all, or put
    the very originals back; both idempotent.

    ``patches``: ``(cls, name, replacement)`` triples, each ``name`` defined
    on ``cls`` itself (else ``install()`` raises RuntimeError naming it, with
    ``unsupported``, a sentence on the framework's version).

    Fields: ``_originals``, None when not installed, else the ``(cls, name,
    original)`` triples install() replaced; guarded by ``_lock``.
    """

    def __init__(self, adapter, patches, unsupported):
        self._adapter = adapter
        self._patches = tuple(patches)
        self._unsupported = unsupported
        self._originals = None
        self._lock = threading.Lock()

    def install(self):
        with self._lock:
            if self._originals is not None:
                return
            for cls, name, _ in self._patches:
                if name not in cls.__dict__:
                    raise RuntimeError(f"{self._adapter}: {cls.__module__}.{cls.__name__} has no "
                                       f"{name}; {self._unsupported()}")
            originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in self._patches]
            # All patches or none, with the record: See Note [Patches under
            # an interrupt].
            patch_all = map(setattr, *zip(*self._patches))
            self._originals = originals
            run_all(patch_all)

    def uninstall(self):
        with self._lock:
            if self._originals is None:
                return
            restore_all = map(setattr, *zip(*self._originals))
            self._originals = None
            run_all(restore_all)

    def is_installed(self) -> bool:
        return self._originals is not None

    def installed(self):
        """The body of an adapter's ``installed()`` whose install is only
        these patches."""
        return installed_while(self.is_installed, self.install, self.uninstall)


@contextlib.contextmanager
def installed_while(is_installed, install, uninstall):
    """The body of an adapter's ``installed()``: the block runs with the
    adapter installed, and the previous state comes back after it (it
    stays installed if it was)."""
    was_installed = is_installed()
    try:
        # In the try: an install that Ctrl-C cut short is undone.
        install()
        yield
    finally:
        if not was_installed:
            uninstall()
