"""Adapters: pyengine as the backward engine of frameworks that already exist.

Each adapter is a module that patches one framework so that its own
``backward`` runs on pyengine, with the framework's results:

- :mod:`pyengine.adapters.dezero`: DeZero's ``Variable.backward(retain_grad,
  create_graph)``;
- :mod:`pyengine.adapters.micrograd`: micrograd's ``Value.backward()``.

Both offer ``install()``, ``uninstall()``, ``is_installed()`` and the
context manager ``installed()``. Importing this package imports neither
framework; importing an adapter module imports its framework (and raises
``ImportError`` naming the package to install when it is missing)::

    from pyengine.adapters import dezero as pyengine_dezero
    pyengine_dezero.install()

Adapters are frontends: they import the engine, never the reverse.
"""

import contextlib

# No names: ``from pyengine.adapters import *`` must not import a framework.
__all__: list = []


@contextlib.contextmanager
def installed_while(is_installed, install, uninstall):
    """The body of an adapter's ``installed()``: the block runs with the
    adapter installed, and the previous state comes back after it (it stays
    installed if it was)."""
    was_installed = is_installed()
    install()
    try:
        yield
    finally:
        if not was_installed:
            uninstall()
