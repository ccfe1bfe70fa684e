"""Compiled kernels as ``torch.library`` custom ops, so traced programs (``torch.compile``,
``torch.export``, ``make_fx``) record them as opaque calls with a shape rule.

Three generic ops, keyed by a kernel id string (the registry ``_KERNELS`` maps it to the
prepared kernel; it is filled when ``execute.run`` meets a kernel while tracing, which runs
the Python of every op, so a traced graph never names a kernel this process has not built):

* ``sparsetorch::dense_kernel(str kernel, Tensor[] inputs, SymInt[] extents) -> Tensor``: a
  dense result, shaped by the extents of the output's index variables.
* ``sparsetorch::sampled_kernel(...) -> Tensor``: the values of a result on a sparse
  operand's own pattern (SDDMM), one per stored entry of that operand.
* ``sparsetorch::emit_kernel(...) -> Tensor[]``: a newly assembled sparse result (SpGEMM,
  sparse + sparse): its level arrays then its values, with data-dependent sizes (the fake
  kernel asks ``torch.library.get_ctx().new_dynamic_size()`` for each stored-entry count).

A fourth, ``sparsetorch::sparse_from_dense(str format, Tensor dense) -> Tensor[]``, gathers
a dense result's nonzeros into a sparse format with the same data-dependent sizes: the
pure-torch paths (``fallback.py``) assemble their results with it while tracing.

``inputs`` is every operand flattened: a dense operand as itself, a sparse one as its level
arrays (``array_names`` order) then its values. ``extents`` gives every index variable's
size in ``Assignment.all_vars`` order; sparse operands' shapes are rebuilt from it.

Why eager calls do not use these ops: the custom-op dispatcher costs several microseconds a
call, as much as a whole small SpMV (about 7 us through the generated shim, ``shim.py``).
So ``execute.run`` calls the ctypes kernel directly on real tensors and takes the custom ops
only while tracing: when ``torch.compiler.is_compiling()``, when an operand is a
``FakeTensor`` or ``FunctionalTensor``, or when a fake or proxy dispatch mode is active
(``is_tracing``). That check sits on the memo-miss path only; the memo key itself refuses
fake and functional operands (``execute._signature``), so the fast path costs nothing more.

Example:
    >>> import torch, sparsetorch as st
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> A = st.tensor(torch.eye(3), "csr")
    >>> with FakeTensorMode(allow_non_fake_inputs=True) as mode:
    ...     x = mode.from_tensor(torch.ones(3, 2))
    ...     y = st.einsum("ij,jk->ik", A, x)
    >>> type(y).__name__, tuple(y.shape)
    ('FakeTensor', (3, 2))
"""
from __future__ import annotations

import hashlib
import pickle

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from .._modes import version
from ..formats.format import as_format
from ..formats.pack import array_names, choose_index_dtype
from ..formats.tensor import SparseTensor, layout

# kernel id -> _Entry. Ids are content hashes of the compile arguments, so a graph cached on
# disk (inductor's FX graph cache) names the same kernel in the next process.
_KERNELS: dict = {}
# Counts real (non-fake) executions of each op: tests use it to show eager calls skip them.
CALLS = {"dense": 0, "sampled": 0, "emit": 0}

# (kernel, dtype, compile args) -> prepared kernel: ``execute._Prepared``, which ``execute``
# hands over when it is imported (``set_preparer``). The call path imports this module, not
# the reverse.
_prepare = None

_TRACED_TYPES = (FakeTensor, FunctionalTensor)
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def set_preparer(prepare) -> None:
    """Set how a kernel rebuilt from its recorded recipe (``_rebuild``) is prepared for
    calls: ``prepare(kernel, dtype, compile_args)``, ``execute._Prepared``.

    Example:
        >>> from sparsetorch.ops import execute
        >>> _prepare is execute._Prepared
        True
    """
    global _prepare
    _prepare = prepare


