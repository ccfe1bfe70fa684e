"""Graph convolutions as ``nn.Module``s: ``GCNConv``, ``SAGEConv`` and ``GATConv``, each
called as ``conv(x, adj)`` with ``adj`` an ``edge_index`` or a SparseTensor adjacency (see
``adjacency.py`` for the convention: messages flow source -> target, ``out = A @ x``).

Parameters carry PyG's names and layouts (``lin.weight``, ``bias``, ``lin_l``/``lin_r``,
``att_src``/``att_dst``), so ``conv.load_state_dict(pyg_conv.state_dict())`` copies a PyG
layer's weights. ``x`` may be dense ``(n, in)`` or a SparseTensor (sparse node features);
outputs are dense. Propagation is an SpMM of the compiler (CSR, row-parallel); its backward
a transposed SpMM on the pattern re-laid once and kept.
"""
from __future__ import annotations

import numbers
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from .._modes import outside_inference_mode, refuse_ad_transforms, version
from ..formats import SparseTensor
from ..formats import tensor as st_tensor
from ..ops import einsum, softmax
from ..ops.edge_scores import additive_scores
from ..ops.policy import torch_blas_is_fast
from ._common import (NoTorchScript, autocast_input, check_dropout, check_sizes,
                      input_type_error, member, outside_graph)
from .adjacency import AdjacencyCache, coordinates, normalized_adjacency


def _check_x(x, in_features: int, what: str, dtype: torch.dtype):
    """``x``, checked (and cast to ``dtype`` under autocast: ``autocast_input``)."""
    if not isinstance(x, torch.Tensor):
        raise input_type_error(what, "x must be a tensor or SparseTensor of node features", x)
    if x.layout != torch.strided and type(x) is not SparseTensor:
        raise TypeError(f"{what}: x is a torch.sparse tensor ({x.layout}); wrap it with "
                        "st.tensor(x) (sparse node features) or pass x.to_dense()")
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"{what}: x must be (num_nodes, in_features={in_features}), got "
                         f"shape {tuple(x.shape)}")
    x = autocast_input(x, dtype)
    if x.dtype != dtype:
        fix = f"x.to({dtype}) or layer.to({x.dtype})" if x.dtype.is_floating_point else \
            f"x.to({dtype}): node features are floating point"
        raise TypeError(f"{what}: x is {x.dtype} but the layer's weights are {dtype}; convert "
                        f"{'one of them' if x.dtype.is_floating_point else 'it'} ({fix})")
    return x


def _propagate(A: SparseTensor, h: torch.Tensor, bias, activation=None) -> torch.Tensor:
    """``activation(A @ h + bias)`` in one kernel (bias and activation applied as each
    output row is written; unfused while autograd records)."""
    return einsum("ij,jk->ik", A, h, bias=bias, activation=activation)


class _TransposedWeight:
    """A weight transposed to ``(in, out)`` for the kernels that read their right operand
    row by row: the product with a sparse ``x``, and narrow dense products (``_linear``).
    ``x W^T`` with ``W`` as ``nn.Linear`` keeps it ``(out, in)`` would copy ``W^T`` on
    every call (Cora, 1433 x 16: ~45 us of a 130 us product). Kept between calls while the
    weight is unchanged (the same tensor, at the same data pointer and version, and no
    optimizer step since: fused optimizers write parameters without bumping their version)
    and no gradient is recorded; rebuilt (a differentiable copy) otherwise. (A write in
    place through ``weight.data`` bumps no version and goes unseen: docs/layers.md says so.)"""

    def __init__(self):
        self._kept = None   # (reference, key, W^T): one attribute, for threads (adjacency.py)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        if _is_grad_enabled() and weight.requires_grad or _is_compiling():
            return weight.t().contiguous()
        # (a resize or an assignment to .data changes the pointer or the version; another
        # tensor, e.g. torch.func.functional_call's, may sit where a freed one was: a
        # probe's calls ran with the old weight's copy)
        key, kept = (weight.data_ptr(), version(weight), _optimizer_steps()), self._kept
        if kept is None or kept[1] != key or kept[0]() is not weight:
            kept = self._kept = weakref.ref(weight), key, _transposed_copy(weight)
        return kept[2]

    def __getstate__(self):   # (a copy starts empty: derived data)
        return {}

    def __setstate__(self, state):
        self._kept = None


