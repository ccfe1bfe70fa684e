"""The two things a workload times, built the same way for every implementation.

``inference`` wraps a forward pass (no autograd); ``training`` wraps one optimizer step
(zero the gradients, forward, loss, backward, ``Adam.step``). Their ``check`` callables give
what ``runner`` compares before timing: the output, or the loss and the gradients in a
layout every implementation maps its own parameters to.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> impl = training("toy", "dense", lambda: w * 3, [w], lambda out: out.sum(),
    ...                 lambda: {"w": w.grad})
    >>> impl.check()["w"]
    tensor([3., 3.])
    >>> float(impl.run()) > 0
    True
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from .workloads import Impl

LEARNING_RATE = 0.01


def inference(name: str, family: str, forward: Callable[[], torch.Tensor],
              config: str = "") -> Impl:
    """An ``Impl`` timing ``forward()`` under ``torch.no_grad``; its check is the output."""
    def run():
        with torch.no_grad():
            return forward()

    return Impl(name, family, run, lambda: {"out": run()}, config)


def training(name: str, family: str, forward: Callable[[], torch.Tensor],
             params: Iterable[torch.Tensor], loss: Callable[[torch.Tensor], torch.Tensor],
             grads: Callable[[], dict], config: str = "") -> Impl:
    """An ``Impl`` timing one Adam step of ``loss(forward())`` over ``params``. Its check
    computes the loss and ``grads()`` (name -> gradient in the shared layout) from the
    starting weights, without stepping. Adam is torch's fused implementation, the fastest
    for every implementation here (the default, one parameter at a time, took the dense
    autoencoder's step from 3.3 to 4.3 ms: 1.0 ms of it optimizer), else its default."""
    params = list(params)
    opt = _adam(params)

    def run():
        opt.zero_grad(set_to_none=True)
        value = loss(forward())
        value.backward()
        opt.step()
        return value

    def check():
        opt.zero_grad(set_to_none=True)
        value = loss(forward())
        value.backward()
        out = {"loss": value.detach(), **grads()}
        opt.zero_grad(set_to_none=True)
        return out

    return Impl(name, family, run, check, config)


def _adam(params: list) -> torch.optim.Optimizer:
    try:
        return torch.optim.Adam(params, lr=LEARNING_RATE, fused=True)
    except (RuntimeError, ValueError, TypeError):   # (parameters fused Adam does not take)
        return torch.optim.Adam(params, lr=LEARNING_RATE)
