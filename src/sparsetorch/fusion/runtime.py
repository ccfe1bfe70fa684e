"""What a fused graph calls at run time: one function per pattern (``epilogue``,
``attention``, ``elementwise``), each bound to the ``Site`` the rewrite matched.

Each call first checks that its operands are what the rewrite assumed when it saw the
traced (fake) values: a SparseTensor where one was traced, dense tensors elsewhere, one
floating dtype, a bias that broadcasts without growing the result, chain operands of equal
shape. When a check fails it *replays* the original ops (``Replay``), so a fused graph
always computes what the traced one did, errors included. The checks cost about a
microsecond; dynamo's own guards already pin the input types, so in practice they fail only
for values the guards do not see (a bias computed inside the function, say).

``CALLS`` counts fused and replayed calls per pattern; ``recording()`` additionally logs
each call, which is how ``Compiled.explain`` reports what ran fused.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch.fx.node import map_aggregate

from ..formats.tensor import SparseTensor

# pattern -> fused calls / replayed calls, since import (tests and benchmarks read it)
CALLS = {"epilogue": 0, "attention": 0, "elementwise": 0, "replayed": 0}
_LOG = None   # a list while ``recording()`` is active: (pattern, fused?, why)


@contextlib.contextmanager
def recording():
    """Log every fused call made inside the block: yields the list of
    ``(pattern, fused, reason)`` tuples, appended as calls run.

    Example:
        >>> with recording() as log:
        ...     pass
        >>> log
        []
    """
    global _LOG
    outer, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        log, _LOG = _LOG, outer
        if outer is not None:        # nested recordings both see the calls
            outer.extend(log)


def _note(pattern: str, why: str | None):
    CALLS["replayed" if why else pattern] += 1
    if _LOG is not None:
        _LOG.append((pattern, why is None, why))


class _In:
    """Reference to the fused call's ``n``-th input inside a replay step's arguments."""
    __slots__ = ("n",)

    def __init__(self, n):
        self.n = n


class _Step:
    """Reference to an earlier replay step's result."""
    __slots__ = ("n",)

    def __init__(self, n):
        self.n = n


class Replay:
    """The original ops of a fused chain, replayable on the fused call's inputs.

    ``steps`` are ``(op, target, args, kwargs)`` as in an FX node (``call_function`` or
    ``call_method``), with ``_In``/``_Step`` references in place of graph nodes; the last
    step's result is the chain's result.

    Example:
        >>> import torch
        >>> r = Replay([("call_function", torch.mul, (_In(0), 2.0), {}),
        ...             ("call_method", "relu", (_Step(0),), {})])
        >>> r(torch.tensor([-1., 3.]))
        tensor([0., 6.])
    """

    def __init__(self, steps):
        self.steps = list(steps)

    def __call__(self, *inputs):
        done = []

        def resolve(a):
            if isinstance(a, _In):
                return inputs[a.n]
            if isinstance(a, _Step):
                return done[a.n]
            return a

        for op, target, args, kwargs in self.steps:
            args, kwargs = map_aggregate(args, resolve), map_aggregate(kwargs, resolve)
            done.append(target(*args, **kwargs) if op == "call_function"
                        else getattr(args[0], target)(*args[1:], **kwargs))
        return done[-1]


class Site:
    """One matched chain: its pattern, a one-line description for reports, how to replay
    the original ops, and the pattern's own fields (set by ``patterns.py``)."""

    def __init__(self, pattern: str, description: str, replay: Replay, **fields):
        self.pattern, self.description, self.replay = pattern, description, replay
        self.__dict__.update(fields)

    def __repr__(self):
        return f"Site({self.pattern}: {self.description})"


def _dense(t) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, SparseTensor)


_FLOATS = (torch.float32, torch.float64)


# -- SpMM (any product of a SparseTensor with dense operands) + bias + activation -----------
def epilogue(site: Site, *inputs):
    """``activation(product + bias)`` as one ``st.einsum(..., bias=, activation=)`` call.

    ``site`` has ``equation``, ``sparse`` (which product operands were SparseTensors when
    traced), ``bias`` (``"input"``: the last input; a number; or None), ``negate`` (the
    chain subtracted the bias) and ``activation``.
    """
    from ..ops.einsum import einsum

    n = len(site.sparse)
    ops = inputs[:n]
    bias = inputs[n] if site.bias == "input" else site.bias
    why = _epilogue_guard(site, ops, bias)
    if why:
        _note("epilogue", why)
        return site.replay(*inputs)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):   # a Python number added to the product
            bias = torch.tensor(bias, dtype=ops[0].dtype, device=ops[0].device)
        if site.negate:
            bias = -bias
    _note("epilogue", None)
    return einsum(site.equation, *ops, bias=bias, activation=site.activation)


