"""Attention masks as boolean-pattern CSR SparseTensors (L x L, stored values 1).

Row ``i`` of a mask lists the keys query ``i`` may attend to. Every builder writes the CSR
arrays directly from the pattern's arithmetic (row lengths, then one gather of column
ranges), in time and memory proportional to the stored entries: no L x L matrix, no sort
of the entries. ``as_mask`` accepts a user's own mask in any form ``st.tensor`` reads.

- ``sliding_window(L, window)``: ``|i - j| <= window``.
- ``longformer(L, window, global_tokens)``: the window plus global tokens that attend to
  everything and that everything attends to (Beltagy et al., 2020).
- ``bigbird(L, block, window_blocks, global_blocks, random_blocks)``: block-sparse sliding,
  global and random blocks (Zaheer et al., 2020, the ITC variant).
"""
from __future__ import annotations

import numbers
import random
from typing import Sequence

import numpy as np
import torch

from ..formats.convert import tensor as _to_sparse
from ..formats.tensor import SparseTensor
from ..ops.attention import block_diagonal_arrays

_INT32_MAX = 2**31 - 1


def sliding_window(L: int, window: int, *, dtype=torch.float32) -> SparseTensor:
    """Each query ``i`` attends to the keys ``j`` with ``|i - j| <= window`` (so up to
    ``2 * window + 1`` a row).

    Example:
        >>> from sparsetorch.nn.masks import sliding_window
        >>> sliding_window(4, 1).to_dense()
        tensor([[1., 1., 0., 0.],
                [1., 1., 1., 0.],
                [0., 1., 1., 1.],
                [0., 0., 1., 1.]])
    """
    return longformer(L, window, global_tokens=(), dtype=dtype)


def longformer(L: int, window: int, global_tokens: int | Sequence[int] = (0,), *,
               dtype=torch.float32) -> SparseTensor:
    """Longformer's mask: a sliding window of ``window`` keys on each side, plus global
    tokens whose rows and columns are full. ``global_tokens`` is a count (the first
    ``global_tokens`` positions, e.g. a CLS token) or a sequence of positions.

    Example:
        >>> from sparsetorch.nn.masks import longformer
        >>> longformer(5, 1, global_tokens=(0,)).to_dense()
        tensor([[1., 1., 1., 1., 1.],
                [1., 1., 1., 0., 0.],
                [1., 1., 1., 1., 0.],
                [1., 0., 1., 1., 1.],
                [1., 0., 0., 1., 1.]])
    """
    L, window = _positive("L", L), _count("window", window)
    glob = _global_positions(global_tokens, L)
    rows = torch.arange(L)
    lo, hi = (rows - window).clamp_min(0), (rows + window).clamp_max(L - 1)
    # Row i holds: the globals left of its window, the window lo..hi, the globals right of
    # it; a global row holds every column. Each is a run of columns or a slice of `glob`.
    left = torch.searchsorted(glob, lo)                    # globals < lo
    right = glob.numel() - torch.searchsorted(glob, hi, right=True)   # globals > hi
    is_global = torch.zeros(L, dtype=torch.bool)
    is_global[glob] = True
    width = hi - lo + 1
    length = torch.where(is_global, L, left + width + right)
    pos = _offsets(length)
    # Entry e of row i inside its window is column e - pos[i] - left[i] + lo[i]; a global
    # row's entry is e - pos[i]. One run per row, written as one pass over the entries.
    shift = torch.where(is_global, 0, lo - left) - pos[:-1]
    index = _index_dtype(pos)
    col = torch.arange(int(pos[-1]), dtype=index) + \
        shift.to(index).repeat_interleave(length, output_size=int(pos[-1]))
    # The few global columns outside a row's window: before it (rank < left) and after it.
    if len(glob):
        g = torch.arange(len(glob))
        inside = len(glob) - left - right            # globals inside the window
        rank = torch.where(g < left[:, None], g, g - inside[:, None] + width[:, None])
        keep = ((g < left[:, None]) | (g >= (len(glob) - right)[:, None])) & \
            ~is_global[:, None]
        col[(pos[:-1, None] + rank)[keep]] = glob.to(index).expand(L, -1)[keep]
    return _csr(L, pos, col, dtype)


