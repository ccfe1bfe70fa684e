"""The two kinds of layer a sparse trainer updates, behind one small interface.

``MaskedLayer``: a dense ``Linear``/``Conv2d`` weight with a bool mask (weights and optimizer
state outside the mask are kept exactly zero). ``SparseLayer``: an ``st.nn.SparseLinear``
whose ``values`` hold only the active weights; a mask update rebuilds its pattern and moves
the values and their optimizer state to the new storage order (grown entries zero, their
state as a new parameter's).

Both give: ``active()`` (sorted flat row-major indices), ``values()`` (the active weights in
that order), ``grad_rows(r0, r1)`` (rows of the dense gradient of the weight as a 2-D
``(out, in * kernel)`` matrix), ``apply(change, optimizer)`` and ``mask()``.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..formats import SparseTensor
from ..ops import einsum
from . import distributed as _dist
from .update import Change


def _state_tensors(optimizer, param: torch.Tensor):
    """The optimizer's state tensors of ``param`` that hold one entry per weight (SGD's
    momentum, Adam's two moments, ...): ``(key, tensor)`` pairs."""
    state = optimizer.state.get(param, {})
    return [(k, v) for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.shape == param.shape]


def _fresh(optimizer, param: torch.Tensor, key: str) -> float:
    """The value a weight's per-entry state ``key`` starts at in ``optimizer``, as torch
    initialises it for a new parameter: Rprop's step sizes at the learning rate, Adagrad's
    sums at ``initial_accumulator_value``; 0 for every other (moments, momentum). A grown
    weight starts there (at 0, Rprop clamped its step to the minimum, 1e-6: a grown weight
    took ~50 steps to move as a new one does)."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])),
                 optimizer.defaults)
    if isinstance(optimizer, torch.optim.Rprop) and key == "step_size":
        return float(group["lr"])
    if isinstance(optimizer, torch.optim.Adagrad) and key == "sum":
        return float(group["initial_accumulator_value"])
    return 0.0


class MaskedLayer:
    """A dense weight kept sparse by a mask."""

    def __init__(self, name: str, param: torch.nn.Parameter,
                 reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.name, self.param, self.reduce = name, param, reduce
        self.shape = tuple(param.shape)
        self.shape2d = (self.shape[0], math.prod(self.shape[1:]))
        self.size = math.prod(self.shape)
        self._set_mask(torch.ones(self.shape, dtype=torch.bool, device=param.device))

    def mask(self) -> torch.Tensor:
        return ~self._off

    def _set_mask(self, mask: torch.Tensor) -> None:
        # (kept inverted, the form every step fills by: one bool a weight, not two)
        self._off = ~mask

    def zero_outside(self, t: torch.Tensor) -> None:
        """Zero ``t`` (the weight, its gradient or optimizer state) outside the mask, in
        place: filled, not multiplied by the mask, where ``NaN * 0`` would stay NaN."""
        t.masked_fill_(self._off, 0)

    def active(self) -> torch.Tensor:
        return self.mask().reshape(-1).nonzero().squeeze(1).cpu()

    def values(self) -> torch.Tensor:
        return self.param.detach().reshape(-1)[self.active().to(self.param.device)]

    def set_active(self, active: torch.Tensor, optimizer) -> None:
        """Make ``active`` the mask and zero everything outside it."""
        mask = torch.zeros(self.size, dtype=torch.bool, device=self.param.device)
        mask[active.to(self.param.device)] = True
        self._set_mask(mask.view(self.shape))
        self.enforce(optimizer)

    def enforce(self, optimizer) -> None:
        """Zero the weights and their optimizer state outside the mask."""
        with torch.no_grad():
            self.zero_outside(self.param)
            for _, t in _state_tensors(optimizer, self.param):
                self.zero_outside(t)

    def mask_grad(self) -> None:
        if self.param.grad is not None:
            self.zero_outside(self.param.grad)

    def grad_rows(self, r0: int, r1: int) -> torch.Tensor:
        return self.reduce(self.param.grad.reshape(self.shape2d)[r0:r1])

    def has_grad(self) -> bool:
        return self.param.grad is not None

    def apply(self, change: Change, optimizer) -> None:
        # Newly grown entries were outside the mask, so their weight and state are already
        # zero; zeroing them again keeps that true even if something wrote there, and their
        # state starts where a new parameter's does (``_fresh``).
        grown = change.active[change.source < 0].to(self.param.device)
        # (written at their row-major positions unravelled: ``reshape(-1)`` of a
        # channels_last weight is a copy, and writes through it were lost)
        at = torch.unravel_index(grown, self.param.shape)
        with torch.no_grad():
            self.param[at] = 0
            for key, t in _state_tensors(optimizer, self.param):
                t[at] = _fresh(optimizer, self.param, key)
        self.set_active(change.active, optimizer)


class SparseLayer:
    """An ``st.nn.SparseLinear`` (or ``SparseConv2d``, a 1x1 convolution on the same
    interface) whose pattern is the mask. The dense gradient of its weight exists only while
    ``grad_rows`` streams it: rows ``r0:r1`` of ``dY X^T`` with ``X`` (in, positions) and
    ``dY`` (out, positions) the layer's input and output gradient as matrices, captured by
    hooks before the steps that need them.

    ``active()`` and ``values()`` are in row-major order; the layer's storage order differs
    where it stores blocks (SparseConv2d picks BSR for a blocky pattern), and ``apply``
    translates between the two."""

    def __init__(self, name: str, module, reduce: Callable[[torch.Tensor], torch.Tensor],
                 capturing: Callable[[], bool], conv: bool):
        self.name, self.module, self.reduce, self.capturing = name, module, reduce, capturing
        self.conv = conv
        out_f, in_f = module.out_features, module.in_features
        # (a 1x1 convolution's weight is (out, in, 1, 1), as the same nn.Conv2d's in masked
        # mode: ERK counts its kernel sizes)
        self.shape = (out_f, in_f, 1, 1) if conv else (out_f, in_f)
        self.shape2d = (out_f, in_f)
        self.size = out_f * in_f
        # (X, dY) per backward: X (in, positions) dense or (positions, in) a SparseTensor
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._known = module.values   # the Parameter the optimizer was last given
        self._known_count = module.values.numel()   # (a load resizes it in place)
        self._handle = module.register_forward_hook(self._hook, with_kwargs=True)

    @property
    def param(self) -> torch.nn.Parameter:
        return self.module.values

    def _hook(self, module, args, kwargs, output):
        if not (output.requires_grad and torch.is_grad_enabled() and self.capturing()):
            return
        if module.values.grad is None:   # zero_grad() since the pairs were kept: start over
            self._pairs = []
        out_f, in_f = self.shape2d
        x = (args[0] if args else next(iter(kwargs.values()))).detach()
        if self.conv:    # (N, C, H, W) -> (C, N*H*W), after the stride the layer applies
            x = x[:, :, ::module.stride, ::module.stride]
            x = x.transpose(0, 1).reshape(in_f, -1)
        elif not (type(x) is SparseTensor and x.dim() == 2):   # (a sparse batch stays so)
            x = (x.to_dense() if type(x) is SparseTensor else x).reshape(-1, in_f).t()
        # the gradient wanted is the weight's: before the layer's fused activation
        if module.activation not in _DERIVATIVES:
            raise ValueError(f"{self.name}: the layer's fused activation "
                             f"{module.activation!r} hides what its weight's gradient needs "
                             f"(the sign of its input); build the layer with activation=None "
                             f"and apply torch.{module.activation} after it")
        derivative = _DERIVATIVES[module.activation]
        y = output.detach() if derivative is not None else None

        def keep_grad(g):
            # this call's own input with its own output gradient: a layer called twice in a
            # forward, or several micro-batches, add up as the weight's gradient does
            g = g.detach() if derivative is None else derivative(g.detach(), y)
            dy = (g.transpose(0, 1).reshape(out_f, -1) if self.conv
                  else g.reshape(-1, out_f).t())
            self._pairs.append((x, dy))
        output.register_hook(keep_grad)

    def mask(self) -> torch.Tensor:
        m = torch.zeros(self.size, dtype=torch.bool, device=self.param.device)
        m[self.active().to(m.device)] = True
        return m.view(self.shape2d)

    def _stored_positions(self) -> torch.Tensor:
        """Flat row-major position of each stored entry, in storage order."""
        weight = self.module.weight.detach()
        if self.module.blocksize is None:   # CSR: rows from the row pointers
            arrays = weight.arrays
            pos, crd = arrays["pos1"].long().cpu(), arrays["crd1"].long().cpu()
            rows = torch.repeat_interleave(torch.arange(self.shape2d[0]), pos.diff())
            return rows * self.shape2d[1] + crd
        numbered = weight.with_values(torch.arange(1, weight.nnz + 1, dtype=torch.float64,
                                                   device=weight.device))
        flat = numbered.to_dense().flatten().cpu()
        where = flat.nonzero().squeeze(1)
        out = torch.empty(weight.nnz, dtype=torch.int64)
        out[flat[where].long() - 1] = where
        return out

    def _storage(self):
        """(row-major active set, storage position of each of its entries or None for
        row-major storage)."""
        stored = self._stored_positions()
        if self.module.blocksize is None:
            return stored, None
        order = torch.argsort(stored)
        return stored[order], order

    def active(self) -> torch.Tensor:
        return self._storage()[0]

    def values(self) -> torch.Tensor:
        _, order = self._storage()
        v = self.module.values.detach()
        return v if order is None else v[order.to(v.device)]

    def has_grad(self) -> bool:
        """Whether a gradient was captured, on any rank: a layer one rank's forward did not
        use (DDP's ``find_unused_parameters``) still enters the all-reduce of its dense
        gradient with zeros; deciding alone, SNFS's ranks hung there and RigL's raised on
        one rank while the other waited."""
        return _dist.any_rank(bool(self._pairs))

    def grad_rows(self, r0: int, r1: int) -> torch.Tensor:
        if not self._pairs:
            if _dist.world_size() == 1:
                raise RuntimeError(f"{self.name}: no input/output gradient was captured for "
                                   "this update step; call loss.backward() before step()")
            local = self.param.new_zeros(r1 - r0, self.shape2d[1])   # (unused on this rank)
        else:
            local = sum(_rows_times(dy[r0:r1], x) for x, dy in self._pairs)
        return self.reduce(local)

    def release(self) -> None:
        self._pairs = []

    def sync(self, optimizer) -> None:
        """Give ``optimizer`` the layer's current ``values`` Parameter (with the state it held
        for the old one) when something else replaced it (``set_pattern``), and drop state
        sized for another entry count (``model.load_state_dict`` resizes it in place)."""
        new = self.module.values
        if new is self._known and new.numel() == self._known_count:
            return
        if new is not self._known:
            _swap_param(optimizer, self._known, new)
        self._known, self._known_count = new, new.numel()
        state = optimizer.state.get(new, {})
        if any(isinstance(v, torch.Tensor) and v.dim() and v.shape != new.shape
               for v in state.values()):
            del optimizer.state[new]   # sized for another entry count: nothing matches

    def close(self) -> None:
        self.release()
        self._handle.remove()

    def set_active(self, active: torch.Tensor, optimizer, values=None) -> dict | None:
        """Rebuild the pattern as ``active`` (row-major flat indices, sorted) with ``values``
        (in that order; zeros if None); ``optimizer`` is handed the layer's values (state
        sized for another count dropped: ``apply`` moves it). Returns the storage position
        of each entry of ``active`` when the layer stores them in another order (blocks),
        else None."""
        self.sync(optimizer)
        old = self.module.values
        dev = old.device
        active = active.to(torch.int64).cpu()
        if values is None:
            values = torch.zeros(active.numel(), dtype=old.dtype)
        if self.conv:   # SparseConv2d takes a dense mask and may choose blocks
            mask = torch.zeros(self.size, dtype=torch.bool)
            mask[active] = True
            dense = torch.zeros(self.size, dtype=old.dtype, device=dev)
            dense[active.to(dev)] = values.to(dev)
            self.module.set_pattern(mask.view(self.shape2d).to(dev),
                                    dense.view(self.shape2d))
        else:
            out_f, in_f = self.shape2d
            rows, cols = active // in_f, active % in_f
            pos = torch.zeros(out_f + 1, dtype=torch.int64)
            pos[1:] = torch.cumsum(torch.bincount(rows, minlength=out_f), 0)
            pattern = _csr(self.shape2d, pos.to(dev), cols.to(dev), values.to(dev))
            self.module.set_pattern(pattern, values=values.to(dev))
        self.sync(optimizer)
        return self._storage()[1]

    def apply(self, change: Change, optimizer) -> None:
        _, old_order = self._storage()
        old_param = self.module.values
        src = change.source.to(old_param.device)
        take = src.clamp_min(0)
        if old_order is not None:            # row-major position -> old storage position
            take = old_order.to(take.device)[take]
        grown = src < 0
        with torch.no_grad():
            values = _taken(old_param.detach(), take, grown, 0.0)
            moved = {k: _taken(t, take, grown, _fresh(optimizer, old_param, k))
                     for k, t in _state_tensors(optimizer, old_param)}
        # (the rest of the state, e.g. Adam's step count: a new count of entries makes
        # set_active drop the state sized for the old one, which a prune must not lose,
        # as masked mode keeps the kept weights' momentum)
        kept = {k: v for k, v in optimizer.state.get(old_param, {}).items() if k not in moved}
        new_order = self.set_active(change.active, optimizer, values)
        if moved:
            if new_order is not None:        # row-major order -> new storage order
                inverse = torch.empty_like(new_order)
                inverse[new_order] = torch.arange(new_order.numel())
                moved = {k: t[inverse.to(t.device)] for k, t in moved.items()}
            state = optimizer.state.setdefault(self.module.values, {})
            state.update({**kept, **state, **moved})


def _taken(old: torch.Tensor, take: torch.Tensor, grown: torch.Tensor,
           fill: float) -> torch.Tensor:
    """``old[take]`` where an entry is kept, ``fill`` where it is grown (gathered at the kept
    entries alone: a layer that stored none has nothing to index)."""
    out = torch.full(take.shape, fill, dtype=old.dtype, device=old.device)
    kept = ~grown
    out[kept] = old[take[kept]]
    return out


# The gradient before a fused activation from the one after it, g, and the output y: each
# activation a truly sparse layer takes but abs, whose sign the output has lost (refused
# by a forward that captures). 0 where torch's backward gives 0, whatever g holds there.
_DERIVATIVES = {
    None: None,
    "relu": lambda g, y: torch.where(y <= 0, 0, g),   # (a NaN passes, as in torch's)
    "relu6": lambda g, y: torch.where((y > 0) & (y < 6), g, 0),
    "sigmoid": lambda g, y: g * y * (1 - y),
    "exp": lambda g, y: g * y,
    "sqrt": lambda g, y: g * 0.5 / y,
    "neg": lambda g, y: -g,
}


def _rows_times(dy: torch.Tensor, x) -> torch.Tensor:
    """``dy @ X^T`` for a kept ``X``: dense ``(in, positions)`` or a SparseTensor of rows."""
    if type(x) is SparseTensor:
        return einsum("rn,ni->ri", dy, x, out_format="dense")
    return dy @ x.t()


def _csr(shape, pos, crd, values):
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