def _epilogue_guard(site, ops, bias):
    dtype = ops[0].dtype
    for t, sparse in zip(ops, site.sparse):
        if not (isinstance(t, SparseTensor) if sparse else _dense(t)):
            return "an operand's sparsity differs from the traced one"
        if t.dtype != dtype or t.device != ops[0].device:
            return "operands of different dtypes or devices"
    if dtype not in _FLOATS:
        return f"dtype {dtype} (the fused epilogue takes float32/float64)"
    if isinstance(bias, torch.Tensor):
        if not _dense(bias) or bias.dtype != dtype or bias.device != ops[0].device:
            return "the bias is not a dense tensor of the product's dtype and device"
        out = _out_shape(site.equation, ops)
        if bias.dim() > len(out) or any(b != 1 and b != o for b, o in
                                        zip(bias.shape, out[len(out) - bias.dim():])):
            return "the bias would broadcast the result to a larger shape"
    return None


def _out_shape(equation, ops):
    lhs, out = equation.split("->")
    size = {}
    for term, t in zip(lhs.split(","), ops):
        size.update(zip(term, t.shape))
    return [size[c] for c in out]


# -- SDDMM -> row softmax -> SpMM ----------------------------------------------------------
def attention(site: Site, A, Q, K, V, *given):
    """``softmax(scale * SDDMM(A, Q, K), 1) @ V`` as one ``st.ops.masked_attention`` call.

    ``site`` has ``scale`` (a number the scores were multiplied by), ``given`` (``"mul"``
    or ``"div"``: they were also multiplied or divided by ``given[0]``, a number given at
    each call), ``k_transposed`` (the traced key operand is Kᵀ) and ``ones`` (the SDDMM
    ignores A's values, as ``torch.sparse.sampled_addmm`` does).
    """
    from ..ops.attention import masked_attention

    why = _attention_guard(A, Q, K, V) or (
        "a divisor given at this call is 0" if site.given == "div" and given[0] == 0
        else None)
    if why:
        _note("attention", why)
        return site.replay(A, Q, K, V, *given)
    if site.k_transposed:
        K = K.t()
    scale = site.scale if not site.given else \
        site.scale * given[0] if site.given == "mul" else site.scale / given[0]
    if site.ones:
        A = A.with_values(torch.full_like(A.values, scale))
    elif scale != 1:
        A = A.with_values(A.values * scale)
    _note("attention", None)
    return masked_attention(A, Q, K, V)


def _attention_guard(A, Q, K, V):
    if not isinstance(A, SparseTensor) or A.dim() != 2:
        return "the mask is not a 2-D SparseTensor"
    for t in (Q, K, V):
        if not _dense(t) or t.dim() != 2:
            return "Q, K or V is not a dense 2-D tensor"
        if t.dtype != A.dtype or t.device != A.device:
            return "Q, K, V and the mask differ in dtype or device"
    if A.dtype not in _FLOATS:
        return f"dtype {A.dtype} (the fused attention takes float32/float64)"
    return None


# -- elementwise trees over SparseTensors --------------------------------------------------
_LAZY = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
         "div": operator.truediv, "neg": operator.neg, "relu": lambda x: x.relu(),
         "abs": lambda x: x.abs(), "sqrt": lambda x: x.sqrt(), "exp": lambda x: x.exp()}


def elementwise(site: Site, *leaves):
    """The whole tree as one ``st.lazy`` expression and one ``.eval()``.

    ``site.steps`` are ``(op, args)`` with ``_In``/``_Step`` references and numbers.
    """
    from ..ops.expr import lazy

    why = _elementwise_guard(leaves) or next(
        ("a divisor given at this call is 0" for op, args in site.steps
         if op == "div" and isinstance(args[1], _In) and leaves[args[1].n] == 0), None)
    if why:
        _note("elementwise", why)
        return site.replay(*leaves)
    done = []

    def resolve(a):
        if isinstance(a, _In):   # (a leaf: a SparseTensor, or a number given at each call)
            leaf = leaves[a.n]
            return lazy(leaf) if isinstance(leaf, torch.Tensor) else leaf
        if isinstance(a, _Step):
            return done[a.n]
        return a

    for op, args in site.steps:
        done.append(_LAZY[op](*(resolve(a) for a in args)))
    _note("elementwise", None)
    return done[-1].eval()


def _elementwise_guard(leaves):
    tensors = [t for t in leaves if not isinstance(t, (int, float))]   # (numbers: factors)
    first = tensors[0]
    for t in tensors:
        if not isinstance(t, SparseTensor):
            return "an operand is not a SparseTensor"
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            return "operands differ in shape, dtype or device"
    return None
