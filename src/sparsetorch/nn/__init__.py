"""``st.nn``: layers whose weights or attention patterns are sparse.

Example:
    >>> import torch
    >>> from sparsetorch.nn import SparseAttention, masks
    >>> attn = SparseAttention(8, 2, mask=masks.longformer(6, 1, global_tokens=1))
    >>> attn(torch.randn(1, 6, 8)).shape
    torch.Size([1, 6, 8])
"""
from . import masks
from .attention import SparseAttention

__all__ = ["SparseAttention", "masks"]
