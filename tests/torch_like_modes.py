"""A grad mode context written as torch writes ``no_grad``: the interrupt
sweep's own oracle (``tests/test_interrupt_sweep.py``) sweeps it, and must
find the two places where an interrupt leaves grad mode off."""

from pyengine import _core


class TorchLikeNoGrad:
    def __enter__(self):
        self.prev = _core.is_grad_enabled()
        _core.set_grad_enabled(False)

    def __exit__(self, *exc_info):
        _core.set_grad_enabled(self.prev)
