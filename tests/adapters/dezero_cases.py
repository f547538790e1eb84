"""DeZero programs for the differential tests: each runs natively and on
pyengine, and the two runs' gradients are compared.

A *program* is a function of no arguments that builds a DeZero graph from
seeded random data (``run`` seeds numpy before each run), runs backward and
returns ``{name: value}``: gradients (a Variable's ``.grad``: None, or its
array), parameter arrays after optimizer steps, or the outcome of an error.
``snapshot`` turns a Variable's ``.grad`` into something comparable.

``FUNCTION_CASES`` covers every differentiable function of
``dezero.functions`` (with ``dezero.functions_conv``) and the operators of
``dezero.core``; ``test_every_function_is_covered`` checks that no DeZero
Function class is left out.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import dezero
import dezero.functions as F
import dezero.layers as L
import dezero.models as M
import numpy as np
from dezero import Variable

from pyengine.adapters import dezero as pyengine_dezero
from pyengine.adapters.dezero import nodes


def live_adapter_nodes():
    """How many of the adapter's nodes (FunctionNodes, DeZeroAccumulateGrads)
    are alive, after a collection."""
    gc.collect()
    return sum(isinstance(obj, (nodes.FunctionNode, nodes.DeZeroAccumulateGrad))
               for obj in gc.get_objects())


def run(program, on_pyengine):
    """``program()`` with DeZero's own engine or with pyengine installed,
    from the same random seed."""
    context = pyengine_dezero.installed() if on_pyengine else contextlib.nullcontext()
    assert not pyengine_dezero.is_installed(), "a test left the adapter installed"
    with context:
        np.random.seed(0)
        return program()


def snapshot(variable):
    """``variable.grad`` as ``None`` or ``(type name, array copy)``."""
    grad = variable.grad
    if grad is None:
        return None
    data = grad.data if isinstance(grad, Variable) else grad
    return (type(grad).__name__, np.array(data, copy=True))


def grads(**variables):
    return {name: snapshot(variable) for name, variable in variables.items()}


def outcome(function):
    """``function()``'s result, or ``("error", exception type name)``."""
    try:
        return function()
    except Exception as error:  # noqa: BLE001 - the type is the outcome compared
        return ("error", type(error).__name__)


def tolerance(array):
    """Where three or more gradients meet, pyengine may sum them in another
    order than DeZero: the results agree to rounding."""
    return {"rtol": 1e-5, "atol": 1e-6} if array.dtype == np.float32 else {"rtol": 1e-10, "atol": 1e-12}


def assert_same(native, ours, path="result"):
    """Equal structure, types, shapes and dtypes; arrays equal to rounding."""
    if isinstance(native, dict):
        assert isinstance(ours, dict) and native.keys() == ours.keys(), (path, native, ours)
        for key in native:
            assert_same(native[key], ours[key], f"{path}[{key!r}]")
    elif isinstance(native, (list, tuple)):
        assert type(ours) is type(native) and len(ours) == len(native), (path, native, ours)
        for index, (a, b) in enumerate(zip(native, ours)):
            assert_same(a, b, f"{path}[{index}]")
    elif isinstance(native, np.ndarray):
        assert isinstance(ours, np.ndarray), (path, ours)
        assert ours.shape == native.shape and ours.dtype == native.dtype, (path, native, ours)
        np.testing.assert_allclose(ours, native, err_msg=path, **tolerance(native))
    else:
        assert ours == native, (path, native, ours)


# -- every differentiable function --------------------------------------------------------

def randn(*shape):
    return np.asarray(np.random.randn(*shape))


def positive(*shape):
    return np.asarray(np.random.rand(*shape) + 0.5)


@dataclass
class Case:
    """``function(*inputs)`` for inputs made by ``makers`` (each makes one
    array; ints are labels, not differentiated)."""

    name: str
    function: object
    makers: list = field(default_factory=list)
    # Orders of differentiation to compare.
    orders: tuple = (1, 2)
    # Orders at which DeZero's own engine fails (Conv2DGradW.backward unpacks
    # a weak reference): pyengine must then fail alike.
    native_errors: tuple = ()


def _labels(*shape, classes=3):
    return np.random.randint(0, classes, size=shape)


