"""``sparsify``: a sparse copy of any ``nn.Module`` (the model given is left unchanged).

Every ``nn.Conv2d`` with a 1x1 kernel and ``groups=1`` (stride 1 or 2, no padding) becomes a
``SparseConv2d`` and every ``nn.Linear`` a ``SparseLinear``, each pruned on its own weights:
``method="magnitude"`` zeroes the ``round(sparsity * N)`` smallest ``|w|`` of the layer,
``"random"`` a random subset of that size; ``blocksize=(r, 1)`` (or ``r``) prunes whole blocks
of ``r`` output channels (in layers whose output channels it divides; others are pruned entry
by entry). Other convolutions stay dense, as in Fast Sparse ConvNets: the first
(3-channel) convolution, which becomes a ``ChannelsFirstStem`` when it is 3x3 with padding
1 and stride 1 or 2, and the depthwise ones, which become ``ChannelsFirstDepthwise``; both
write the sparse layers' (C, N, H, W) layout, so a batch keeps it through them.

Only layers their parent calls as modules are replaced: when ``torch.fx`` traces the model,
those reached by a module call (directly, or inside a called ``torch.nn`` module); a layer
whose parent reads its ``.weight`` itself stays dense (called as a module or not). Layers inside an
``nn.MultiheadAttention`` always stay dense: it reads ``out_proj.weight`` directly.

With ``fold_bn=True`` each ``BatchNorm2d`` applied right after a convolution (and nowhere
else) is folded into it, with its running statistics (the model as in ``eval()``; one
without them, ``track_running_stats=False``, stays as it is), and a ``ReLU``/``ReLU6``
module right after is fused into the sparse or depthwise layer. A module with hooks of its
own, or named in ``skip`` (a name keeps everything inside it as it is), is neither folded
nor folded into. A replaced layer keeps its hooks and its parameters' ``requires_grad``.
Layers that are already sparse are kept as they are (not pruned again). The data
flow is read by ``torch.fx`` tracing; models that do not trace are read as ``nn.Sequential``
chains (neighbouring children) only.

These layers write their output in (C, N, H, W) memory (at batch 1 that is plain NCHW):
the next such layer reads it as it is, where NCHW would cost a transposing copy per layer.
Where the traced data flow shows a layer's output (through any other operations) reaching
a ``.view`` or the model's output, the layer writes plain NCHW memory instead
(``nchw_output``), as a dense convolution would: ``x.view(x.size(0), -1)`` cannot view
the other layout. A model that does not trace gets NCHW outputs throughout.

A sparse 1x1 expansion followed by a 3x3 depthwise layer in an ``nn.Sequential`` (MobileNet
v2's inverted residual blocks) then runs as one kernel in inference, the expanded
activation never written to memory: that Sequential becomes an
``ExpandDepthwiseSequential`` of the same children (``fuse.py``; hooks on those layers turn
it off for them).

Example:
    >>> import torch, sparsetorch as st
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.BatchNorm2d(16),
    ...                           torch.nn.ReLU(), torch.nn.Conv2d(16, 32, 1)).eval()
    >>> sp = st.sparsify(net, sparsity=0.75)
    >>> [type(m).__name__ for m in sp], sp[3].values.numel()
    (['Conv2d', 'Identity', 'ReLU', 'SparseConv2d'], 128)
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch import nn

from ._common import check_pointwise as _check_pointwise
from .conv import SparseConv2d
from .depthwise import ChannelsFirstDepthwise, is_depthwise
from .fold import copy_model, fold_batchnorm, foldable, is_parameter_hook, refresh_computed
from .fuse import fuse_expand_depthwise
from .pattern import METHODS, exact_density, prune_mask
from .stem import ChannelsFirstStem, is_stem

from .linear import SparseLinear

_ACTIVATION_OF = {nn.ReLU: "relu", nn.ReLU6: "relu6"}
# torch modules that read their child layers' weights themselves instead of calling them
_READS_CHILD_WEIGHTS = (nn.MultiheadAttention,)


def sparsify(model: nn.Module, sparsity: float = 0.9, method: str = "magnitude",
             blocksize=None, skip: Iterable[str] | Callable[[str, nn.Module], bool] = (),
             fold_bn: bool = True, generator: torch.Generator | None = None) -> nn.Module:
    """A sparse copy of ``model`` (see the module docstring). ``skip``: qualified module
    names (``"features.0.0"``) to keep dense, or a predicate ``(name, module) -> bool``.
    ``generator`` seeds ``method="random"``.

    Example:
        >>> import torch, sparsetorch as st
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(8, 8, 1), torch.nn.Conv2d(8, 8, 1))
        >>> sp = st.sparsify(net, sparsity=0.5, skip=["1"])
        >>> [type(m).__name__ for m in sp], type(net[0]).__name__
        (['SparseConv2d', 'Conv2d'], 'Conv2d')
    """
    _check_model(model, "sparsify")
    if not isinstance(sparsity, (int, float)) or not 0.0 <= float(sparsity) <= 1.0:
        raise ValueError(f"sparsify: sparsity must be a number in [0, 1], got {sparsity!r}")
    if method not in METHODS:
        raise ValueError(f"sparsify: method={method!r} is not one of {METHODS}")
    blocksize = _blocksize(blocksize)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"sparsify: generator must be a torch.Generator, got "
                        f"{type(generator).__name__} (torch.Generator().manual_seed(seed))")
    skipped = _skip_predicate(skip, model)

    def make_sparse(module, conv, act):
        if is_depthwise(module):
            return ChannelsFirstDepthwise.from_dense(conv, act)
        if is_stem(module):
            return ChannelsFirstStem.from_dense(conv, act)
        weight = module.weight.detach().flatten(1)
        bs = blocksize if blocksize and weight.shape[0] % blocksize[0] == 0 else None
        if isinstance(module, nn.Linear):   # the exact count, given as a density
            return SparseLinear.from_dense(module,
                                           density=exact_density(weight.shape, sparsity, bs),
                                           method=method, blocksize=bs, generator=generator)
        mask = prune_mask(weight, sparsity=sparsity, method=method, blocksize=bs,
                          generator=generator)
        return SparseConv2d._from_mask(conv, mask, act)

    return fuse_expand_depthwise(_ask_nchw_outputs(_rebuild(model, fold_bn, skipped,
                                                             make_sparse)))


# The layers that write (C, N, H, W) memory, and those that read any layout of their input
# and write their own (where the search for a ``.view`` stops).
_CNHW_WRITERS = (SparseConv2d, ChannelsFirstDepthwise, ChannelsFirstStem)
_LAYOUT_READERS = _CNHW_WRITERS + (SparseLinear, nn.Conv2d, nn.Linear)


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _LAYOUT_READERS) or super().is_leaf_module(m, qualname)


def _ask_nchw_outputs(model: nn.Module) -> nn.Module:
    """Sets ``nchw_output`` on each (C, N, H, W) writer in ``model`` whose output may be
    viewed (see the module docstring; a fuzzer's finding: ``t.view(t.size(0), -1)`` after
    a sparse 1x1 convolution failed at batch 2); returns ``model``."""
    writers = [m for m in model.modules() if isinstance(m, _CNHW_WRITERS)]
    if not writers:
        return model
    try:
        with _hooks_set_aside(model):
            graph = _Tracer().trace(model)
    except Exception:   # (control flow on values, ...): the data flow is unknown
        for m in writers:
            m.nchw_output = True
        return model
    modules = dict(model.named_modules())
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(modules[node.target], _CNHW_WRITERS) \
                and _may_be_viewed(node, modules):
            modules[node.target].nchw_output = True
    return model


def _may_be_viewed(node: fx.Node, modules: dict) -> bool:
    """Whether ``node``'s output, through any operations but the layers that read any
    layout (``_LAYOUT_READERS``), reaches a ``view`` or the model's output."""
    seen, todo = set(), list(node.users)
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.op == "output" or user.op == "call_method" and user.target in (
                "view", "view_as") or user.op == "call_function" and user.target in (
                torch.Tensor.view, torch.Tensor.view_as):
            return True
        if user.op == "call_module" and isinstance(modules[user.target], _LAYOUT_READERS):
            continue
        todo.extend(user.users)
    return False


