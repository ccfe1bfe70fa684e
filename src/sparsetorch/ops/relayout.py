"""Dense operands and results laid out for the kernel: the vectorised index contiguous.

A product of sparse and dense operands has its dense-only index innermost, in register
tiles (SpMM's ``k`` of ``ij,jk->ik``, SDDMM's reduction ``k``): its loads and stores are
contiguous when that index is the last one of every dense operand and of the result. Where
the equation puts it elsewhere, the kernel strides: ``F.linear``'s ``ni,oi->no`` (``x @
W.T``) gathered 32 floats from 32 rows of ``x`` for every stored weight and stored them
into 32 rows of the result. Here such an einsum is run as the equation with that index moved
last: the dense operand copied in that order (free where it already is, as ``X.T``'s
source; otherwise by ``transpose.py``'s block transposes), the result computed in that order
and permuted back into a contiguous tensor.
Measured (2 threads, float32, in one process): ``F.linear`` of a 256 x 1024 input and a 90%
sparse 1024 x 1024 CSR weight 61.8 -> 3.5 ms (dense: 7.9 ms); 64 x 512 by 2048 x 512 10.7
-> 0.75 ms (dense: 2.0 ms). Where that index has size 1 (``F.linear`` of one row) the call
runs without it, as SpMV instead of an SpMM of one column: 1 x 1024 by the same weight 489
-> 79 us (dense: 153 us).

Only plain equations are rewritten (explicit ``->``, letters, no index repeated within a
term, no ``...``), with one index that no sparse operand has; the result only where it is
known dense (``out_format="dense"``, or no stored index of a sparse operand in it, or a
bias added: the epilogue's result is dense), the bias then permuted with it (a view). Errors are reported for the equation as written: a call that fails is run
again unrewritten. A product too small to pay for the copies (``MIN_PERMUTED_WORK``) runs
as written too; the call shim it leaves is not offered to ``st.einsum``'s fast path
(``execute._remember``), which would answer later, larger calls of the string with it.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..formats.levels import Dense
from ..formats.tensor import SparseTensor
from .policy import asks_dense
from .transpose import permuted


# Below this much work (the moved index's size times the stored entries) the call runs as
# written: its strided kernel costs less than the two copies and the rewritten call's
# Python (F.linear, 10% dense weights, in one process: 16 x 256 by 256 x 256 and
# 4 x 512 by 512 x 512, 105k, 60 and 92 us as written against 90 and 128 us rewritten;
# 128 x 128 by 128 x 128 and 8 x 512 by 512 x 512, 210k, 142 and 138 against 86 and 104).
MIN_PERMUTED_WORK = 1 << 17


@dataclass(frozen=True)
class Relayout:
    """``equation`` computed as ``inner`` on operands permuted by ``perms`` (None: as
    given), whose result ``out_perm`` permutes back (None: as it is); where the moved index
    has size 1, as ``squeezed`` instead (without it: ``F.linear`` of one row is SpMV, not
    an SpMM of one column), on operands without dimension ``dims[n]`` (the moved index's
    place in operand ``n``; None: not there), the result given it back at ``out_dim``."""

    inner: str
    perms: tuple
    out_perm: tuple | None
    squeezed: str | None = None
    dims: tuple = ()
    out_dim: int | None = None
    out_ndim: int = 0

    def run(self, einsum, operands, bias=None):
        """``einsum(equation, operands, bias)`` of the call as rewritten, or None where it
        runs as written (``rewrite``)."""
        rewritten = self.rewrite(operands)
        if rewritten is None:
            return None
        equation, ops, finish = rewritten
        if bias is None:
            return finish(einsum(equation, ops, None))
        return finish(einsum(equation, ops, self._bias(equation, bias)))

    def _bias(self, equation: str, bias):
        """``bias`` (broadcasting against the result as written) for ``equation``'s result,
        the squeezed or the permuted one: as a view with the moved index dropped or moved
        along with the result's."""
        b = bias.reshape((1,) * (self.out_ndim - bias.dim()) + tuple(bias.shape))
        if equation != self.inner:
            return b if self.out_dim is None else b.select(self.out_dim, 0)
        if self.out_perm is None:
            return b
        inner_dims = sorted(range(self.out_ndim), key=lambda k: self.out_perm[k])
        return b.permute(inner_dims)

    def rewrite(self, operands) -> tuple | None:
        """``(equation, operands, finish)`` this call runs as: the squeezed or the permuted
        equation, its operands, and what turns its result into the one asked for; None for
        a product too small to pay for the copies (``MIN_PERMUTED_WORK``)."""
        size = self._size(operands)
        if self.squeezed is not None and size == 1:
            ops = tuple(t if d is None else t.select(d, 0) for t, d in zip(operands, self.dims))
            dim = self.out_dim
            return self.squeezed, ops, (lambda out: out) if dim is None else \
                (lambda out: out.unsqueeze(dim))
        if size * sum(t.nnz for t in operands if type(t) is SparseTensor) < MIN_PERMUTED_WORK:
            return None
        ops = tuple(t if p is None else permuted(t, p) for t, p in zip(operands, self.perms))
        perm = self.out_perm
        return self.inner, ops, (lambda out: out) if perm is None else \
            (lambda out: permuted(out, perm))

    def _size(self, operands) -> int:
        # (the largest: an operand of size 1 there broadcasts against the others, so the
        # index has size 1 only where every operand says so)
        return max(operands[n].shape[d] for n, d in enumerate(self.dims) if d is not None)


