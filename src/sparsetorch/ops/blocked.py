"""Blocked operands (BSR and any blocked format) as unblocked ones of twice the order.

A format with ``blocksize = (b_0, ..., b_{n-1})`` stores ``A[x_0, ..., x_{n-1}]`` at block
``(x_m // b_m)`` and in-block offset ``(x_m % b_m)``. Its level arrays are exactly those of
a 2n-order tensor ``A'[o_0.., e_0..]`` (shape ``(n_m / b_m).. + (b_m)..``) in the same level
kinds, with the outer modes first: so instead of a special blocked loop, every index
variable ``v`` a blocked operand uses is split into a block variable ``v_b`` and an in-block
variable ``v_e`` (``v = v_b * b + v_e``), dense operands that use ``v`` are viewed with that
dimension split (free), and the compiler schedules the result like any other expression:
dense in-block loops over ``v_e`` inside the compressed block loop, register tiles over the
dense operand's free dimension, no conversion and no per-entry index arithmetic.

Where the split does not apply (another sparse operand takes part, or the result would be a
newly assembled sparse tensor), the caller falls back to converting the blocked operand to
CSR.
"""
from __future__ import annotations

from dataclasses import fields, replace

from ..compiler.notation import Access, Assignment, Expr, var_extents
from ..formats.format import Format
from ..formats.tensor import SparseTensor


def _map_accesses(expr: Expr, fn) -> Expr:
    if isinstance(expr, Access):
        return fn(expr)
    changes = {f.name: _map_accesses(getattr(expr, f.name), fn) for f in fields(expr)
               if isinstance(getattr(expr, f.name), Expr)}
    return replace(expr, **changes)


def unblocked_format(fmt: Format) -> Format:
    """The 2n-order format whose level arrays are those of blocked ``fmt``.

    Example:
        >>> from sparsetorch.formats.format import as_format
        >>> unblocked_format(as_format("bsr", 2, (2, 2))).mode_order
        (0, 1, 2, 3)
    """
    n = len(fmt.mode_order)
    return Format(fmt.levels, tuple(fmt.mode_order) + tuple(n + m for m in fmt.mode_order))


def split_blocked(assignment: Assignment, tensors):
    """``(assignment', tensors', finish, static)`` computing the same result with every
    blocked operand seen unblocked, or None when the split does not apply. ``finish(result')``
    turns the rewritten result back into the original one (a view for dense results);
    ``static`` pairs each in-block variable with its extent, the block size (the compiler
    unrolls on it: ``compiler/jam.py``).

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> A = st.tensor(torch.eye(4), format="bsr", blocksize=(2, 2))
        >>> a, ops, finish, static = split_blocked(parse_einsum("ij,jk->ik", [2, 2]),
        ...                                        [A, torch.ones(4, 3)])
        >>> str(a)
        'out[i_b,i_e,k] = sum_{j_b,j_e} T0[i_b,j_b,i_e,j_e] * T1[j_b,j_e,k]'
        >>> static
        (('i_e', 2), ('j_e', 2))
    """
    block = {}                      # variable -> block size
    for acc in assignment.expr.accesses():
        t = tensors[acc.operand]
        if not isinstance(t, SparseTensor) or t.format.blocksize is None:
            continue
        for v, b in zip(acc.indices, t.format.blocksize):
            if block.setdefault(v, b) != b:
                return None
    # One sparse operand, the blocked one: with several, the split result's format (dense
    # in-block levels) would not be the sparse one their product needs.
    if not block or sum(isinstance(t, SparseTensor) for t in tensors) != 1:
        return None
    for acc in assignment.expr.accesses():
        shape = tensors[acc.operand].shape
        if any(v in block and s % block[v] for v, s in zip(acc.indices, shape)):
            return None             # a shape error: the unsplit path reports it

    def split(indices):
        return tuple(x for v in indices for x in ((f"{v}_b", f"{v}_e") if v in block
                                                    else (v,)))

    new_tensors = list(tensors)
    done = set()

    def rewrite(acc: Access) -> Access:
        t = tensors[acc.operand]
        if isinstance(t, SparseTensor) and t.format.blocksize is not None:
            indices = tuple(f"{v}_b" for v in acc.indices) + \
                tuple(f"{v}_e" for v in acc.indices)
            if acc.operand not in done:
                new_tensors[acc.operand] = unblocked(t)
            done.add(acc.operand)
            return Access(acc.operand, indices)
        if acc.operand not in done:
            new_tensors[acc.operand] = _split_dense(t, acc.indices, block)
            done.add(acc.operand)
        return Access(acc.operand, split(acc.indices))

    new = Assignment(split(assignment.out_vars), _map_accesses(assignment.expr, rewrite))

    def finish(result, out_shape, sampled):
        """``sampled``: (operand, blocked result format) for a result on a blocked
        operand's pattern (its arrays, new values), else (None, None)."""
        return _put_back(result, out_shape, sampled, tensors)

    return new, new_tensors, finish, tuple(sorted((f"{v}_e", b) for v, b in block.items()))