FUNCTION_CASES = [
    # dezero.core operators
    Case("add", lambda x, y: x + y, [lambda: randn(2, 3), lambda: randn(2, 3)]),
    Case("add_broadcast", lambda x, b: x + b, [lambda: randn(2, 3), lambda: randn(3)]),
    Case("add_constant", lambda x: x + 1.5, [lambda: randn(2, 3)]),
    Case("radd_array", lambda x: np.array(2.0) + x, [lambda: randn(3)]),
    Case("sub", lambda x, y: x - y, [lambda: randn(2, 3), lambda: randn(3)]),
    Case("rsub", lambda x: 2.0 - x, [lambda: randn(2, 3)]),
    Case("mul", lambda x, y: x * y, [lambda: randn(2, 3), lambda: randn(2, 3)]),
    Case("mul_broadcast", lambda x, y: x * y, [lambda: randn(2, 3), lambda: randn(1, 3)]),
    Case("div", lambda x, y: x / y, [lambda: randn(2, 3), lambda: positive(2, 3)]),
    Case("rdiv", lambda x: 1.0 / x, [lambda: positive(2, 3)]),
    Case("neg", lambda x: -x, [lambda: randn(2, 3)]),
    Case("pow", lambda x: x ** 3, [lambda: randn(2, 3)], orders=(1, 2, 3)),
    # dezero.functions
    Case("sin", F.sin, [lambda: randn(2, 3)], orders=(1, 2, 3)),
    Case("cos", F.cos, [lambda: randn(2, 3)], orders=(1, 2, 3)),
    Case("tanh", F.tanh, [lambda: randn(2, 3)], orders=(1, 2, 3)),
    Case("exp", F.exp, [lambda: randn(2, 3)], orders=(1, 2, 3)),
    Case("log", F.log, [lambda: positive(2, 3)], orders=(1, 2, 3)),
    Case("reshape", lambda x: F.reshape(x, (3, 2)), [lambda: randn(2, 3)]),
    Case("expand_dims", lambda x: F.expand_dims(x, 1), [lambda: randn(2, 3)]),
    Case("flatten", F.flatten, [lambda: randn(2, 3, 2)]),
    Case("transpose", F.transpose, [lambda: randn(2, 3)]),
    Case("transpose_axes", lambda x: F.transpose(x, (1, 2, 0)), [lambda: randn(2, 3, 4)]),
    Case("sum", F.sum, [lambda: randn(2, 3)]),
    Case("sum_axis_keepdims", lambda x: F.sum(x, axis=1, keepdims=True), [lambda: randn(2, 3)]),
    Case("sum_to", lambda x: F.sum_to(x, (1, 3)), [lambda: randn(2, 3)]),
    Case("broadcast_to", lambda x: F.broadcast_to(x, (2, 3)), [lambda: randn(1, 3)]),
    Case("matmul", F.matmul, [lambda: randn(2, 3), lambda: randn(3, 4)]),
    Case("linear", F.linear, [lambda: randn(2, 3), lambda: randn(3, 4), lambda: randn(4)]),
    Case("linear_no_bias", lambda x, w: F.linear(x, w), [lambda: randn(2, 3), lambda: randn(3, 4)]),
    Case("linear_simple", F.linear_simple, [lambda: randn(2, 3), lambda: randn(3, 4), lambda: randn(4)]),
    Case("get_item", lambda x: x[1], [lambda: randn(3, 2)], orders=(1, 2, 3)),
    Case("get_item_repeated", lambda x: F.get_item(x, np.array([0, 2, 0, 0])), [lambda: randn(3, 2)],
         orders=(1, 2, 3)),
    Case("sigmoid", F.sigmoid, [lambda: randn(2, 3)]),
    Case("sigmoid_simple", F.sigmoid_simple, [lambda: randn(2, 3)]),
    Case("relu", F.relu, [lambda: randn(2, 3)]),
    Case("softmax", F.softmax, [lambda: randn(2, 3)]),
    Case("softmax_simple", F.softmax_simple, [lambda: randn(2, 3)]),
    Case("log_softmax", F.log_softmax, [lambda: randn(2, 3)]),
    Case("leaky_relu", F.leaky_relu, [lambda: randn(2, 3)]),
    Case("mean_squared_error", F.mean_squared_error, [lambda: randn(4, 2), lambda: randn(4, 2)]),
    Case("mean_squared_error_simple", F.mean_squared_error_simple,
         [lambda: randn(4, 2), lambda: randn(4, 2)]),
    Case("softmax_cross_entropy", F.softmax_cross_entropy, [lambda: randn(4, 3), lambda: _labels(4)]),
    Case("softmax_cross_entropy_simple", F.softmax_cross_entropy_simple,
         [lambda: randn(4, 3), lambda: _labels(4)]),
    Case("sigmoid_cross_entropy", F.sigmoid_cross_entropy,
         [lambda: randn(4, 1), lambda: _labels(4, 1, classes=2)]),
    Case("binary_cross_entropy", lambda x, t: F.binary_cross_entropy(F.sigmoid(x), t),
         [lambda: randn(4, 1), lambda: _labels(4, 1, classes=2)]),
    Case("dropout", lambda x: F.dropout(x, 0.3), [lambda: randn(4, 5)]),
    Case("batch_norm_2d", lambda x, g, b: F.batch_nrom(x, g, b, np.zeros(3), np.ones(3)),
         [lambda: randn(4, 3), lambda: positive(3), lambda: randn(3)]),
    Case("batch_norm_4d", lambda x, g, b: F.batch_nrom(x, g, b, np.zeros(2), np.ones(2)),
         [lambda: randn(2, 2, 3, 3), lambda: positive(2), lambda: randn(2)]),
    Case("max", F.max, [lambda: randn(2, 3)]),
    Case("max_axis", lambda x: F.max(x, axis=1, keepdims=True), [lambda: randn(2, 3)]),
    Case("min", lambda x: F.min(x, axis=0), [lambda: randn(2, 3)]),
    Case("clip", lambda x: F.clip(x, -0.5, 0.5), [lambda: randn(3, 4)]),
    Case("embed_id", lambda w: F.embed_id(np.array([0, 2, 2]), w), [lambda: randn(3, 4)]),
    # dezero.functions_conv
    Case("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=1, pad=1),
         [lambda: randn(1, 2, 4, 4), lambda: randn(3, 2, 3, 3), lambda: randn(3)], native_errors=(2,)),
    Case("conv2d_stride", lambda x, w: F.conv2d(x, w, stride=2, pad=0),
         [lambda: randn(2, 1, 5, 5), lambda: randn(2, 1, 3, 3)], native_errors=(2,)),
    Case("conv2d_simple", lambda x, w, b: F.conv2d_simple(x, w, b, stride=1, pad=1),
         [lambda: randn(1, 2, 4, 4), lambda: randn(3, 2, 3, 3), lambda: randn(3)]),
    Case("deconv2d", lambda x, w, b: F.deconv2d(x, w, b, stride=2, pad=1),
         [lambda: randn(1, 2, 3, 3), lambda: randn(2, 3, 3, 3), lambda: randn(3)], native_errors=(2,)),
    Case("pooling", lambda x: F.pooling(x, 2, stride=2), [lambda: randn(1, 2, 4, 4)], orders=(1, 2, 3)),
    Case("pooling_simple", lambda x: F.pooling_simple(x, 2, stride=2), [lambda: randn(1, 2, 4, 4)]),
    Case("average_pooling", lambda x: F.average_pooling(x, 2, stride=2), [lambda: randn(1, 2, 4, 4)]),
    Case("im2col", lambda x: F.im2col(x, 2, stride=1, pad=0), [lambda: randn(1, 2, 3, 3)]),
    Case("col2im", lambda x: F.col2im(x, (1, 2, 3, 3), 2, stride=1, pad=0, to_matrix=True),
         [lambda: randn(4, 8)]),
]


