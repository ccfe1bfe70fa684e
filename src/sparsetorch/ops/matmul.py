"""Matrix products as einsum calls: ``@``/``matmul``, ``mm``, ``bmm``, ``sparse.mm``,
``sampled_addmm`` and ``F.linear``, for any mix of dense and sparse operands.

Each is one ``st.einsum`` (so it compiles to one kernel and is differentiable through
``sparsetorch.autograd``); nothing is densified. Shapes follow torch's rules for the ranks
supported here (1-D to 3-D, no broadcasting of batch dimensions).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..formats.tensor import SparseTensor
from .einsum import einsum

# (rank of a, rank of b) -> einsum of torch.matmul's semantics
_MATMUL = {(1, 1): "j,j->", (1, 2): "j,jk->k", (2, 1): "ij,j->i", (2, 2): "ij,jk->ik",
           (3, 3): "bij,bjk->bik", (3, 2): "bij,jk->bik", (2, 3): "ij,bjk->bik",
           (3, 1): "bij,j->bi", (1, 3): "j,bjk->bk"}


def _check(x, what: str, n: int):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: operand {n} is a {type(x).__name__}; pass torch tensors or "
                        "SparseTensors")


def _check_addend(x, product, what: str, name: str):
    """Raise unless ``x`` (added to ``product``) has its dtype and broadcasts to its shape:
    torch's add would fail in its own terms, or broadcast the result to a larger shape, or
    promote it (which torch's ``F.linear`` and ``addmm`` refuse)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} is a {type(x).__name__}; pass a tensor")
    if x.dtype != product.dtype:
        raise TypeError(f"{what}: {name} is {x.dtype} but the product is {product.dtype}; "
                        f"convert one of them ({name}.to({product.dtype}))")
    result_shape = product.shape
    try:
        fits = torch.broadcast_shapes(x.shape, result_shape) == result_shape
    except RuntimeError:
        fits = False
    if not fits:
        hint = {tuple(result_shape), tuple(result_shape[-1:])}
        raise ValueError(f"{what}: {name} of shape {tuple(x.shape)} does not broadcast to the "
                         f"product's shape {tuple(result_shape)}; pass one of shape "
                         f"{' or '.join(str(h) for h in sorted(hint, key=len))}")


def _formats(*xs) -> str:
    return ", ".join(sorted({x.format.name for x in xs if isinstance(x, SparseTensor)}))


@lru_cache(maxsize=None)
def _shared_axes(eq: str) -> tuple:
    """``(axis of a, axis of b)`` of each index the two operands of ``eq`` share."""
    ia, ib = eq.split("->")[0].split(",")
    return tuple((ia.index(c), ib.index(c)) for c in ia if c in ib)


def _product(eq, a, b, what: str):
    # A size of 1 broadcasts in einsum (as in torch.einsum), never in a matrix product: a
    # (5, 4) matrix times a (1, 3) one is an error in torch, not a sum over a repeated row.
    for i, j in _shared_axes(eq):
        if a.shape[i] != b.shape[j]:
            raise ValueError(
                f"{what}: shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be multiplied: "
                f"the sizes of dimension {i} of the first ({a.shape[i]}) and dimension {j} "
                f"of the second ({b.shape[j]}) must be equal")
    if eq == "ij,jk->ik":
        # A dense operand of one column (``A @ x[:, None]``) or one row: the matrix-vector
        # product it is, SpMV's kernel instead of a register tile over one column (2x
        # faster on a 4096 x 4096 matrix of 168k entries here). Here, not as a relayout
        # squeeze: ``ij,jk->ik`` needs no permutation, so st.einsum's fast path answers it
        # before relayout could look at the size.
        if type(a) is SparseTensor and _strided(b) and b.shape[1] == 1:
            return _product("ij,j->i", a, b.select(1, 0), what).unsqueeze(1)
        if type(b) is SparseTensor and _strided(a) and a.shape[0] == 1:
            return _product("j,jk->k", a.select(0, 0), b, what).unsqueeze(0)
    elif eq == "ni,oi->no" and type(b) is SparseTensor and _strided(a) and a.shape[0] == 1:
        # ``F.linear`` of one input row (batch-1 inference, a decoding step): the weight's
        # SpMV. Relayout would drop the row too, but after a plan lookup and a rewrite per
        # call: 15 -> 9 us on a DLMC 90%-sparse 512 x 512 weight here (dense: 9 us).
        return _product("i,oi->o", a.select(0, 0), b, what).unsqueeze(0)
    # torch's products with a dense operand return dense tensors; keep that contract even
    # where format inference would pick a sparse vector (CSC @ v)
    dense = not (isinstance(a, SparseTensor) and isinstance(b, SparseTensor))
    return einsum(eq, a, b, out_format="dense" if dense and "->" in eq and eq[-1] != ">"
                  else None)


def _strided(x) -> bool:
    return type(x) is not SparseTensor and x.layout == torch.strided


def matmul(a, b):
    """``a @ b`` with torch.matmul's shape rules for 1-D to 3-D operands (sparse or dense).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 2.]]), "csr")
        >>> matmul(A, torch.ones(2))
        tensor([1., 2.])
    """
    # (the checks of the common case folded into one lookup: ``A @ x`` is the call users
    # repeat most, and each Python-level call here costs a tenth of a tiny SpMV)
    eq = _MATMUL.get((a.dim(), b.dim())) if isinstance(a, torch.Tensor) and \
        isinstance(b, torch.Tensor) else None
    if eq is None:
        _check(a, "matmul", 0)
        _check(b, "matmul", 1)
        raise NotImplementedError(
            f"matmul of a {a.dim()}-D and a {b.dim()}-D tensor (format {_formats(a, b)}) is "
            "not supported; sparse matmul takes 1-D to 3-D operands (reshape the batch "
            "dimensions into one)")
    if eq == "bij,bjk->bik" and a.shape[0] != b.shape[0]:
        raise ValueError(f"matmul: batch sizes differ ({a.shape[0]} and {b.shape[0]}); "
                         "broadcasting batch dimensions of sparse operands is not supported")
    return _product(eq, a, b, "matmul")


def mm(a, b):
    """``torch.mm`` / ``torch.sparse.mm``: the product of two 2-D tensors.

    Example:
        >>> import torch, sparsetorch as st
        >>> mm(st.tensor(torch.eye(2), "coo"), torch.ones(2, 1)).shape
        torch.Size([2, 1])
    """
    for n, x in enumerate((a, b)):
        _check(x, "mm", n)
        if x.dim() != 2:
            raise ValueError(f"mm: operand {n} must be 2-D, got shape {tuple(x.shape)} "
                             "(use matmul or bmm for other ranks)")
    return _product("ij,jk->ik", a, b, "mm")


def mv(a, b):
    """``torch.mv``: a 2-D tensor times a 1-D one.

    Example:
        >>> import torch, sparsetorch as st
        >>> mv(st.tensor(torch.eye(2), "csr"), torch.tensor([1., 2.]))
        tensor([1., 2.])
    """
    _check(a, "mv", 0)
    _check(b, "mv", 1)
    if a.dim() != 2 or b.dim() != 1:
        raise ValueError(f"mv: takes a 2-D and a 1-D tensor, got shapes {tuple(a.shape)} and "
                         f"{tuple(b.shape)} (use matmul for other ranks)")
    return _product("ij,j->i", a, b, "mv")


def addmm(input, mat1, mat2, *, beta=1, alpha=1):
    """``torch.addmm`` / ``torch.sparse.addmm``: ``beta * input + alpha * (mat1 @ mat2)``.

    Example:
        >>> import torch, sparsetorch as st
        >>> addmm(torch.ones(2, 1), st.tensor(torch.eye(2), "csr"), torch.ones(2, 1), alpha=2)
        tensor([[3.],
                [3.]])
    """
    out = mm(mat1, mat2)
    _check_addend(input, out, "addmm", "input")
    if alpha != 1:
        out = out * alpha
    if beta == 0:   # (torch ignores input's values then, nan and inf included)
        return out
    return out + (input if beta == 1 else input * beta)


def bmm(a, b):
    """``torch.bmm``: batched product of two 3-D tensors (sparse 3-D in any format).

    Example:
        >>> import torch, sparsetorch as st
        >>> bmm(st.tensor(torch.ones(2, 3, 4), "csf"), torch.ones(2, 4, 5)).shape
        torch.Size([2, 3, 5])
    """
    for n, x in enumerate((a, b)):
        _check(x, "bmm", n)
        if x.dim() != 3:
            raise ValueError(f"bmm: operand {n} must be 3-D, got shape {tuple(x.shape)}")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"bmm: batch sizes differ ({a.shape[0]} and {b.shape[0]})")
    return _product("bij,bjk->bik", a, b, "bmm")


