"""Dynamic sparse training algorithms on the shared machinery (``engine.SparseTrainer``):
RigL, SET, SNFS, Static and gradual magnitude pruning. They differ only in how many weights
an update drops and how growth is scored.

In: a model and its optimizer. Out: a trainer; call ``trainer.step()`` where you called
``optimizer.step()``.
"""
from __future__ import annotations

import numbers

import torch

from . import distributed as _dist
from .densities import kept_count
from .engine import SparseTrainer, _check_int
from .layers import SparseLayer
from .schedules import cosine_drop_fraction, cubic_sparsity, is_update_step


class RigL(SparseTrainer):
    """RigL (Evci et al., ICML 2020): every ``delta_t`` steps until ``t_end`` (default 3/4 of
    ``total_steps``) each layer drops ``f(t) * active`` weights of smallest ``|w|``, ``f(t) =
    alpha / 2 * (1 + cos(pi t / t_end))``, and grows as many inactive ones with the largest
    dense-gradient magnitude; the optimizer does not step on those iterations; grown weights
    start at zero and their optimizer state where a new parameter's does (moments and
    momentum 0, Rprop's step size the learning rate); per-layer counts never change.

    Arguments: ``density`` (global fraction kept), ``distribution`` ("erk", "er", "uniform"),
    ``delta_t``, ``alpha``, ``t_end``, ``total_steps``, ``dense`` (layer or parameter names
    left dense and out of the budget; default: the first layer when it is a Conv2d, as the
    official code does, else none; biases and norms are never masked), ``layer_density``
    (``{name: density}`` fixed per layer, left out of ERK's solve), ``grow_init`` ("zeros"),
    ``seed`` (all random choices; rank 0's under torch.distributed), ``noise_std`` (drop
    tie-breaking noise), ``erk_power_scale``.

    Example:
        >>> import torch, sparsetorch as st
        >>> _ = torch.manual_seed(0)
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> rigl = st.train.RigL(model, opt, density=0.25, distribution="uniform", delta_t=2,
        ...                      total_steps=8)
        >>> for _ in range(8):
        ...     opt.zero_grad(); model(torch.randn(5, 8)).square().sum().backward(); rigl.step()
        >>> rigl.nnz()
        {'0.weight': 32, '2.weight': 16}
        >>> bool((model[0].weight[~rigl.masks["0.weight"]] == 0).all())
        True
    """
    uses_gradient = True

    def _drop_count(self, layer, t: int) -> int:
        n_active = layer.active().numel()
        return int(n_active * cosine_drop_fraction(t, self.alpha, self.t_end))

    def _grow_score(self, layer):
        return lambda r0, r1: layer.grad_rows(r0, r1).abs()


class SET(RigL):
    """SET (Mocanu et al., 2018): RigL's schedule and drop rule, growth at random among the
    inactive weights (uniform scores from the seeded generator, drawn row block by row block).

    Example:
        >>> import torch, sparsetorch as st
        >>> model = torch.nn.Linear(10, 10)
        >>> t = st.train.SET(model, torch.optim.SGD(model.parameters(), lr=0.1), density=0.3,
        ...                  distribution="uniform", delta_t=1, total_steps=4)
        >>> t.step(); t.step(); t.nnz()
        {'weight': 30}
    """
    uses_gradient = False

    def _grow_score(self, layer):
        cols = layer.shape2d[1]
        return lambda r0, r1: torch.rand((r1 - r0, cols), generator=self.generator)


class SNFS(RigL):
    """Sparse momentum (Dettmers & Zettlemoyer, 2019) as in RigL's official code: growth by
    the magnitude of an exponential moving average (``momentum``, default 0.9) of the dense
    gradients, updated every step. The average is dense by definition, in both modes: with
    truly sparse layers (``SparseLinear``, ``SparseConv2d``) each layer's dense gradient is
    formed every step from its input and output gradient and folded into a dense average,
    so this statistic costs what dense training's weight gradient costs (RigL forms the
    dense gradient on update steps only).

    Example:
        >>> import torch, sparsetorch as st
        >>> model = torch.nn.Linear(6, 6)
        >>> t = st.train.SNFS(model, torch.optim.SGD(model.parameters(), lr=0.1), density=0.5,
        ...                   distribution="uniform", delta_t=1, total_steps=4)
        >>> model(torch.ones(1, 6)).sum().backward(); t.step(); t.nnz()
        {'weight': 18}
    """
    uses_gradient = False

    def __init__(self, model, optimizer, *, momentum: float = 0.9, **kwargs):
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
            raise TypeError(f"SNFS: momentum={momentum!r} must be a number in [0, 1)")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"SNFS: momentum={momentum} must be in [0, 1)")
        self.momentum = float(momentum)
        self._average_grads = not _dist.grads_already_averaged(model)
        super().__init__(model, optimizer, **kwargs)
        self.ema = {n: torch.zeros(l.shape, dtype=l.param.dtype, device=l.param.device)
                    for n, l in self.layers.items()}

    def _capturing(self) -> bool:
        return True          # every step's dense gradient feeds the average

    def _before_optimizer_step(self):
        for name, layer in self.layers.items():
            if isinstance(layer, SparseLayer):
                if not layer.has_grad():
                    continue
                g = layer.grad_rows(0, layer.shape2d[0])    # (averaged over ranks)
                layer.release()
            elif layer.param.grad is None:
                continue
            else:
                g = layer.param.grad
                g = _dist.mean_over_ranks(g) if self._average_grads else g
            self.ema[name].mul_(self.momentum).add_(g.reshape(layer.shape),
                                                   alpha=1 - self.momentum)

    def _grow_score(self, layer):
        ema = self.ema[layer.name].reshape(layer.shape2d)
        return lambda r0, r1: ema[r0:r1].abs()

    def _extra_state(self):
        return {"ema": {n: e.clone() for n, e in self.ema.items()}}

    def _load_extra_state(self, extra):
        for n, e in extra["ema"].items():
            self.ema[n].copy_(e)


