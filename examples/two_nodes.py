"""The README's example: two Python Nodes, backward and grad."""

import numpy as np

import pyengine


class Leaf:
    """A minimal tensor: pyengine reads data, grad, grad_fn, output_nr, requires_grad."""

    def __init__(self, data, grad_fn=None, requires_grad=True):
        self.data = np.asarray(data, dtype=np.float64)
        self.grad = None
        self.grad_fn = grad_fn
        self.output_nr = 0
        self.requires_grad = requires_grad


class MulBackward(pyengine.Node):
    """Backward of z = x * y."""

    def __init__(self, x, y):
        super().__init__(next_edges=[pyengine.gradient_edge(x), pyengine.gradient_edge(y)],
                         input_metadata=[x.data * y.data])
        self.save_for_backward(x.data, y.data)

    def apply(self, grads):
        x, y = self.saved_values
        return [grads[0] * y, grads[0] * x]


class SumBackward(pyengine.Node):
    """Backward of s = z.sum(); the engine reduces nothing here, it broadcasts."""

    def __init__(self, z):
        super().__init__(next_edges=[pyengine.gradient_edge(z)],
                         input_metadata=[((), np.float64)])
        self.shape = z.data.shape

    def apply(self, grads):
        return [np.broadcast_to(grads[0], self.shape)]


x = Leaf([1.0, 2.0, 3.0])
y = Leaf([4.0, 5.0, 6.0])
z = Leaf(x.data * y.data, grad_fn=MulBackward(x, y))
s = Leaf(z.data.sum(), grad_fn=SumBackward(z))

pyengine.backward(s, retain_graph=True)
print(x.grad, y.grad)  # [4. 5. 6.] [1. 2. 3.]

(dz,) = pyengine.grad(s, [z])
print(dz)  # [1. 1. 1.]