def function_program(case, order, retain_grad=True):
    """``case``'s function on seeded inputs, differentiated ``order`` times
    with DeZero's idiom (``create_graph``, take ``x.grad``, clear it,
    backward again); the gradients of every input at every order."""

    def program():
        arrays = [make() for make in case.makers]
        inputs = [Variable(array) for array in arrays if array.dtype.kind == "f"]
        labels = [array for array in arrays if array.dtype.kind != "f"]
        y = case.function(*inputs, *labels)
        # DeZero starts from y.grad when it is set: a random upstream gradient.
        y.grad = Variable(randn(*y.shape))
        result = {}
        y.backward(retain_grad=retain_grad, create_graph=order > 1)
        result["order1"] = {"y": snapshot(y), **{f"x{i}": snapshot(x) for i, x in enumerate(inputs)}}
        for k in range(2, order + 1):
            # d/dx of sum(r * dy/dx), as DeZero's higher-order examples do.
            gxs = [x.grad for x in inputs]
            for x in inputs:
                x.cleargrad()
            total = None
            for gx in gxs:
                if gx is None:
                    continue
                term = F.sum(gx * Variable(randn(*gx.shape)))
                total = term if total is None else total + term
            if total is None or total.creator is None:
                result[f"order{k}"] = "constant"
                break
            total.backward(create_graph=k < order)
            result[f"order{k}"] = {f"x{i}": snapshot(x) for i, x in enumerate(inputs)}
        return result

    return program


def function_names_reached(*roots):
    """The class names of every DeZero Function upstream of ``roots``."""
    names = set()
    seen = set()
    stack = [root.creator for root in roots if root is not None and root.creator is not None]
    while stack:
        function = stack.pop()
        if id(function) in seen:
            continue
        seen.add(id(function))
        names.add(type(function).__name__)
        for x in function.inputs:
            if x.creator is not None:
                stack.append(x.creator)
    return names