def _split_dense(t, indices, block: dict):
    """Dense ``t`` (indexed by ``indices``) viewed with each blocked dimension split into
    (blocks, block size)."""
    shape = []
    for v, size in zip(indices, t.shape):
        shape += [size // block[v], block[v]] if v in block else [size]
    return t.reshape(shape)


def _put_back(result, out_shape, sampled, operands):
    """The split expression's result in the original modes: a blocked result on operand
    ``sampled[0]``'s arrays, or the dense result reshaped."""
    n, fmt = sampled
    if n is not None:
        return SparseTensor(out_shape, fmt, operands[n]._level_arrays, result._values)
    return result.reshape(out_shape)


def unblocked(t: SparseTensor) -> SparseTensor:
    """Blocked ``t`` as the unblocked tensor of twice the order (module docstring): the same
    arrays and values, no copy. Kept with ``t`` unless its values require grad (then the
    wrapper records an autograd node of its own each time).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(4), format="bsr", blocksize=(2, 2))
        >>> tuple(unblocked(A).shape), unblocked(A) is unblocked(A)
        ((2, 2, 2, 2), True)
    """
    found = t.__dict__.get("_unblocked")
    if found is None:
        fmt = t.format
        shape = tuple(s // b for s, b in zip(t.shape, fmt.blocksize)) + tuple(fmt.blocksize)
        found = SparseTensor(shape, unblocked_format(fmt), t._level_arrays, t._values)
        if not t._values.requires_grad:
            t.__dict__["_unblocked"] = found
    return found


class BlockedCall:
    """A repeated call on blocked operands, memoised like any other (``execute.lookup``):
    the blocked operand seen unblocked (kept with it), dense operands viewed with their
    blocked dimensions split, ``call`` (the split expression's kernel) run on them, and the
    result put back in the original modes. Mismatched shapes raise as on a first call."""

    def __init__(self, assignment: Assignment, static: tuple, call, sampled):
        self.assignment, self.call, self.sampled = assignment, call, sampled
        self.block = {v[:-2]: b for v, b in static}
        self.indices = {acc.operand: acc.indices for acc in assignment.expr.accesses()}

    def __call__(self, operands):
        full = var_extents(self.assignment, [t.shape for t in operands])
        split = [unblocked(t) if type(t) is SparseTensor else
                 _split_dense(t, self.indices[n], self.block) for n, t in enumerate(operands)]
        out_shape = tuple(full[v] for v in self.assignment.out_vars)
        return _put_back(self.call(split), out_shape, self.sampled, operands)


def blocked_result_format(assignment: Assignment, split: Assignment, out_format: Format,
                          source: Format) -> Format | None:
    """The blocked format of a result sampled on a blocked operand, in the original output's
    modes (a transposed result gets the transposed mode order and block shape), or None if
    the split result's storage is not block-major.

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.formats.format import as_format
        >>> bsr = as_format("bsr", 2, (2, 3))
        >>> a = parse_einsum("ij->ji", [2])
        >>> s = Assignment(("j_b", "j_e", "i_b", "i_e"), Access(0, ("i_b", "j_b", "i_e", "j_e")))
        >>> f = blocked_result_format(a, s, Format(bsr.levels, (2, 0, 3, 1)), bsr)
        >>> f.mode_order, f.blocksize
        ((1, 0), (3, 2))
    """
    stored = [split.out_vars[m] for m in out_format.mode_order]
    n = len(assignment.out_vars)
    outer, inner = stored[:n], stored[n:]
    if not all(v.endswith("_b") for v in outer) or [v[:-2] for v in outer] != \
            [v[:-2] for v in inner]:
        return None
    order = tuple(assignment.out_vars.index(v[:-2]) for v in outer)
    # The result shares the source's arrays: its k-th stored level is the source's k-th.
    blocks = {v[:-2]: source.blocksize[source.mode_order[k]] for k, v in enumerate(outer)}
    return Format(source.levels, order, tuple(blocks[v] for v in assignment.out_vars))