def sampled_addmm(input, mat1, mat2, *, beta=1.0, alpha=1.0, out=None):
    """``beta * input + alpha * (mat1 @ mat2)`` at ``input``'s stored entries only (SDDMM);
    the result has ``input``'s pattern (arrays shared).

    Example:
        >>> import torch, sparsetorch as st
        >>> S = st.tensor(torch.tensor([[1., 0.], [0., 1.]]), "csr")
        >>> sampled_addmm(S, torch.ones(2, 3), torch.ones(3, 2), beta=0.5).values.tolist()
        [3.5, 3.5]
    """
    if out is not None:
        raise NotImplementedError("sampled_addmm(out=...) is not supported for SparseTensor; "
                                  "use the returned tensor")
    if not isinstance(input, SparseTensor) or input.dim() != 2:
        raise TypeError("sampled_addmm: input must be a 2-D SparseTensor (the sampling "
                        f"pattern), got {type(input).__name__} of shape {tuple(input.shape)}")
    for n, x in enumerate((mat1, mat2), 1):
        _check(x, "sampled_addmm", n)
        if isinstance(x, SparseTensor) or x.dim() != 2:
            raise TypeError(f"sampled_addmm: operand {n} must be a dense 2-D tensor")
    from ..autograd.pattern import ones_pattern, values_on_pattern

    product = einsum("ij,ik,kj->ij", ones_pattern(input), mat1, mat2)
    vals = values_on_pattern(input, product)
    if alpha != 1:
        vals = vals * alpha
    if beta != 0:
        vals = vals + (input.values if beta == 1 else input.values * beta)
    return input.with_values(vals)


