"""Running a sparse 1x1 expansion and the 3x3 depthwise convolution after it as one kernel
(``st.ops.expand_depthwise3x3``), as ``sparsify`` sets up in MobileNet v2-style inverted
residual blocks.

Inside an ``nn.Sequential`` (whose children run in order, each on the last one's output),
a child that is a ``SparseConv2d`` with stride 1 (alone, or as the first of an
``nn.Sequential`` whose other children are ``nn.Identity``: a convolution whose batch norm
and activation ``sparsify`` folded in) followed, with nothing but ``nn.Identity`` children
between, by a child that is a 3x3 ``ChannelsFirstDepthwise`` (the same way) is a fusable
pair. ``fuse_expand_depthwise`` makes each ``nn.Sequential`` holding such pairs an
``ExpandDepthwiseSequential``: the same children under the same names (so ``state_dict``
keys, ``named_modules`` and the layers themselves are unchanged), whose forward runs each
pair as one kernel in inference. It runs the layers one by one as before while autograd
records through their parameters, while ``torch.compile`` traces, for a blocked (BSR)
expansion, for inputs that are not plain tensors (``torch.fx`` proxies), once the children
have moved so that they no longer form the pair, and whenever a hook is registered on any
module of the pair (a global module hook included), so every hook still sees its module's
own input and output.

Example:
    >>> import torch, sparsetorch as st
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(8, 48, 1), torch.nn.ReLU6(),
    ...                           torch.nn.Conv2d(48, 48, 3, 1, 1, groups=48)).eval()
    >>> sp = st.sparsify(net, sparsity=0.8)
    >>> type(sp).__name__, [type(m).__name__ for m in sp]
    ('ExpandDepthwiseSequential', ['SparseConv2d', 'Identity', 'ChannelsFirstDepthwise'])
    >>> x = torch.randn(1, 8, 10, 10)
    >>> with torch.no_grad():
    ...     torch.allclose(sp(x), sp[2](sp[0](x)), atol=1e-5)
    True
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module

from ..ops.expand_depthwise import expand_depthwise3x3
from ._common import NoTorchScript, as_asked, hooked
from .conv import SparseConv2d
from .depthwise import ChannelsFirstDepthwise

_is_compiling = torch.compiler.is_compiling
# The fused kernel computes each expanded row in the depthwise walk, less efficiently than
# spmm_narrow does; what it saves is writing and reading the expanded activation. So it
# wins where rows are short: per pair, fused against the two kernels (2 threads, batch 1,
# SPR): MobileNet v2 at 90% (2-16 entries a row) 1.1-1.9x; at 70%, 5-19 entries
# 1.0-1.3x, 29-48 entries 0.80-0.97x; v1 at 90% with 3-13 entries 1.05-1.5x, 26 entries
# 0.88-1.14x, 51 entries 0.83-0.91x.
FUSE_UP_TO_ENTRIES_PER_ROW = 20


class ExpandDepthwiseSequential(NoTorchScript, nn.Sequential):
    """An ``nn.Sequential`` whose fusable (expansion, depthwise) neighbours run as one kernel
    in inference (see the module docstring); ``pairs`` maps the expansion child's name to
    the depthwise child's.

    Example:
        >>> import torch, sparsetorch as st
        >>> seq = torch.nn.Sequential(st.nn.SparseConv2d(4, 12, density=0.5),
        ...                           st.nn.ChannelsFirstDepthwise.from_dense(
        ...                               torch.nn.Conv2d(12, 12, 3, padding=1, groups=12)))
        >>> ExpandDepthwiseSequential(*seq).pairs
        {'0': '1'}
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.pairs = _pairs(self._modules)

    def forward(self, x):
        modules, pairs, until = self._modules, self.pairs, None
        for name, module in modules.items():
            if until is not None:   # the rest of a fused pair
                until = None if name == until else until
                continue
            partner = pairs.get(name)
            if partner is not None:
                y = _fused(modules, name, partner, x)
                if y is not None:
                    x, until = y, partner
                    continue
            x = module(x)
        return x