def differentiable_function_classes():
    """Every Function subclass that DeZero defines in core, functions and
    functions_conv."""
    import dezero.core
    import dezero.functions_conv

    classes = set()
    for module in (dezero.core, F, dezero.functions_conv):
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, dezero.core.Function)
                    and value is not dezero.core.Function and value.__module__ == module.__name__):
                classes.add(value.__name__)
    return classes


# -- models, layers, optimizers ----------------------------------------------------------------

def named_params(layer):
    """``{"l0/W": param, ...}``: DeZero's own naming of a layer's parameters."""
    params = {}
    layer._flatten_params(params)
    return params


def parameters(model):
    return {name: np.array(param.data, copy=True) for name, param in named_params(model).items()}


def mlp_training(optimizer_factory, steps=3, hooks=()):
    """A few optimizer steps of an MLP on a seeded regression problem; the
    parameters and losses after each step."""

    def program():
        x = np.random.rand(16, 1)
        t = np.sin(2 * np.pi * x) + np.random.rand(16, 1)
        model = M.MLP((8, 8, 1))
        optimizer = optimizer_factory().setup(model)
        for hook in hooks:
            optimizer.add_hook(hook)
        result = {}
        for step in range(steps):
            loss = F.mean_squared_error(model(x), t)
            model.cleargrads()
            loss.backward()
            optimizer.update()
            result[f"loss{step}"] = np.array(loss.data)
            result[f"params{step}"] = parameters(model)
        return result

    return program


def layer_program(make_layer, make_input, steps=1):
    """``make_layer()`` applied to a seeded input; the gradients of its
    parameters and of the input."""

    def program():
        layer = make_layer()
        x = Variable(make_input())
        y = layer(x)
        for _ in range(steps - 1):
            y = layer(y) if y.shape == x.shape else y
        loss = F.sum(y * Variable(randn(*y.shape)))
        loss.backward()
        return {"x": snapshot(x), **{name: snapshot(param) for name, param in named_params(layer).items()}}

    return program


LAYER_CASES = {
    "Linear": (lambda: L.Linear(4), lambda: randn(3, 5)),
    "Linear_nobias": (lambda: L.Linear(4, nobias=True, in_size=5), lambda: randn(3, 5)),
    "Conv2d": (lambda: L.Conv2d(3, kernel_size=3, stride=1, pad=1), lambda: randn(2, 2, 4, 4)),
    "Deconv2d": (lambda: L.Deconv2d(2, kernel_size=3, stride=2, pad=1), lambda: randn(1, 3, 3, 3)),
    "BatchNorm": (L.BatchNorm, lambda: randn(5, 3)),
    "EmbedID": (lambda: L.EmbedID(5, 3), lambda: np.array([0, 3, 3, 1])),
    "MLP": (lambda: M.MLP((6, 5, 2)), lambda: randn(4, 3)),
    "MLP_relu": (lambda: M.MLP((6, 2), activation=F.relu), lambda: randn(4, 3)),
    "Sequential": (lambda: M.Sequential(L.Linear(4), L.BatchNorm(), L.Linear(2)), lambda: randn(5, 3)),
}


def layer_input_program(name):
    make_layer, make_input = LAYER_CASES[name]
    if name == "EmbedID":
        # An integer input: only the table is differentiated.
        def program():
            layer = make_layer()
            y = layer(make_input())
            F.sum(y * Variable(randn(*y.shape))).backward()
            return {"W": snapshot(layer.W)}
        return program
    return layer_program(make_layer, make_input)


def rnn_bptt(layer_factory, steps=12, bptt_length=4):
    """DeZero's truncated backpropagation through time (its step 59/60
    examples): a recurrent layer and a Linear head on a sine wave, with
    ``loss.unchain_backward()`` every ``bptt_length`` steps and an Adam
    update."""

    def program():
        rnn = layer_factory()
        head = L.Linear(1)
        model = M.Sequential(rnn, head)
        optimizer = dezero.optimizers.Adam(0.01).setup(model)
        xs = np.sin(np.linspace(0, 4 * np.pi, steps + 1)).reshape(-1, 1, 1)
        loss, count = 0, 0
        result = {}
        for i in range(steps):
            y = model(xs[i])
            loss += F.mean_squared_error(y, xs[i + 1])
            count += 1
            if count % bptt_length == 0 or count == steps:
                model.cleargrads()
                loss.backward()
                loss.unchain_backward()
                optimizer.update()
                result[f"loss{i}"] = np.array(loss.data)
                result[f"params{i}"] = parameters(model)
                loss = 0
        return result

    return program
