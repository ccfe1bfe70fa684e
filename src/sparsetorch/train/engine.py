"""The machinery every sparse training algorithm shares: finding the layers to sparsify,
initial masks with exact per-layer counts, stepping the optimizer on masked gradients, mask
updates on schedule, and ``state_dict`` / ``load_state_dict``.

In: a model (``Linear``/``Conv2d`` layers trained as dense weights with masks, and/or
``st.nn.SparseLinear``/``SparseConv2d`` layers trained truly sparse) and its optimizer.
Out: a trainer whose ``step()`` replaces ``optimizer.step()``. Algorithms (``algorithms.py``) subclass
``SparseTrainer`` and say how many weights to drop and how to score growth.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch
from torch import nn
from torch.nn.utils import parametrize

from . import distributed as _dist
from .densities import DISTRIBUTIONS, kept_count, layer_densities
from .layers import MaskedLayer, SparseLayer
from .schedules import is_update_step
from .update import change, drop_and_grow, drop_smallest, grow_largest

GROW_INITS = ("zeros",)


def _sparse_linear_type():
    try:
        from ..nn import SparseLinear
    except ImportError:   # the nn package is optional for masked training
        return None
    return SparseLinear


class SparseTrainer:
    """Base class of the sparse trainers (see ``RigL`` for the arguments).

    Subclasses set ``grows`` (does an update grow weights?), ``skips_optimizer_on_update``
    and implement ``_drop_count(layer, t)`` and ``_grow_score(layer)``.
    """
    grows = True
    prunes = False              # the active count falls from dense to ``counts`` over time
    skips_optimizer_on_update = True
    uses_gradient = False       # grow scores read the dense gradient on update steps

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 density: float = 0.1, distribution: str = "erk", delta_t: int = 100,
                 alpha: float = 0.3, t_end: int | None = None, total_steps: int | None = None,
                 dense=None, layer_density: dict | None = None, grow_init: str = "zeros",
                 seed: int = 0, noise_std: float = 1e-5, erk_power_scale: float = 1.0,
                 needs_schedule: bool = True):
        cls = type(self).__name__
        if not isinstance(model, nn.Module):
            raise TypeError(f"{cls}: model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{cls}: optimizer must be a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"{cls}: distribution={distribution!r} is not one of "
                             f"{DISTRIBUTIONS}")
        if grow_init not in GROW_INITS:
            raise ValueError(f"{cls}: grow_init={grow_init!r} is not supported; grown weights "
                             f"start at {GROW_INITS} (the paper's choice)")
        _check_int(cls, "delta_t", delta_t, 1)
        _check_int(cls, "seed", seed)
        if not -2 ** 63 <= seed < 2 ** 63:
            raise ValueError(f"{cls}: seed={seed} must fit in 64 bits (a signed int64)")
        for what, v in (("t_end", t_end), ("total_steps", total_steps)):
            if v is not None:
                _check_int(cls, what, v, 0 if what == "t_end" else 1)
        _check_real(cls, "alpha", alpha, 0.0, 1.0, "the initial fraction of active weights "
                    "dropped per update")
        _check_real(cls, "noise_std", noise_std, 0.0, math.inf, "the tie-breaking noise")
        if layer_density is not None and not isinstance(layer_density, Mapping):
            raise TypeError(f"{cls}: layer_density must be a dict of layer name -> density, "
                            f"got {type(layer_density).__name__}")
        if t_end is None and needs_schedule:
            if total_steps is None:
                raise ValueError(f"{cls}: give total_steps= (t_end defaults to 3/4 of it) "
                                 "or t_end= (the last step that updates masks)")
            t_end = int(0.75 * total_steps)
        self.model, self.optimizer = model, optimizer
        self.delta_t, self.alpha, self.t_end = delta_t, float(alpha), t_end
        self.total_steps, self.noise_std = total_steps, float(noise_std)
        self.distribution, self.density = distribution, density
        self.step_count = 0
        seed = _dist.same_seed(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.layers, names = self._find_layers(model, dense)
        try:   # (an error leaves no hook on the user's layers)
            self._check_optimizer()
            custom = _by_param_name(layer_density or {}, self.layers, names, cls,
                                    "layer_density")
            shapes = {name: layer.shape for name, layer in self.layers.items()}
            self.densities = layer_densities(shapes, density, distribution, custom,
                                             erk_power_scale)
            self.counts = {n: kept_count(self.layers[n].size, d)
                           for n, d in self.densities.items()}
            self._initial_masks(torch.Generator().manual_seed(seed + 1))
        except BaseException:
            self.close()
            raise
        self.last_update: dict[str, tuple[int, int]] = {}

    # ---- layers -------------------------------------------------------------------------
    def _find_layers(self, model, dense):
        """``(layers, names)``: the layers to sparsify by parameter name, and every name a
        user may give one by (module or parameter name, a tied weight's others, frozen ones)
        -> that layer's parameter name."""
        cls = type(self).__name__
        reduce = _identity if _dist.grads_already_averaged(model) else _dist.mean_over_ranks
        sparse_type = _sparse_linear_type()
        found, frozen, computed = [], [], []
        # a weight shared by several modules is one layer, under its first name; the
        # others name it too (dense=, layer_density=): two masks on one tensor kept only
        # their intersection (density ~d^2)
        aliases, owner, first = {}, {}, None
        try:   # (a SparseLayer hooks its module: none may stay behind an error)
            for mname, module in model.named_modules():
                prefix = mname + "." if mname else ""
                is_sparse = sparse_type is not None and isinstance(module, sparse_type)
                if not is_sparse and not isinstance(module, (nn.Linear, nn.Conv2d)):
                    continue
                if not is_sparse and parametrize.is_parametrized(module, "weight"):
                    computed.append(mname)   # (refused below unless kept dense)
                    aliases[mname] = aliases[prefix + "weight"] = prefix + "weight"
                    continue
                param = module.values if is_sparse else module.weight
                pname = prefix + ("values" if is_sparse else "weight")
                if id(param) in owner:
                    aliases[mname] = aliases[pname] = owner[id(param)][0]
                    continue
                owner[id(param)] = pname, param   # (held: an id is unique while alive)
                if first is None:
                    first = pname if not is_sparse and param.dim() == 4 else ""
                if not param.requires_grad:   # frozen: left as it is, out of the budget
                    frozen.append(mname)
                    aliases[mname] = aliases[pname] = pname
                    continue
                if is_sparse:
                    if module.blocksize and not _is_sparse_conv(module):
                        raise ValueError(f"{cls}: layer {mname!r} stores blocks (blocksize="
                                         f"{module.blocksize}); sparse training updates single "
                                         "entries, so build it without blocksize")
                    found.append((mname, SparseLayer(prefix + "values", module,
                                                     _dist.mean_over_ranks, self._capturing,
                                                     conv=_is_sparse_conv(module))))
                else:
                    found.append((mname, MaskedLayer(pname, param, reduce)))
            if dense is None:   # the official ImageNet/CIFAR code keeps a first conv dense
                dense = [first] if first else []
            elif isinstance(dense, str):
                dense = [dense]
            elif not isinstance(dense, (list, tuple, set)) or \
                    not all(isinstance(d, str) for d in dense):
                raise TypeError(f"{cls}: dense= must be a layer name or a list of them, got "
                                f"{dense!r}")
            names = dict(aliases)
            for mname, layer in found:
                names[mname] = names[layer.name] = layer.name
            dense_params = set()
            for d in dense:
                if d not in names:
                    raise ValueError(f"{cls}: dense= names {d!r}, which is not a Linear/Conv2d/"
                                     f"SparseLinear layer of the model; layers: "
                                     f"{[m for m, _ in found]}")
                dense_params.add(names[d])
            for mname in computed:
                if names[mname] not in dense_params:
                    raise ValueError(f"{cls}: layer {mname!r} computes its weight (a "
                                     "parametrization: weight_norm, spectral_norm, ...), "
                                     "which a mask cannot hold; remove the parametrization, "
                                     f"or keep the layer dense (dense=[{mname!r}])")
            layers = {}
            for _, layer in found:
                if layer.name in dense_params:
                    if isinstance(layer, SparseLayer):
                        raise ValueError(f"{cls}: {layer.name!r} is a SparseLinear and cannot "
                                         "be trained dense; use nn.Linear for a dense layer")
                    continue
                layers[layer.name] = layer
        except BaseException:
            for _, layer in found:
                if isinstance(layer, SparseLayer):
                    layer.close()
            raise
        if not layers:
            raise ValueError(f"{cls}: the model has no Linear/Conv2d/SparseLinear layer left to "
                             f"sparsify (found {[m for m, _ in found]}, dense={list(dense)}"
                             + (f", frozen (requires_grad=False): {frozen}" if frozen else "")
                             + ")")
        return layers, names

    def _check_optimizer(self):
        owned = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [n for n, l in self.layers.items() if id(l.param) not in owned]
        if missing:
            raise ValueError(f"{type(self).__name__}: the optimizer does not hold the weights "
                             f"{missing}; build it from model.parameters() before the trainer")

    def _initial_masks(self, generator):
        for name, layer in self.layers.items():
            count = self._initial_count(name)
            if isinstance(layer, MaskedLayer):
                layer.set_active(torch.sort(torch.randperm(layer.size, generator=generator)
                                            [:count]).values, self.optimizer)
                continue
            n = layer.active().numel()
            if n == count:
                continue   # a SparseLinear built at this density keeps its pattern and values
            if _dist.grads_already_averaged(self.model):
                raise ValueError(f"{type(self).__name__}: {name} stores {n} weights but its "
                                 f"density needs {count}; resizing its values Parameter would "
                                 "break DDP's gradient buckets, sized once. Build the layer "
                                 f"with that many entries (density={count}/{layer.size}: "
                                 "SparseLinear rounds its count, the trainer floors it as the "
                                 "official code does) or create the trainer before wrapping "
                                 "the model in DistributedDataParallel")
            # keep the user's pattern and trained values: drop the smallest or grow zeros at
            # random (seeded) until the layer holds its target count
            active, values = layer.active(), layer.values()
            keep = drop_smallest(values, max(0, n - count), generator, self.noise_std)
            cols = layer.shape2d[1]
            grown = grow_largest(active, max(0, count - n), layer.shape2d,
                                 lambda r0, r1: torch.rand((r1 - r0, cols), generator=generator))
            layer.apply(change(active, keep, grown), self.optimizer)

    def _initial_count(self, name: str) -> int:
        return self.counts[name]

    # ---- stepping -----------------------------------------------------------------------
    @property
    def masks(self) -> dict[str, torch.Tensor]:
        """``{parameter name: bool tensor of the weight's shape}`` (a SparseLinear's mask is
        its pattern, keyed by its ``values`` parameter's name)."""
        return {name: layer.mask() for name, layer in self.layers.items()}

    def nnz(self) -> dict[str, int]:
        """Active weights per layer now."""
        return {name: int(layer.active().numel()) for name, layer in self.layers.items()}

    def is_update_step(self, t: int | None = None) -> bool:
        """Whether ``step()`` number ``t`` (default: the next one) updates masks."""
        t = self.step_count if t is None else t
        return self.t_end is not None and is_update_step(t, self.delta_t, self.t_end)

    def step(self, closure=None):
        """Replace ``optimizer.step()``: on update steps change the masks (and, for RigL, SET
        and SNFS, skip the optimizer step); otherwise step the optimizer on the masked
        gradients and zero the weights outside the masks. ``closure`` (re-evaluates the
        loss with its gradient) is called on every step; its loss is returned."""
        t = self.step_count
        update = self.is_update_step(t)
        loss = None
        self._sync_parameters()
        if update and self.skips_optimizer_on_update and closure is not None:
            with torch.enable_grad():   # the update scores the gradient the closure computes
                loss = closure()
        if update and self.grows and self.uses_gradient:   # (before anything changes)
            missing = [n for n, layer in self.layers.items() if not layer.has_grad()]
            if missing:
                raise RuntimeError(f"{type(self).__name__}: {', '.join(missing)} "
                                   f"{'has' if len(missing) == 1 else 'have'} no gradient at "
                                   f"update step {t}; call loss.backward() before step() "
                                   "(nothing was changed)")
        if update and self.skips_optimizer_on_update:
            self._before_optimizer_step()
        else:
            if closure is None:
                self._before_optimizer_step()
                self._mask_gradients()
            else:   # (the gradient exists once the optimizer has called the closure)
                closure = self._prepared_closure(closure)
            loss = self.optimizer.step(closure)
            with torch.no_grad():
                for layer in self.layers.values():
                    if isinstance(layer, MaskedLayer):
                        layer.zero_outside(layer.param)
        if update:
            self._update_masks(t)
        self.step_count += 1
        return loss

    def _mask_gradients(self):
        for layer in self.layers.values():
            if isinstance(layer, MaskedLayer):
                layer.mask_grad()

    def _prepared_closure(self, closure):
        """``closure`` for ``optimizer.step``: each call's gradient masked before the
        optimizer reads it (LBFGS calls it several times), the first call's also folded
        into the algorithm's statistics, which take one gradient a step."""
        calls = 0

        def prepared():
            nonlocal calls
            with torch.enable_grad():
                loss = closure()
            if calls == 0:
                self._before_optimizer_step()
            calls += 1
            self._mask_gradients()
            return loss
        return prepared

    def _sync_parameters(self):
        """Hand the optimizer any SparseLinear ``values`` Parameter replaced behind the
        trainer's back (``model.load_state_dict`` makes new ones)."""
        for layer in self.layers.values():
            if isinstance(layer, SparseLayer):
                layer.sync(self.optimizer)

    def _before_optimizer_step(self):
        """Hook for algorithms that track gradients every step (SNFS)."""

    def _update_masks(self, t: int):
        self.last_update = {}
        for name, layer in self.layers.items():
            k = self._drop_count(layer, t)
            score = self._grow_score(layer) if self.grows else None
            ch = drop_and_grow(layer.active(), layer.values(), k, layer.shape2d, score,
                               self.generator, self.noise_std)
            layer.apply(ch, self.optimizer)
            if isinstance(layer, SparseLayer):
                layer.release()
            self.last_update[name] = (ch.n_dropped, ch.n_grown)

    def _capturing(self) -> bool:
        """Whether truly sparse layers keep their input and output gradient in this forward
        and backward: only before an update step that scores growth by the gradient."""
        return self.uses_gradient and self.is_update_step()

    def close(self) -> None:
        """Remove the hooks this trainer put on truly sparse layers (before training the
        same model with another trainer)."""
        for layer in self.layers.values():
            if isinstance(layer, SparseLayer):
                layer.close()

    def _drop_count(self, layer, t: int) -> int:
        raise NotImplementedError

    def _grow_score(self, layer):
        raise NotImplementedError

    # ---- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs besides the model's weights: the step count, each
        layer's kept count and active set (flat indices), the random generator, and the
        optimizer's class and state."""
        return {"algorithm": type(self).__name__, "step": self.step_count,
                "counts": dict(self.counts),
                "active": {n: l.active() for n, l in self.layers.items()},
                "generator": self.generator.get_state(),
                "optimizer_class": type(self.optimizer).__name__,
                "optimizer": self.optimizer.state_dict(), "extra": self._extra_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore from ``state_dict()``, before or after the model's weights (a SparseLinear
        whose pattern changes here gets zero values until its weights are loaded)."""
        cls = type(self).__name__
        if not isinstance(state, dict):
            raise TypeError(f"{cls}.load_state_dict: state must be the dict state_dict() "
                            f"returned, got {type(state).__name__}")
        if state.get("algorithm") != cls:
            raise ValueError(f"{cls}.load_state_dict: the state was saved by "
                             f"{state.get('algorithm')!r}, not {cls}")
        if set(state["active"]) != set(self.layers):
            raise ValueError(f"{cls}.load_state_dict: the state's layers "
                             f"{sorted(state['active'])} differ from this model's "
                             f"{sorted(self.layers)}")
        # (states saved before these keys existed skip the checks)
        counts = state.get("counts", self.counts)
        if counts != self.counts:
            differ = ", ".join(f"{n}: {counts.get(n)} saved, {self.counts[n]} here"
                               for n in sorted(self.counts) if counts.get(n) != self.counts[n])
            raise ValueError(f"{cls}.load_state_dict: the state keeps other weight counts "
                             f"({differ}); build the trainer with the density and "
                             "distribution of the run that saved it")
        saved_opt = state.get("optimizer_class", type(self.optimizer).__name__)
        if saved_opt != type(self.optimizer).__name__:
            raise ValueError(f"{cls}.load_state_dict: the state holds a {saved_opt} "
                             f"optimizer's state, but this trainer's optimizer is a "
                             f"{type(self.optimizer).__name__}; build it with {saved_opt}")
        # (checked before anything changes: the optimizer's own check came after the masks
        # were applied, which zeroed trained weights outside them)
        sizes = [len(g["params"]) for g in self.optimizer.param_groups]
        saved_sizes = [len(g.get("params", ())) for g in
                       state.get("optimizer", {}).get("param_groups", ())]
        if saved_sizes != sizes:
            raise ValueError(f"{cls}.load_state_dict: the state's optimizer has parameter "
                             f"groups of {saved_sizes} parameters, this trainer's of {sizes}; "
                             "build the optimizer with the parameter groups of the run "
                             "that saved it")
        actives = {name: _checked_active(cls, name, state["active"][name], layer.size,
                                         self.counts[name], self.prunes)
                   for name, layer in self.layers.items()}
        self._sync_parameters()
        for name, layer in self.layers.items():
            active = actives[name]
            if not torch.equal(active, layer.active()):
                layer.set_active(active, self.optimizer)
        self.step_count = int(state["step"])
        self.generator.set_state(state["generator"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_extra_state(state.get("extra", {}))

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass


def _is_sparse_conv(module) -> bool:
    """SparseConv2d (a SparseLinear subclass: a 1x1 convolution whose storage may switch to
    blocks of output channels by itself when a pattern is blocky)."""
    try:
        from ..nn import SparseConv2d
    except ImportError:
        return False
    return isinstance(module, SparseConv2d)


def _identity(t):
    return t


def _checked_active(cls, name, active, size: int, count: int, prunes: bool) -> torch.Tensor:
    """A saved layer's active set as int64, checked: increasing flat positions in
    ``[0, size)``, ``count`` of them (for a pruning trainer, from ``count`` to ``size``);
    a damaged state otherwise loaded silently with another count, or failed in torch."""
    where = f"{cls}.load_state_dict: the active set of layer {name!r}"
    if not isinstance(active, torch.Tensor) or active.dim() != 1 or \
            active.dtype.is_floating_point or active.dtype.is_complex or \
            active.dtype == torch.bool:
        raise ValueError(f"{where} is not a 1-D tensor of integer positions; the state is "
                         "damaged")
    active, n = active.to(torch.int64).cpu(), active.numel()
    if not (count <= n <= size if prunes else n == count):
        keeps = f"{count} to {size}" if prunes else f"{count}"
        raise ValueError(f"{where} holds {n} weights where this trainer keeps {keeps}; the "
                         "state is damaged or from a run of another density")
    if n and (active[0] < 0 or active[-1] >= size or bool((active[1:] <= active[:-1]).any())):
        raise ValueError(f"{where} is not increasing positions in [0, {size}) (the layer's "
                         "weights, row-major); the state is damaged")
    return active


def _check_int(cls, what, v, least=None) -> None:
    """Raise unless ``v`` is an int (not a bool), at least ``least`` if given."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{cls}: {what}={v!r} must be an int")
    if least is not None and v < least:
        raise ValueError(f"{cls}: {what}={v!r} must be an int >= {least}")


def _check_real(cls, what, v, low, high, meaning) -> None:
    """Raise unless ``v`` is a finite real number (not a bool) in [low, high]."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{cls}: {what}={v!r} must be a number ({meaning})")
    if not low <= v <= high or math.isinf(v):
        raise ValueError(f"{cls}: {what}={v} must be in [{low}, {high}] ({meaning})")


def _by_param_name(mapping, layers, names, cls, what):
    """``mapping`` keyed by layer names (``names``: module or parameter name, a shared
    weight's other names included, -> its layer)."""
    out = {}
    for key, value in mapping.items():
        name = names.get(key)
        if name not in layers:
            raise ValueError(f"{cls}: {what} names {key!r}, which is not a sparse layer; "
                             f"sparse layers: {sorted(layers)}")
        out[name] = value
    return out