def is_tracing(tensors) -> bool:
    """Whether these operands are being traced (compile, export, fake propagation) rather
    than computed: then kernels run as custom ops instead of direct ctypes calls.

    Example:
        >>> import torch, sparsetorch as st
        >>> is_tracing([st.tensor(torch.eye(2), "csr"), torch.ones(2)])
        False
    """
    if torch.compiler.is_compiling():
        return True
    for t in tensors:
        v = t._values if type(t) is SparseTensor else t
        if type(v) is not torch.Tensor and isinstance(v, _TRACED_TYPES):
            return True
    return (torch._C._get_dispatch_mode(_PROXY) is not None
            or torch._C._get_dispatch_mode(_FAKE) is not None)


class _Entry:
    """A prepared kernel plus how to rebuild its operands from the flat inputs."""

    def __init__(self, prepared):
        self.prepared = prepared
        kernel = prepared.kernel
        assignment, infos = prepared.compile_args[0], prepared.compile_args[1]
        var_order = list(prepared.var_order)
        self.formats = [None if info.strided else info.format for info in infos]
        self.names = [None if f is None else array_names(f) for f in self.formats]
        dims = {}
        for acc in assignment.expr.accesses():
            dims.setdefault(acc.operand, [var_order.index(v) for v in acc.indices])
        self.dims = [dims[n] for n in range(len(infos))]
        self.out_index = prepared.out_index
        self.output = kernel.output
        out = kernel.output
        sampled = out.sampled_operand if out.kind == "sampled" else None
        converted = {n for n, _ in kernel.schedule.conversions}
        # A sampled result shares its operand's arrays, unless the schedule re-lays that
        # operand out: then its arrays are new, and returned like an emitted result's.
        self.kind = ("sampled" if sampled is not None and sampled not in converted
                     else "dense" if out.kind == "dense" else "emit")

    def operands(self, inputs, extents):
        out, at = [], 0
        for fmt, names, dims in zip(self.formats, self.names, self.dims):
            if fmt is None:
                out.append(inputs[at])
                at += 1
                continue
            arrays = dict(zip(names, inputs[at: at + len(names)]))
            values = inputs[at + len(names)]
            at += len(names) + 1
            out.append(SparseTensor([extents[d] for d in dims], fmt, arrays, values))
        return out

    def out_shape(self, extents):
        return [extents[d] for d in self.out_index]

    def index_dtype(self, extents):
        """The index dtype of an emitted result: fixed from the shape alone (the entry count
        is unknown when tracing), int32 whenever the full shape's count fits."""
        return _shape_index_dtype(self.output.format, self.out_shape(extents))


def _shape_index_dtype(fmt, shape) -> torch.dtype:
    """An assembled result's index dtype, fixed by its shape alone (the entry count is
    unknown when tracing): int32 whenever the full shape's count fits."""
    total = 1
    for s in shape:
        total *= s
    return choose_index_dtype(fmt.storage_dims(shape), total)


def kernel_id(prepared) -> str:
    """The registry id of ``prepared`` (an ``execute._Prepared``), registering it.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.ops import execute
        >>> A = st.tensor(torch.eye(2), "csr")
        >>> _ = st.einsum("ij,j->i", A, torch.ones(2))
        >>> kernel_id(execute._Prepared(*_prepared_args(A))).startswith("out[i]")
        True
    """
    key = prepared.__dict__.get("_op_id")
    if key is None:
        digest = hashlib.sha1(repr(prepared.compile_args).encode()).hexdigest()[:16]
        key = f"{prepared.kernel.assignment}#{digest}"
        prepared._op_id = key
    if key not in _KERNELS:
        _KERNELS[key] = _Entry(prepared)
        _persist(key, prepared)
    return key


def _op_path(key: str):
    from ..runtime.cache import cache_dir

    return cache_dir() / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".op")


def persist_recipe(key: str, recipe) -> None:
    """Record what the op ``key`` was built from (a picklable recipe) in the kernel cache: a
    graph traced by another process (inductor's on-disk graph cache) names ops this process
    has not met, and ``read_recipe`` finds them there."""
    from ..runtime.cache import ensure_dir, write_atomic

    path = _op_path(key)
    if not path.exists():
        ensure_dir()
        write_atomic(path, pickle.dumps(recipe))


