"""A leaf tensor with exactly the tensor protocol pyengine reads (``data``,
``grad``, ``grad_fn``, ``output_nr``, ``requires_grad``) and nothing else:
for tests whose oracle is the ``.grad`` the engine leaves."""


class Leaf:
    def __init__(self, data):
        self.data = data
        self.grad = None
        self.grad_fn = None
        self.output_nr = 0
        self.requires_grad = True
