"""``freeze``: an inference-only copy of a model, run as one flat Python function.

At batch 1 a sparse MobileNet's kernels take 10-70 us each, and reaching them through the
module tree costs nearly as much again at the small late layers: each ``nn.Module`` call,
the ``nn.Identity`` children that batch-norm folding leaves behind, ``nn.Sequential``'s
loop, and the per-call checks of ``ExpandDepthwiseSequential``, which cannot know that
nothing changed since the last call. ``freeze`` pays those once:

1. it copies the model (``copy.deepcopy``: later changes to the model do not reach the
   frozen copy) in ``eval()`` mode with every parameter's ``requires_grad`` off;
2. traces the copy with ``torch.fx`` (sparsetorch's layers and ``torch.nn``'s are leaves:
   called, not traced into), with the arguments given as None, True or False fixed at those
   values: once at freezing with the forward's defaults, and once more for each other
   combination a call brings (``if mask is None:`` or ``if return_all:`` then run as in
   the model; a placeholder would have taken one branch, or failed, for every call). Such
   a trace at a call patches ``nn.Module`` calls process-wide while it runs, as torch.fx
   does: call each combination once before serving from several threads. A root with
   hooks is frozen as one call of itself (a trace would run its forward alone);
3. rewrites the graph: ``nn.Identity`` and dropout calls (identities in eval mode) vanish;
   a ``SparseConv2d`` whose only consumer is a 3x3 ``ChannelsFirstDepthwise`` (the pair
   ``fuse.py`` fuses, the same rule) becomes one ``st.ops.expand_depthwise3x3`` call,
   wherever the graph shows the pair, not only inside an ``nn.Sequential``; every other
   module call becomes a direct call of its ``forward`` (of the module itself, hooks and
   all, for a module with hooks);
4. has ``torch.fx`` write the graph as one Python function (``Frozen.code`` shows it);
5. at run time each step plans its layer's call once per input signature (shape, strides,
   dtype, device, thread count) where the layer offers that (``_inference_step``: the
   sparse, depthwise and stem convolutions and the fused pair, through the ops'
   ``prepared_*`` functions), so a call is its kernel and the output's allocation.

MobileNet v1 / v2 at 90%, batch 1, 2 threads: 1.28-1.32x / 1.35-1.38x the module tree.

The frozen model runs under ``torch.no_grad()``; it holds no parameters of its own
(``parameters()`` is empty) and refuses ``.to()``, ``.train()`` and pickling: change,
move or save the model, and freeze it again. A model ``torch.fx`` cannot trace (control
flow on tensor values) raises a ``ValueError``; run it unfrozen.

Example:
    >>> import torch, sparsetorch as st
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Identity(),
    ...                           torch.nn.Conv2d(8, 16, 1), torch.nn.ReLU())
    >>> sp = st.sparsify(net, sparsity=0.75).eval()
    >>> frozen = st.freeze(sp)
    >>> x = torch.randn(1, 3, 8, 8)
    >>> with torch.no_grad():
    ...     torch.allclose(frozen(x), sp(x))
    True
"""
from __future__ import annotations

import inspect
import threading

import torch
import torch.fx as fx
from torch import nn

from .._modes import refuse_ad_transforms
from ..ops.expand_depthwise import expand_depthwise3x3, prepared_expand_depthwise3x3
from ._common import NoTorchScript, as_asked, hooked, input_type_error, step_as_asked
from .attention import SparseAttention
from .depthwise import ChannelsFirstDepthwise
from .fold import copy_model
from .fuse import fusable_pair
from .graph import GATConv, GCNConv, SAGEConv
from .linear import SparseLinear
from .stem import ChannelsFirstStem

# sparsetorch's layers: called as a whole, as torch.fx calls torch.nn's own modules
_LAYERS = (SparseLinear, ChannelsFirstDepthwise, ChannelsFirstStem, GCNConv, SAGEConv, GATConv,
           SparseAttention)
# input signatures a step keeps plans for (then it forgets them all and starts again)
_MOST_PLANS = 16
# modules that return their (first) input unchanged in eval mode
_IDENTITIES = (nn.Identity, nn.modules.dropout._DropoutNd)


