"""``SparseTensor``: a traceable ``torch.Tensor`` wrapper subclass over level arrays.

The wrapper carries shape, dtype and device like any tensor; its inner tensors are the level
arrays (``pos{k}``, ``crd{k}``) and ``values``. ``__tensor_flatten__`` exposes exactly those,
so ``torch.compile`` and autograd see plain dense tensors, and every kernel is an op over them.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

import torch

from .._modes import ad_transforms_active, refuse_ad_transforms
from .format import Format
from .pack import array_names
from .traced import check_recordable, outside_tracer, read_by_dynamo

# torch functions a SparseTensor handles itself (``torch.matmul``, ``F.linear``, ``torch.sum``,
# ...), filled by ``sparsetorch.ops`` (``formats/`` must not import the compiler). Anything
# not here falls through to ``__torch_dispatch__``, which names the op and raises.
_TORCH_FUNCTIONS: dict = {}
_DisableTorchFunction = torch._C.DisableTorchFunctionSubclass
_is_grad_enabled = torch.is_grad_enabled
_make_wrapper = torch.Tensor._make_wrapper_subclass


class UnsupportedOp(NotImplementedError):
    """An op with no SparseTensor rule. Raised naming the ATen op; ``SparseTensor``'s
    ``__torch_function__`` renames it after the torch function the user called
    (``called_as``), which is the name the user knows."""

    def __init__(self, aten_op, formats, called=None):
        self.aten_op, self.formats = aten_op, formats
        op = f"{called} (ATen {aten_op})" if called else str(aten_op)
        super().__init__(
            f"sparsetorch: {op} is not supported on SparseTensor (format "
            f"{', '.join(formats)}); convert explicitly with .to_dense() if a dense result is "
            "what you want")

    def called_as(self, func) -> "UnsupportedOp":
        name = torch.overrides.resolve_name(func) or getattr(func, "__name__", str(func))
        return UnsupportedOp(self.aten_op, self.formats, name)


@lru_cache(maxsize=None)
def layout(fmt: Format) -> tuple:
    """``(fmt, its index array names, the attributes a SparseTensor keeps them in)``: what
    ``SparseTensor._from_parts`` takes, found once per format (hashing a Format is not free).

    Example:
        >>> from sparsetorch.formats.format import as_format
        >>> layout(as_format("csr", 2))[1:]
        (('pos1', 'crd1'), ('_pos1', '_crd1'))
    """
    names = array_names(fmt)
    return fmt, names, tuple("_" + name for name in names)


# What kernels work out about a SparseTensor from its pattern and value dtype alone and keep
# in its ``__dict__`` (the call key, ``ops/execute.py``; the blocking and row-length facts,
# ``ops/balance.py``; the ones-valued mask, ``autograd/pattern.py``): another wrapper of the
# same arrays with values of the same dtype inherits them (``inherit_pattern_facts``).
PATTERN_FACTS = ("_call_key", "_long_rows", "_row_profile", "_ones")


def inherit_pattern_facts(source, t) -> None:
    """Copy ``source``'s ``PATTERN_FACTS`` to ``t``, a SparseTensor of the same pattern
    (its level arrays or equal copies of them), when their values share dtype and device
    and ``t``'s are eager (a traced wrapper must not find a call key: its calls are
    recorded, not run). Saves a wrapper rebuilt per call (autograd's saved values, a
    re-laid operand) from working them out again.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(3), format="csr")
        >>> _ = A @ torch.ones(3)
        >>> B = A.with_values(torch.ones(3))
        >>> B.__dict__["_call_key"] == A.__dict__["_call_key"]
        True
    """
    values = t._values
    if type(values) is torch.Tensor and source._values.dtype == values.dtype and \
            source._values.device == values.device:
        facts = source.__dict__
        t.__dict__.update((k, facts[k]) for k in PATTERN_FACTS if k in facts)


# What a SparseTensor keeps about its own arrays, never copied or saved with it: the raw
# pointers call shims read (``ops/shim.raw``), views of its arrays (unblocked, transposed,
# a ones tensor on its pattern) and patterns re-laid for them (``ops/relaid``).
_CACHES = ("_raw", "_unblocked", "_views", "_ones", "_relaid")
# Values of these types are real memory, which ``_readable_values`` checks.
_REAL_TENSORS = (torch.Tensor, torch.nn.Parameter)


class SparseTensor(torch.Tensor):
    """A sparse tensor in any level format (CSR, CSC, COO, DCSR, DCSC, CSF, BSR, dense, ...).

    Build one with ``st.tensor`` (from dense, numpy, scipy, torch.sparse or COO data) or
    ``SparseTensor.from_levels`` (from raw level arrays); both validate user data once.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), format="csr")
        >>> A.nnz, A.format.name
        (2, 'csr')
        >>> A.to_dense()
        tensor([[0., 2.],
                [3., 0.]])
    """

    _format: Format
    _array_names: tuple[str, ...]
    _values: torch.Tensor
    # True on wrappers that autograd may have recorded themselves (built by an autograd node:
    # ``_FromValues``, or AOTAutograd's output rebuilding via ``__tensor_unflatten__``); the
    # others skip reading the wrapper's own autograd state, which is not free.
    _wrapper_grad = False
    # True on wrappers rebuilt by ``__tensor_unflatten__`` (see ``values``).
    _unflattened = False

    @staticmethod
    def __new__(cls, shape, fmt: Format, arrays: dict, values: torch.Tensor,
                requires_grad: bool = False):
        if values.requires_grad and _is_grad_enabled():
            # The gradient lives on ``values``; the wrapper is recorded too (one node), so
            # code that differentiates the wrapper itself sees the same gradient: AOTAutograd
            # (torch.compile) calls ``autograd.grad`` on a SparseTensor output.
            return _FromValues.apply(shape, fmt, arrays, values)
        return cls._wrap(shape, fmt, arrays, values, requires_grad)

    @staticmethod
    def _wrap(shape, fmt: Format, arrays: dict, values: torch.Tensor,
              requires_grad: bool) -> "SparseTensor":
        """The wrapper itself, never recorded by autograd (a leaf)."""
        parts = layout(fmt)   # kernels read raw pointers: always contiguous
        return SparseTensor._from_parts(shape, parts, [arrays[n].contiguous() for n in parts[1]],
                                        values.contiguous(), requires_grad)

    @staticmethod
    def _from_parts(shape, parts: tuple, arrays, values: torch.Tensor,
                    requires_grad: bool = False) -> "SparseTensor":
        """``_wrap`` for ``parts = layout(fmt)``, contiguous ``arrays`` in its order and
        contiguous ``values``: what a kernel's new result is. One update of the instance
        dict instead of an attribute store each: half the cost of a wrapper (4.9 -> 2.3 us
        here, of a 20 us SpGEMM of 7 x 7 matrices)."""
        fmt, names, attributes = parts
        t = _make_wrapper(SparseTensor, tuple(shape), dtype=values.dtype,
                          device=values.device, requires_grad=requires_grad)
        attrs = dict(zip(attributes, arrays))
        attrs.update(_format=fmt, _size=torch.Size(shape), _array_names=names, _values=values)
        t.__dict__.update(attrs)
        return t

    def __init__(self, *args, **kwargs):  # everything happens in __new__
        super().__init__()

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_levels(cls, shape, format, arrays: dict, values: torch.Tensor, *, blocksize=None,
                    check: bool = True) -> "SparseTensor":
        """Wrap raw level arrays (``{"pos1": ..., "crd1": ...}``) and values. The arrays are
        copied (kernels must not read memory the caller can still write); the values are
        kept as given (``.values`` is that tensor) when contiguous, else copied contiguous.

        ``check=True`` validates everything (ranges, order, duplicates, sizes, dtypes,
        devices); ``check=False`` skips only the order and duplicate checks, for callers
        whose arrays are sorted by construction: what keeps kernels in bounds (array names,
        dtypes, sizes, ``pos`` monotone, coordinates in range) is always checked.

        Example:
            >>> import torch, sparsetorch as st
            >>> A = st.SparseTensor.from_levels(
            ...     (2, 3), "csr", {"pos1": torch.tensor([0, 1, 2]),
            ...                     "crd1": torch.tensor([2, 0])}, torch.tensor([5., 6.]))
            >>> A.to_dense()[0, 2].item()
            5.0
        """
        shape, fmt, arrays, values = cls._checked_levels(shape, format, arrays, values,
                                                         blocksize, check)
        # the caller keeps its tensors: kernels must read copies it cannot write into
        arrays = {k: a.clone(memory_format=torch.contiguous_format) for k, a in arrays.items()}
        return cls(shape, fmt, arrays, values)

    @staticmethod
    def _checked_levels(shape, format, arrays, values, blocksize=None, check=True):
        """``from_levels``'s checks: ``(shape, format, arrays, values)`` to wrap, the
        arrays not copied, for callers that copy the result anyway when it shares the
        caller's memory (``convert._convert_owned``)."""
        from .format import as_format
        from .validate import check_levels, check_shape

        shape = check_shape(shape, "SparseTensor.from_levels")
        fmt = as_format(format, len(shape), blocksize)
        arrays = dict(arrays)
        missing = set(array_names(fmt)) - set(arrays)
        extra = set(arrays) - set(array_names(fmt))
        if missing or extra:
            raise ValueError(f"SparseTensor.from_levels: format {fmt.name!r} stores arrays "
                             f"{list(array_names(fmt))}; missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        check_levels(fmt, shape, arrays, values, "SparseTensor.from_levels", full=check)
        return shape, fmt, arrays, values

    def __setstate__(self, state):
        # torch.load (weights_only=True included, the mode for files one does not trust)
        # and pickle restore a SparseTensor by handing over its attribute dict.
        # Kernels trust the level arrays, so a loaded tensor is validated like user data.
        from .validate import check_levels, check_restored_state

        fmt, shape, arrays, values = check_restored_state(state, self)
        check_levels(fmt, shape, arrays, values, "torch.load of a SparseTensor")
        parts = layout(fmt)
        self.__dict__.update(dict(zip(parts[2], (arrays[n].contiguous() for n in parts[1]))),
                             _format=fmt, _size=torch.Size(shape), _array_names=parts[1],
                             _values=values)
        self._flag_restored_leaf()

    def __getstate__(self):
        # (the hook requires_grad_ put on the wrapper is not saved, and its handle may not
        # be: torch.load(weights_only=True) refuses it; __setstate__ registers a new one.
        # Nor are the caches: torch takes the state before it clears them, and a kept
        # transposed view's re-laid pattern holds weak references, which pickle refuses:
        # torch.save failed after A.t() @ A.)
        return {k: v for k, v in self.__dict__.items()
                if k != "_grad_hook" and k not in _CACHES}

    def __deepcopy__(self, memo):
        # torch's copy takes __dict__ (the old hook's handle included) but not the hook
        # or the wrapper's requires_grad: a compiled function's backward then missed the
        # copy (a probe's finding)
        new = super().__deepcopy__(memo)
        new.__dict__.pop("_grad_hook", None)
        new._flag_restored_leaf()
        return new

    def _flag_restored_leaf(self) -> None:
        """A copied or loaded tensor whose values require grad gets ``requires_grad_``'s
        wrapper flag and hook (neither survives a copy)."""
        if self._values.requires_grad and not self._wrapper_grad:
            self.requires_grad_(True)

    def _clear_non_serializable_cached_data(self):
        # torch calls this before a deepcopy or pickle copies ``__dict__``: the raw data
        # pointers call shims keep (``ops/shim.raw``) belong to this object's arrays, and a
        # copy or a loaded tensor must read its own.
        super()._clear_non_serializable_cached_data()
        for key in _CACHES:
            self.__dict__.pop(key, None)

    # -- traceability -------------------------------------------------------------------------
    def __tensor_flatten__(self):
        # "values", the public name: of a SparseTensor computed inside a compiled function,
        # dynamo can record reading only the attributes named here (``C.values``); the
        # property hands tracers the stored tensor itself (see ``traced.outside_tracer``).
        return ["values", *("_" + n for n in self._array_names)], (self._format,)

    def _stable_hash_for_caching(self) -> str:
        # torch.compile's extension point for a tensor subclass's part of the AOT-autograd
        # cache key (without it torch warns and hashes the flattened parts itself): what a
        # compiled graph may specialise on -- the format, the outer shape, and each stored
        # array's dtype, shape, strides and offset -- as text, so the key is the same in
        # every process (``hash()`` is not).
        parts = [type(self).__name__, repr(self._format), tuple(self.shape), self.requires_grad]
        for name in self.__tensor_flatten__()[0]:
            t = getattr(self, name)
            parts.append((name, str(t.dtype), t.device.type, tuple(t.shape), tuple(t.stride()),
                          t.storage_offset(), t.requires_grad, t.is_inference()))
        return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        (fmt,) = meta
        arrays = {n[1:]: t for n, t in inner.items() if n != "values"}
        values = inner["values"]
        # A leaf, even when the values require grad: AOTAutograd differentiates a compiled
        # function's SparseTensor inputs as wholes (see ``values``), and fakes them as leaves.
        t = SparseTensor._wrap(outer_size, fmt, arrays, values, values.requires_grad)
        t._wrapper_grad = t._unflattened = True
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # Route torch-level calls (before autograd) so gradients flow to the values; the
        # rest goes on to ``__torch_dispatch__`` (structural ops, or a clear error).
        if ad_transforms_active():   # (forward_ad.dual_level() or torch.func only)
            refuse_ad_transforms(getattr(func, "__name__", str(func)),
                                 (*args, *(kwargs or {}).values()))
        handler = _TORCH_FUNCTIONS.get(func)
        if handler is not None:
            return handler(*args, **(kwargs or {}))
        with _DisableTorchFunction():
            try:
                return func(*args, **(kwargs or {}))
            except UnsupportedOp as e:
                raise e.called_as(func) from None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .dispatch import dispatch

        return dispatch(func, args, kwargs or {})

    # -- metadata -----------------------------------------------------------------------------
    # Plain Python reads of what never changes: with ``__torch_function__`` defined, torch's
    # own getters would each take a trip through it (a microsecond per kernel call).
    @property
    def shape(self) -> torch.Size:
        return self._size

    @property
    def dtype(self) -> torch.dtype:
        return self._values.dtype

    @property
    def device(self) -> torch.device:
        return self._values.device

    @property
    def ndim(self) -> int:
        return len(self._size)

    def dim(self) -> int:
        return len(self._size)

    def size(self, dim=None):
        return self._size if dim is None else self._size[dim]

    # -- autograd: the values carry it --------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        """Whether the stored values require grad (gradients live on ``.values``)."""
        return self._values.requires_grad or (self._wrapper_grad and wrapper_requires_grad(self))

    @requires_grad.setter
    def requires_grad(self, value: bool):
        # torch.compile's fakification copies the flag onto the fake copy of an input
        self.requires_grad_(value)

    @property
    def data(self) -> "SparseTensor":
        """The tensor without autograd history (shares the arrays and values)."""
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, value):
        # (torch's setter left a wrapper as it was, without a word: a probe found)
        raise TypeError("SparseTensor.data cannot be assigned (its pattern lives in its "
                        "index arrays); copy values of the same pattern with A.copy_(B), "
                        "make a tensor of new values with A.with_values(v), or assign "
                        "the new SparseTensor where A was held")

    def requires_grad_(self, requires_grad: bool = True) -> "SparseTensor":
        """Track gradients of the stored values; returns ``self``.

        Example:
            >>> import torch, sparsetorch as st
            >>> A = st.tensor(torch.eye(2, dtype=torch.float64), "csr").requires_grad_()
            >>> A.requires_grad, A.values.requires_grad
            (True, True)
        """
        self._values.requires_grad_(requires_grad)
        if not self._wrapper_grad:   # a leaf wrapper: flag it too (see _move_wrapper_grad)
            with _DisableTorchFunction():
                torch.Tensor.requires_grad_(self, requires_grad)
            if requires_grad and "_grad_hook" not in self.__dict__:
                self.__dict__["_grad_hook"] = torch.Tensor.register_post_accumulate_grad_hook(
                    self, _move_wrapper_grad)
        return self

    def register_hook(self, hook):
        """``torch.Tensor.register_hook`` for the stored values' gradient: ``hook(grad)``
        gets it as a SparseTensor with this pattern and may return a replacement (a
        SparseTensor of the pattern, or its values) or None; returns the removable handle.
        (The hook was the wrapper's, which eager ops never differentiate: it never ran.)

        Example:
            >>> import torch, sparsetorch as st
            >>> A = st.tensor(torch.eye(2, dtype=torch.float64), "csr").requires_grad_()
            >>> _ = A.register_hook(lambda g: g * 2)
            >>> st.einsum("ij,j->i", A, torch.ones(2, dtype=torch.float64)).sum().backward()
            >>> A.grad.values.tolist()
            [2.0, 2.0]
        """
        def on_values(grad):
            out = hook(self.with_values(grad))
            return out._values if isinstance(out, SparseTensor) else out
        return self._values.register_hook(on_values)

    def register_post_accumulate_grad_hook(self, hook):
        """``torch.Tensor.register_post_accumulate_grad_hook`` for the stored values:
        ``hook(self)`` runs after their gradient (``self.grad``) has been accumulated.

        Example:
            >>> import torch, sparsetorch as st
            >>> A = st.tensor(torch.eye(2, dtype=torch.float64), "csr").requires_grad_()
            >>> _ = A.register_post_accumulate_grad_hook(lambda t: print(t.grad.values))
            >>> st.einsum("ij,j->i", A, torch.ones(2, dtype=torch.float64)).sum().backward()
            tensor([1., 1.], dtype=torch.float64)
        """
        return self._values.register_post_accumulate_grad_hook(lambda values: hook(self))

    @property
    def grad(self):
        """The gradient as a SparseTensor with this tensor's pattern (None before backward)."""
        g = self._values.grad
        return None if g is None else self.with_values(g)

    @grad.setter
    def grad(self, value):
        if value is not None and isinstance(value, SparseTensor):
            value = value._values
        self._values.grad = value

    @property
    def grad_fn(self):
        return self._values.grad_fn or (_wrapper_grad_fn(self) if self._wrapper_grad else None)

    @property
    def is_leaf(self) -> bool:
        # a wrapper recorded by autograd (``with_values`` of values that require grad) is
        # derived, like its ``grad_fn`` says; torch.compile reads leaf-only state otherwise
        return self._values.is_leaf and self.grad_fn is None

    def with_values(self, values: torch.Tensor) -> "SparseTensor":
        """This tensor's pattern (level arrays shared, not copied) with other ``values``, one
        per stored entry in storage order; differentiable in ``values``.

        Example:
            >>> import torch, sparsetorch as st
            >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
            >>> A.with_values(torch.tensor([10., 20.])).to_dense()
            tensor([[ 0., 10.],
                    [20.,  0.]])
        """
        if not isinstance(values, torch.Tensor) or isinstance(values, SparseTensor):
            raise TypeError(f"with_values: values must be a dense torch.Tensor, got "
                            f"{type(values).__name__}")
        if values.dim() != 1 or values.numel() != self._values.numel():
            raise ValueError(f"with_values: this {self._format.name} tensor stores "
                             f"{self._values.numel()} entries, so values must have shape "
                             f"({self._values.numel()},), got {tuple(values.shape)}")
        if values.device != self._values.device:
            raise ValueError(f"with_values: values are on {values.device} but the level "
                             f"arrays on {self._values.device}; move them with .to()")
        from .validate import check_value_dtype

        check_value_dtype(values, "with_values")
        out = SparseTensor(self._size, self._format, self._level_arrays, values)
        inherit_pattern_facts(self, out)
        return out

    # -- accessors ----------------------------------------------------------------------------
    @property
    def format(self) -> Format:
        """The storage ``Format`` (``.format.name`` is e.g. ``'csr'``)."""
        if type(self._values) is not torch.Tensor:   # eager tensors skip the check
            check_recordable(self, "format", "a Format object", "decide on formats outside "
                             "the compiled function (the format of an input SparseTensor "
                             "can be read inside), or return the tensor and read .format "
                             "outside")
        return self._format

    @property
    def values(self) -> torch.Tensor:
        """The stored values, one per stored entry, in storage order."""
        if (self._unflattened and _is_grad_enabled() and wrapper_requires_grad(self)
                and not outside_tracer(self._values)):
            # AOTAutograd (torch.compile) differentiates the SparseTensors it rebuilds as
            # wholes: a compiled function's output carries its history on the wrapper, and
            # an input's gradient is taken with respect to the wrapper. Connect the values.
            # (Not when AOTAutograd reads them to flatten the wrapper: it needs the inner
            # tensor itself.)
            return _ValuesOf.apply(self)
        return self._values

    @property
    def nnz(self) -> int:
        """Number of stored entries (explicit zeros inside BSR blocks count)."""
        n = self._values.numel()
        if type(n) is not int and read_by_dynamo(self):   # a SymInt: data-dependent
            raise RuntimeError(
                "SparseTensor.nnz: this SparseTensor is assembled inside the torch.compile'd "
                "function, so its entry count is data-dependent and dynamo cannot record it "
                "as an attribute; read C.values.shape[0] instead (traced), or return C and "
                "read .nnz outside")
        return n

    @property
    def index_dtype(self) -> torch.dtype:
        """dtype of the level arrays (int32 when everything fits, else int64)."""
        names = self._array_names
        return getattr(self, "_" + names[0]).dtype if names else torch.int64

    @property
    def arrays(self) -> dict:
        """Copies of the level arrays by name (``pos{k}``, ``crd{k}``); level ``k`` stores
        the mode ``format.mode_order[k]`` (or its block/in-block part for blocked formats).
        Copies, because kernels trust the arrays validated at construction: writing into
        them would send a kernel out of bounds.

        Example:
            >>> import torch, sparsetorch as st
            >>> A = st.tensor(torch.eye(2), "csr")
            >>> A.arrays["crd1"][0] = 99      # a copy: A is unchanged
            >>> A.arrays["crd1"].tolist()
            [0, 1]
        """
        if type(self._values) is not torch.Tensor:   # eager tensors skip the check
            check_recordable(self, "arrays", "a dict of tensors", "return it and read "
                             ".arrays outside, or keep to C.values and torch ops inside "
                             "(the level arrays of an input SparseTensor can be read)")
            return self._level_arrays   # (traced: no memory a kernel reads)
        return {n: getattr(self, "_" + n).clone() for n in self._array_names}

    @property
    def _level_arrays(self) -> dict:
        """The level arrays themselves (not copies), for the library's own use: never hand
        them to users, who could write into them."""
        return {n: getattr(self, "_" + n) for n in self._array_names}

    def _stored_count(self) -> int:
        """The entries the pattern stores, from the level arrays' sizes alone."""
        count = 1
        for k, (level, size) in enumerate(zip(self._format.levels,
                                              self._format.storage_dims(self._size))):
            count = getattr(self, f"_crd{k}").numel() if level.has_crd else count * size
        return count

    def _checked_values(self) -> torch.Tensor:
        """The values tensor, after checking it still fits the pattern: ``.values`` is the
        stored tensor itself, whose storage a user may replace (``.data =``, ``set_``,
        ``resize_``). Kernels read as many entries as the pattern stores, contiguously, in
        the wrapper's dtype; anything else raises ValueError."""
        values, count = self._values, self._stored_count()
        with _DisableTorchFunction():
            dtype = torch.Tensor.dtype.__get__(self)
        if (values.dim() != 1 or values.numel() != count or values.dtype != dtype
                or not values.is_contiguous()):
            layout = "contiguous" if values.is_contiguous() else "strided"
            raise ValueError(
                f"SparseTensor: its values were replaced by a {layout} tensor of shape "
                f"{tuple(values.shape)} and dtype {values.dtype}, but its {self._format.name} "
                f"pattern stores {count} contiguous entries of {dtype}; give other values with "
                "A.with_values(v), or change them in place (A.values.copy_(v))")
        return values

    def _readable_values(self) -> torch.Tensor:
        """``_checked_values`` for real values: what reads them by the pattern (conversions,
        ``to_dense``, kernels' operand checks) sizes buffers by one and writes by the other,
        so a mismatch must stop it (a probe's conversions crashed). Traced values (fake,
        functional: torch.compile) are taken as they are."""
        values = self._values
        return self._checked_values() if type(values) in _REAL_TENSORS else values

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"SparseTensor(shape={tuple(self.shape)}, format={self._format.name!r}, "
                f"nnz={self.nnz}, dtype={self.dtype}, index_dtype={self.index_dtype}, "
                f"device={self.device})")

    # -- conversions --------------------------------------------------------------------------
    def to_dense(self, dtype=None, *, masked_grad=None) -> torch.Tensor:
        """The tensor as a dense ``torch.Tensor`` (duplicates impossible; zeros filled).

        Example:
            >>> import torch, sparsetorch as st
            >>> st.tensor((torch.tensor([[1], [0]]), torch.tensor([7.])), shape=(2, 2)).to_dense()
            tensor([[0., 0.],
                    [7., 0.]])
        """
        from .convert import to_dense

        out = to_dense(self)
        return out if dtype is None else out.to(dtype)

    def to_scipy(self):
        """A ``scipy.sparse`` array owning a copy of the data: csr/csc/bsr keep their format,
        others become COO. Only for 2-D tensors on the CPU.

        Example:
            >>> import torch, sparsetorch as st
            >>> m = st.tensor(torch.eye(2), format="csc").to_scipy()
            >>> m.format, m.nnz
            ('csc', 2)
        """
        from .convert import to_scipy

        return to_scipy(self)

    def to_torch(self) -> torch.Tensor:
        """A ``torch.sparse`` tensor (sharing memory where the layouts match): csr, csc and bsr
        map to their layouts, dense formats to a strided tensor, everything else to a
        coalesced ``sparse_coo`` tensor.

        Example:
            >>> import torch, sparsetorch as st
            >>> st.tensor(torch.eye(2), format="dcsr").to_torch().layout
            torch.sparse_coo
        """
        from .convert import to_torch

        return to_torch(self)

    def numpy(self, *, force: bool = False):
        """A dense numpy array."""
        return self.to_dense().numpy()

    def asformat(self, format, *, blocksize=None, index_dtype=None) -> "SparseTensor":
        """The same tensor in another format (vectorised conversion, never a Python loop).

        Stored entries are kept, explicit zeros included (BSR blocks stay in the pattern);
        a dense *format* converts like a dense tensor (zeros dropped). ``index_dtype=None``
        keeps int64 indices int64, otherwise picks int32 whenever everything fits. Between
        formats with ordered levels this costs at most one stable sort (CSR -> CSC sorts the
        column indices once); returns ``self`` when nothing changes. Like ``Tensor.to`` or
        ``reshape``, the result may share memory with ``self``: a conversion that keeps
        the entries' order (CSR -> COO, a wider index type) keeps the same ``values``
        tensor, so an in-place update of one shows in the other; ``.clone()`` the result
        for an independent copy.

        Example:
            >>> import torch, sparsetorch as st
            >>> A = st.tensor(torch.eye(3), format="csr")
            >>> A.asformat("coo").format.name
            'coo'
        """
        from .convert import convert

        return convert(self, format, blocksize=blocksize, index_dtype=index_dtype)


def map_arrays(t: SparseTensor, on_index, on_values) -> SparseTensor:
    """A SparseTensor with ``on_index`` applied to every level array and ``on_values`` to the
    values (same shape and format); the one helper behind clone, detach, .to and index casts."""
    arrays = {k: on_index(v) for k, v in t._level_arrays.items()}
    return SparseTensor(t.shape, t.format, arrays, on_values(t.values))


# (imported last: they build and read SparseTensors; the class reads them only when called)
from .wrapper_grad import (_FromValues, _move_wrapper_grad, _ValuesOf,  # noqa: E402
                           _wrapper_grad_fn, wrapper_requires_grad)
