"""``st.ops.masked_attention``: SDDMM -> row softmax -> SpMM in one fused kernel.

The fused path (``compiler/attention.py``; on CUDA tensors the Triton kernel of
``codegen/triton.py``) keeps scores as nnz values, never a dense
matrix, and reads each row's entries while they are in cache. With gradients required, or
off the compiled path (other devices, float16), it evaluates the same thing unfused through
differentiable ops: ``st.einsum`` SDDMM, ``st.ops.softmax`` over stored entries, SpMM.
Traced (``torch.compile``) without gradients, the fused C kernel is recorded as the custom
op ``sparsetorch::masked_attention``; with them, the unfused ops are.

A batch of sequences and heads folded into rows attends over copies of one sequence's
mask along a block diagonal (``nn.SparseAttention``). Exported with that batch symbolic
(``torch.export`` with a ``Dim``), building the copies in the graph would fix the batch;
``block_diagonal_attention`` records the one sequence's mask and the copy count instead,
as the op ``sparsetorch::block_diagonal_attention``, which folds them where it runs.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .._modes import constant_to_tracer, refuse_ad_transforms, version
from ..formats.tensor import SparseTensor
from .custom_ops import _CSR, csr_operand
from .execute import kernel_argtypes
from .policy import backend, uses_triton


def row_kernel(kind: str, A: SparseTensor):
    """The built kernel of ``compiler/attention.py`` named ``kind`` (``"attention"``,
    ``"row_softmax"`` or ``"row_softmax_grad"``) for CSR ``A``'s value and index types
    (float32 or float64)."""
    return _kernel(kind, "float" if A.dtype == torch.float32 else "double",
                   "int32_t" if A.index_dtype == torch.int32 else "int64_t")


@lru_cache(maxsize=None)
def _kernel(kind: str, value_ctype: str, index_ctype: str):
    from .. import runtime
    from ..codegen.c import render_c
    from ..compiler import attention
    from ..compiler.kernel import sum_copies, tile_width, vector_isa

    dtype = {"float": "float32", "double": "float64"}[value_ctype]
    rows = {"row_softmax": attention.row_softmax_function,
            "row_softmax_grad": attention.row_softmax_grad_function}
    fn = attention.attention_function(tile_width(dtype), sum_copies()) \
        if kind == "attention" else rows[kind]()
    source = render_c([fn], value_ctype, {0: index_ctype}, f"fused {kind}", vector_isa())
    return runtime.load_entries(source, {fn.name: kernel_argtypes(fn)})[fn.name]


def _check(A, Q, K, V):
    what = "masked_attention"
    if not isinstance(A, SparseTensor) or A.dim() != 2:
        got = f"a {A.dim()}-D SparseTensor" if isinstance(A, SparseTensor) else \
            type(A).__name__
        raise TypeError(f"{what}: the mask A must be a 2-D SparseTensor, got {got}; build "
                        "one with st.tensor(mask, format='csr')")
    if A.format.is_dense:
        raise TypeError(f"{what}: the mask A is in the dense format, which stores every "
                        "entry (there is nothing to mask); build it with st.tensor(mask, "
                        "format='csr'), which keeps the nonzeros, or use dense attention")
    if not A.dtype.is_floating_point:
        raise TypeError(f"{what}: A holds {A.dtype} values; attention needs floating point: "
                        "convert A, Q, K and V, e.g. with .to(torch.float32)")
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor) or isinstance(t, SparseTensor) or t.dim() != 2:
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) and \
                not isinstance(t, SparseTensor) else type(t).__name__
            raise TypeError(f"{what}: {name} must be a dense 2-D torch.Tensor, got {got}")
        if t.dtype != A.dtype or t.device != A.device:
            raise TypeError(f"{what}: {name} is {t.dtype} on {t.device} but A is {A.dtype} on "
                            f"{A.device}; convert them to one dtype and device")
    (n, m), d = A.shape, Q.shape[1]
    if Q.shape[0] != n or K.shape != (m, d) or V.shape[0] != m:
        raise ValueError(f"{what}: shapes do not agree: A {tuple(A.shape)}, Q {tuple(Q.shape)}"
                         f", K {tuple(K.shape)}, V {tuple(V.shape)}; need A (n, m), Q (n, d), "
                         "K (m, d), V (m, e)")


def masked_attention(A, Q, K, V):
    """``softmax_rows(A * (Q Kᵀ)) V`` with the softmax over the stored entries of each row
    of the sparse mask ``A`` (scores are sampled on A's pattern and scaled by its values;
    missing entries count as -inf; an empty row gives zeros).

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 1.], [0., 1.]]), format="csr")
        >>> Q = K = torch.zeros(2, 3); V = torch.tensor([[2.], [4.]])
        >>> st.ops.masked_attention(A, Q, K, V)
        tensor([[3.],
                [4.]])
    """
    _check(A, Q, K, V)
    refuse_ad_transforms("masked_attention", (A, Q, K, V))
    fusable = not (torch.is_grad_enabled() and any(t.requires_grad for t in (A, Q, K, V)))
    if torch.compiler.is_compiling():
        # Traced: the fused kernel reads data pointers, which fake tensors do not have; it
        # is recorded as a custom op where it runs (a compiled SparseTransformer, L = 1024,
        # evaluated at 0.55x its eager speed through the unfused ops, at 0.91-0.94x so),
        # else the unfused ops, which record as custom ops of their own.
        if fusable and _fused_on_cpu(A) and A.format.name == "csr" and _compiled_c():
            return torch.ops.sparsetorch.masked_attention(A._pos1, A._crd1, A.values,
                                                          A.shape[1], Q, K, V)
        return _unfused(A, Q, K, V)
    if fusable and uses_triton(A.device) and A.dtype.is_floating_point:
        from .triton_run import attention

        return attention(_csr(A), Q, K, V)
    if not (fusable and _fused_on_cpu(A)) or backend() != "c":
        return _unfused(A, Q, K, V)
    A = _csr(A)
    Q, K, V = Q.contiguous(), K.contiguous(), V.contiguous()
    (n, m), d, e = A.shape, Q.shape[1], V.shape[1]
    scratch = torch.empty(A.nnz, dtype=A.dtype)
    out = torch.empty((n, e), dtype=A.dtype)
    fn = row_kernel("attention", A)
    from ..runtime import num_threads

    nt = num_threads() if A.nnz * (d + e) >= (1 << 14) else 1
    fn(nt, n, m, d, e, A._pos1.data_ptr(), A._crd1.data_ptr(), A._checked_values().data_ptr(),
       Q.data_ptr(), K.data_ptr(), V.data_ptr(), scratch.data_ptr(),
       out.data_ptr())
    return out


def _fused_on_cpu(A: SparseTensor) -> bool:
    """Whether the fused C kernel takes ``A``'s device and dtype."""
    return A.device.type == "cpu" and A.dtype in (torch.float32, torch.float64)