class Frozen(NoTorchScript, nn.Module):
    """What ``freeze`` returns: call it as the model (same arguments, same results, no
    autograd graph). ``code`` is the Python source of its forward.

    Example:
        >>> import torch, sparsetorch as st
        >>> from collections import OrderedDict
        >>> frozen = st.freeze(torch.nn.Sequential(OrderedDict(
        ...     lin=torch.nn.Linear(4, 2), drop=torch.nn.Dropout(), act=torch.nn.ReLU())))
        >>> print(frozen.code.strip())
        def forward(self, input):
            input_1 = input
            lin_1 = step_lin(input_1);  input_1 = None
            act_1 = step_act(lin_1);  lin_1 = None
            return act_1
    """

    def __init__(self, trace, name: str, signature=None):
        super().__init__()
        self.training = False
        # (nothing here is a submodule: nothing may be moved, cast or loaded into)
        d = self.__dict__
        d["_trace"], d["_name"], d["_signature"] = trace, name, signature
        d["_graphs"] = {}   # the arguments traced as constants -> GraphModule
        # Traced now, so a model torch.fx cannot trace fails at freeze, not at its first
        # call; unless a parameter with no default is a flag (annotated ``bool``), which
        # may decide a branch: calls bring its values, and the first call's trace fails.
        try:
            d["_default"] = self._graph(self._defaults()).forward
        except ValueError:
            if signature is None or not signature.required_flags:
                raise

    def _defaults(self) -> tuple:
        sig = self._signature
        return () if sig is None else _constants(sig.named, sig.defaults)

    def _graph(self, key: tuple) -> fx.GraphModule:
        graph = self._graphs.get(key)
        if graph is None:
            with _TRACING:   # (one trace at a time: torch.fx patches nn.Module's calls)
                graph = self._graphs.get(key) or self._trace(dict(key))
                self._graphs[key] = graph
        return graph

    @property
    def code(self) -> str:
        """The Python source of the forward, traced with the arguments' defaults."""
        return self._graph(self._defaults()).code

    def forward(self, *args, **kwargs):
        # (fx.symbolic_trace hands *args over as one Proxy; its own error said "cannot be
        # iterated")
        if isinstance(args, fx.Proxy):
            raise input_type_error("Frozen", "inputs must be tensors", args)
        refuse_ad_transforms(f"the frozen {self._name}", (*args, *kwargs.values()))
        sig = self._signature
        if sig is None:
            run = self._default
        else:
            named, rest, kwargs = sig.split(self._name, args, kwargs)
            run = self._graph(_constants(sig.named, named)).forward
            args = (*named, *rest)
        with torch.no_grad():
            return run(*args, **kwargs)

    def train(self, mode: bool = True):
        if mode:
            raise ValueError(f"freeze: the frozen {self._name} runs inference only; train the "
                             f"model itself and freeze it again")
        return self

    def _apply(self, fn, recurse=True):
        raise TypeError(f"freeze: the frozen {self._name} cannot be moved or cast; call "
                        f".to()/.double()/... on the model and freeze it again")

    def __getstate__(self):
        raise TypeError(f"freeze: the frozen {self._name} cannot be pickled; save the model "
                        f"(or its state_dict) and freeze it after loading")

    def extra_repr(self) -> str:
        return f"frozen {self._name}"