def fold_batchnorms(model: nn.Module) -> nn.Module:
    """A dense copy of ``model`` with each ``BatchNorm2d`` that follows a convolution (and
    nothing else) folded into it, as ``sparsify`` folds them: the dense baseline with the
    same fusions.

    Example:
        >>> import torch, sparsetorch as st
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4)).eval()
        >>> [type(m).__name__ for m in st.nn.fold_batchnorms(net)]
        ['Conv2d', 'Identity']
    """
    _check_model(model, "fold_batchnorms")
    return _rebuild(model, True, lambda name, module: False, None)


def _check_model(model, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}: model must be an nn.Module, got {type(model).__name__}")
    from .freeze import Frozen   # (freeze imports this module)
    if isinstance(model, Frozen):
        raise TypeError(f"{what}: the model is frozen (st.freeze), which keeps no layers to "
                        f"change; {what} the model before freezing it")


def _rebuild(model: nn.Module, fold_bn: bool, skipped, make_sparse) -> nn.Module:
    """A copy of ``model`` with batch norms folded (``fold_bn``) and, unless ``make_sparse``
    is None, each 1x1, depthwise or stem convolution and linear layer not ``skipped`` replaced by
    ``make_sparse(module, module with its batch norm folded, fused activation name)``."""
    out = copy_model(model)
    refresh_computed(out)
    links, called = _data_flow(out)
    aliases = defaultdict(list)   # a module registered under several names: all of them
    for name, module in out.named_modules(remove_duplicate=False):
        aliases[id(module)].append(name)
    chains = _chains(out, links, fold_bn, lambda name, module: (
        skipped(name, module) or not called(name) or len(aliases[id(module)]) > 1))
    modules = dict(out.named_modules())
    for name, module in modules.items():
        if not name or skipped(name, module) or not called(name):
            continue
        bn_name, act_name = chains.get(name, (None, None))
        act = _ACTIVATION_OF.get(type(modules[act_name])) if act_name else None
        convertible = (isinstance(module, nn.Linear) or _is_pointwise(module)
                       or is_depthwise(module) or is_stem(module))
        new = None
        if make_sparse is not None and convertible:
            folded = fold_batchnorm(module, modules[bn_name]) if bn_name else module
            new = make_sparse(module, folded, act)
        if new is None:
            if not (bn_name and isinstance(module, nn.Conv2d)):
                continue
            new, act = fold_batchnorm(module, modules[bn_name]), None   # dense, BN folded
        # (a module of several names is in no chain: its other uses see no fold)
        others = aliases[id(module)][1:]
        _carry_over(module, new)
        for alias in (name, *others):   # (a shared module stays shared: one sparse module)
            _replace(out, alias, new)
        if bn_name:
            _replace(out, bn_name, nn.Identity())
        if act is not None:
            _replace(out, act_name, nn.Identity())
    return out