def linear(input, weight, bias=None):
    """``F.linear``: ``input @ weight.T + bias`` with a sparse weight and/or a sparse 2-D
    input. A dense input may have any number of leading dimensions.

    Example:
        >>> import torch, sparsetorch as st
        >>> W = st.tensor(torch.tensor([[1., 0., 2.], [0., 3., 0.]]), "csr")
        >>> linear(torch.ones(4, 3), W, torch.tensor([1., 1.]))[0]
        tensor([4., 4.])
    """
    _check(input, "linear", 0)
    _check(weight, "linear", 1)
    if input.dim() == 0:
        raise ValueError("linear: input is 0-d; it needs a last dimension of in_features "
                         f"= {weight.shape[-1] if weight.dim() else '?'}")
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be 2-D (out_features, in_features), got "
                         f"shape {tuple(weight.shape)}")
    if isinstance(bias, SparseTensor):
        raise NotImplementedError(f"linear with a sparse bias (format {bias.format.name}) is "
                                  "not supported; pass a dense bias")
    if isinstance(input, SparseTensor):
        if input.dim() not in (1, 2):
            raise NotImplementedError(f"linear with a {input.dim()}-D sparse input is not "
                                      "supported; use a 1-D or 2-D SparseTensor")
        out = _product("ni,oi->no" if input.dim() == 2 else "i,oi->o", input, weight,
                       "linear")
    else:
        lead = input.shape[:-1]
        x = input.reshape(-1, input.shape[-1]) if input.dim() > 2 else input
        out = _product("i,oi->o" if input.dim() == 1 else "ni,oi->no", x, weight, "linear")
        if input.dim() > 2:
            out = out.reshape(*lead, weight.shape[0])
    if bias is None:
        return out
    _check_addend(bias, out, "linear", "bias")
    if isinstance(out, SparseTensor):   # bias fills every row: the sum is dense by nature
        from .expr import lazy

        return (lazy(out) + lazy(bias.expand(out.shape))).eval()
    return out + bias