def freeze(model: nn.Module) -> Frozen:
    """An inference-only copy of ``model`` run as one flat function (see the module
    docstring): its results equal ``model.eval()``'s under ``torch.no_grad()``.

    Example:
        >>> import torch, sparsetorch as st
        >>> sp = st.sparsify(st.models.mobilenet_v2(0.25, num_classes=10), sparsity=0.9).eval()
        >>> frozen, x = st.freeze(sp), torch.randn(2, 3, 64, 64)
        >>> with torch.no_grad():
        ...     torch.allclose(frozen(x), sp(x), atol=1e-5)
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"freeze: model must be an nn.Module, got {type(model).__name__}")
    name = type(model).__name__
    if isinstance(model, Frozen):
        return model
    copied = copy_model(model).eval()
    for p in copied.parameters():
        p.requires_grad_(False)
    # One call of the model itself for sparsetorch's layers (torch.fx traces into a root,
    # never takes it whole) and for a root with hooks (a trace runs its forward alone)
    if isinstance(copied, _LAYERS) or hooked(copied):
        root, graph = _lone_layer(copied)
        return Frozen(lambda concrete: fx.GraphModule(root, graph), name)
    return Frozen(lambda concrete: _traced(copied, name, concrete), name,
                  _Signature.of(copied.forward))


def _traced(model: nn.Module, name: str, concrete: dict) -> fx.GraphModule:
    """``model`` traced with the arguments in ``concrete`` fixed at their values, and
    rewritten (the module docstring's steps 3 and 4)."""
    try:
        graph = _Tracer().trace(model, concrete_args=concrete or None)
    except Exception as err:   # any tracing failure: control flow on values, unsupported ops
        raise ValueError(f"freeze: torch.fx cannot trace {name} ({type(err).__name__}: "
                         f"{err}); freezing needs a forward without control flow on tensor "
                         f"values, or on arguments other than None, True and False (those "
                         f"are traced as constants). Run the model unfrozen (under "
                         f"torch.no_grad()).") from err
    modules = dict(model.named_modules())
    _drop_identities(graph, modules)
    _fuse_expand_depthwise(graph, modules)
    _call_forwards(graph, modules)
    graph.eliminate_dead_code()
    graph.lint()
    return fx.GraphModule(model, graph)


def _specialised_value(value) -> bool:
    """Whether an argument of this value is traced as a constant: None and bools, which
    decide branches (``if mask is None``, ``if return_all``) that a traced placeholder
    cannot."""
    return value is None or type(value) is bool


def _constants(names, values) -> tuple:
    """``((name, value), ...)`` of the arguments traced as constants: the key of a trace."""
    return tuple((n, v) for n, v in zip(names, values) if _specialised_value(v))


_TRACING = threading.Lock()
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class _Signature:
    """How a call's arguments reach a traced forward. ``named``: every parameter but
    ``*args``/``**kwargs``, which the forward torch.fx writes takes by position,
    keyword-only ones too (before ``*args``), and which may be traced as constants (torch.fx
    renames those, so none can go by keyword); ``*args`` follow them, ``**kwargs`` pass by
    keyword."""

    def __init__(self, signature: inspect.Signature):
        params = list(signature.parameters.values())
        by_position = [p for p in params if p.kind in _POSITIONAL or p.kind is p.KEYWORD_ONLY]
        self.signature = signature
        self.named = tuple(p.name for p in by_position)
        self.defaults = tuple(p.default for p in by_position)
        self.varargs = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        self.varkw = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        self.required_flags = any(p.default is p.empty and p.annotation in (bool, "bool")
                                  for p in by_position)
        self._plain = self.varargs is None and self.varkw is None

    @classmethod
    def of(cls, forward):
        try:
            return cls(inspect.signature(forward))
        except (TypeError, ValueError):   # (no signature: traced as it is)
            return None

    def split(self, name: str, args: tuple, kwargs: dict) -> tuple:
        """``(named values, more positional values, keywords)`` of a call, checked as
        Python checks a call of the model's forward."""
        if self._plain and not kwargs and len(args) == len(self.named):
            return args, (), {}   # (the common call: every argument by position)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"the frozen {name}: {err}") from None
        bound.apply_defaults()
        given = bound.arguments
        return (tuple(given[n] for n in self.named),
                given[self.varargs] if self.varargs is not None else (),
                given[self.varkw] if self.varkw is not None else {})


def _lone_layer(layer: nn.Module) -> tuple:
    """``(root, graph)`` for a model that is one of sparsetorch's layers: a root holding it
    as ``layer`` and a graph of one call of it, with the layer's positional parameters
    (and their defaults) as the inputs."""
    root, graph = nn.Module(), fx.Graph()
    root.add_module("layer", layer)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    args = tuple(graph.placeholder(p.name, default_value=p.default)
                 for p in inspect.signature(layer.forward).parameters.values()
                 if p.kind in positional)
    graph.output(graph.call_function(_step(layer, "layer"), args))
    return root, graph


class _Tracer(fx.Tracer):
    # (a module with hooks is called, not traced into: its hooks then run in the frozen
    # model, and not on the tracer's placeholders while freezing)
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, _LAYERS) or hooked(m) or super().is_leaf_module(m, qualname)