_STEPS = [0, None]   # optimizer steps counted since the first kept copy; the hook's handle


def _optimizer_steps() -> int:
    """How many optimizer steps (any ``torch.optim`` optimizer, in this process) have run
    since the first call: ``torch.optim``'s fused kernels (``fused=True``) write parameters
    without bumping their version counters, so a kept copy of a weight must also be older
    than the last step. (A probe: every evaluation under no_grad after training with fused
    Adam ran with the weight of the first one.)"""
    if _STEPS[1] is None:
        _STEPS[1] = register_optimizer_step_post_hook(_count_step)
    return _STEPS[0]


def _count_step(optimizer, args, kwargs) -> None:
    _STEPS[0] += 1


@outside_inference_mode
def _transposed_copy(weight: torch.Tensor) -> torch.Tensor:
    return weight.detach().t().contiguous()


_is_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling


# The dense products the generated kernel takes where torch's BLAS is slow: at most this
# many outputs. ``F.linear`` against the form ``_DOT_OUT`` picks on a Zen 4 (MKL, 2 threads,
# 2708 and 8192 rows of 16-1024 inputs, ``benchmarks/nn_layers.py --only narrow``): the
# kernel 1.29-3.26x faster at 2-8 outputs, 1.33-2.41x at 16, 1.13-1.92x at 32, 0.96-1.52x
# at 64.
_NARROW_OUT = 32
# Up to this many outputs from at least this many inputs, the kernel computes each output as
# an inner product of ``x``'s row and ``W``'s (``ij,kj->ik``, eight side by side: each
# vector step does a register's worth of useful multiply-adds); otherwise it adds ``W^T``'s
# rows scaled by ``x``'s entries into a row of outputs held in registers (``ij,jk->ik``,
# four rows side by side), whose steps carry as many useful lanes as there are outputs. At
# 2-8 outputs from 64-1024 inputs the inner products ran 1.2-4x faster than the rows (but
# from 1024 inputs to 8 outputs 0.76-0.91x); from 16 inputs the rows ran 0.95-1.7x as fast,
# at 16 or more outputs 1.3-2.9x.
_DOT_OUT, _DOT_IN = 8, 64


def _linear(x: torch.Tensor, weight: torch.Tensor, transposed, bias=None) -> torch.Tensor:
    """``x W^T + b`` for a dense ``x``: torch's ``F.linear`` (whose backward is the faster
    one too: a GCN training step on Cora, 1 thread, 3.0 ms where the recorded einsum took
    3.6), except where no gradient is recorded, torch's BLAS is slow on narrow products
    (``torch_blas_is_fast``: MKL on AMD CPUs) and this one is narrow (``_NARROW_OUT``),
    where the compiler's dense kernel runs, in the form ``_DOT_OUT`` picks
    (``transposed``: the layer's kept ``W^T``, a ``_TransposedWeight``), given detached
    weights (a Parameter is not a plain tensor to einsum's guarded call shims: each call
    would take its full path, ~0.3 ms here)."""
    out_features, in_features = weight.shape
    if torch_blas_is_fast() or out_features > _NARROW_OUT or \
            _is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.detach()
    if out_features <= _DOT_OUT and in_features >= _DOT_IN:
        return einsum("ij,kj->ik", x, weight.detach(), bias=bias)
    return einsum("ij,jk->ik", x, transposed(weight), bias=bias)


def _sparse_product(x: SparseTensor, weights_t: torch.Tensor) -> torch.Tensor:
    return einsum("ij,jk->ik", x, weights_t)


