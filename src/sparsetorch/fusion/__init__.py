"""``st.compile(fn)``: fusion of what one loop nest can compute, in code written with
ordinary ops.

Mechanism: ``torch.compile`` with a backend of our own. Dynamo runs ``fn`` symbolically and
hands the backend an FX graph of the torch-level calls it made (``A @ X``, ``torch.relu``,
``torch.sparse.softmax``, ``st.einsum`` recorded as ``torch.einsum``, ...), each node
carrying a fake example of its result, so the backend knows which results are
SparseTensors. ``patterns.py`` rewrites matching chains into single calls of the fused ops:

* product of a SparseTensor with dense operands (``@``, ``matmul``, ``mm``, ``einsum``,
  ``F.linear``) -> ``+ bias`` -> activation  =>  ``st.einsum(..., bias=, activation=)``
* SDDMM -> sparse softmax -> ``@ V``  =>  ``st.ops.masked_attention``
* elementwise ops over SparseTensors  =>  one ``st.lazy`` expression

and the backend returns the rewritten graph's Python ``forward`` to run *eagerly* (no
AOTAutograd, no inductor): the fused ops run their direct ctypes kernels, and gradients come
from the ops themselves (each fused op falls back to its differentiable unfused form when a
gradient is required). Each fused call checks at run time that its operands are what was
traced and otherwise replays the original ops (``runtime.py``). Dynamo's guards decide when
to re-trace (other input types, formats, dtypes, grad mode); a graph break splits the
function into several graphs, each fused on its own.

Observability: ``Compiled.explain(*args)`` runs the function and reports which patterns ran
fused; ``Compiled.fusions`` lists every replacement made so far; ``runtime.CALLS`` counts
fused calls per pattern.

Example:
    >>> import torch, sparsetorch as st
    >>> A = st.tensor(torch.tensor([[1., 0.], [0., -2.]]), "csr")
    >>> f = st.compile(lambda A, X, b: torch.relu(A @ X + b))
    >>> report = f.explain(A, torch.ones(2, 3), torch.zeros(3))
    >>> report.fused
    ('epilogue',)
    >>> report.result
    tensor([[1., 1., 1.],
            [0., 0., 0.]])
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .patterns import Fusion, fuse
from .runtime import CALLS, recording

__all__ = ["CALLS", "Compiled", "Fusion", "FusionReport", "compile"]

# dynamo's exception types, once it is imported: what a graph with breaks may get past
# (a break, a guard on data, .item() in control flow, the recompile limit of a full graph),
# and any failure of dynamo's (the first of those included)
_SPLIT = _FAILED = None


def _import_dynamo():
    """Import dynamo's exception types on the first ``st.compile`` rather than at import:
    importing dynamo costs about a second."""
    global _SPLIT, _FAILED
    if _SPLIT is None:
        from torch._dynamo.exc import (FailOnRecompileLimitHit, TorchDynamoException,
                                       Unsupported, UserError)

        _SPLIT = (Unsupported, UserError, FailOnRecompileLimitHit)
        _FAILED = (TorchDynamoException, FailOnRecompileLimitHit)


@dataclass
class FusionReport:
    """What one call of a compiled function ran: ``fused`` (the pattern of each fused call
    that ran fused, in order), ``replayed`` (``(pattern, reason)`` of each fused call whose
    run-time check failed, so the original ops ran), ``fusions`` (every replacement in the
    graphs compiled so far), ``graphs`` (their code) and the ``result``."""

    fused: tuple
    replayed: tuple
    fusions: tuple
    graphs: tuple
    result: object

    def __str__(self):
        lines = [f"ran fused: {', '.join(self.fused) or 'nothing'}"]
        lines += [f"replayed unfused: {p} ({why})" for p, why in self.replayed]
        lines += [f"fusion: {f}" for f in self.fusions] or ["no fusion in the compiled graphs"]
        return "\n".join(lines)


class Compiled:
    """A function compiled by ``st.compile``: call it like the original.

    Example:
        >>> import torch, sparsetorch as st
        >>> f = st.compile(lambda A, B: torch.relu(A * 2 - B))
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 1.]]), "coo")
        >>> f(A, A).to_dense()
        tensor([[1., 0.],
                [0., 1.]])
        >>> [fusion.pattern for fusion in f.fusions]
        ['elementwise']
    """

    def __init__(self, fn, fullgraph: bool = False, dynamic=None):
        self.fn = fn
        self.graphs: list = []     # the code of each graph compiled
        self.fusions: list = []    # every Fusion made, all graphs
        self.fallback = None       # why calls run eagerly (unfused), once they do
        self.split = None          # the graph break that split the function, if any
        self._fullgraph, self._dynamic = fullgraph, dynamic
        # One graph first, even when breaks are allowed: dynamo 2.13 crashes
        # (InternalTorchDynamoError) on sparse elementwise ops when it may split the graph.
        self._mode = "fullgraph"
        self._compiled = torch.compile(fn, backend=self._backend, fullgraph=True,
                                       dynamic=dynamic)
        functools.update_wrapper(self, fn, updated=())

    def _backend(self, gm, example_inputs):
        self.fusions += fuse(gm)
        self.graphs.append(gm.code)
        return gm.forward

    def __call__(self, *args, **kwargs):
        if self._mode == "eager":
            return self.fn(*args, **kwargs)
        try:
            return self._compiled(*args, **kwargs)
        except _FAILED as e:
            if self._fullgraph:
                raise
            if self._mode != "fullgraph" or not isinstance(e, _SPLIT):
                return self._eagerly(e, args, kwargs)
            # a graph break: compile the pieces between breaks, each fused on its own
            self._mode = "split"
            self.split = str(e).splitlines()[0]
            self._compiled = torch.compile(self.fn, backend=self._backend,
                                           dynamic=self._dynamic)
        try:
            return self._compiled(*args, **kwargs)
        except _FAILED as e:
            return self._eagerly(e, args, kwargs)

    def _eagerly(self, error, args, kwargs):
        """The call run as written; if it runs, dynamo was what failed, and later calls run
        eagerly too. (If it raises, that error is the user's, clearer than dynamo's wrapping
        of it, and the function stays compiled.)"""
        out = self.fn(*args, **kwargs)
        self._fall_back(error)
        return out

    def _fall_back(self, error):
        import warnings

        self._mode = "eager"
        self.fallback = f"dynamo failed ({str(error).splitlines()[0]})"
        warnings.warn(f"st.compile({getattr(self.fn, '__name__', 'fn')}): {self.fallback}; "
                      "it runs eagerly, unfused. Pass fullgraph=True to see the error, or "
                      "call the fused ops (st.einsum(..., bias=, activation=), "
                      "st.ops.masked_attention, st.lazy) directly", RuntimeWarning,
                      stacklevel=3)

    def explain(self, *args, **kwargs) -> FusionReport:
        """Call the function on these arguments and report what ran fused.

        Example:
            >>> import torch, sparsetorch as st
            >>> f = st.compile(lambda A, X: A @ X)     # nothing to fuse: runs as written
            >>> r = f.explain(st.tensor(torch.eye(2), "csr"), torch.ones(2, 1))
            >>> r.fused, r.result.tolist()
            ((), [[1.0], [1.0]])
        """
        with recording() as log:
            result = self(*args, **kwargs)
        return FusionReport(fused=tuple(p for p, ok, _ in log if ok),
                            replayed=tuple((p, why) for p, ok, why in log if not ok),
                            fusions=tuple(self.fusions), graphs=tuple(self.graphs),
                            result=result)

    def __repr__(self):
        return f"st.compile({getattr(self.fn, '__name__', self.fn)!r})"


def compile(fn=None, *, fullgraph: bool = False, dynamic=None):
    """Compile ``fn`` so chains of sparse ops one loop nest can compute run as one fused
    kernel (see this module's docstring for the patterns). Use as ``st.compile(fn)`` or as a
    decorator (``@st.compile`` or ``@st.compile(fullgraph=True)``). ``fullgraph=True``
    makes a graph break an error instead of a split; ``dynamic`` is ``torch.compile``'s.

    Example:
        >>> import torch, sparsetorch as st
        >>> @st.compile
        ... def layer(A, X, b):
        ...     return torch.relu(A @ X + b)
        >>> A = st.tensor(torch.eye(2), "csr")
        >>> layer(A, torch.ones(2, 2), torch.tensor([-2., 0.]))
        tensor([[0., 1.],
                [0., 1.]])
    """
    if fn is None:
        return functools.partial(compile, fullgraph=fullgraph, dynamic=dynamic)
    if isinstance(fn, Compiled):
        return fn
    if not callable(fn):
        raise TypeError(f"st.compile: fn must be a function or module, got "
                        f"{type(fn).__name__}; pass the function itself (st.compile(f)), not "
                        "the result of calling it (st.compile(f(x)))")
    _import_dynamo()
    return Compiled(fn, fullgraph=fullgraph, dynamic=dynamic)