def read_recipe(key: str):
    """The recipe ``persist_recipe`` recorded for ``key``, or None (none, or unreadable)."""
    from ..runtime.cache import read_private

    try:   # (only the user's own private file: unpickling one can run code)
        return pickle.loads(read_private(_op_path(key)))
    except (OSError, EOFError, ValueError, TypeError, AttributeError, ImportError,
            pickle.UnpicklingError):
        return None


def _persist(key: str, prepared) -> None:
    persist_recipe(key, (prepared.compile_args, prepared.kernel.workspace_kind, prepared.dtype))


def _rebuild(key: str):
    """The kernel behind ``key`` from its recorded recipe, or None (none, or unreadable)."""
    from ..codegen.kernel import compile_kernel

    recipe = read_recipe(key)
    if recipe is None:
        return None
    try:
        args, workspace, dtype = recipe
        kernel = compile_kernel(*args, workspace or "dense")
    except (ValueError, TypeError, AttributeError):
        return None
    prepared = _prepare(kernel, dtype, args)
    return prepared if kernel_id(prepared) == key else None


def _prepared_args(A):
    """(kernel, dtype, compile args) of SpMV on CSR ``A`` with short rows, as
    ``execute.run`` compiles it: the doctest helper of ``kernel_id``."""
    from ..codegen.kernel import compile_kernel
    from ..compiler.notation import parse_einsum
    from ..compiler.schedule import OperandInfo
    from ..formats.format import as_format

    infos = (OperandInfo(A.format, False), OperandInfo(as_format("dense", 1), True))
    index = ("int32" if A.index_dtype == torch.int32 else "int64", "int64")
    args = (parse_einsum("ij,j->i", [2, 1]), infos, str(A.dtype).removeprefix("torch."),
            index, None, ())
    return compile_kernel(*args), A.dtype, args


def flatten(tensors) -> list:
    """Operands as the flat tensor list the custom ops take.

    Example:
        >>> import torch, sparsetorch as st
        >>> len(flatten([st.tensor(torch.eye(2), "csr"), torch.ones(2)]))  # pos, crd, vals, x
        4
    """
    flat = []
    for t in tensors:
        if isinstance(t, SparseTensor):
            flat += [getattr(t, "_" + n) for n in t._array_names]
            flat.append(t._values)
        else:
            flat.append(t)
    return flat


_CSR = layout(as_format("csr", 2))