class _GraphLayer(NoTorchScript, nn.Module):
    """What the graph layers share: ``forward`` runs ``_forward``, eagerly under
    ``torch.compile`` (``torch.compiler.disable``, a graph break). Their adjacency is
    found kept (or built) by Python that dynamo cannot trace, a graph break already, and
    traced, their products went through einsum's generic custom ops without the eager
    calls' kept transposed patterns and fused epilogues. A compiled ``st.models.GCN``
    evaluated at 0.18-0.24x (Cora) and 0.40-0.46x (PubMed) its eager speed and trained at
    0.56-0.61x and 0.53-0.56x; with its layers eager, at 0.47-0.50x, 0.78-0.88x, 0.83-0.88x
    and 0.92-0.94x (the rest: the graph breaks' fixed cost; ``python
    benchmarks/nn_layers.py --only compiled``)."""

    def forward(self, x, adj) -> torch.Tensor:
        if _is_compiling():
            if torch.compiler.is_exporting():
                # (torch's own errors, a data-dependent guard or a disabled function, named
                # no cause)
                raise TypeError(
                    f"{type(self).__name__}: torch.export is not supported: the layer builds "
                    "and keeps its normalised adjacency from the graph's entries, whose count "
                    "depends on their values, outside any traced graph; run the model "
                    "eagerly or under torch.compile, which calls the layer eagerly")
            return _eager_forward(self, x, adj)
        # (before the adjacency's first build, which reads memory: torch's error named no
        # cause; the products refuse transformed weights as einsum)
        refuse_ad_transforms(type(self).__name__, (x,))
        return self._forward(x, adj)


@outside_graph
def _eager_forward(layer: _GraphLayer, x, adj) -> torch.Tensor:
    return layer._forward(x, adj)


class _Propagation(_GraphLayer):
    """What GCNConv and SAGEConv share: the kept normalised adjacency."""

    def __init__(self, normalize, add_self_loops: bool, cached: bool, degree: str = "weights"):
        super().__init__()
        self.normalize, self.add_self_loops, self.cached = normalize, add_self_loops, cached
        self._degree = degree
        self._cache = AdjacencyCache()
        self._transposed = _TransposedWeight()

    @property
    def self_loops(self) -> bool:
        """``add_self_loops`` under its older name."""
        return self.add_self_loops

    def adjacency(self, adj, x) -> SparseTensor:
        """The normalised propagation matrix for ``adj`` and ``x``'s node count and dtype."""
        if type(adj) is SparseTensor and adj.requires_grad and _is_grad_enabled():
            # (a fuzzer's finding: the gradient was silently dropped)
            raise ValueError(
                f"{type(self).__name__}: the adjacency's values require grad, but the layer "
                "normalises a detached copy of them, so no gradient would reach them; pass "
                "adj.detach(), or for learnable edge weights normalise the adjacency "
                "yourself and propagate with st.einsum('ij,jk->ik', A, h)")
        # built eagerly under torch.compile, a graph break: building an adjacency reads
        # values (validation), its entry count depends on them, and the cache compares data
        # pointers; the products around it are traced
        if _is_compiling():
            return self._eager_adjacency(adj, x)
        kept = self._cache.lookup(adj, x.shape[0], x.dtype, self._config()) \
            if self.cached else None
        return kept if kept is not None else self._adjacency(adj, x)

    def _config(self) -> tuple:
        """The settings the matrix is built from (read at each call: they may be set after
        the first)."""
        return self.normalize, self.add_self_loops, self._degree

    def _adjacency(self, adj, x) -> SparseTensor:
        n, dtype = x.shape[0], x.dtype
        what = type(self).__name__
        config = self._config()

        def build():
            normalize, loops, degree = config
            return normalized_adjacency(adj, n, normalize, loops, degree=degree, dtype=dtype,
                                        what=what)

        return self._cache.get(adj, n, dtype, build, config) if self.cached else build()

    _eager_adjacency = outside_graph(_adjacency)


_GCN_ACTIVATIONS = (None, "relu")