@constant_to_tracer
def _compiled_c() -> bool:
    return backend() == "c"


@torch.library.custom_op("sparsetorch::masked_attention", mutates_args=())
def _traced_fused(pos: torch.Tensor, crd: torch.Tensor, values: torch.Tensor, cols: int,
                  Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``masked_attention`` of the ``(n, cols)`` CSR mask of ``pos``, ``crd``, ``values``:
    the fused kernel, recorded in traced inference (no derivative: where autograd records,
    the unfused ops are traced instead)."""
    return masked_attention(csr_operand(pos, crd, values, cols,
                                        "sparsetorch::masked_attention"), Q, K, V)


@_traced_fused.register_fake
def _(pos, crd, values, cols, Q, K, V):
    return V.new_empty((pos.shape[0] - 1, V.shape[1]))


def _csr(A: SparseTensor) -> SparseTensor:
    return A if A.format.name == "csr" else A.asformat("csr", index_dtype=A.index_dtype)


def _unfused(A, Q, K, V):
    from .einsum import einsum

    # torch.sparse.softmax routes to st.ops.softmax (__torch_function__), and dynamo records
    # a torch function on a SparseTensor as one graph node.
    return torch.sparse.softmax(einsum("ij,ik,jk->ij", A, Q, K), 1) @ V


# -- one sequence's mask, copied along a block diagonal ----------------------------------------
_INT32_MAX = 2**31 - 1


def block_diagonal_arrays(pos: torch.Tensor, crd: torch.Tensor, columns: int,
                          copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CSR ``(pos, crd)`` of ``copies`` copies of the CSR pattern ``pos``/``crd``
    (``columns`` wide) along a block diagonal: copy ``c`` holds rows ``c * rows ...`` and
    columns ``c * columns ...``. int32 where every index fits, else int64.

    Example:
        >>> import torch
        >>> i = lambda *v: torch.tensor(v, dtype=torch.int32)
        >>> [t.tolist() for t in block_diagonal_arrays(i(0, 1, 2), i(1, 0), 2, 2)]
        [[0, 1, 2, 3, 4], [1, 0, 3, 2]]
    """
    nnz = crd.shape[0]
    shift = torch.arange(copies, device=pos.device)[:, None]
    big_pos = torch.cat([(pos[:-1].long() + shift * nnz).reshape(-1),
                         pos.new_full((1,), copies * nnz, dtype=torch.long)])
    index = torch.int32 if copies * max(nnz, columns) <= _INT32_MAX else torch.int64
    return big_pos.to(index), (crd.long() + shift * columns).reshape(-1).to(index)


def block_diagonal_attention(mask: SparseTensor, copies, scale: float, Q: torch.Tensor,
                             K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``masked_attention`` over ``copies`` copies of CSR ``mask``'s pattern along a block
    diagonal, every stored entry valued ``scale`` (``mask``'s own values are not read): Q's
    rows are ``copies`` sequences of ``mask.shape[0]`` queries, K's and V's of
    ``mask.shape[1]`` keys. Recorded as one custom op, with its derivative, so ``copies``
    may be symbolic while tracing (a batch ``torch.export`` keeps dynamic).

    Example:
        >>> import torch, sparsetorch as st
        >>> mask = st.tensor(torch.tensor([[1., 0.], [1., 1.]]), format="csr")
        >>> Q = K = torch.zeros(4, 3); V = torch.arange(4.)[:, None]
        >>> block_diagonal_attention(mask, 2, 1.0, Q, K, V).flatten().tolist()
        [0.0, 0.5, 2.0, 2.5]
    """
    if not isinstance(mask, SparseTensor) or mask.dim() != 2:
        raise TypeError(f"block_diagonal_attention: the mask must be a 2-D SparseTensor, got "
                        f"{type(mask).__name__}; build one with st.tensor(mask, format='csr')")
    rows, columns = mask.shape
    if Q.shape[0] != copies * rows or K.shape[0] != copies * columns:
        raise ValueError(f"block_diagonal_attention: Q needs {copies} x {rows} rows and K, V "
                         f"{copies} x {columns}; got Q {tuple(Q.shape)}, K {tuple(K.shape)}")
    mask = _csr(mask)
    return torch.ops.sparsetorch.block_diagonal_attention(mask._pos1, mask._crd1, columns,
                                                          copies, float(scale), Q, K, V)


def _block_mask(pos, crd, columns: int, copies: int, scale: float, Q) -> SparseTensor:
    """The block-diagonal mask, kept on ``crd`` for the next call with the same arrays
    (unchanged), copies, scale and dtype: an exported transformer (L = 4096, BigBird,
    batch 2, 4 heads) built its 14.4M entries each call, running at 0.5x the eager model,
    which keeps its own."""
    key = (version(pos), version(crd), columns, copies, scale, Q.dtype, Q.device)
    kept = getattr(crd, "_st_block_mask", None)
    if kept is not None and kept[0] is pos and kept[1] == key:
        return kept[2]
    what = "sparsetorch::block_diagonal_attention"
    mask = csr_operand(pos, crd, torch.empty(crd.shape[0], dtype=Q.dtype, device=Q.device),
                       columns, what)   # (checks the arrays; the values are not read)
    big_pos, big_crd = block_diagonal_arrays(mask._pos1, mask._crd1, columns, copies)
    values = torch.full((big_crd.shape[0],), scale, dtype=Q.dtype, device=Q.device)
    folded = SparseTensor._from_parts((big_pos.shape[0] - 1, copies * columns), _CSR,
                                      [big_pos, big_crd], values)
    crd._st_block_mask = (pos, key, folded)
    return folded


@torch.library.custom_op("sparsetorch::block_diagonal_attention", mutates_args=())
def _traced_block(pos: torch.Tensor, crd: torch.Tensor, columns: int, copies: int,
                  scale: float, Q: torch.Tensor, K: torch.Tensor,
                  V: torch.Tensor) -> torch.Tensor:
    """``block_diagonal_attention`` of the mask of ``pos``/``crd``."""
    A = _block_mask(pos, crd, columns, copies, scale, Q)
    with torch.no_grad():   # (the derivative is the op's own: _block_backward)
        return masked_attention(A, Q.detach(), K.detach(), V.detach())


@_traced_block.register_fake
def _(pos, crd, columns, copies, scale, Q, K, V):
    return V.new_empty((Q.shape[0], V.shape[1]))


@torch.library.custom_op("sparsetorch::block_diagonal_attention_backward", mutates_args=())
def _traced_block_backward(dout: torch.Tensor, pos: torch.Tensor, crd: torch.Tensor,
                           columns: int, copies: int, scale: float, Q: torch.Tensor,
                           K: torch.Tensor, V: torch.Tensor) -> list[torch.Tensor]:
    """``(dQ, dK, dV)`` of ``block_diagonal_attention`` for the output gradient ``dout``:
    with ``S = scale * (Q Kᵀ)`` sampled on the mask and ``P`` its row softmax,
    ``dV = Pᵀ dout``, ``dS = P * (dP - rowsum(P * dP))`` where ``dP = dout Vᵀ`` on the
    mask, ``dQ = scale * dS K`` and ``dK = scale * dSᵀ Q``. (Autograd does not record
    inside an op's implementation, so the chain is written out.)"""
    from .einsum import einsum

    A = _block_mask(pos, crd, columns, copies, scale, Q)
    dout = dout.contiguous()
    with torch.no_grad():
        P = torch.sparse.softmax(einsum("ij,ik,jk->ij", A, Q, K), 1)
        dP = einsum("ij,ik,jk->ij", A.with_values(torch.ones_like(A.values)), dout, V)
        p, dp = P.values, dP.values
        rows = torch.repeat_interleave(torch.arange(A.shape[0], device=p.device),
                                       A._pos1.diff().long())
        row_sums = p.new_zeros(A.shape[0]).index_add_(0, rows, p * dp)
        dS = A.with_values(scale * p * (dp - row_sums[rows]))
        return [einsum("ij,jk->ik", dS, K), einsum("ij,ik->jk", dS, Q),
                einsum("ij,ik->jk", P, dout)]


@_traced_block_backward.register_fake
def _(dout, pos, crd, columns, copies, scale, Q, K, V):
    return [torch.empty_like(Q), torch.empty_like(K), torch.empty_like(V)]


def _setup_block(ctx, inputs, output):
    pos, crd, columns, copies, scale, Q, K, V = inputs
    ctx.save_for_backward(pos, crd, Q, K, V)
    ctx.columns, ctx.copies, ctx.scale = columns, copies, scale


def _block_backward(ctx, dout):
    pos, crd, Q, K, V = ctx.saved_tensors
    dQ, dK, dV = torch.ops.sparsetorch.block_diagonal_attention_backward(
        dout, pos, crd, ctx.columns, ctx.copies, ctx.scale, Q, K, V)
    return None, None, None, None, None, dQ, dK, dV


_traced_block.register_autograd(_block_backward, setup_context=_setup_block)