def csr_operand(pos: torch.Tensor, crd: torch.Tensor, values: torch.Tensor,
                columns: int, what: str) -> SparseTensor:
    """The CSR SparseTensor of the level arrays and values a hand-written kernel's custom op
    receives (``rows_op.py``, ``conv_ops.py``, ``attention.py``), without copies where
    they are contiguous, checked: the ops are public (``torch.ops.sparsetorch``), and
    their kernels read whatever the arrays say (a strided or out-of-range array crashed
    them or gave garbage, a probe found). The contents are checked once per arrays
    (``_checked``): a layer's own, passed every call of a compiled model, cost nothing
    after the first. Errors name the op (``what``).

    Example:
        >>> import torch
        >>> i = lambda *v: torch.tensor(v, dtype=torch.int32)
        >>> csr_operand(i(0, 1, 1), i(2), torch.tensor([5.]), 3, "op").to_dense().tolist()
        [[0.0, 0.0, 5.0], [0.0, 0.0, 0.0]]
        >>> csr_operand(i(0, 1, 1), i(3), torch.tensor([5.]), 3, "op")
        Traceback (most recent call last):
        ValueError: op: crd holds a column index outside [0, 3); the arrays must be a CSR ...
    """
    for name, t in (("pos", pos), ("crd", crd), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise TypeError(f"{what}: {name} must be a 1-D tensor, got "
                            f"{getattr(t, 'shape', type(t).__name__)}")
    if pos.dtype not in (torch.int32, torch.int64) or crd.dtype != pos.dtype:
        raise TypeError(f"{what}: pos and crd must share one index dtype, int32 or int64; "
                        f"got {pos.dtype} and {crd.dtype}")
    if not values.dtype.is_floating_point or values.shape[0] != crd.shape[0] or \
            pos.shape[0] < 1:
        raise ValueError(f"{what}: a CSR matrix needs pos of rows + 1 entries and one "
                         f"floating value per entry of crd; got pos of {pos.shape[0]}, crd of "
                         f"{crd.shape[0]} and values of {values.shape[0]} ({values.dtype})")
    pos, crd, values = pos.contiguous(), crd.contiguous(), values.contiguous()
    _checked(pos, crd, columns, what)
    return SparseTensor._from_parts((pos.shape[0] - 1, columns), _CSR, [pos, crd], values)


def _checked(pos: torch.Tensor, crd: torch.Tensor, columns: int, what: str) -> None:
    # (the stamp of the arrays found valid rides on crd: a dict keyed by tensors would
    # compare them with ==, elementwise)
    key = (version(pos), version(crd), columns)
    known = getattr(crd, "_st_valid_csr", None)
    if known is not None and known[0] is pos and known[1:] == key:
        return
    nnz = crd.shape[0]
    if int(pos[0]) != 0 or int(pos[-1]) != nnz or (pos.shape[0] > 1 and
                                                  bool((pos[1:] < pos[:-1]).any())):
        raise ValueError(f"{what}: pos must rise from 0 to the entry count {nnz}, never "
                         "falling; the arrays must be a CSR matrix's (a SparseTensor's "
                         "_pos1, _crd1, values)")
    if nnz and (int(crd.min()) < 0 or int(crd.max()) >= columns):
        raise ValueError(f"{what}: crd holds a column index outside [0, {columns}); the "
                         "arrays must be a CSR matrix's (a SparseTensor's _pos1, _crd1, "
                         "values)")
    crd._st_valid_csr = (pos, *key)


def call(prepared, tensors):
    """Run ``prepared`` on ``tensors`` through the custom ops (the tracing path): the same
    result ``prepared(tensors)`` gives, recorded as one op in the traced graph.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.ops import execute
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
        >>> call(execute._Prepared(*_prepared_args(A)), [A, torch.ones(2)])
        tensor([2., 3.])
    """
    key = kernel_id(prepared)
    entry = _KERNELS[key]
    extents = prepared.extents(tensors)
    flat = flatten(tensors)
    shape = entry.out_shape(extents)
    if entry.kind == "dense":
        return torch.ops.sparsetorch.dense_kernel(key, flat, extents)
    fmt = entry.output.format
    if entry.kind == "sampled":
        source = tensors[entry.output.sampled_operand]
        values = torch.ops.sparsetorch.sampled_kernel(key, flat, extents)
        return SparseTensor(shape, fmt, source._level_arrays, values)
    out = torch.ops.sparsetorch.emit_kernel(key, flat, extents)
    return SparseTensor(shape, fmt, dict(zip(array_names(fmt), out[:-1])), out[-1])


def _entry(kernel: str) -> _Entry:
    entry = _KERNELS.get(kernel)
    if entry is None and _rebuild(kernel) is not None:
        entry = _KERNELS[kernel]
    if entry is None:
        raise RuntimeError(
            f"sparsetorch: kernel {kernel!r} is not registered in this process and the kernel "
            "cache holds no recipe for it (cleared, or SPARSETORCH_CACHE differs); a traced "
            "graph must be traced (torch.compile runs the Python of each op) in the process "
            "that runs it: re-trace instead of loading a graph saved by another process")
    return entry


def _run(kernel: str, inputs, extents):
    entry = _entry(kernel)
    return entry, entry.prepared(entry.operands(inputs, list(extents)))


@torch.library.custom_op("sparsetorch::dense_kernel", mutates_args=())
def dense_kernel(kernel: str, inputs: list[torch.Tensor], extents: list[int]) -> torch.Tensor:
    """Run registered kernel ``kernel`` (a dense result) on the flat ``inputs``.

    Example:
        >>> import torch, sparsetorch as st
        >>> from sparsetorch.ops import execute
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
        >>> key = kernel_id(execute._Prepared(*_prepared_args(A)))
        >>> torch.ops.sparsetorch.dense_kernel(key, flatten([A, torch.ones(2)]), [2, 2])
        tensor([2., 3.])
    """
    CALLS["dense"] += 1
    return _run(kernel, inputs, extents)[1]


@dense_kernel.register_fake
def _(kernel, inputs, extents):
    entry = _entry(kernel)
    return inputs[-1].new_empty(entry.out_shape(extents), dtype=entry.prepared.dtype)


@torch.library.custom_op("sparsetorch::sampled_kernel", mutates_args=())
def sampled_kernel(kernel: str, inputs: list[torch.Tensor],
                   extents: list[int]) -> torch.Tensor:
    """Run registered kernel ``kernel`` (a result sampled on one sparse operand's pattern);
    returns one value per stored entry of that operand.

    Example:
        >>> import torch, sparsetorch as st
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> S = st.tensor(torch.eye(2), "csr")
        >>> with FakeTensorMode(allow_non_fake_inputs=True) as mode:   # SDDMM, traced
        ...     x = mode.from_tensor(torch.ones(2, 3))
        ...     out = st.einsum("ij,ik,jk->ij", S, x, x)
        >>> tuple(out.values.shape)   # one value per stored entry of S
        (2,)
    """
    CALLS["sampled"] += 1
    entry, out = _run(kernel, inputs, extents)
    return out.values


@sampled_kernel.register_fake
def _(kernel, inputs, extents):
    entry = _entry(kernel)
    at = 0
    for n, names in enumerate(entry.names):   # the sampled operand's values
        width = 1 if names is None else len(names) + 1
        if n == entry.output.sampled_operand:
            values = inputs[at + width - 1]
            return values.new_empty(values.shape, dtype=entry.prepared.dtype)
        at += width
    raise AssertionError("sampled operand not found")


@torch.library.custom_op("sparsetorch::emit_kernel", mutates_args=())
def emit_kernel(kernel: str, inputs: list[torch.Tensor],
                extents: list[int]) -> list[torch.Tensor]:
    """Run registered kernel ``kernel`` (a newly assembled sparse result); returns its level
    arrays (``array_names`` order, index dtype fixed by the shape) then its values.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[0., 2.], [3., 0.]]), "csr")
        >>> B = torch.compile(lambda A: A @ A, backend="aot_eager", fullgraph=True)(A)
        >>> B.to_dense()
        tensor([[6., 0.],
                [0., 6.]])
    """
    CALLS["emit"] += 1
    entry, out = _run(kernel, inputs, extents)
    index = entry.index_dtype(extents)
    flat_in = {t.data_ptr() for t in inputs if t.numel()}
    result = []
    for t in [*(out._level_arrays[n] for n in array_names(out.format)), out.values]:
        t = t.to(index) if t is not out.values and t.dtype != index else t
        # custom ops must not return their inputs' memory (a sampled pattern re-laid out
        # may keep an unchanged array)
        result.append(t.clone() if t.numel() and t.data_ptr() in flat_in else t)
    return result


def _entry_count(ctx) -> torch.SymInt:
    """A new size for an entry count that depends on values. ``new_dynamic_size`` refuses
    while dynamo's ``capture_dynamic_output_shape_ops`` is off (its default) and dynamo
    then breaks the graph there and retries the frames below eagerly, which fails inside
    this package's dispatch (a compiled backward of ``A @ x`` with ``x`` requiring grad
    raised dynamo's AttributeError); the graph takes the size as ``fullgraph=True`` does."""
    try:
        return ctx.new_dynamic_size()
    except torch._subclasses.fake_tensor.DynamicOutputShapeException:
        if ctx._shape_env is None:
            raise
        size = ctx._shape_env.create_unbacked_symint()
        torch._check(size >= 0)
        return size


@emit_kernel.register_fake
def _(kernel, inputs, extents):
    entry = _entry(kernel)
    return _assembled_like(entry.output.format, entry.out_shape(extents),
                           entry.index_dtype(extents), entry.prepared.dtype, inputs[-1].device)


def _assembled_like(fmt, shape, index, dtype, device) -> list[torch.Tensor]:
    """Empty level arrays then values of an assembled result in ``fmt``, each entry count a
    new data-dependent size: what the fake kernels of assembling ops return."""
    ctx = torch.library.get_ctx()
    out, count = [], 1
    for level, size in zip(fmt.levels, fmt.storage_dims(shape)):
        if level.has_pos:     # one position per parent, then a data-dependent entry count
            out.append(torch.empty(count + 1, dtype=index, device=device))
            count = _entry_count(ctx)
        elif not level.has_crd:   # dense: every coordinate of every parent
            count = count * size
        if level.has_crd:
            out.append(torch.empty(count, dtype=index, device=device))
    out.append(torch.empty(count, dtype=dtype, device=device))
    return out


def format_key(fmt) -> str:
    """``fmt`` as the string ``sparse_from_dense`` takes (a custom op takes no Python
    objects): each level's kind, uniqueness and order, the mode order, the block sizes.
    Read back by ``_format_of``, not from a registry: under torch.compile a registry's
    write is a side effect dynamo replays after tracing, when the fake kernel has run.

    Example:
        >>> import sparsetorch as st
        >>> format_key(st.Format((st.dense, st.compressed)))
        'Dense:1:1,Compressed:1:1;0,1;'
    """
    levels = ",".join(f"{type(lv).__name__}:{int(lv.unique)}:{int(lv.ordered)}"
                      for lv in fmt.levels)
    blocks = ",".join(map(str, fmt.blocksize or ()))
    return f"{levels};{','.join(map(str, fmt.mode_order))};{blocks}"


def _format_of(key: str):
    from ..formats import levels as kinds
    from ..formats.format import Format

    levels, order, blocks = key.split(";")
    made = []
    for part in levels.split(","):
        kind, unique, ordered = part.split(":")
        made.append(getattr(kinds, kind)(unique=unique == "1", ordered=ordered == "1"))
    return Format(tuple(made), tuple(int(m) for m in order.split(",")),
                  tuple(int(b) for b in blocks.split(",")) if blocks else None)


def from_dense(dense: torch.Tensor, fmt) -> SparseTensor:
    """``dense`` in format ``fmt``, zeros dropped, recorded as one traced op: what the
    pure-torch paths (``SPARSETORCH_BACKEND=torch``, the Triton backend's fallback) call
    while tracing, where ``nonzero``'s data-dependent count would stop the graph.

    Example:
        >>> import torch, sparsetorch as st
        >>> f = torch.compile(lambda x: from_dense(x, st.Format((st.dense, st.compressed))),
        ...                   backend="aot_eager", fullgraph=True)
        >>> f(torch.eye(2)).values
        tensor([1., 1.])
    """
    out = torch.ops.sparsetorch.sparse_from_dense(format_key(fmt), dense)
    return SparseTensor(dense.shape, fmt, dict(zip(array_names(fmt), out[:-1])), out[-1])


@torch.library.custom_op("sparsetorch::sparse_from_dense", mutates_args=())
def sparse_from_dense(fmt: str, dense: torch.Tensor) -> list[torch.Tensor]:
    """``dense``'s nonzeros in the format ``fmt`` names (``format_key``): level arrays
    (``array_names`` order) then values, the index dtype fixed by the shape."""
    from ..formats.convert import _from_dense

    form = _format_of(fmt)
    out = _from_dense(dense, form, None, None, _shape_index_dtype(form, dense.shape))
    # (a custom op must not return its input's memory: a dense format's values may be it)
    shared = out.values.untyped_storage().data_ptr() == dense.untyped_storage().data_ptr()
    return [*(out._level_arrays[n] for n in array_names(form)),
            out.values.clone() if shared else out.values]


@sparse_from_dense.register_fake
def _(fmt, dense):
    form = _format_of(fmt)
    return _assembled_like(form, dense.shape, _shape_index_dtype(form, dense.shape),
                           dense.dtype, dense.device)
