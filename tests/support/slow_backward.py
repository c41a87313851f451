"""An identity whose backward keeps the GPU busy, for tests of what the host does while it waits."""

from __future__ import annotations

import torch


class SlowBackward(torch.autograd.Function):
    """``SlowBackward.apply(x, cycles)``: ``x``; its backward sleeps ``cycles`` GPU clock cycles on the
    compute stream before the gradient flows on."""

    @staticmethod
    def forward(ctx, x, cycles: int):
        ctx.cycles = cycles
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        torch.cuda._sleep(ctx.cycles)
        return grad, None
