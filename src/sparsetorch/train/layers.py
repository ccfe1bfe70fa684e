"""The two kinds of layer a sparse trainer updates, behind one small interface.

``MaskedLayer``: a dense ``Linear``/``Conv2d`` weight with a bool mask (weights and optimizer
state outside the mask are kept exactly zero). ``SparseLayer``: an ``st.nn.SparseLinear``
whose ``values`` hold only the active weights; a mask update rebuilds its pattern and moves
the values and their optimizer state to the new storage order (grown entries zero).

Both give: ``active()`` (sorted flat row-major indices), ``values()`` (the active weights in
that order), ``grad_rows(r0, r1)`` (rows of the dense gradient of the weight as a 2-D
``(out, in * kernel)`` matrix), ``apply(change, optimizer)`` and ``mask()``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .update import Change


def _state_tensors(optimizer, param: torch.Tensor):
    """The optimizer's state tensors of ``param`` that hold one entry per weight (SGD's
    momentum, Adam's two moments, ...): ``(key, tensor)`` pairs."""
    state = optimizer.state.get(param, {})
    return [(k, v) for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.shape == param.shape]


class MaskedLayer:
    """A dense weight kept sparse by a mask."""

    def __init__(self, name: str, param: torch.nn.Parameter,
                 reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.name, self.param, self.reduce = name, param, reduce
        self.shape = tuple(param.shape)
        self.shape2d = (self.shape[0], math.prod(self.shape[1:]))
        self.size = math.prod(self.shape)
        self._mask = torch.ones(self.shape, dtype=torch.bool, device=param.device)

    def mask(self) -> torch.Tensor:
        return self._mask

    def active(self) -> torch.Tensor:
        return self._mask.reshape(-1).nonzero().squeeze(1).cpu()

    def values(self) -> torch.Tensor:
        return self.param.detach().reshape(-1)[self.active().to(self.param.device)]

    def set_active(self, active: torch.Tensor, optimizer) -> None:
        """Make ``active`` the mask and zero everything outside it."""
        mask = torch.zeros(self.size, dtype=torch.bool, device=self.param.device)
        mask[active.to(self.param.device)] = True
        self._mask = mask.view(self.shape)
        self.enforce(optimizer)

    def enforce(self, optimizer) -> None:
        """Zero the weights and their optimizer state outside the mask."""
        with torch.no_grad():
            self.param.mul_(self._mask)
            for _, t in _state_tensors(optimizer, self.param):
                t.mul_(self._mask)

    def mask_grad(self) -> None:
        if self.param.grad is not None:
            self.param.grad.mul_(self._mask)

    def grad_rows(self, r0: int, r1: int) -> torch.Tensor:
        return self.reduce(self.param.grad.reshape(self.shape2d)[r0:r1])

    def has_grad(self) -> bool:
        return self.param.grad is not None

    def apply(self, change: Change, optimizer) -> None:
        # Newly grown entries were outside the mask, so their weight and state are already
        # zero; zeroing them again keeps that true even if something wrote there.
        grown = change.active[change.source < 0].to(self.param.device)
        with torch.no_grad():
            for t in [self.param] + [t for _, t in _state_tensors(optimizer, self.param)]:
                t.reshape(-1)[grown] = 0
        self.set_active(change.active, optimizer)


class SparseLayer:
    """An ``st.nn.SparseLinear`` whose pattern is the mask. The dense gradient of its weight
    exists only while ``grad_rows`` streams it: rows ``r0:r1`` of ``dY^T X`` from the layer's
    input and output gradient, captured by hooks on the steps that need them."""

    def __init__(self, name: str, module, reduce: Callable[[torch.Tensor], torch.Tensor],
                 capturing: Callable[[], bool]):
        self.name, self.module, self.reduce, self.capturing = name, module, reduce, capturing
        out_f, in_f = module.out_features, module.in_features
        self.shape = self.shape2d = (out_f, in_f)
        self.size = out_f * in_f
        self._x = self._dy = None
        self._handle = module.register_forward_hook(self._hook)

    @property
    def param(self) -> torch.nn.Parameter:
        return self.module.values

    def _hook(self, module, inputs, output):
        if not (output.requires_grad and torch.is_grad_enabled() and self.capturing()):
            return
        x = inputs[0].detach()
        if x.dim() == 4:   # a SparseConv2d (1x1): the same product over every pixel it reads
            s = module.stride
            x = x[:, :, ::s, ::s].movedim(1, -1)
        self._x = x.reshape(-1, self.shape[1])

        def keep_grad(g):
            g = g.detach()
            self._dy = (g.movedim(1, -1) if g.dim() == 4 else g).reshape(-1, self.shape[0])
        output.register_hook(keep_grad)

    def mask(self) -> torch.Tensor:
        m = torch.zeros(self.size, dtype=torch.bool)
        m[self.active()] = True
        return m.view(self.shape)

    def active(self) -> torch.Tensor:
        arrays = self.module.weight.arrays
        pos, crd = arrays["pos1"].long().cpu(), arrays["crd1"].long().cpu()
        rows = torch.repeat_interleave(torch.arange(self.shape[0]), pos.diff())
        return rows * self.shape[1] + crd

    def values(self) -> torch.Tensor:
        return self.module.values.detach()

    def has_grad(self) -> bool:
        return self._x is not None and self._dy is not None

    def grad_rows(self, r0: int, r1: int) -> torch.Tensor:
        if not self.has_grad():
            raise RuntimeError(f"{self.name}: no input/output gradient was captured for this "
                               "update step; call loss.backward() before step()")
        return self.reduce(self._dy[:, r0:r1].t() @ self._x)

    def release(self) -> None:
        self._x = self._dy = None

    def close(self) -> None:
        self.release()
        self._handle.remove()

    def set_active(self, active: torch.Tensor, optimizer, values=None) -> None:
        """Rebuild the pattern as ``active`` with ``values`` (zeros if None); a new ``values``
        Parameter replaces the old one in ``optimizer``."""
        old = self.module.values
        active = active.to(torch.int64).cpu()
        rows, cols = active // self.shape[1], active % self.shape[1]
        pos = torch.zeros(self.shape[0] + 1, dtype=torch.int64)
        pos[1:] = torch.cumsum(torch.bincount(rows, minlength=self.shape[0]), 0)
        if values is None:
            values = torch.zeros(active.numel(), dtype=old.dtype)
        dev = old.device
        pattern = _csr(self.shape, pos.to(dev), cols.to(dev), values.to(dev))
        self.module.set_pattern(pattern, values=values.to(dev))
        new = self.module.values
        if new is not old:
            _swap_param(optimizer, old, new)

    def apply(self, change: Change, optimizer) -> None:
        src = change.source.to(self.param.device)
        take = src.clamp_min(0)
        grown = src < 0
        old_param = self.module.values
        with torch.no_grad():
            values = torch.where(grown, 0, old_param.detach()[take])
            moved = {k: torch.where(grown, 0, t[take])
                     for k, t in _state_tensors(optimizer, old_param)}
        self.set_active(change.active, optimizer, values)
        state = optimizer.state.get(self.module.values)
        if state is not None:
            state.update(moved)


def _csr(shape, pos, crd, values):
    from ..formats import SparseTensor   # public class; arrays built here are trusted
    index = torch.int32 if max(shape) < 2 ** 31 - 1 else torch.int64
    return SparseTensor.from_levels(shape, "csr", {"pos1": pos.to(index), "crd1": crd.to(index)},
                                    values, check=False)


def _swap_param(optimizer, old: torch.Tensor, new: torch.Tensor) -> None:
    """Put ``new`` where ``old`` was in ``optimizer``'s groups, moving its state along."""
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p is old:
                group["params"][i] = new
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)
