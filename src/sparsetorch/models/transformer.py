"""A sparse transformer classifier, and the same model on torch's own attention.

``SparseTransformer``: token and learned position embeddings, pre-norm encoder layers
(``SparseAttention`` over one mask, then a GELU MLP, each around a residual), a final
LayerNorm, mean pooling (or the first token's state) and a linear head.

``reference(model, impl)`` returns a copy of a model, same weights, whose attention layers
compute the same attention with torch only: ``"sdpa"`` (``F.scaled_dot_product_attention``
with a boolean L x L mask, torch's fastest dense path), ``"matmul"`` (scores, ``masked_fill``,
softmax, product) or ``"torch_sparse"`` (``torch.sparse.sampled_addmm`` on a CSR mask, COO
``torch.sparse.softmax``, ``torch.sparse.mm``); ``dense_reference`` is ``"sdpa"``. These are
the baselines benchmarks time against and tests check against. Dense references build the
L x L mask (and scores) the sparse model avoids; rows with no stored entries give zeros in
the sparse model and in torch 2.13's SDPA (NaN in ``nn.MultiheadAttention`` with
``need_weights=True``).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..nn._common import check_sizes, input_type_error
from ..nn.attention import MaskArg, SparseAttention
from ..nn.masks import block_diagonal

IMPLS = ("sdpa", "matmul", "torch_sparse")


class SparseTransformer(nn.Module):
    """Sequence classifier whose self-attention runs only on ``mask``'s entries.

    ``mask`` is an L x L SparseTensor (from ``sparsetorch.nn.masks``; inputs must then have
    length L) or a function ``L -> mask``; ``pool`` is ``"mean"`` or ``"first"`` (a CLS
    token at position 0). Call it on token ids (B, L); it returns logits (B, num_classes).

    Example:
        >>> import torch
        >>> from functools import partial
        >>> from sparsetorch.nn import masks
        >>> model = SparseTransformer(10, 2, embed_dim=16, num_heads=2, ff_dim=32,
        ...                           max_len=64, mask=partial(masks.longformer, window=2))
        >>> model(torch.randint(0, 10, (3, 20))).shape
        torch.Size([3, 2])
    """

    def __init__(self, vocab_size: int, num_classes: int, embed_dim: int = 128,
                 num_heads: int = 4, num_layers: int = 2, ff_dim: int = 512,
                 max_len: int = 4096, mask: MaskArg = None, dropout: float = 0.0,
                 pool: str = "mean"):
        super().__init__()
        check_sizes("SparseTransformer", vocab_size=vocab_size, num_classes=num_classes,
                    embed_dim=embed_dim, ff_dim=ff_dim, max_len=max_len)
        check_sizes("SparseTransformer", least=0, num_layers=num_layers)
        if pool not in ("mean", "first"):
            raise ValueError(f"SparseTransformer: pool must be 'mean' or 'first', got {pool!r}")
        self.pool, self.max_len = pool, max_len
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.position = nn.Embedding(max_len, embed_dim)
        self.layers = nn.ModuleList(
            EncoderLayer(embed_dim, num_heads, ff_dim, mask, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor, mask: MaskArg = None) -> torch.Tensor:
        """Logits (B, num_classes) for token ids (B, L); ``mask`` overrides the model's."""
        if not isinstance(tokens, torch.Tensor):
            raise input_type_error("SparseTransformer", "tokens must be integer ids (B, L)",
                                   tokens)
        if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"SparseTransformer: tokens must be integer ids (B, L), got "
                            f"{tokens.dtype} of shape {tuple(tokens.shape)}")
        if tokens.numel() and not torch.compiler.is_compiling():
            # (nn.Embedding's own error is an IndexError, a device assert on a GPU)
            low, high = (int(t) for t in torch.aminmax(tokens))
            if low < 0 or high >= self.embed.num_embeddings:
                raise ValueError(f"SparseTransformer: token ids must lie in [0, "
                                 f"{self.embed.num_embeddings}) (vocab_size), got ids from "
                                 f"{low} to {high}; map them into the vocabulary")
        if tokens.shape[1] > self.max_len:
            raise ValueError(f"SparseTransformer: sequence length {tokens.shape[1]} exceeds "
                             f"max_len={self.max_len}; build the model with a larger max_len")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.embed(tokens) + self.position(positions))
        for layer in self.layers:
            x = layer(x, mask)
        x = self.norm(x)
        return self.head(x.mean(1) if self.pool == "mean" else x[:, 0])