def run_relaid(einsum, equation, operands, out_format, bias):
    """``einsum(equation', operands')`` of the rewritten call, or None where the call runs as
    written: no rewrite applies, or the rewritten call raised (the call as written then
    reports the error for the equation the user wrote)."""
    plan = relayout(equation, operands, out_format, bias)
    if plan is None or (bias is not None and bias.dim() > plan.out_ndim):
        return None
    try:
        return plan.run(einsum, operands, bias)   # (None: too small, as written)
    except (TypeError, ValueError, IndexError, NotImplementedError):
        return None


def relayout(equation, operands, out_format, bias) -> Relayout | None:
    """The rewrite of ``st.einsum(equation, *operands)`` (see the module docstring), or None
    where the call runs as written.

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.eye(3), format="csr")
        >>> relayout("ni,oi->no", (torch.ones(2, 3), W), None, None).inner
        'in,oi->on'
        >>> relayout("ij,jk->ik", (W, torch.ones(3, 2)), None, None) is None
        True
    """
    if type(equation) is not str:
        return None
    kinds = []
    for t in operands:
        if type(t) is SparseTensor:
            kinds.append(_stored_modes(t._format))
        elif isinstance(t, torch.Tensor) and t.layout == torch.strided:
            kinds.append(None)
        else:
            return None   # torch's sparse layouts, non-tensors: the call as written
    dense_result = out_format is None or asks_dense(out_format)
    return _plan(equation, tuple(kinds), dense_result, out_format is not None or bias is not None)


@lru_cache(maxsize=64)
def _stored_modes(fmt) -> frozenset:
    """Modes of a format held by a compressed (or singleton) level."""
    return frozenset(m for m, level in zip(fmt.mode_order, fmt.levels)
                     if not isinstance(level, Dense))


@lru_cache(maxsize=512)
def _plan(equation: str, kinds: tuple, dense_result: bool, forced: bool):
    """``kinds``: per operand, None (dense) or the modes a sparse operand stores;
    ``forced``: ``out_format`` names dense (else the result is dense only when no stored
    index of a sparse operand is in it)."""
    if equation.count("->") != 1:   # (implicit, or malformed: the parser says so)
        return None
    lhs, out = equation.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(kinds) or None not in kinds or all(k is None for k in kinds):
        return None
    if not all(t.isalpha() and len(set(t)) == len(t) for t in terms) or \
            not (out == "" or out.isalpha()) or len(set(out)) != len(out):
        return None
    sparse_vars = {c for t, k in zip(terms, kinds) if k is not None for c in t}
    only_dense = {c for t, k in zip(terms, kinds) if k is None for c in t} - sparse_vars
    if len(only_dense) != 1:
        return None
    (v,) = only_dense
    perms = tuple(_last(t, v) if k is None and v in t and t[-1] != v else None
                  for t, k in zip(terms, kinds))
    stored = {t[m] for t, k in zip(terms, kinds) if k is not None for m in k}
    known_dense = dense_result and (forced or not stored & set(out))
    out_perm, inner_out = None, out
    if v in out and out[-1] != v and known_dense:
        order = _last(out, v)
        inner_out = "".join(out[m] for m in order)
        out_perm = tuple(inner_out.index(c) for c in out)
    if out_perm is None and all(p is None for p in perms):
        return None
    inner = ",".join(t if p is None else "".join(t[m] for m in p)
                     for t, p in zip(terms, perms))
    dims = tuple(t.index(v) if k is None and v in t else None for t, k in zip(terms, kinds))
    # (squeezed: no operand left without dimensions; the result's kind and shape known)
    if any(len(t) < 2 for t in terms if v in t) or not (
            known_dense or (dense_result and v not in out)):
        return Relayout(f"{inner}->{inner_out}", perms, out_perm, dims=dims,
                        out_ndim=len(out))
    squeezed = ",".join(t.replace(v, "") for t in terms) + "->" + out.replace(v, "")
    return Relayout(f"{inner}->{inner_out}", perms, out_perm, squeezed, dims,
                    out.index(v) if v in out else None, len(out))


def _last(term: str, v: str) -> tuple:
    """The permutation of ``term``'s modes that moves ``v`` last."""
    return (*(m for m, c in enumerate(term) if c != v), term.index(v))
