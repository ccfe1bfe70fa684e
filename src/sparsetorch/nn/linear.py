"""``SparseLinear``: ``y = x W^T + b`` with ``W`` a CSR (or BSR) SparseTensor.

The module stores the pattern's level arrays as buffers (``pos1``, ``crd1``) and one weight
per stored entry as the dense Parameter ``values``, so any torch optimizer steps it and
``state_dict`` round-trips both. Each forward wraps them as ``W`` (``with_values``, shared
arrays, differentiable in ``values``) and calls ``F.linear``: the compiler's SpMM forward,
a transposed SpMM for ``dx`` (on a pattern re-laid once and kept) and an SDDMM sampled on
``W``'s pattern for ``dvalues``. Time and memory scale with the stored entries.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._modes import ad_transforms_active, outside_inference_mode, version
from ..formats import SparseTensor
from ..formats.pack import array_names
from ..ops import einsum, rows_op
from ..ops.epilogue import ACTIVATIONS, unfused
from ..ops.rows import MIN_ROWS, linear_rows
from . import _pattern
from ._common import (NoTorchScript, autocast_input, input_type_error, keep_facts, member,
                      outside_graph)

_is_compiling = torch.compiler.is_compiling

# A sparse input holding more than this fraction of entries is multiplied dense: a row
# times a sparse weight row costs about their merged lengths, so denser rows lose to the
# dense-input SpMM (256 rows x 2048 by a 10%-dense 512 x 2048 weight, 1 thread: sparse
# input 0.44x as long as densifying it at 2% density, 2.0x at 5%, 2.9x at 10%; MNIST
# digits, 19%: 7x; bag-of-words rows at 0.5% of 20000 words: 0.18x).
DENSIFY_INPUT_ABOVE = 0.03


def _densified_for_product(x: SparseTensor) -> torch.Tensor:
    """``x.to_dense()`` as the product's kernel reads it: a 2-D ``(batch, in)`` input is
    written ``(in, batch)``-major and returned as the transposed view, since ``ops/relayout``
    runs ``x W^T`` with the batch index last and takes such a view without copying (MNIST's
    256 x 784 batch: densified and transposed 174 + 97 us, written transposed 85 us)."""
    if x.dim() != 2:
        return x.to_dense()
    return einsum("ni->in", x, out_format="dense").t()


class SparseLinear(NoTorchScript, nn.Module):
    """A linear layer whose weight is sparse: ``forward(x) = x @ W.T + b``.

    Give exactly one of ``density`` (a random pattern of ``kept_count(out * in, density)``
    = ``N - round((1 - density) * N)`` entries, the count ``prune_mask`` and ``from_dense``
    keep too, or as many whole ``blocksize`` blocks counted in blocks) or ``mask`` (a bool
    ``(out_features, in_features)`` tensor or a SparseTensor whose stored entries are kept;
    with ``blocksize``, every block holding an entry is stored whole). ``blocksize`` (an int
    or a pair dividing the shape) stores the weight in BSR, else CSR.

    Parameters: ``values`` (1-D, one weight per stored entry in storage order; its
    ``state_dict`` key is ``"values"``) and ``bias`` (``(out_features,)`` or None). Buffers:
    the pattern's index arrays. Initialisation is ``nn.Linear``'s (uniform in ``+-1 /
    sqrt(fan_in)``) with ``fan_in`` the stored entries per output row on average, not
    ``in_features``: a 90%-sparse row sums a tenth of the terms, so its weights are drawn
    ``sqrt(10)`` times wider and the output keeps ``nn.Linear``'s scale.

    ``x`` may be dense with any leading dimensions, ``(..., in_features)``, or a 1-D/2-D
    SparseTensor (sparse activations such as bag-of-words rows: a CSR batch holding less
    than 3% of its entries is multiplied by its entries, its cost in proportion to them,
    ``ops/sparse_rows.py``; a denser one is read as it is by the row-block kernel, or
    densified first); the result is dense. ``activation`` (None or one of
    ``st.einsum``'s: "relu", "sigmoid", ...) is applied to the result: for a 2-D dense
    input with a CSR weight in the product's kernel together with the bias, as each output
    is written (unfused while autograd records).
    ``load_state_dict`` accepts a state of another pattern (another entry count) and takes
    it over. Works with autograd, any optimizer, ``torch.compile`` (CSR weights traced,
    float32 ones through the eager kernels recorded as custom ops, dense or CSR inputs,
    ``ops/rows_op.py``; a BSR weight's product runs eagerly, a graph break, so
    ``fullgraph=True`` refuses it: its coordinates are unpacked by their values),
    ``.to(dtype)``.

    Example:
        >>> import torch, sparsetorch as st
        >>> gen = torch.Generator().manual_seed(0)
        >>> layer = st.nn.SparseLinear(6, 4, density=0.5, generator=gen)
        >>> layer.values.shape, layer.weight.format.name
        (torch.Size([12]), 'csr')
        >>> layer(torch.randn(3, 6)).shape
        torch.Size([3, 4])
        >>> torch.allclose(layer(torch.ones(6)),
        ...                torch.ones(6) @ layer.weight.to_dense().T + layer.bias)
        True
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 density=None, mask=None, blocksize=None, dtype=None, device=None,
                 generator=None, activation: str | None = None):
        super().__init__()
        if device is not None and torch.device(device).type == "meta":
            # (a fuzzer's finding: it built, then failed inside its first use)
            raise ValueError("SparseLinear: device='meta' holds no data, and the layer's "
                             "pattern is data (the positions of its stored weights); build "
                             "it on a real device (device='cpu') and move it with .to()")
        if activation is not None and activation not in ACTIVATIONS:
            raise ValueError(f"SparseLinear: activation must be None or one of "
                             f"{', '.join(ACTIVATIONS)}, got {activation!r}")
        self.activation = activation
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"SparseLinear: {name} must be a positive int, got {n!r}")
        self.in_features, self.out_features = in_features, out_features
        shape = (out_features, in_features)
        self.blocksize = _pattern.blocks(blocksize, shape, "SparseLinear")
        self._format = _pattern.weight_format(self.blocksize)
        self._array_names = array_names(self._format)
        if (density is None) == (mask is None):
            raise ValueError("SparseLinear: give exactly one of density= (a random pattern) "
                             "and mask= (a bool (out_features, in_features) tensor or a "
                             "SparseTensor pattern)")
        if mask is None:
            mask = _pattern.random_mask(shape, self.blocksize, generator, "SparseLinear",
                                        density=density)
        pattern = _pattern.from_mask(mask, shape, self.blocksize, "SparseLinear")
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"{type(self).__name__}: dtype={dtype} is not a floating-point "
                            "dtype; its weights are trained: use torch.float32 (the default) "
                            "or torch.float64")
        for name, array in pattern.arrays.items():
            self.register_buffer(name, array.to(device))
        # (in the state dict, checked by loads: see _load_from_state_dict)
        self.register_buffer("weight_shape", torch.tensor(shape, device=device))
        # fan-in: the entries a row actually sums (nn.Linear's rule with in_features)
        bound = 1 / math.sqrt(max(1.0, pattern.nnz / out_features))
        self.values = nn.Parameter(_uniform(pattern.nnz, bound, dtype, device, generator))
        self.bias = nn.Parameter(_uniform(out_features, bound, dtype, device, generator)) \
            if bias else None

    # -- the weight ---------------------------------------------------------------------------
    def _arrays(self) -> dict:
        return {name: self._buffers[name] for name in self._array_names}

    @property
    def weight(self) -> SparseTensor:
        """``(out_features, in_features)`` SparseTensor whose values are ``self.values``
        (differentiable: gradients reach the Parameter)."""
        values = member(self, "values")
        if _is_compiling():   # traced: no Python-side caches
            return SparseTensor.from_levels(self._shape(), self._format, self._arrays(),
                                            values, check=False)
        kept = self._kept_weight()
        if not (values.requires_grad and torch.is_grad_enabled()):
            return kept
        # (a plain view: Parameters do not pass the check that lets wrappers share facts)
        return kept.with_values(values.view(-1))

    def _kept_weight(self) -> SparseTensor:
        """Eagerly, one wrapper of the arrays (over a detached alias of the values, so
        optimizer steps show through) is kept: what kernels work out about the pattern
        stays with it, and a graph-recording wrapper inherits it. The wrapper holds
        validated copies of the pattern buffers, so it is rebuilt when a buffer is replaced
        (set_pattern) or written in place (load_state_dict): each buffer's identity and
        version counter are part of the key."""
        values = member(self, "values")
        cached = self.__dict__.get("_cached_weight")
        if not _still_valid(cached, values, self._buffers, self._array_names):
            cached = self.__dict__["_cached_weight"] = self._built_weight(values)
        return cached[2]

    @outside_inference_mode
    def _built_weight(self, values):
        arrays = self._arrays()
        stamp = tuple((a, version(a)) for a in arrays.values())
        try:   # (fully checked: the buffers may have been written in place since)
            kept = SparseTensor.from_levels(self._shape(), self._format, arrays,
                                            values.detach())
        except ValueError as exc:
            if not any(not a.is_inference() and a._version for a in arrays.values()):
                raise   # (never written in place: not the case the hint below is about)
            raise ValueError(
                f"{type(self).__name__}: its pattern buffers ({', '.join(arrays)}) are not a "
                f"valid {self._format.name} pattern for its values: {exc}. They were written "
                "in place since they were made: if not by load_state_dict, maybe by "
                "torch.optim.swa_utils.AveragedModel(use_buffers=True), which averages every "
                "buffer, integer ones included: average with use_buffers=False (the patterns "
                "are copied), and change a pattern with set_pattern or load_state_dict") \
                from None
        return values, values.data_ptr(), kept, stamp

    def _shape(self):
        return (self.out_features, self.in_features)

    def mask(self) -> torch.Tensor:
        """The stored entries as a dense bool ``(out_features, in_features)`` tensor.

        Example:
            >>> import torch, sparsetorch as st
            >>> st.nn.SparseLinear(3, 2, mask=torch.eye(2, 3, dtype=torch.bool)).mask().sum().item()
            2
        """
        flat = torch.zeros(self.out_features * self.in_features, dtype=torch.bool,
                           device=self.values.device)
        flat[_pattern.positions(self.weight.detach())] = True
        return flat.reshape(self._shape())

    # -- changing the pattern -----------------------------------------------------------------
    def set_pattern(self, mask, values=None) -> None:
        """Replace the pattern by ``mask`` (a bool ``(out_features, in_features)`` tensor or a
        SparseTensor; with a block size, blocks holding an entry are stored whole).

        ``values``: a 1-D tensor of one value per new stored entry (storage order) or a dense
        ``(out_features, in_features)`` tensor read at the new entries; by default the old
        weights where the entry was stored before, 0 where it is new. ``self.values`` stays
        the same Parameter, written in place, or resized (its gradient dropped) when the
        entry count changes, as ``load_state_dict`` does. Per-entry optimizer state
        (momentum, Adam's moments) belongs to the old entry at that position; sized for the
        old count, it makes the optimizer's next step raise torch's size mismatch: drop it
        (``optimizer.state.pop(layer.values, None)``) or remap it (``st.train`` does).

        Example:
            >>> import torch, sparsetorch as st
            >>> layer = st.nn.SparseLinear(3, 2, mask=torch.eye(2, 3, dtype=torch.bool))
            >>> layer.set_pattern(torch.ones(2, 3, dtype=torch.bool))
            >>> layer.values.shape, int((layer.weight.to_dense() != 0).sum())
            (torch.Size([6]), 2)
        """
        pattern = _pattern.from_mask(mask, self._shape(), self.blocksize,
                                     "SparseLinear.set_pattern")
        device, old = self.values.device, self.values.detach()
        new_at = _pattern.positions(pattern).to(device)
        if values is None:
            dense = torch.zeros(self.out_features * self.in_features, dtype=old.dtype,
                                device=device)
            dense[_pattern.positions(self.weight.detach())] = old
            values = dense[new_at]
        else:
            values = self._new_values(values, pattern.nnz, new_at)
        for name, array in pattern.arrays.items():
            setattr(self, name, array.to(device))
        if values.numel() == old.numel():
            with torch.no_grad():
                self.values.copy_(values)
        else:   # the same Parameter, resized, as load_state_dict does: an optimizer, a list
            # given to clip_grad_norm_ or a hook holding it goes on seeing the layer's weights
            # (a new Parameter left them all on an orphan)
            self.values.data = values.to(old.dtype).clone()
            self.values.grad = None

    def _new_values(self, values, nnz: int, new_at: torch.Tensor) -> torch.Tensor:
        if not isinstance(values, torch.Tensor) or isinstance(values, SparseTensor):
            raise TypeError("SparseLinear.set_pattern: values must be a dense tensor, got "
                            f"{type(values).__name__}")
        values = values.detach().to(device=new_at.device, dtype=self.values.dtype)
        if tuple(values.shape) == self._shape():
            return values.flatten()[new_at]
        if tuple(values.shape) != (nnz,):
            raise ValueError(f"SparseLinear.set_pattern: the new pattern stores {nnz} "
                             f"entries, so values must have shape ({nnz},) or be a dense "
                             f"{self._shape()} tensor; got {tuple(values.shape)}")
        return values

    # -- construction from a dense layer ------------------------------------------------------
    @classmethod
    def from_dense(cls, linear: nn.Linear, *, density=None, sparsity=None,
                   method: str = "magnitude", blocksize=None, generator=None) -> "SparseLinear":
        """Prune ``linear`` to a SparseLinear with its weights and bias on the kept entries.

        Give ``density`` or ``sparsity`` (``1 - density``), by keyword: ``st.sparsify``'s
        positional number is a sparsity, so a positional one here would be ambiguous.
        ``method="magnitude"`` keeps exactly the ``kept_count(out * in, density, sparsity)``
        largest ``|w|`` (with ``blocksize``, that
        many blocks by their summed ``|w|``, counted in blocks); ``"random"`` keeps as many
        chosen uniformly (``generator`` seeds it).

        Example:
            >>> import torch, sparsetorch as st
            >>> dense = torch.nn.Linear(4, 2)
            >>> sparse = st.nn.SparseLinear.from_dense(dense, density=0.25)
            >>> sparse.values.numel(), bool((sparse.values.abs().min()
            ...                              >= dense.weight.abs().flatten().sort().values[-2]))
            (2, True)
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"SparseLinear.from_dense: expected an nn.Linear, got "
                            f"{type(linear).__name__}")
        w = linear.weight.detach()
        bs = _pattern.blocks(blocksize, w.shape, "SparseLinear.from_dense")
        if method == "magnitude":
            mask = _pattern.top_mask(w.abs(), bs, "SparseLinear.from_dense", density=density,
                                     sparsity=sparsity)
        elif method == "random":
            mask = _pattern.random_mask(tuple(w.shape), bs, generator,
                                        "SparseLinear.from_dense", density=density,
                                        sparsity=sparsity).to(w.device)
        else:
            raise ValueError(f"SparseLinear.from_dense: method must be 'magnitude' or "
                             f"'random', got {method!r}")
        out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  mask=mask, blocksize=bs, dtype=w.dtype, device=w.device)
        out.set_pattern(mask, w)
        if linear.bias is not None:
            with torch.no_grad():
                out.bias.copy_(linear.bias)
        return out

    # -- forward ------------------------------------------------------------------------------
    def forward(self, x):
        if not isinstance(x, torch.Tensor):
            raise input_type_error("SparseLinear", "input must be a tensor or SparseTensor", x)
        if x.layout != torch.strided and type(x) is not SparseTensor:
            raise TypeError(f"SparseLinear: input is a torch.sparse tensor ({x.layout}); "
                            "wrap it with st.tensor(x) (sparse activations) or pass "
                            "x.to_dense()")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"SparseLinear: input of shape {tuple(x.shape)} does not end in "
                             f"in_features={self.in_features}")
        # (parameters read from the module's table, ~1.5 us a name otherwise: at batch 1
        # the layer's own code took twice its kernel's 12 us)
        dtype = member(self, "values").dtype
        x = autocast_input(x, dtype)
        if x.dtype != dtype:
            raise TypeError(f"SparseLinear: input is {x.dtype} but the weights are "
                            f"{dtype}; cast the input or the layer (.to(dtype))")
        if ad_transforms_active() and not _is_compiling():
            return self._transformed_product(x)
        if isinstance(x, SparseTensor):
            if x.dim() > 2:
                raise ValueError(f"SparseLinear: a sparse input must be 1-D or 2-D (batch, "
                                 f"in_features), got shape {tuple(x.shape)}")
            if _is_compiling():
                # (traced: the kernels as a custom op where they apply, else densified: the
                # sparse x sparse product does not compile yet)
                out = self._traced_sparse_rows(x)
                if out is not None:
                    return out
                x = x.to_dense()
            else:
                # (the row-block kernel reads CSR rows as they are; very sparse ones go
                # by their entries, ops/sparse_rows.py)
                out = self._rows(x)
                if out is not None:
                    return out
                if x.nnz > DENSIFY_INPUT_ABOVE * math.prod(x.shape):
                    x = _densified_for_product(x)
        if self.blocksize is not None and _is_compiling():
            return self._eager_product(x)
        return self._product(x)

    def _transformed_product(self, x):
        """The product under a ``torch.func`` transform (``vmap``, ``grad``: per-example
        gradients, ensembles of layers) or forward-mode AD: by torch's dense ops, which
        those differentiate and batch (the kernels read raw memory and see no tangents),
        the values scattered into a dense ``(out_features, in_features)`` weight. As fast
        as a dense layer, no faster."""
        if isinstance(x, SparseTensor):
            raise TypeError("SparseLinear: a SparseTensor input is not supported under "
                            "torch.func transforms or forward-mode AD; pass x.to_dense()")
        values, bias = member(self, "values"), member(self, "bias")
        at = _pattern.entry_positions(self._arrays(), self.blocksize, self.in_features)
        weight = values.new_zeros(self.out_features * self.in_features).index_put(
            (at,), values.reshape(-1)).view(self._shape())
        return unfused(F.linear(x, weight), bias, self.activation)

    # BSR under torch.compile runs eagerly, a graph break: the blocked kernels' coordinates
    # are unpacked from the stored block indices by their values (``formats.pack``: the
    # largest block row picks the index width), which fake tensors do not have, and dynamo
    # cannot wrap a blocked SparseTensor (its fake-tensor conversion fails). Autograd
    # records across the break.
    @outside_graph
    def _eager_product(self, x):
        return self._product(x)

    def _rows(self, x):
        """The product by ``st.ops.sparse_linear``'s row-block kernel (a batch of at least
        16 rows, CSR float32 weight; differentiable: see ``ops/rows.py``), or None where it
        does not apply. A dense ``x`` of more dimensions goes as its rows."""
        if _is_compiling():   # (traced: the same kernels as a custom op, where they apply)
            return self._traced_rows(x)
        shape = x.shape
        if type(x) is torch.Tensor and x.dim() > 2 and x.is_contiguous():
            x = x.view(-1, shape[-1])
        # the kept wrapper and the Parameter apart: no graph-recording wrapper per step
        out = linear_rows(x, self._kept_weight(), member(self, "values"), member(self, "bias"),
                          self.activation)
        if out is None:
            return None
        return out if len(shape) <= 2 else out.view(*shape[:-1], self.out_features)

    def _traced_rows(self, x):
        """``_rows`` while tracing: ``ops/rows_op.py``'s custom op (through einsum's traced
        product the compiled MNIST autoencoder trained at 0.18x its eager speed), or None."""
        values, bias = member(self, "values"), member(self, "bias")
        if self._format.name != "csr" or isinstance(x, SparseTensor) or x.dim() < 2:
            return None
        pos, crd = self._buffers["pos1"], self._buffers["crd1"]
        rows = x.reshape(-1, self.in_features)
        if not rows_op.applies(rows, crd.dtype, values, bias, self.activation):
            return None
        out = torch.ops.sparsetorch.rows_linear(rows, pos, crd, values, bias, self.activation,
                                                self.in_features)
        return out.view(*x.shape[:-1], self.out_features)

    def _traced_sparse_rows(self, x: SparseTensor):
        """A CSR batch while tracing: ``ops/rows_op.py``'s custom op (its rows by their
        entries or by the row-block kernel, as eager calls), or None."""
        if self._format.name != "csr":
            return None
        values, bias, crd = member(self, "values"), member(self, "bias"), self._buffers["crd1"]
        if not rows_op.sparse_applies(x, crd.dtype, values, bias, self.activation):
            return None
        return torch.ops.sparsetorch.rows_linear_csr(
            x._pos1, x._crd1, x.values, self._buffers["pos1"], crd, values, bias,
            self.activation, self.in_features)

    def _product(self, x):
        # (fewer rows than the row-block kernel takes without a gradient: the matrix-vector
        # kernel or einsum's, not a call to find that out, ~8 us at batch 1; traced, the
        # custom op takes any batch, whose size is not read: non-strict torch.export runs
        # this with FakeTensors, and a batch compared with 16 was specialised)
        if x.dim() >= 2 and (_is_compiling() and type(x) is not SparseTensor or
                             type(x) is torch.Tensor and (torch.is_grad_enabled() or
                                                          x.numel() >= MIN_ROWS * x.shape[-1])):
            out = self._rows(x)
            if out is not None:
                return out
        weight, bias = self.weight, member(self, "bias")
        if isinstance(x, SparseTensor):
            # (dense out_format: a sparse input times a sparse weight would otherwise be
            # assembled sparse, and nearly every output row is full)
            out = unfused(einsum("ni,oi->no" if x.dim() == 2 else "i,oi->o", x, weight,
                                 out_format="dense"), bias, self.activation)
        elif self.blocksize is None and (x.dim() == 1 or x.dim() == 2 and x.shape[0] == 1):
            # one row: the matrix-vector kernel, the bias and activation in it (MobileNet
            # v1's classifier at batch 1, its weights cold in cache: 50 us against 105 us
            # through F.linear and a separate bias add)
            out = einsum("oi,i->o", weight, x.reshape(-1), bias=bias,
                         activation=self.activation)
            out = out.unsqueeze(0) if x.dim() == 2 else out
        elif x.dim() == 2 and self.blocksize is None and x.shape[0] > 1 and \
                (self.activation is not None or bias is not None):
            # bias and activation in the product's kernel, applied as each output is
            # written (unfused while autograd records): MNIST's 256 x 784 decoder output,
            # a separate bias add and sigmoid cost 1.3 ms beside 1 ms of product
            out = einsum("ni,oi->no", x, weight, bias=bias, activation=self.activation)
        else:
            out = unfused(F.linear(x, weight), bias, self.activation)
        keep_facts(weight, self)
        return out

    # -- state_dict of another pattern --------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # The arrays do not tell the column count: a state of a narrower layer would load
        # into a wider one unnoticed (a fuzzer's finding). States keep the shape as a buffer;
        # those of earlier versions in their metadata, which a copy into a plain dict loses
        # (a probe's finding: a DDP prefix stripped that way); the oldest have neither.
        shape = state_dict.get(prefix + "weight_shape")
        shape = shape.tolist() if isinstance(shape, torch.Tensor) and shape.numel() == 2 \
            else local_metadata.get("shape")
        if shape is not None and tuple(shape) != (self.out_features, self.in_features):
            error_msgs.append(f"SparseLinear {prefix!r}: size mismatch: the state is of a "
                              f"{shape[0]} x {shape[1]} layer (out_features x in_features), "
                              f"this layer is {self.out_features} x {self.in_features} "
                              "(nothing of this layer was loaded)")
            return
        # The pattern it describes is checked first: nothing is copied from an invalid one
        # (the layer would run it: the kernels trust a layer's own arrays).
        arrays = {name: state_dict.get(prefix + name, self._buffers.get(name))
                  for name in self._array_names}
        values = state_dict.get(prefix + "values", self.values)
        if all(isinstance(t, torch.Tensor) for t in (values, *arrays.values())):
            try:
                SparseTensor.from_levels(self._shape(), self._format,
                                         {k: v.detach() for k, v in arrays.items()},
                                         values.detach(), check=True)
            except (ValueError, TypeError) as e:
                stored = f"blocks of {self.blocksize}" if self.blocksize else "single entries"
                error_msgs.append(f"SparseLinear {prefix!r}: the loaded pattern is not a valid "
                                  f"{self._format.name} pattern of shape {self._shape()}: {e}. "
                                  f"This layer stores {stored}; a state saved by a layer of "
                                  "another blocksize does not fit: build the layer with the "
                                  "saved one's (nothing of this layer was loaded)")
                return
        # A state of another pattern stores other entry counts: take its sizes and index
        # dtype first (every array's: a probe's int64 state left int32 offsets beside int64
        # columns), so the copies below fit. The values stay the same Parameter, resized, as
        # torch's loads copy into the parameters they have: an optimizer built before the
        # load goes on training it (a new one left it training an orphan).
        for name in self._array_names:
            incoming, current = state_dict.get(prefix + name), self._buffers.get(name)
            if isinstance(incoming, torch.Tensor) and (incoming.shape != current.shape or
                                                       incoming.dtype != current.dtype):
                setattr(self, name, incoming.new_empty(incoming.shape).to(current.device))
        incoming = state_dict.get(prefix + "values")
        if isinstance(incoming, torch.Tensor) and incoming.shape != self.values.shape:
            self.values.data = self.values.new_empty(incoming.shape)
            # (of the old entries. A graph recorded before the load and still held, say
            # through a kept output, holds the values' gradient node sized for the old
            # count, which the next backward meets: drop such outputs first)
            self.values.grad = None
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if prefix + "weight_shape" in missing_keys:   # (a state of an earlier version)
            missing_keys.remove(prefix + "weight_shape")
        self.__dict__.pop("_cached_weight", None)

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_cached_weight", None)   # an alias of the values: rebuilt on demand
        return state

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_cached_weight", None)
        return super()._apply(fn, recurse)

    def extra_repr(self) -> str:
        nnz = self.values.numel()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, nnz={nnz} "
                f"(density {nnz / (self.in_features * self.out_features):.3g}), "
                f"format={self._format.name}"
                + (f", blocksize={self.blocksize}" if self.blocksize else "")
                + (f", activation={self.activation!r}" if self.activation else ""))


def _uniform(n: int, bound: float, dtype, device, generator) -> torch.Tensor:
    u = torch.rand(n, dtype=dtype, generator=generator)
    return ((2 * u - 1) * bound).to(device)



def _still_valid(cached, values, buffers, names) -> bool:
    """Whether a layer's kept weight wrapper ``cached`` still shows its values and pattern
    buffers: the same values tensor and storage, each buffer the same tensor at the same
    version (a plain loop: this runs on every forward, and a late ConvNet layer's kernel
    takes tens of microseconds)."""
    if cached is None or cached[0] is not values or cached[1] != values.data_ptr():
        return False
    stamp = cached[3]
    if len(stamp) != len(names):
        return False
    for name, (array, seen) in zip(names, stamp):
        current = buffers[name]
        if current is not array or version(current) != seen:
            return False
    return True
