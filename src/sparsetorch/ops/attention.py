"""``st.ops.masked_attention``: SDDMM -> row softmax -> SpMM in one fused kernel.

The fused path (``compiler/attention.py``; on CUDA tensors the Triton kernel of
``codegen/triton.py``) keeps scores as nnz values, never a dense
matrix, and reads each row's entries while they are in cache. With gradients required, or
off the compiled path (other devices, float16), it evaluates the same thing unfused through
differentiable ops: ``st.einsum`` SDDMM, ``st.ops.softmax`` over stored entries, SpMM.
Traced (``torch.compile``) without gradients, the fused C kernel is recorded as the custom
op ``sparsetorch::masked_attention``; with them, the unfused ops are.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .._modes import constant_to_tracer, refuse_ad_transforms
from ..formats.tensor import SparseTensor
from .custom_ops import csr_operand
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