def bigbird(L: int, block: int = 64, window_blocks: int = 3, global_blocks: int = 2,
            random_blocks: int = 3, *, generator: torch.Generator | None = None,
            dtype=torch.float32) -> SparseTensor:
    """BigBird's block-sparse mask (ITC): the sequence is cut into blocks of ``block``
    tokens (the last one may be shorter); block row ``b`` attends to the ``window_blocks``
    blocks centred on ``b`` (always its own: 0 is taken as 1), to the first
    ``global_blocks`` blocks (whose rows attend to everything), and to ``random_blocks``
    further blocks drawn without replacement from the rest by ``generator`` (the same
    seeded generator gives the same mask).

    Example:
        >>> import torch
        >>> from sparsetorch.nn.masks import bigbird
        >>> m = bigbird(8, block=2, window_blocks=1, global_blocks=1, random_blocks=0)
        >>> m.to_dense()[:, :4]
        tensor([[1., 1., 1., 1.],
                [1., 1., 1., 1.],
                [1., 1., 1., 1.],
                [1., 1., 1., 1.],
                [1., 1., 0., 0.],
                [1., 1., 0., 0.],
                [1., 1., 0., 0.],
                [1., 1., 0., 0.]])
    """
    L, block = _positive("L", L), _positive("block", block)
    window_blocks, global_blocks = _count("window_blocks", window_blocks), \
        _count("global_blocks", global_blocks)
    random_blocks = _count("random_blocks", random_blocks)
    if window_blocks % 2 == 0 and window_blocks:
        raise ValueError(f"bigbird: window_blocks must be odd (the window is centred on the "
                         f"query's block), got {window_blocks}; use {window_blocks + 1}")
    nb = -(-L // block)
    n_global = min(global_blocks, nb)
    # One Python stream seeded from the generator: Random.sample draws k of n in O(k).
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"bigbird: generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}; e.g. torch.Generator().manual_seed(0)")
    rng = random.Random(int(torch.randint(2**62, (1,), generator=generator)))
    per_block = [_block_columns(b, nb, window_blocks // 2, n_global, random_blocks, rng)
                 for b in range(nb)]   # O(L / block) lists of column blocks
    # Every row of block b lists the same columns, the tokens of its column blocks in
    # order: build those lists, then tile each over its block's rows.
    col_blocks = torch.tensor([c for cs in per_block for c in cs])
    widths = (col_blocks * block + block).clamp_max(L) - col_blocks * block
    list_len = torch.zeros(nb, dtype=torch.long).index_add_(
        0, torch.arange(nb).repeat_interleave(torch.tensor([len(cs) for cs in per_block])),
        widths)
    list_start = _offsets(list_len)
    tokens = torch.arange(int(list_start[-1])) + (
        col_blocks * block - _offsets(widths)[:-1]).repeat_interleave(widths)
    length = list_len.repeat_interleave(block)[:L]
    pos = _offsets(length)
    col = torch.empty(int(pos[-1]), dtype=_index_dtype(pos))
    for b in range(nb):
        rows, width = min(block, L - b * block), int(list_len[b])
        start = int(pos[b * block])
        col[start:start + rows * width].view(rows, width).copy_(
            tokens[list_start[b]:list_start[b] + width])
    return _csr(L, pos, col, dtype)


def as_mask(mask, L: int | None = None, *, name: str = "mask") -> SparseTensor:
    """A user's mask as a CSR SparseTensor of its pattern: a SparseTensor in any format, a
    ``torch.sparse`` tensor, a scipy sparse matrix or a dense boolean tensor (its True
    entries); rectangular (queries x keys) for cross-attention. Stored values are ignored
    by attention (which entries are stored is what counts); ``L``, when given, is the
    sequence length a square mask must match.

    Example:
        >>> import torch
        >>> from sparsetorch.nn.masks import as_mask
        >>> as_mask(torch.tensor([[True, False], [True, True]])).nnz
        3
    """
    if isinstance(mask, np.ndarray) and mask.dtype == np.bool_:
        mask = torch.from_numpy(mask)   # (as a bool tensor: st.tensor stores numbers)
    if isinstance(mask, torch.Tensor) and not isinstance(mask, SparseTensor) and \
            mask.layout == torch.strided and mask.dtype != torch.bool:
        raise TypeError(f"{name}: a dense mask must be a bool tensor (True = may attend), got "
                        f"{mask.dtype}; pass mask != 0, or a SparseTensor")
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:   # (before st.tensor's formats)
        raise ValueError(f"{name}: an attention mask is 2-D (queries x keys), got shape "
                         f"{tuple(mask.shape)}; one mask serves every batch element and head")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = mask.to(torch.float32)   # st.tensor stores numbers; True -> 1
    try:
        out = mask if isinstance(mask, SparseTensor) else _to_sparse(mask, format="csr")
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: expected an L x L SparseTensor (e.g. from "
                        f"sparsetorch.nn.masks.longformer) or a bool tensor, got "
                        f"{type(mask).__name__} ({err})") from None
    if out.dim() != 2:
        raise ValueError(f"{name}: an attention mask is 2-D (queries x keys), got shape "
                         f"{tuple(out.shape)}")
    if L is not None and out.shape != (L, L):
        raise ValueError(f"{name}: the mask is {out.shape[0]} x {out.shape[1]} but the "
                         f"sequence has length {L}; build the mask for L={L}")
    if out.format.name != "csr":
        out = out.asformat("csr")
    return out


def block_diagonal(mask: SparseTensor, copies: int) -> SparseTensor:
    """``copies`` copies of CSR ``mask`` along a block diagonal: one mask for a batch of
    sequences and heads folded into rows (copy ``c`` holds rows and columns
    ``c * L ... c * L + L - 1``). Index arrays widen to int64 when they must.

    Example:
        >>> from sparsetorch.nn.masks import block_diagonal, sliding_window
        >>> block_diagonal(sliding_window(2, 0), 2).to_dense()
        tensor([[1., 0., 0., 0.],
                [0., 1., 0., 0.],
                [0., 0., 1., 0.],
                [0., 0., 0., 1.]])
    """
    if not isinstance(mask, SparseTensor) or mask.dim() != 2:
        raise TypeError(f"block_diagonal: mask must be a 2-D SparseTensor (as_mask converts "
                        f"other masks), got {type(mask).__name__}")
    if not isinstance(copies, torch.SymInt):   # (a symbolic batch while tracing)
        copies = _count("copies", copies)
    mask = mask if mask.format.name == "csr" else mask.asformat("csr")
    n, m = mask.shape
    pos, crd = block_diagonal_arrays(mask._pos1, mask._crd1, m, copies)
    return SparseTensor.from_levels((copies * n, copies * m), "csr", {"pos1": pos, "crd1": crd},
                                    mask.values.repeat(copies), check=False)


# -- helpers -------------------------------------------------------------------------------
def _block_columns(b, nb, half, n_global, n_random, rng):
    """Column blocks of block row ``b``, ascending, in O(window + globals + randoms)."""
    if b < n_global:
        return range(nb)
    fixed = sorted(set(range(n_global)) | set(range(max(0, b - half), min(nb, b + half + 1))))
    picked = []
    for r in sorted(rng.sample(range(nb - len(fixed)), min(n_random, nb - len(fixed)))):
        for f in fixed:      # the r-th block not fixed: step over the fixed ones up to it
            r += f <= r
        picked.append(r)
    return sorted(fixed + picked)


def _global_positions(global_tokens, L):
    if isinstance(global_tokens, numbers.Integral) and not isinstance(global_tokens, bool):
        glob = torch.arange(min(_count("global_tokens", global_tokens), L))
    elif isinstance(global_tokens, (bool, str, bytes, numbers.Number)) or \
            not hasattr(global_tokens, "__iter__") or \
            isinstance(global_tokens, torch.Tensor) and global_tokens.dim() != 1:
        raise TypeError(f"longformer: global_tokens is a count (an int) or a sequence of "
                        f"positions, got {global_tokens!r}")
    else:
        given = torch.as_tensor(list(global_tokens))
        glob = given.long()   # (1.5 would become 1 unseen: a fuzzer's finding)
        if glob.dim() != 1 or len(glob) and (
                given.is_floating_point() or given.is_complex() or given.dtype == torch.bool
                or glob.min() < 0 or glob.max() >= L):
            raise ValueError(f"longformer: global_tokens must be positions in [0, {L}), got "
                             f"{list(global_tokens)}")
    return torch.unique(glob)   # sorted, no repeats


def _offsets(length):
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(length, 0)])


def _index_dtype(pos):
    return torch.int32 if int(pos[-1]) <= _INT32_MAX else torch.int64


def _csr(L, pos, col, dtype):
    index = _index_dtype(pos)
    return SparseTensor.from_levels(
        (L, L), "csr", {"pos1": pos.to(index), "crd1": col.to(index)},
        torch.ones(col.numel(), dtype=dtype), check=False)


def _positive(name, v):
    # (numpy's integers are ints here, as the layers take them)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"mask builder: {name} must be a positive int, got {v!r}")
    return int(v)


def _count(name, v):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
        raise ValueError(f"mask builder: {name} must be an int >= 0, got {v!r}")
    return int(v)
