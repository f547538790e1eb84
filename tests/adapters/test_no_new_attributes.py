"""No adapter adds an attribute to a framework's classes (issue 23): an
adapter only replaces attributes a class defines itself (``Patches``), and
reads the framework's graph through ``OwnerGraph``'s callables or the
framework's own names. The oracle: every class of the framework's modules
has the same attribute names (``vars(cls)``) installed as not installed,
and a backward run while installed leaves them so too.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

# (adapter module, the framework's modules, a backward to run installed)
FRAMEWORKS = {
    "micrograd": ("pyengine.adapters.micrograd", ["micrograd.engine", "micrograd.nn"]),
    "dezero": ("pyengine.adapters.dezero", ["dezero.core", "dezero.functions", "dezero.layers"]),
    "autograd": ("pyengine.adapters.autograd", ["autograd.core", "autograd.tracer",
                                                "autograd.numpy.numpy_boxes"]),
    "chainer": ("pyengine.adapters.chainer", ["chainer.variable", "chainer.function_node",
                                              "chainer._backprop_utils"]),
}


def run_backward(name):
    if name == "micrograd":
        from micrograd.engine import Value
        x = Value(2.0)
        (x * x + x).backward()
        assert x.grad == 5.0
    elif name == "dezero":
        from dezero import Variable
        x = Variable(np.array(2.0))
        y = x * x + x
        y.backward()
        assert float(x.grad.data) == 5.0
    elif name == "chainer":
        import chainer
        x = chainer.Variable(np.array(2.0))
        (x * x + x).backward()
        assert float(x.grad) == 5.0
        gx, = chainer.grad([x * x], [x])
        assert float(gx.array) == 4.0
    else:
        from autograd import grad
        assert grad(lambda x: x * x + x)(2.0) == 5.0


def class_attributes(module_names):
    names = {}
    for module_name in module_names:
        module = importlib.import_module(module_name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__.split(".")[0] == module_name.split(".")[0]:
                names[f"{cls.__module__}.{cls.__qualname__}"] = set(vars(cls))
    return names


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_installing_and_running_adds_no_attribute_to_a_framework_class(name):
    pytest.importorskip(name)
    adapter_name, module_names = FRAMEWORKS[name]
    adapter = importlib.import_module(adapter_name)
    before = class_attributes(module_names)
    assert before, f"no classes found in {module_names}"
    adapter.install()
    try:
        run_backward(name)
        during = class_attributes(module_names)
    finally:
        adapter.uninstall()
    assert during == before
    assert class_attributes(module_names) == before
