"""``SparseAttention``: multi-head attention whose scores exist only on a sparse mask.

Per head, ``softmax(mask * (Q Kᵀ / sqrt(d))) V`` with the softmax over each row's stored
entries, through ``st.ops.masked_attention`` (SDDMM -> row softmax -> SpMM fused in one
kernel; with gradients required, the same chain of differentiable sparse ops). The batch
and the heads are folded into one call on a block-diagonal mask of ``B * H`` copies of the
pattern (rows of every head spread over the threads; measured faster than one call per
head, see the README), so neither L x L scores nor B * H kernel launches appear.

Parameters are named as ``torch.nn.MultiheadAttention``'s (``in_proj_weight``,
``in_proj_bias``, ``out_proj``), so state dicts load across: a dense baseline with the
same weights is one ``load_state_dict`` away.
"""
from __future__ import annotations

import collections
import contextlib
import math
import threading
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .._modes import outside_inference_mode, refuse_ad_transforms
from ..formats.tensor import SparseTensor
from ..ops import einsum
from ..ops.attention import block_diagonal_attention, masked_attention
from ._common import (NoTorchScript, autocast_input, check_dropout, check_sizes,
                      input_type_error, outside_graph)
from .masks import as_mask, block_diagonal

# The mask functions' masks a layer keeps, in stored entries (~8 bytes each): 128 MiB.
_KEPT_MASK_ENTRIES = 1 << 24
# Every layer's kept masks change under this one (re-entrant: a mask function may build
# another layer's); one for all keeps layers copyable and picklable.
_MASKS_LOCK = threading.RLock()

MaskArg = SparseTensor | torch.Tensor | Callable[[int], SparseTensor] | None


