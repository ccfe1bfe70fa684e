"""Batch norm folded into the convolution before it (inference: running statistics).

``BN(conv(x)) = gamma * (W x + b - mean) / sqrt(var + eps) + beta`` is a convolution with
weight ``W * s`` and bias ``(b - mean) * s + beta``, ``s = gamma / sqrt(var + eps)`` per
output channel: one layer instead of two, and the bias then rides in the sparse kernel.

Example:
    >>> import torch
    >>> conv, bn = torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4).eval()
    >>> bn.running_mean.uniform_(); bn.running_var.uniform_(0.5, 2)  # doctest: +ELLIPSIS
    tensor(...)
    >>> x = torch.randn(2, 3, 5, 5)
    >>> torch.allclose(fold_batchnorm(conv, bn)(x), bn(conv(x)), atol=1e-5)
    True
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm


def fold_batchnorm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> nn.Conv2d:
    """A new ``nn.Conv2d`` equal to ``bn(conv(x))`` with ``bn`` in eval mode (its running
    statistics); neither input is modified."""
    if not isinstance(conv, nn.Conv2d) or not isinstance(bn, nn.BatchNorm2d):
        raise TypeError(f"fold_batchnorm: need an nn.Conv2d and an nn.BatchNorm2d, got "
                        f"{type(conv).__name__} and {type(bn).__name__}")
    if bn.num_features != conv.out_channels:
        raise ValueError(f"fold_batchnorm: batch norm has {bn.num_features} features but the "
                         f"convolution {conv.out_channels} output channels")
    if not foldable(bn):
        raise ValueError("fold_batchnorm: batch norm without running statistics "
                         "(track_running_stats=False) cannot be folded (st.sparsify and "
                         "st.nn.fold_batchnorms leave such a batch norm as it is)")
    with torch.no_grad():
        folded = _with_plain_weight(conv)
        scale = bn.running_var.add(bn.eps).rsqrt()
        if bn.weight is not None:
            scale = scale * bn.weight
        shift = -bn.running_mean * scale
        if bn.bias is not None:
            shift = shift + bn.bias
        folded.weight.mul_(scale.view(-1, 1, 1, 1).to(folded.weight.dtype))
        bias = shift if conv.bias is None else conv.bias * scale + shift
        folded.bias = nn.Parameter(bias.to(folded.weight.dtype))
    return folded


def foldable(bn: nn.BatchNorm2d) -> bool:
    """Whether ``bn`` has running statistics to fold."""
    return bn.running_mean is not None and bn.running_var is not None


def is_parameter_hook(hook) -> bool:
    """Whether a forward pre-hook computes a parameter from others before each call: an
    older ``nn.utils.weight_norm``/``spectral_norm``'s, or ``nn.utils.prune``'s
    (``weight_orig * weight_mask``). A fold or a sparse copy takes the tensor it computes,
    and drops the hook (a pruning hook carried over failed on the sparse layer, which has
    no ``weight_mask``)."""
    return isinstance(hook, (WeightNorm, SpectralNorm, BasePruningMethod))


def copy_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)``, where each tensor a parameter hook computes (see
    ``is_parameter_hook``) is copied detached: computed with gradients it is no graph
    leaf, which deepcopy refuses (a model just pruned by ``nn.utils.prune`` could not be
    sparsified or frozen), and the copy's hook computes it again."""
    memo = {}
    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            if is_parameter_hook(hook):
                name = hook._tensor_name if isinstance(hook, BasePruningMethod) else hook.name
                t = module.__dict__.get(name)
                if isinstance(t, torch.Tensor) and not t.is_leaf:
                    memo[id(t)] = t.detach().clone()
    return copy.deepcopy(model, memo)


def refresh_computed(model: nn.Module) -> None:
    """Set every pruned tensor of ``model`` (``nn.utils.prune``) from its original and
    mask as they are now, as the pruning hook does before each call: the attribute holds
    the value of the last call (or of the pruning), older than a later optimizer step."""
    for module in model.modules():
        for hook in list(module._forward_pre_hooks.values()):
            if isinstance(hook, BasePruningMethod):
                hook(module, ())


def _with_plain_weight(conv: nn.Conv2d) -> nn.Conv2d:
    """A copy of ``conv`` whose weight is a plain Parameter: a parametrization
    (``parametrizations.weight_norm``, ``spectral_norm``) or an older
    ``nn.utils.weight_norm``/``spectral_norm`` hook recomputes the weight at each access or
    call, which would undo a fold written into it (the scale lost, the shifted bias kept:
    outputs off by ~1). Such a convolution becomes an ``nn.Conv2d`` holding the weight it
    computes now. (Not by ``remove_parametrizations`` on a copy: a parametrized module's
    copies share its class, and the removal deletes the class's property, the original's
    too.)"""
    hooked = any(is_parameter_hook(h) for h in conv._forward_pre_hooks.values())
    if not hooked and not parametrize.is_parametrized(conv):
        return copy.deepcopy(conv)
    weight = _computed(conv, "weight")
    plain = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                      conv.padding, conv.dilation, conv.groups, conv.bias is not None,
                      conv.padding_mode, device=weight.device, dtype=weight.dtype)
    plain.weight.copy_(weight)
    if conv.bias is not None:
        plain.bias.copy_(_computed(conv, "bias"))
    return plain.train(conv.training)


def _computed(module: nn.Module, name: str) -> torch.Tensor:
    """Tensor ``name`` of ``module`` as its hook computes it now (a pruned one's attribute
    is set by ``refresh_computed``); else the attribute (a parametrization computes it)."""
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, (WeightNorm, SpectralNorm)) and hook.name == name:
            return hook.compute_weight(module, do_power_iteration=False) \
                if isinstance(hook, SpectralNorm) else hook.compute_weight(module)
    return getattr(module, name)