def fuse_expand_depthwise(model: nn.Module) -> nn.Module:
    """``model`` with every plain ``nn.Sequential`` in it (itself included) that holds a
    fusable pair made an ``ExpandDepthwiseSequential``, in place: the same module, its
    class changed, so its hooks and attributes stay (a new module of the same children
    dropped them); returns ``model``.

    Example:
        >>> import torch, sparsetorch as st
        >>> block = torch.nn.Sequential(torch.nn.Identity())
        >>> fuse_expand_depthwise(block) is block
        True
    """
    for child in model.children():
        fuse_expand_depthwise(child)
    pairs = _pairs(model._modules) if type(model) is nn.Sequential else None
    if pairs:
        model.__class__ = ExpandDepthwiseSequential   # (it adds no state but its pairs)
        model.pairs = pairs
    return model


def _pairs(modules: dict) -> dict:
    """``{expansion child's name: depthwise child's name}`` of the fusable pairs among
    ``modules`` (children in order), with nothing but ``nn.Identity`` children between."""
    names, pairs = list(modules), {}
    for i, first in enumerate(names):
        j = i + 1
        while j < len(names) and type(modules[names[j]]) is nn.Identity:
            j += 1
        if j < len(names) and fusable_pair(modules[first], modules[names[j]]) is not None:
            pairs[first] = names[j]
    return pairs


def _layer(module, kind):
    """``module`` if it is a ``kind``, the first child of a plain ``nn.Sequential`` that is
    a ``kind`` followed only by ``nn.Identity``s, else None."""
    if isinstance(module, kind):
        return module
    if type(module) is not nn.Sequential:
        return None
    first = None
    for child in module._modules.values():
        if first is None:
            if not isinstance(child, kind):
                return None
            first = child
        elif type(child) is not nn.Identity:
            return None
    return first


def fusable_pair(first, second):
    """``(expansion, depthwise)`` layers of two neighbouring children (or modules, where
    ``freeze`` finds the one feeding the other), or None: also where the expansion stores
    more than ``FUSE_UP_TO_ENTRIES_PER_ROW`` weights per output channel on average."""
    conv, dw = _layer(first, SparseConv2d), _layer(second, ChannelsFirstDepthwise)
    if conv is None or dw is None or conv.stride != 1 or conv.blocksize is not None \
            or dw._fused_stride() is None \
            or dw.weight.shape[0] != conv.out_features \
            or conv.values.numel() > FUSE_UP_TO_ENTRIES_PER_ROW * conv.out_features:
        return None
    return conv, dw


def _fused(modules: dict, first: str, second: str, x):
    """The output of children ``first`` to ``second`` by the fused kernel, or None where the
    layers run instead."""
    if type(x) is not torch.Tensor or _is_compiling():
        return None
    names = list(modules)   # (children may have moved, or gone, since the pairs were found)
    i = names.index(first)
    j = names.index(second) if second in modules else -1
    span = [modules[n] for n in names[i:j + 1]]
    if j <= i or any(type(m) is not nn.Identity for m in span[1:-1]):
        return None
    layers = fusable_pair(span[0], span[-1])
    if layers is None:
        return None
    conv, dw = layers
    if x.dim() != 4 or x.shape[1] != conv.in_features or x.dtype != conv.values.dtype:
        return None   # (the layers say what is wrong)
    if _module._global_forward_hooks or _module._global_forward_pre_hooks \
            or any(hooked(child) or any(hooked(m) for m in child._modules.values())
                   for child in span):   # (a pair's modules are at most two deep: _layer)
        return None
    if torch.is_grad_enabled() and any(p.requires_grad for p in (
            conv.values, conv.bias, dw.weight, dw.bias, x) if p is not None):
        return None
    return as_asked(dw, expand_depthwise3x3(x, conv.weight, conv.bias, conv.activation,
                                            dw.weight, dw.bias, dw._fused_stride(), dw.activation))