class GCNConv(_Propagation):
    """Kipf & Welling's graph convolution: ``D^-1/2 (A + I) D^-1/2 (x W^T) + b``, as PyG's
    ``GCNConv`` computes it (``normalize="mean"``: ``D^-1 (A + I)``; None: ``A`` as is).
    ``add_self_loops`` (``I``; nodes that already have a self loop keep it) follows
    ``normalize`` unless given, as in PyG: added when normalising, not with
    ``normalize=None`` (PyG's ``normalize=False``). ``self_loops=`` is an alias of
    ``add_self_loops=`` (the name GATConv and PyG use).

    The normalised adjacency is computed once and kept while the same adjacency object (or
    ``edge_index``, unmodified) comes back; ``cached=False`` recomputes it every call. The
    product runs in the cheaper order: ``x W^T`` first when ``out_features <= in_features``
    or ``x`` is sparse, else ``(A x) W^T``. ``activation="relu"`` (not in PyG's layer)
    applies ReLU to the output in the propagation's kernel, as each row is written (Kipf &
    Welling's first layer: ``st.models.GCN`` uses it). Weights: ``lin.weight`` ``(out, in)`` (Glorot
    init, like PyG) and ``bias`` ``(out,)`` (zeros): from PyG, ``conv.lin.weight.copy_(
    pyg.lin.weight); conv.bias.copy_(pyg.bias)``, or ``load_state_dict(pyg.state_dict())``.

    Example:
        >>> import torch, sparsetorch as st
        >>> conv = st.nn.GCNConv(3, 2)
        >>> edge_index = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])
        >>> conv(torch.randn(3, 3), edge_index).shape
        torch.Size([3, 2])
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 normalize="sym", add_self_loops: bool | None = None, cached: bool = True,
                 *, self_loops: bool | None = None, activation: str | None = None):
        if normalize not in ("sym", "mean", None):
            raise ValueError(f"GCNConv: normalize must be 'sym', 'mean' or None, got "
                             f"{normalize!r}")
        if activation not in _GCN_ACTIVATIONS:
            raise ValueError(f"GCNConv: activation must be None or 'relu', got {activation!r}")
        if add_self_loops is not None and self_loops is not None and \
                bool(add_self_loops) != bool(self_loops):
            raise ValueError(f"GCNConv: add_self_loops={add_self_loops!r} and its alias "
                             f"self_loops={self_loops!r} disagree; give one of them")
        check_sizes("GCNConv", in_features=in_features, out_features=out_features)
        loops = add_self_loops if add_self_loops is not None else self_loops
        super().__init__(normalize, normalize is not None if loops is None else bool(loops),
                         cached)
        self.in_features, self.out_features = in_features, out_features
        self.activation = activation
        self.lin = nn.Linear(in_features, out_features, bias=False)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.xavier_uniform_(self.lin.weight)

    def _forward(self, x, adj) -> torch.Tensor:
        weight, bias = member(member(self, "lin"), "weight"), member(self, "bias")
        x = _check_x(x, self.in_features, "GCNConv", weight.dtype)
        activation = self.activation
        if activation not in _GCN_ACTIVATIONS:   # (an attribute: it may be set later)
            raise ValueError(f"GCNConv: activation must be None or 'relu', got "
                             f"{activation!r}")
        A = self.adjacency(adj, x)
        if isinstance(x, SparseTensor):
            return _propagate(A, _sparse_product(x, self._transposed(weight)), bias,
                              activation)
        if self.out_features <= self.in_features:
            return _propagate(A, _linear(x, weight, self._transposed), bias, activation)
        out = F.linear(A @ x, weight, bias)
        return out if activation is None else F.relu(out)

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, normalize={self.normalize!r}, "
                f"add_self_loops={self.add_self_loops}, cached={self.cached}"
                + (f", activation={self.activation!r}" if self.activation else ""))


class SAGEConv(_Propagation):
    """GraphSAGE (PyG's ``SAGEConv``): ``lin_l(aggr_{j -> i} x_j) + lin_r(x_i)`` with
    ``aggr="mean"`` (nodes without in-edges aggregate 0) or ``"sum"``; ``root_weight=False``
    drops ``lin_r``. ``lin_l`` holds the bias. On a weighted adjacency (a SparseTensor) the
    mean is PyG's: the weighted messages ``w_ij x_j`` summed and divided by the number of
    in-edges (stored entries), not by the sum of the weights. The aggregation matrix
    (``D^-1 A``) is kept as GCNConv keeps its own (``cached``); the product runs in the
    cheaper order.

    Example:
        >>> import torch, sparsetorch as st
        >>> conv = st.nn.SAGEConv(3, 2)
        >>> conv(torch.randn(3, 3), torch.tensor([[0, 1], [1, 2]])).shape
        torch.Size([3, 2])
    """

    def __init__(self, in_features: int, out_features: int, aggr: str = "mean",
                 root_weight: bool = True, bias: bool = True, cached: bool = True):
        check_sizes("SAGEConv", in_features=in_features, out_features=out_features)
        super().__init__(_sage_normalization(aggr), False, cached, degree="edges")
        self.in_features, self.out_features, self.aggr = in_features, out_features, aggr
        self.lin_l = nn.Linear(in_features, out_features, bias=bias)
        self.lin_r = nn.Linear(in_features, out_features, bias=False) if root_weight else None
        self._transposed_r = _TransposedWeight()

    def _forward(self, x, adj) -> torch.Tensor:
        lin_l, lin_r = member(self, "lin_l"), member(self, "lin_r")
        x = _check_x(x, self.in_features, "SAGEConv", member(lin_l, "weight").dtype)
        A = self.adjacency(adj, x)
        sparse = isinstance(x, SparseTensor)
        if not sparse and self.out_features > self.in_features:
            out = lin_l(A @ x)
            return out if lin_r is None else out + lin_r(x)
        # One product per weight, the root term x W_r^T + b then added by the propagation's
        # kernel as its bias: no slices of a joint product to copy and add (dense x: see
        # ``_linear``). The layer's kernels on Cora, 2 threads: sparse x 199 us where a
        # joint product and its slices took 228, dense x 175-220 where 232-298 (1 thread:
        # 290 vs 310, 251-262 vs 257-263).
        w_l, bias = member(lin_l, "weight"), member(lin_l, "bias")
        w_r = None if lin_r is None else member(lin_r, "weight")
        if sparse:
            messages = _sparse_product(x, self._transposed(w_l))
            root = None if w_r is None else einsum("ij,jk->ik", x, self._transposed_r(w_r),
                                                   bias=bias)
        else:
            messages = _linear(x, w_l, self._transposed)
            root = None if w_r is None else _linear(x, w_r, self._transposed_r, bias)
        return _propagate(A, messages, bias if root is None else root)

    def _config(self) -> tuple:
        # (aggr, not normalize, is SAGEConv's setting: read at each call as GCNConv's are)
        return _sage_normalization(self.aggr), False, self._degree

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, aggr={self.aggr!r}, "
                f"root_weight={self.lin_r is not None}")


def _sage_normalization(aggr) -> str | None:
    """SAGEConv's ``aggr`` as its propagation's normalisation."""
    if aggr not in ("mean", "sum"):
        raise ValueError(f"SAGEConv: aggr must be 'mean' or 'sum', got {aggr!r}")
    return "mean" if aggr == "mean" else None


class GATConv(_GraphLayer):
    """Graph attention (PyG's ``GATConv``): per head, scores ``e_ij = leaky_relu(a_dst .
    h_i + a_src . h_j)`` on the edges ``j -> i`` (with ``h = x W^T``), a softmax over each
    target's incoming edges, dropout on the attention, and ``out_i = sum_j alpha_ij h_j``;
    heads concatenated (``concat=True``, output ``heads * out_features``) or averaged.

    The scores are an SDDMM of the additive kind: for every stored entry of the adjacency
    pattern, the target's and the source's terms gathered and added (all heads at once),
    with the LeakyReLU, in one C pass each way (``ops/edge_scores.py``).
    The heads' patterns are interleaved in one CSR matrix of ``n * heads`` rows (node-major,
    see ``pattern``), so the softmax (the compiler's row softmax over stored entries,
    ``st.ops.softmax``) and the aggregation (SpMM) are one kernel call each for all heads;
    nothing is n x n dense.
    ``add_self_loops`` replaces existing self loops by one per node, as PyG does; duplicate
    edges count once. Weights as PyG's: ``lin.weight`` ``(heads * out, in)``, ``att_src``
    and ``att_dst`` ``(1, heads, out)``, ``bias``.

    Example:
        >>> import torch, sparsetorch as st
        >>> conv = st.nn.GATConv(3, 4, heads=2)
        >>> conv(torch.randn(3, 3), torch.tensor([[0, 1, 2], [1, 2, 0]])).shape
        torch.Size([3, 8])
    """

    def __init__(self, in_features: int, out_features: int, heads: int = 1,
                 concat: bool = True, negative_slope: float = 0.2, dropout: float = 0.0,
                 add_self_loops: bool = True, bias: bool = True, cached: bool = True):
        super().__init__()
        check_sizes("GATConv", in_features=in_features, out_features=out_features,
                     heads=heads)
        check_dropout("GATConv", dropout)
        if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real):
            raise TypeError(f"GATConv: negative_slope must be a number (LeakyReLU's slope "
                            f"below 0), got {negative_slope!r}")
        self.in_features, self.out_features, self.heads = in_features, out_features, heads
        self.concat, self.negative_slope, self.dropout = concat, negative_slope, dropout
        self.add_self_loops, self.cached = add_self_loops, cached
        self.lin = nn.Linear(in_features, heads * out_features, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_features))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_features))
        width = heads * out_features if concat else out_features
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None
        for w in (self.lin.weight, self.att_src, self.att_dst):
            nn.init.xavier_uniform_(w)
        self._cache = AdjacencyCache()
        self._transposed = _TransposedWeight()

    def pattern(self, adj, x):
        """``(P, dst, src)``: the attention pattern of all heads as one CSR SparseTensor of
        shape ``(n * heads, n * heads)``, node-major: row ``i * heads + k`` holds head
        ``k``'s entries of node ``i`` (its in-edges, with self loops as configured), in
        columns ``j * heads + k``; values 1. ``dst`` and ``src`` give, for every stored
        entry in order, where its target's and its source's attention terms are in the
        flattened ``(n, 2 * heads)`` terms (``[a_src | a_dst]`` per node). Kept like
        GCNConv's adjacency (and built eagerly under torch.compile, as it is)."""
        return (self._eager_pattern if _is_compiling() else self._pattern)(adj, x)

    def _pattern(self, adj, x):
        n, H = x.shape[0], self.heads
        add_loops = self.add_self_loops   # (read once: for the key and the build alike)

        def build():
            rows, cols, _ = coordinates(adj, n, x.dtype, "GATConv")
            if add_loops:
                keep = rows != cols
                loops = torch.arange(n, device=rows.device)
                rows, cols = torch.cat([rows[keep], loops]), torch.cat([cols[keep], loops])
            one = st_tensor((torch.stack([rows, cols]), torch.ones(rows.numel(), dtype=x.dtype)),
                            shape=(n, n), format="csr")   # (sorted, duplicates merged)
            pos, crd = one.arrays["pos1"].long(), one.arrays["crd1"].long()
            # Node-major heads: features (n, H, C) are already the (n * H, C) operand and
            # the result the (n, H * C) output, with no transposes (a head-major block
            # diagonal copied h and the output across heads, forward and backward).
            deg = pos.diff().repeat_interleave(H)                  # row i * H + k
            row = torch.arange(n * H, device=pos.device).repeat_interleave(deg)
            start = torch.cumsum(deg, 0) - deg
            node, head = row // H, row % H
            entry = pos[node] + torch.arange(row.numel(), device=pos.device) - start[row]
            source = crd[entry]
            P = st_tensor((torch.stack([row, source * H + head]),
                           torch.ones(row.numel(), dtype=x.dtype)),
                          shape=(n * H, n * H), format="csr")
            return P, node * 2 * H + H + head, source * 2 * H + head

        return self._cache.get(adj, n, x.dtype, build, (add_loops, H)) if self.cached \
            else build()

    _eager_pattern = outside_graph(_pattern)

    def _forward(self, x, adj) -> torch.Tensor:
        x = _check_x(x, self.in_features, "GATConv", self.lin.weight.dtype)
        P, dst, src = self.pattern(adj, x)
        n, H, C = x.shape[0], self.heads, self.out_features
        h = (_sparse_product(x, self._transposed(self.lin.weight))
             if isinstance(x, SparseTensor) else
             _linear(x, self.lin.weight, self._transposed))
        # every head's source and target terms in one product: h (n, H*C) times the
        # (H*C, 2H) matrix holding att_src and att_dst head by head on its block diagonal
        # (elementwise products and sums over (n, H, C) took 4x as long, backward included)
        att = torch.cat([torch.block_diag(*self.att_src[0]), torch.block_diag(*self.att_dst[0])])
        a = (h @ att.t()).reshape(-1)
        scores = additive_scores(a, dst, src, self.negative_slope)
        alpha = softmax(P.with_values(scores), 1)
        if self.dropout and self.training:
            alpha = F.dropout(alpha, self.dropout)
        out = alpha @ h.reshape(n * H, C)
        out = out.view(n, H * C) if self.concat else out.view(n, H, C).mean(1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, heads={self.heads}, "
                f"concat={self.concat}, dropout={self.dropout}")