# A module's own hooks (a deep copy's: the model given keeps its own), moved to what
# replaces it: nothing is folded into a hooked module, so it computes what the module did.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _carry_over(module: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (``module``'s replacement) ``module``'s hooks and its parameters'
    ``requires_grad`` (a frozen backbone stays frozen): weight -> values or weight."""
    for attr in _HOOK_DICTS:
        if getattr(module, attr, None):
            setattr(new, attr, getattr(module, attr))
    new._forward_pre_hooks = type(module._forward_pre_hooks)(
        (k, h) for k, h in module._forward_pre_hooks.items() if not is_parameter_hook(h))
    new._is_full_backward_hook = module._is_full_backward_hook
    new.train(module.training)   # (the new layers were in training mode in an eval model)
    flags = {name: p.requires_grad for name, p in module.named_parameters()}
    for name, p in new.named_parameters():
        p.requires_grad_(flags.get("weight" if name == "values" else name,
                                   any(flags.values()) if flags else True))


def _hooked(module: nn.Module) -> bool:
    """``hooked``, not counting an older weight_norm/spectral_norm pre-hook (the weight it
    computes is what the replacement takes)."""
    return bool(module._forward_hooks or module._backward_hooks or module._backward_pre_hooks
                or any(not is_parameter_hook(h) for h in module._forward_pre_hooks.values()))


def _is_pointwise(conv: nn.Module) -> bool:
    if not isinstance(conv, nn.Conv2d):
        return False
    try:
        _check_pointwise(conv)
    except ValueError:
        return False
    return True


def _blocksize(blocksize):
    if blocksize is None:
        return None
    if isinstance(blocksize, int) and not isinstance(blocksize, bool):
        blocksize = (blocksize, 1)
    if (not isinstance(blocksize, (tuple, list)) or len(blocksize) != 2 or blocksize[1] != 1
            or not isinstance(blocksize[0], int) or isinstance(blocksize[0], bool)
            or blocksize[0] < 1):   # (4.5 fell back to entries, without a word)
        raise ValueError(f"sparsify: blocksize must be None, r or (r, 1) (blocks of r output "
                         f"channels, e.g. 4); got {blocksize!r}")
    return tuple(blocksize)


def _skip_predicate(skip, model: nn.Module):
    """``(name, module) -> bool``: a module named in ``skip``, or inside one (a block's
    name keeps the whole block dense), stays as it is, and nothing is folded into it."""
    if skip is None:
        skip = ()
    if callable(skip):
        return skip
    if isinstance(skip, str):
        raise TypeError(f"sparsify: skip must be a list of module names or a predicate, got the "
                        f"string {skip!r}; write skip=[{skip!r}]")
    names = set(skip)
    # (a misspelt name would leave its layer sparsified without a word)
    known = [name for name, _ in model.named_modules()]
    unknown = names.difference(known)
    if unknown:
        listed = [name for name in known if name]
        raise ValueError(f"sparsify: skip names {sorted(unknown)}, which are not modules of "
                         f"the model; its modules: {listed[:20]}"
                         + (" ..." if len(listed) > 20 else ""))
    return lambda name, module: name in names or _below(name, names)


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


# -- which batch norm and activation follow each convolution ----------------------------------
def _data_flow(model: nn.Module):
    """``(links, called)``: ``{module name: the module that alone consumes its output}`` and
    a predicate ``called(name)``, true for the modules their parent calls as modules (so a
    replacement module is used): outside every ``_READS_CHILD_WEIGHTS`` module and, when
    ``torch.fx`` traces the model, a ``call_module`` target or inside one (a called
    ``torch.nn`` module, which fx does not trace into, calls its children). Untraceable models
    are read as ``nn.Sequential`` chains, with every layer called."""
    opaque = [n for n, m in model.named_modules() if isinstance(m, _READS_CHILD_WEIGHTS)]
    try:
        with _hooks_set_aside(model):
            graph = torch.fx.symbolic_trace(model).graph
    except Exception:   # any tracing failure (control flow, unsupported ops): read Sequentials
        return _sequential_links(model), lambda name: not _below(name, opaque)
    targets = {node.target for node in graph.nodes if node.op == "call_module"}
    # (a module whose parameters the parent reads itself, called or not, keeps them)
    read = {node.target.rpartition(".")[0] for node in graph.nodes if node.op == "get_attr"}
    return _fx_links(graph), lambda name: (not _below(name, opaque) and name not in read
                                           and (name in targets or _below(name, targets)))


@contextmanager
def _hooks_set_aside(model: nn.Module):
    """``model``'s modules without their hooks for the block (``torch.fx`` runs the hooks of
    the modules it traces into on its placeholders: a hook collecting features filled the
    user's list with Proxies); put back after."""
    kept = [(m, {a: getattr(m, a) for a in (*_HOOK_DICTS, "_forward_pre_hooks")
                 if hasattr(m, a)}) for m in model.modules()]
    for module, hooks in kept:
        for attr, value in hooks.items():
            setattr(module, attr, type(value)())
    try:
        yield
    finally:
        for module, hooks in kept:
            for attr, value in hooks.items():
                setattr(module, attr, value)