class Static(SparseTrainer):
    """A fixed random mask (same densities and exact counts as RigL), never updated.

    Example:
        >>> import torch, sparsetorch as st
        >>> model = torch.nn.Linear(10, 10)
        >>> t = st.train.Static(model, torch.optim.SGD(model.parameters(), lr=0.1), density=0.2,
        ...                     distribution="uniform")
        >>> t.nnz(), t.is_update_step(100)
        ({'weight': 20}, False)
    """
    grows = False

    def __init__(self, model, optimizer, **kwargs):
        for unused in ("delta_t", "alpha", "t_end", "total_steps"):
            if kwargs.pop(unused, None) is not None:
                raise ValueError(f"Static: {unused}= has no meaning for a fixed mask")
        super().__init__(model, optimizer, needs_schedule=False, **kwargs)
        self.t_end = None

    def _drop_count(self, layer, t):
        return 0


class MagnitudePruning(SparseTrainer):
    """Gradual magnitude pruning (Zhu & Gupta, 2017): starts dense; every ``delta_t`` steps
    between ``t_begin`` and ``t_end`` (default 3/4 of ``total_steps``) each layer keeps its
    largest-magnitude weights down to ``kept_count(size, d_t)``, with the cubic schedule of
    sparsity from 0 to the layer's final ``1 - density`` (densities by ``distribution``).
    The optimizer steps on every iteration (pruning follows it).

    Example:
        >>> import torch, sparsetorch as st
        >>> model = torch.nn.Linear(10, 10)
        >>> t = st.train.MagnitudePruning(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...         density=0.1, distribution="uniform", delta_t=1, t_end=2)
        >>> [(t.step(), t.nnz()["weight"])[1] for _ in range(4)]
        [100, 22, 10, 10]
    """
    grows = False
    prunes = True
    skips_optimizer_on_update = False

    def __init__(self, model, optimizer, *, t_begin: int = 0, **kwargs):
        _check_int(type(self).__name__, "t_begin", t_begin, 0)
        self.t_begin = int(t_begin)
        super().__init__(model, optimizer, **kwargs)

    def _initial_masks(self, generator):
        # (checked here, before any layer changes; an error closes the trainer)
        if not self.t_begin < self.t_end:
            raise ValueError(f"MagnitudePruning: t_begin={self.t_begin} must be before "
                             f"t_end={self.t_end}")
        sparse = [n for n, layer in self.layers.items() if isinstance(layer, SparseLayer)]
        if sparse and _dist.world_size() > 1:
            raise ValueError(
                f"MagnitudePruning: the SparseLinear layers {sparse} store fewer entries at "
                "every prune, each time resizing the values Parameter; under "
                "torch.distributed, DistributedDataParallel's gradient buckets keep the old "
                "size and the ranks would drift apart. Prune nn.Linear/nn.Conv2d layers "
                "(masked in place) instead, or prune in one process")
        super()._initial_masks(generator)

    def _initial_count(self, name):
        return self.layers[name].size

    def is_update_step(self, t=None):
        t = self.step_count if t is None else t
        # t_end always prunes, on the grid or not: that is where the final density is reached
        return t == self.t_end or is_update_step(t, self.delta_t, self.t_end, self.t_begin)

    def _drop_count(self, layer, t):
        sparsity = cubic_sparsity(t, 1 - self.densities[layer.name], self.t_begin, self.t_end)
        target = kept_count(layer.size, 1 - sparsity)
        return max(0, layer.active().numel() - target)


__all__ = ["RigL", "SET", "SNFS", "Static", "MagnitudePruning"]