class SparseAttention(NoTorchScript, nn.Module):
    """Multi-head attention restricted to the stored entries of an L x L mask.

    ``mask`` (at construction, or per call) is a SparseTensor from
    ``sparsetorch.nn.masks`` or any mask ``masks.as_mask`` reads (its pattern is used, its
    values ignored), or a function ``L -> mask`` called once per sequence length (its
    masks kept, up to ``_KEPT_MASK_ENTRIES`` stored entries: a random one is drawn once per
    length and layer). Query i
    attends to the keys j stored in row i; a row with no entries outputs zeros before the
    output projection. Inputs are (B, L, E) (``batch_first=True``) or (L, B, E).
    ``dropout`` drops attention probabilities in training.

    Example:
        >>> import torch
        >>> from sparsetorch.nn import SparseAttention, masks
        >>> attn = SparseAttention(16, 4, mask=masks.sliding_window(10, 2))
        >>> x = torch.randn(2, 10, 16, requires_grad=True)
        >>> y = attn(x); y.sum().backward()
        >>> y.shape, x.grad.shape
        (torch.Size([2, 10, 16]), torch.Size([2, 10, 16]))
    """

    def __init__(self, embed_dim: int, num_heads: int, mask: MaskArg = None,
                 dropout: float = 0.0, bias: bool = True, batch_first: bool = True):
        super().__init__()
        check_sizes("SparseAttention", embed_dim=embed_dim, num_heads=num_heads)
        embed_dim, num_heads = int(embed_dim), int(num_heads)
        if embed_dim % num_heads:
            raise ValueError(f"SparseAttention: embed_dim ({embed_dim}) must be divisible by "
                             f"num_heads ({num_heads}); each head gets embed_dim // num_heads "
                             "features")
        check_dropout("SparseAttention", dropout)
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first = dropout, batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * embed_dim)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        nn.init.xavier_uniform_(self.in_proj_weight)   # as nn.MultiheadAttention
        if bias:
            nn.init.zeros_(self.out_proj.bias)
        self.mask = mask if mask is None or callable(mask) and \
            not isinstance(mask, torch.Tensor) else as_mask(mask)
        # a mask function's result for each length it was called for, {(function, L): mask},
        # least recently used first: kept, so a random mask (BigBird's) stays the same for a
        # length another came between, up to _KEPT_MASK_ENTRIES stored entries in all
        # (variable-length batches could otherwise keep a mask for every length)
        self._built: collections.OrderedDict = collections.OrderedDict()
        self._folded: dict = {}   # (mask id, copies, dtype) -> (mask, block-diagonal mask)

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, mask: MaskArg = None) -> torch.Tensor:
        """Attend ``query`` to ``key``/``value`` (both default to ``query``: self-attention)
        over ``mask`` (default: the one given at construction), shape (Lq, Lk)."""
        # (before the mask's first build, which reads memory: torch's error named no cause)
        refuse_ad_transforms("SparseAttention", (query, key, value))
        key = query if key is None else key
        value = key if value is None else value
        q_in, k_in, v_in = (self._checked(t, n) for t, n in
                            ((query, "query"), (key, "key"), (value, "value")))
        if k_in.shape[:2] != v_in.shape[:2] or q_in.shape[0] != k_in.shape[0]:
            raise ValueError(f"SparseAttention: batch and length do not agree: query "
                             f"{tuple(q_in.shape)}, key {tuple(k_in.shape)}, value "
                             f"{tuple(v_in.shape)} (batch_first layout)")
        (B, Lq, _), Lk, H, d = q_in.shape, k_in.shape[1], self.num_heads, self.head_dim
        w, b = self.in_proj_weight, self.in_proj_bias
        if query is key and key is value:
            q, k, v = F.linear(q_in, w, b).chunk(3, dim=-1)
        else:
            q, k, v = (F.linear(t, w_, b_) for t, w_, b_ in zip(
                (q_in, k_in, v_in), w.chunk(3), b.chunk(3) if b is not None else (None,) * 3))
        # (B, L, H*d) -> (B*H*L, d): every (batch, head) is one diagonal block of A.
        q, k, v = (t.reshape(B, L, H, d).transpose(1, 2).reshape(-1, d)
                   for t, L in ((q, Lq), (k, Lk), (v, Lk)))
        dropout = self.training and self.dropout > 0
        if not dropout and torch.compiler.is_exporting():
            # Exported: the copies of the mask are made inside one op, which keeps the batch
            # symbolic (folded in the graph, it was fixed), and a fixed mask is read in the
            # graph (strict export allows no graph break). torch.compile folds it outside
            # its graph, eagerly (a graph break), with a symbolic batch too.
            fixed = isinstance(self.mask if mask is None else mask, SparseTensor)
            with _real_tensors():
                one = self._mask(Lq, Lk, mask) if fixed else self.mask_for(Lq, Lk, mask)
            out = block_diagonal_attention(one, B * H, 1 / math.sqrt(d), q, k, v)
            return self._projected(out, B, Lq)
        # (in the projections' dtype: half precision under autocast)
        A = self._folded_mask(self.mask_for(Lq, Lk, mask), B * H, q.dtype)
        if dropout:
            probs = torch.sparse.softmax(einsum("ij,ik,jk->ij", A, q, k), 1)
            probs = probs.with_values(F.dropout(probs.values, self.dropout))
            out = probs @ v
        else:
            out = masked_attention(A, q, k, v)
        return self._projected(out, B, Lq)

    def _projected(self, out: torch.Tensor, B, Lq) -> torch.Tensor:
        """The heads' outputs, (B*H*Lq, d), projected and laid out as the input."""
        H, d, E = self.num_heads, self.head_dim, self.embed_dim
        out = self.out_proj(out.reshape(B, H, Lq, d).transpose(1, 2).reshape(B, Lq, E))
        return out if self.batch_first else out.transpose(0, 1)

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, batch_first={self.batch_first}")

    @outside_graph
    def mask_for(self, Lq: int, Lk: int | None = None, mask: MaskArg = None) -> SparseTensor:
        """The CSR mask a call with these lengths uses: ``mask``, else the layer's own
        (a function of L is called once per length, and its result kept)."""
        return self._mask(Lq, Lk, mask)

    def _mask(self, Lq: int, Lk: int | None, mask: MaskArg) -> SparseTensor:
        Lk = Lq if Lk is None else Lk
        mask = self.mask if mask is None else mask
        if mask is None:
            raise ValueError("SparseAttention: no mask; give one at construction or call, e.g. "
                             "sparsetorch.nn.masks.longformer(L, window=64, global_tokens=1)")
        if callable(mask) and not isinstance(mask, torch.Tensor):
            mask = self._built_mask(mask, Lq)
        mask = as_mask(mask)
        if mask.shape != (Lq, Lk):
            raise ValueError(f"SparseAttention: the mask is {mask.shape[0]} x {mask.shape[1]} "
                             f"but the query has length {Lq} and the key {Lk}; build the mask "
                             f"for these lengths")
        return mask

    # -- helpers ---------------------------------------------------------------------------
    @outside_inference_mode
    def _built_mask(self, fn, L: int) -> SparseTensor:
        # (under a lock: threads making a layer's first call drew a random mask each, and
        # an eviction between another thread's test and read was a KeyError)
        with _MASKS_LOCK:
            built, key = self._built, (_identity(fn), L)
            if key in built:
                built.move_to_end(key)
                return built[key][1]
            # (the function kept beside its mask: an unhashable one, keyed by its id, stays
            # alive, so no other object takes that id while the entry lasts)
            mask = as_mask(fn(L))
            built[key] = fn, mask
            total = sum(m.nnz for _, m in built.values())
            while total > _KEPT_MASK_ENTRIES and len(built) > 1:
                total -= built.popitem(last=False)[1][1].nnz
            return mask

    def _checked(self, t, name):
        layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
        if not isinstance(t, torch.Tensor):
            raise input_type_error("SparseAttention", f"{name} must be a dense 3-D tensor "
                                   f"{layout}", t)
        if isinstance(t, SparseTensor) or t.dim() != 3:
            raise ValueError(f"SparseAttention: {name} must be a dense 3-D tensor {layout}, "
                             f"got shape {tuple(t.shape)}")
        t = autocast_input(t, self.in_proj_weight.dtype)
        if t.dtype != self.in_proj_weight.dtype:
            raise TypeError(f"SparseAttention: {name} is {t.dtype} but the weights are "
                            f"{self.in_proj_weight.dtype}; convert one of them (e.g. "
                            f"x.to({self.in_proj_weight.dtype}) or module.to(x.dtype))")
        if t.shape[-1] != self.embed_dim:
            raise ValueError(f"SparseAttention: {name} has {t.shape[-1]} features, the layer "
                             f"embed_dim={self.embed_dim}")
        return t if self.batch_first else t.transpose(0, 1)

    # Not traced by torch.compile: the mask is built and cached outside the graph (a graph
    # break), which then receives it as an input whose format dynamo can read.
    @outside_graph
    @outside_inference_mode
    def _folded_mask(self, mask, copies, dtype):
        """``copies`` copies of ``mask`` on a block diagonal, valued 1/sqrt(head_dim) (the
        score scale rides on the mask's values); kept while the same mask is used."""
        kept = type(copies) is int   # (a symbolic batch under torch.export: built each trace)
        key = (id(mask), copies, dtype)
        hit = self._folded.get(key) if kept else None
        if hit is not None and hit[0] is mask:
            return hit[1]
        folded = block_diagonal(mask, copies)
        folded = folded.with_values(torch.full_like(folded.values, 1 / math.sqrt(self.head_dim),
                                                    dtype=dtype))
        if kept:
            self._folded = {key: (mask, folded)}
        return folded


def _identity(fn):
    """``fn`` itself where it hashes, else its id (a dataclass with ``__call__`` does not
    hash: keyed by itself, every call failed with "unhashable type")."""
    try:
        hash(fn)
    except TypeError:
        return id(fn)
    return fn


def _real_tensors():
    """Under non-strict ``torch.export``, a context in which torch ops make real tensors:
    the mask is built (a function called, a bool or COO mask converted) from values, with
    data-dependent sizes, and enters the graph as a constant. Traced as fakes, a first
    call failed on those sizes (only a mask kept by an eager call exported). Strict export
    (dynamo) traces the mask as it is: it needs a fixed CSR mask."""
    if torch.compiler.is_dynamo_compiling():
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()