def _below(name: str, ancestors) -> bool:
    """Whether module ``name`` lies strictly inside one of the modules ``ancestors``."""
    return any(a == "" or name.startswith(a + ".") for a in ancestors)


def _chains(model: nn.Module, links: dict, fold_bn: bool, kept) -> dict:
    """``{conv name: (batch norm name or None, activation name or None)}`` for convolutions
    whose output feeds only that batch norm (folded when ``fold_bn`` and it has running
    statistics), whose output in turn (or the convolution's) feeds only a ReLU/ReLU6 module
    (``links``, from ``_data_flow``). Each module must be called once, and none of them be
    ``kept`` as it is (skipped, not called as a module, its parameters read by its parent,
    or registered under another name, which would keep the module replaced: a batch norm
    applied twice) or have hooks of its own (which expect that module's output)."""
    modules = dict(model.named_modules())

    def free(name):
        return name in modules and not kept(name, modules[name]) and \
            not _hooked(modules[name])

    chains = {}
    for name, module in modules.items():
        if not isinstance(module, nn.Conv2d) or not free(name):
            continue
        bn = act = None
        nxt = links.get(name)
        if fold_bn and isinstance(modules.get(nxt), nn.BatchNorm2d) and free(nxt) and \
                foldable(modules[nxt]):
            bn, nxt = nxt, links.get(nxt)
        if type(modules.get(nxt)) in _ACTIVATION_OF and free(nxt):
            act = nxt
        if bn or act:
            chains[name] = (bn, act)
    return chains


def _fx_links(graph: torch.fx.Graph) -> dict:
    """``{module name: the module that alone consumes its output}``, from an fx graph."""
    calls: dict = {}
    for node in graph.nodes:
        if node.op == "call_module":
            calls[node.target] = calls.get(node.target, 0) + 1
    links = {}
    for node in graph.nodes:
        if node.op != "call_module" or calls[node.target] != 1 or len(node.users) != 1:
            continue
        (user,) = node.users
        if user.op == "call_module" and calls[user.target] == 1 and user.args[:1] == (node,):
            links[node.target] = user.target
    return links


def _sequential_links(model: nn.Module) -> dict:
    links = {}
    for prefix, module in model.named_modules():
        # (a subclass with its own forward may use its children otherwise: a residual)
        if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
            names = [f"{prefix}.{k}" if prefix else k for k in module._modules]
            links.update(zip(names, names[1:]))
    return links