class EncoderLayer(nn.Module):
    """Pre-norm encoder layer: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    Example:
        >>> import torch
        >>> from sparsetorch.nn import masks
        >>> layer = EncoderLayer(8, 2, 16, masks.sliding_window(5, 1))
        >>> layer(torch.randn(2, 5, 8)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, mask: MaskArg = None,
                 dropout: float = 0.0):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(embed_dim), nn.LayerNorm(embed_dim)
        self.attn = SparseAttention(embed_dim, num_heads, mask=mask, dropout=dropout)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, ff_dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ff_dim, embed_dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: MaskArg = None) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.dropout(self.attn(h, mask=mask))
        return x + self.dropout(self.mlp(self.norm2(x)))


class ReferenceAttention(nn.Module):
    """``SparseAttention``'s computation, same weights, in torch only (``impl``: see the
    module docstring). Self-attention; dropout is not applied.

    Example:
        >>> import torch
        >>> from sparsetorch.nn import SparseAttention, masks
        >>> attn = SparseAttention(8, 2, mask=masks.longformer(6, 1, global_tokens=1))
        >>> x = torch.randn(1, 6, 8)
        >>> ref = ReferenceAttention(attn, "matmul")
        >>> torch.allclose(ref(x), attn(x), atol=1e-5)
        True
    """

    def __init__(self, attn: SparseAttention, impl: str = "sdpa"):
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"ReferenceAttention: impl must be one of {IMPLS}, got {impl!r}")
        self.impl, self.num_heads, self.head_dim = impl, attn.num_heads, attn.head_dim
        self.batch_first = attn.batch_first
        self.in_proj_weight = nn.Parameter(attn.in_proj_weight.detach().clone())
        self.in_proj_bias = None if attn.in_proj_bias is None else \
            nn.Parameter(attn.in_proj_bias.detach().clone())
        self.out_proj = copy.deepcopy(attn.out_proj)
        self._mask_for = attn.mask_for   # the sparse layer's mask for a length
        self._cache: tuple = (None, None)

    def forward(self, x: torch.Tensor, mask: MaskArg = None) -> torch.Tensor:
        x = x if self.batch_first else x.transpose(0, 1)
        (B, L, E), H, d = x.shape, self.num_heads, self.head_dim
        sparse = self._mask_for(L, L, mask)
        q, k, v = (t.reshape(B, L, H, d).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, -1))
        out = _ATTEND[self.impl](q, k, v, self._prepared(sparse, B * H, x.dtype))
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, E))
        return out if self.batch_first else out.transpose(0, 1)

    def _prepared(self, sparse, copies, dtype):
        """The mask in the form ``impl`` takes, built once per mask."""
        key = (id(sparse), copies, dtype)
        if self._cache[0] != key:
            if self.impl == "torch_sparse":
                prepared = block_diagonal(sparse, copies).to_torch().to(dtype)
            else:
                prepared = sparse.to_dense() != 0
            self._cache = (key, (sparse, prepared))
        return self._cache[1][1]


def _attend_sdpa(q, k, v, allowed):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def _attend_matmul(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    # (a query with no allowed key: its row of -inf softmaxes to NaN; it attends to
    # nothing, zeros, as the sparse layer and SDPA give)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).masked_fill(~allowed, 0)
    return probs @ v


def _attend_torch_sparse(q, k, v, block_diagonal):
    """One torch.sparse chain over all (batch, head) pairs on a block-diagonal CSR mask
    (one call per op; per-head calls are slower in torch too)."""
    B, H, L, d = q.shape
    fold = [t.reshape(B * H * L, d) for t in (q, k, v)]
    scores = torch.sparse.sampled_addmm(block_diagonal, fold[0], fold[1].t(), beta=0.0,
                                        alpha=1.0 / math.sqrt(d))
    probs = torch.sparse.softmax(scores.to_sparse_coo(), 1)   # CPU softmax needs COO
    return torch.sparse.mm(probs, fold[2]).reshape(B, H, L, d)


_ATTEND = {"sdpa": _attend_sdpa, "matmul": _attend_matmul, "torch_sparse": _attend_torch_sparse}


def reference(model: nn.Module, impl: str = "sdpa") -> nn.Module:
    """A deep copy of ``model`` (same weights) with every ``SparseAttention`` replaced by a
    ``ReferenceAttention`` of ``impl``: the baseline for tests and benchmarks.

    Example:
        >>> import torch
        >>> from sparsetorch.nn import masks
        >>> model = SparseTransformer(10, 2, embed_dim=8, num_heads=2, ff_dim=16, max_len=6,
        ...                           mask=masks.longformer(6, 1, global_tokens=1)).eval()
        >>> tokens = torch.randint(0, 10, (2, 6))
        >>> torch.allclose(reference(model, "sdpa")(tokens), model(tokens), atol=1e-5)
        True
    """
    out = copy.deepcopy(model)
    for name, module in list(out.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, SparseAttention):
                setattr(module, child_name, ReferenceAttention(child, impl))
    return out


def dense_reference(model: nn.Module) -> nn.Module:
    """``reference(model, "sdpa")``: the same model on torch's dense attention with a
    boolean mask built from the sparse one.

    Example:
        >>> import torch
        >>> from sparsetorch.nn import masks
        >>> model = SparseTransformer(10, 2, embed_dim=8, num_heads=2, ff_dim=16, max_len=6,
        ...                           mask=masks.sliding_window(6, 1))
        >>> dense_reference(model)(torch.randint(0, 10, (1, 6))).shape
        torch.Size([1, 2])
    """
    return reference(model, "sdpa")
