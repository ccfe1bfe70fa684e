"""Elementwise expressions: ``st.lazy`` trees compiled into one kernel, and the eager
operators on ``SparseTensor`` (``A + B`` unions patterns, ``A * B`` intersects).

Reference: the same arithmetic on dense copies. Shape rule: operands have equal shapes
(scalars scale). Formats: a map with f(0) != 0 (``exp``) or a sum with a dense operand
gives a dense result; otherwise the result is sparse in the inferred format.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..compiler.notation import UNARY, Access, Add, Assignment, Expr, Mul, Scale, Unary
from .promote import FLOAT_MAPS, promoted

_LETTERS = "ijklmnopqrstuvwxyzabcdefgh"
# Starts the ``torch.einsum`` equation that records ``LazyExpr.eval`` under torch.compile
# (``_traced_eval``); no einsum equation contains it.
EXPR_MARK = "="
# Separates an ``out_format`` name from the equation in the ``torch.einsum`` call recorded
# while compiling; no einsum equation contains it.
FORMAT_MARK = "|"
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
# An expression this deep, or over this many operands, is evaluated before it grows on (a
# sum built in a loop): the compiler walks trees recursively (a chain of 500 additions
# exceeded Python's recursion limit), and a kernel's compile time grows with its operands
# (0.26 s at 16, 1.4 s at 64 here).
_MAX_DEPTH = 64
_MAX_OPERANDS = 64


def _scalar(x) -> bool:
    """A Python or NumPy number (a scalar operand of ``+ - * /``)."""
    return isinstance(x, numbers.Real)


def _as_float(x) -> float:
    """``x`` as a float; a Python int past float's range is +-inf (the factor it tends to;
    torch raises ``OverflowError`` there)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _factor(x, integer: bool):
    """A scale factor as the kernel multiplies by it. An integer that fits int64 stays an
    int (a C integer literal: exact past 2^53, and an int32 product wraps as torch's does,
    where a float factor lost the low bits or saturated); scaling ``integer`` values, one
    in [2^63, 2^64) is its two's complement (the same product modulo 2^64, as torch's) and
    a larger one a ValueError (torch's OverflowError); anything else a float."""
    if isinstance(x, numbers.Integral):
        if -2 ** 63 <= x < 2 ** 63:
            return int(x)
        if integer:
            if 2 ** 63 <= x < 2 ** 64:
                return int(x) - 2 ** 64
            raise ValueError(f"scaling integer values by {int(x)}, which does not fit in 64 "
                             "bits; convert the tensor to floats first (.to(torch.float64))")
    return _as_float(x)


def _remap(e: Expr, offset: int) -> Expr:
    if isinstance(e, Access):
        return Access(e.operand + offset, e.indices)
    if isinstance(e, (Add, Mul)):
        return type(e)(_remap(e.a, offset), _remap(e.b, offset))
    if isinstance(e, Scale):
        return Scale(e.factor, _remap(e.a, offset))
    return Unary(e.fn, _remap(e.a, offset))