def _calls(graph: fx.Graph, modules: dict, kinds):
    """The ``call_module`` nodes of ``graph`` whose module is one of ``kinds``."""
    return [n for n in graph.nodes
            if n.op == "call_module" and isinstance(modules[n.target], kinds)]


def _drop_identities(graph: fx.Graph, modules: dict) -> None:
    for node in _calls(graph, modules, _IDENTITIES):
        if len(node.args) == 1 and not node.kwargs and not hooked(modules[node.target]):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _fuse_expand_depthwise(graph: fx.Graph, modules: dict) -> None:
    for dw_node in _calls(graph, modules, ChannelsFirstDepthwise):
        conv_node = dw_node.args[0] if len(dw_node.args) == 1 and not dw_node.kwargs else None
        if (not isinstance(conv_node, fx.Node) or conv_node.op != "call_module"
                or len(conv_node.users) != 1 or len(conv_node.args) != 1 or conv_node.kwargs):
            continue
        conv, dw = modules[conv_node.target], modules[dw_node.target]
        if hooked(conv) or hooked(dw) or fusable_pair(conv, dw) is None:
            continue
        step = _fused_step(conv, dw, f"{conv_node.target}+{dw_node.target}")
        with graph.inserting_before(dw_node):
            fused = graph.call_function(step, conv_node.args)
        dw_node.replace_all_uses_with(fused)
        graph.erase_node(dw_node)
        graph.erase_node(conv_node)


def _call_forwards(graph: fx.Graph, modules: dict) -> None:
    for node in _calls(graph, modules, nn.Module):
        module = modules[node.target]
        with graph.inserting_before(node):
            call = graph.call_function(_step(module, node.target), node.args, node.kwargs)
        node.replace_all_uses_with(call)
        graph.erase_node(node)


def _fused_step(conv, dw, target: str):
    weight, bias, act = conv.weight, conv.bias, conv.activation   # (fixed: the copy is ours)
    dw_weight, dw_bias, stride, dw_act = dw.weight, dw.bias, dw._fused_stride(), dw.activation

    def fused(x):
        return as_asked(dw, expand_depthwise3x3(x, weight, bias, act, dw_weight, dw_bias,
                                                stride, dw_act))

    def plan(x):
        return step_as_asked(dw, prepared_expand_depthwise3x3(x, weight, bias, act, dw_weight,
                                                              dw_bias, stride, dw_act))
    return _specialised(plan, fused, target)


def _step(module: nn.Module, target: str):
    """A call of ``module``: through ``__call__`` if it has hooks (they run), else its
    ``forward``, specialised to each input's shape where the layer offers that."""
    if hooked(module):
        return _specialised(None, module, target)
    plan = getattr(module, "_inference_step", None)
    return _specialised(plan, module.forward, target)


def _specialised(plan, call, target: str):
    """``call`` as a function the graph calls (torch.fx writes a torch.nn module's bound
    forward as a dotted path into torch, which does not exist: the step is a function of
    ours). Given ``plan`` (an input -> a function of such inputs, or None), each input
    signature (shape, strides, dtype, device, thread count) is planned once and its
    function called from then on: the layers' checks and choices, a few microseconds each,
    beside kernels of tens at batch 1."""
    if plan is None:
        def step(*args, **kwargs):
            return call(*args, **kwargs)
        return _named(step, target)
    plans: dict = {}

    def step(x, *args, **kwargs):
        if args or kwargs or type(x) is not torch.Tensor:
            return call(x, *args, **kwargs)
        key = (x.shape, x.stride(), x.dtype, x.device, torch.get_num_threads())
        run = plans.get(key, plans)
        if run is plans:   # (not planned yet)
            if len(plans) >= _MOST_PLANS:
                plans.clear()
            run = plans[key] = plan(x)
        return call(x) if run is None else run(x)
    return _named(step, target)


def _named(step, target: str):
    """``step`` named after the module path, so the written code reads like the model
    (torch.fx names a function's global ``<__module__>_<__name__>``)."""
    step.__name__ = step.__qualname__ = "".join(
        c if c.isalnum() else "_" for c in target) or "module"
    step.__module__ = "step"
    return step