class LazyExpr:
    """An unevaluated elementwise expression over same-shaped tensors.

    Build with ``st.lazy(t)`` and operators (``+ - *``, scalars, ``.relu()``, ``.abs()``,
    ``.exp()``, ``.sqrt()``); ``.eval(out_format=None)`` compiles the whole tree into one
    kernel. A tree that reaches 64 levels or 64 operands (a sum built in a loop) is
    evaluated there and continues from its result, so long chains run as a few kernels.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., -2.], [0., 3.]]), format="csr")
        >>> B = st.tensor(torch.tensor([[0., 1.], [1., 0.]]), format="csr")
        >>> (st.lazy(A) * 2 + st.lazy(B)).relu().eval().to_dense()
        tensor([[2., 0.],
                [1., 6.]])
    """

    def __init__(self, tree: Expr, operands: tuple, shape: tuple, floats: bool = False,
                 depth: int = 1):
        self.tree, self.operands, self.shape = tree, tuple(operands), tuple(shape)
        # whether the tree makes floats of integers (a Python float factor, true division,
        # sqrt, exp): ``eval`` promotes as torch would (``ops/promote.py``)
        self.floats = floats
        self.depth = depth   # of ``tree``, counted as it is built (a walk would recurse)

    @property
    def vars(self) -> tuple[str, ...]:
        return tuple(_LETTERS[: len(self.shape)])

    def assignment(self) -> Assignment:
        return Assignment(self.vars, self.tree)

    def _settled(self) -> LazyExpr:
        """This expression, evaluated first if it is as deep or as wide as an expression
        may grow (``_MAX_DEPTH``, ``_MAX_OPERANDS``)."""
        if self.depth < _MAX_DEPTH and len(self.operands) < _MAX_OPERANDS:
            return self
        return lazy(self.eval())

    def _combine(self, other, make):
        other = lazy(other)
        if other.shape != self.shape:
            raise ValueError(f"elementwise operands must have equal shapes, got "
                             f"{self.shape} and {other.shape} (broadcasting is not supported)")
        a, b = self._settled(), other._settled()
        tree = make(a.tree, _remap(b.tree, len(a.operands)))
        return LazyExpr(tree, a.operands + b.operands, self.shape, a.floats or b.floats,
                        max(a.depth, b.depth) + 2)   # (a subtraction adds a Scale too)

    def __add__(self, other):
        if _scalar(other) and other == 0:   # (a float 0 makes floats of integers, as torch)
            return self if self.floats or isinstance(other, numbers.Integral) else \
                LazyExpr(self.tree, self.operands, self.shape, True, self.depth)
        return self._combine(other, Add)

    __radd__ = __add__

    def __sub__(self, other):
        if _scalar(other):
            return self + (-other)
        return self._combine(other, lambda a, b: Add(a, Scale(-1.0, b)))

    def __rsub__(self, other):
        return (-self) + other

    def __mul__(self, other):
        if _scalar(other):
            a = self._settled()
            floats = a.floats or not isinstance(other, numbers.Integral)
            integer = not floats and not any(t.dtype.is_floating_point for t in a.operands)
            return LazyExpr(Scale(_factor(other, integer), a.tree), a.operands, self.shape,
                            floats, a.depth + 1)
        return self._combine(other, Mul)

    __rmul__ = __mul__

    def __truediv__(self, other):
        if not _scalar(other):
            raise TypeError("only division by a scalar is supported")
        # (by zero: the stored values times +-inf, as torch.sparse divides its values)
        out = self * (1.0 / _as_float(other) if other else math.copysign(math.inf, other))
        out.floats = True   # true division, as torch's: floats even for an int divisor
        return out

    def __neg__(self):
        return self * -1

    def _unary(self, fn):
        a = self._settled()
        return LazyExpr(Unary(fn, a.tree), a.operands, self.shape, a.floats or fn in FLOAT_MAPS,
                        a.depth + 1)

    def relu(self):
        return self._unary("relu")

    def abs(self):
        return self._unary("abs")

    def exp(self):
        return self._unary("exp")

    def sqrt(self):
        return self._unary("sqrt")

    def eval(self, out_format=None):
        """Compile and run the whole tree as one kernel (recorded for autograd when an
        operand requires grad: gradients are derived from the same tree)."""
        from ..autograd.function import evaluate

        if _is_dynamo_compiling():   # one graph node (_traced_eval)
            return _traced_eval(self, out_format)
        return evaluate(self.assignment(), promoted(self.operands, self.floats), out_format,
                        what="expression")

    def __repr__(self):
        return f"LazyExpr({self.assignment()}, shape={self.shape})"


def _render(e: Expr) -> str:
    """``e`` in prefix notation, one token per node (``_parse`` reads it back): how a tree
    crosses into a traced graph, as a string constant."""
    if isinstance(e, Access):
        return f"T{e.operand}"
    if isinstance(e, Add):
        return f"+ {_render(e.a)} {_render(e.b)}"
    if isinstance(e, Mul):
        return f"* {_render(e.a)} {_render(e.b)}"
    if isinstance(e, Scale):
        return f"s{e.factor!r} {_render(e.a)}"
    return f"u{e.fn} {_render(e.a)}"


def _parse(tokens, indices) -> Expr:
    """The tree ``_render`` wrote (``tokens``: an iterator over its tokens)."""
    tok = next(tokens)
    if tok[0] == "T":
        return Access(int(tok[1:]), indices)
    if tok in ("+", "*"):
        a = _parse(tokens, indices)
        return (Add if tok == "+" else Mul)(a, _parse(tokens, indices))
    if tok[0] == "s":
        factor = tok[1:]   # (an int factor stays an int: see ``_factor``)
        return Scale(int(factor) if factor.lstrip("-").isdigit() else float(factor),
                     _parse(tokens, indices))
    return Unary(tok[1:], _parse(tokens, indices))


def _dense_eval(e: Expr, operands):
    """The tree on dense tensors with torch ops (what it means for them)."""
    if isinstance(e, Access):
        return operands[e.operand]
    if isinstance(e, (Add, Mul)):
        a, b = _dense_eval(e.a, operands), _dense_eval(e.b, operands)
        return a + b if isinstance(e, Add) else a * b
    if isinstance(e, Scale):
        return _dense_eval(e.a, operands) * e.factor
    return UNARY[e.fn][1](_dense_eval(e.a, operands))


def _traced_eval(expr: LazyExpr, out_format):
    """``expr.eval()`` as dynamo should see it: one ``torch.einsum`` call whose equation
    carries the tree (``EXPR_MARK``, the rank, the tree in prefix notation, then any
    ``out_format`` name), which ``SparseTensor.__torch_function__`` hands to
    ``recorded_eval`` while the graph is traced, below dynamo (the same way ``st.einsum``
    records itself). Dense operands only: torch ops, which dynamo records as they are."""
    from ..formats.tensor import SparseTensor

    if not any(isinstance(t, SparseTensor) for t in expr.operands):
        if out_format not in (None, "dense"):
            raise NotImplementedError(
                f"st.lazy(...).eval(out_format={out_format!r}) of dense operands under "
                "torch.compile: wrap the result with st.tensor outside the compiled function")
        return _dense_eval(expr.tree, expr.operands)
    floats = "f" if expr.floats else ""     # a float scalar or map: promote to floats
    equation = mark_format(f"{EXPR_MARK}{len(expr.shape)}{floats} {_render(expr.tree)}",
                           out_format, "st.lazy(...).eval()")
    return torch.einsum(equation, *expr.operands)


def mark_format(equation: str, out_format, what: str) -> str:
    """``equation`` with a named ``out_format`` appended after ``FORMAT_MARK``, for a
    ``torch.einsum`` call recorded under torch.compile (a graph holds strings, not Format
    objects)."""
    if out_format is None:
        return equation
    if not isinstance(out_format, str):
        raise NotImplementedError(
            f"{what} under torch.compile takes out_format as a format name (e.g. 'csr'), "
            f"got {out_format!r}; pass its name, or convert the result outside the compiled "
            "function")
    return f"{equation}{FORMAT_MARK}{out_format}"


def recorded_eval(equation: str, operands):
    """Evaluate the lazy expression that ``_traced_eval`` recorded as ``equation``.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., -2.]]), "csr")
        >>> recorded_eval("=2 urelu T0", (A,)).to_dense()
        tensor([[1., 0.]])
    """
    from ..autograd.function import evaluate

    head, _, out_format = equation[len(EXPR_MARK):].partition(FORMAT_MARK)
    rank, *tokens = head.split()
    floats = rank.endswith("f")
    letters = tuple(_LETTERS[: int(rank.rstrip("f"))])
    tree = _parse(iter(tokens), letters)
    return evaluate(Assignment(letters, tree), promoted(tuple(operands), floats),
                    out_format or None, what="expression")


def lazy(t) -> LazyExpr:
    """A leaf expression for tensor ``t`` (dense or sparse); operators on it build a tree.

    Example:
        >>> import torch, sparsetorch as st
        >>> st.lazy(torch.ones(2)).shape
        (2,)
    """
    if isinstance(t, LazyExpr):
        return t
    if isinstance(t, (int, float)):
        raise TypeError("a bare scalar cannot be an expression leaf; add it to a tensor "
                        "expression instead (only adding 0 is sparse-safe)")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"st.lazy takes a tensor, got {type(t).__name__}")
    shape = tuple(t.shape)
    return LazyExpr(Access(0, tuple(_LETTERS[: len(shape)])), (t,), shape)


def _eager(fn):
    def op(x):
        return getattr(lazy(x), fn)().eval()
    op.__name__ = fn
    op.__doc__ = (f"Elementwise ``{fn}`` of a sparse (or dense) tensor, or a lazy expression "
                  f"node when given a ``LazyExpr``.\n\n    Example:\n"
                  f"        >>> import torch, sparsetorch as st\n"
                  f"        >>> st.{fn}(st.tensor(torch.tensor([0., 4.]), 'csf')).shape\n"
                  f"        torch.Size([2])\n")
    return op


_relu, _abs, _exp, _sqrt = (_eager(f) for f in ("relu", "abs", "exp", "sqrt"))


def _dispatch_unary(name, eager):
    def fn(x):
        if isinstance(x, LazyExpr):
            return getattr(x, name)()
        return eager(x)
    fn.__name__, fn.__doc__ = name, eager.__doc__
    return fn


relu = _dispatch_unary("relu", _relu)
abs = _dispatch_unary("abs", _abs)  # noqa: A001 - mirrors torch.abs
exp = _dispatch_unary("exp", _exp)
sqrt = _dispatch_unary("sqrt", _sqrt)
