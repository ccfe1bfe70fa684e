"""``st.einsum`` and ``st.explain``: einsum over any mix of dense and sparse operands.

Reference: ``torch.einsum`` on dense copies (``ops/fallback.py`` is exactly that).
Shape rule: every use of an index variable has the same extent; the output has the extents of
its variables in order. Formats: inferred per output level (``compiler/output.py``) unless
``out_format`` is given; a dense result is a ``torch.Tensor``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from .._modes import ad_transforms_active, refuse_ad_transforms
from ..compiler.kblock import block_coords
from ..compiler.kernel import l2_bytes, panel_factors, sampled_block_bytes
from ..compiler.notation import Assignment, BroadcastShapes, parse_einsum, var_extents
from ..compiler.schedule import pads
from ..compiler.hold import describe as describe_held
from ..compiler.sblock import describe as describe_column_blocks
from ..formats.tensor import SparseTensor
from .broadcast import squeeze_broadcast
from .diagonal import has_sparse_diagonal, take_diagonals
from .execute import (_FAST, _FAST_DENSE, _FAST_EPILOGUE, _FAST_PER_EQUATION, kernel_for,
                      lookup, run)
from .expr import EXPR_MARK, FORMAT_MARK, LazyExpr, mark_format, recorded_eval
from .policy import _BACKEND_KEY, _ENV_DATA as _ENV, asks_dense, backend
from .promote import FLOAT_MAPS, cast, promoted, result_dtype
from .relayout import relayout, run_relaid
from .transposed import transposed_product


def einsum(equation: str, *operands, out_format=None, bias=None, activation=None):
    """Einstein summation over dense tensors and SparseTensors in any format.

    Every repeated index not in the output is summed. The notation is ``torch.einsum``'s:
    ``...`` for the dimensions a subscript does not name, sizes of 1 broadcast, an index
    repeated within one subscript takes a diagonal. The loop order, output format and kernel
    are chosen automatically (see ``st.explain``). ``bias`` (a dense tensor that
    broadcasts against the result) and ``activation`` (``"relu"``, ``"relu6"``, ``"abs"``,
    ``"neg"``, ``"exp"``, ``"sqrt"``, ``"sigmoid"``) are fused into the same kernel,
    applied where each output element is written: ``activation(einsum + bias)``, a dense
    result.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.tensor([[1., 0.], [0., 2.]]), format="csr")
        >>> st.einsum("ij,jk->ik", A, torch.ones(2, 3))
        tensor([[1., 1., 1.],
                [2., 2., 2.]])
        >>> st.einsum("ij,jk->ik", A, A).format.name
        'csr'
        >>> st.einsum("ij,j->i", A, torch.ones(2), bias=torch.tensor([-3., 0.]),
        ...           activation="relu")
        tensor([0., 2.])
        >>> st.einsum("...j,j->...", A, torch.ones(2))
        tensor([1., 2.])
    """
    if ad_transforms_active():   # (forward_ad.dual_level() or torch.func only)
        refuse_ad_transforms("st.einsum", (*operands, bias))
    if bias is None and activation is None and not _is_compiling():
        # A repeated call: the guarded shims of this string, no key to build. This is
        # ``execute.fast_calls`` inlined (0.2 us, about 5% of a tiny SpMM), with
        # its backend test reduced to "SPARSETORCH_BACKEND unset" where CPython allows.
        table = _FAST if out_format is None else _FAST_DENSE if asks_dense(out_format) else {}
        calls = table.get(equation) if type(equation) is str else None
        if calls and ((_ENV is not None and _ENV.get(_BACKEND_KEY) is None) or
                      backend() == "c"):
            try:
                for call in calls:
                    out = call(operands)
                    if out is not None:
                        return out
            except BroadcastShapes:   # sizes of 1 to broadcast: the full path squeezes them
                return _einsum(equation, operands, out_format, memo=False)
    elif not _is_compiling() and type(equation) is str and out_format is None:
        # A repeated fused call (``_einsum_epilogue``): its guarded shims, operands and bias
        # as the kernel takes them. Building the epilogue's key in Python each time cost
        # more than the bias add it saves on a small SpMM (Cora, 7 columns: 194 vs 117 us).
        calls = _FAST_EPILOGUE.get((equation, activation))
        # (a bias that is no tensor goes the full path, which says so)
        if calls and backend() == "c" and (bias is None or isinstance(bias, torch.Tensor)):
            # (a Parameter is not a plain tensor to the guard; without autograd recording,
            # its detached alias is the same operand)
            ops = operands if bias is None else \
                (*operands, bias if _is_grad_enabled() else bias.detach())
            try:
                for call in calls:
                    out = call(ops)
                    if out is not None:
                        return out
            except (BroadcastShapes, ValueError):   # the full path says what is wrong
                pass
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    # the vectorised index moved last in dense operands and result (while compiling:
    # ``torch_einsum``, below dynamo)
    if not _is_compiling():
        out = run_relaid(lambda eq, ops, b: einsum(eq, *ops, out_format=out_format, bias=b,
                                                   activation=activation),
                         equation, operands, out_format, bias)
        if out is not None:
            return out
    if bias is not None or activation is not None:
        return _einsum_epilogue(equation, operands, out_format, bias, activation)
    if _is_compiling():   # dynamo: record torch.einsum, which routes back here (see below)
        return _traced_einsum(equation, operands, out_format)
    prepared = lookup(equation, operands, out_format)   # the memo (no autograd), inline
    if prepared is not None:
        try:
            return prepared(operands)
        except BroadcastShapes:
            return _einsum(equation, operands, out_format, memo=False)
    return _einsum(equation, operands, out_format)


def _einsum(equation, operands, out_format, memo=True):
    if len({getattr(t, "dtype", None) for t in operands}) > 1 and all(
            isinstance(t, torch.Tensor) for t in operands):
        operands = promoted(operands)   # mixed dtypes: torch's result type (a memo miss)
    elif _sums_small_integers(equation, operands):
        operands = (cast(operands[0], torch.int64),)
    if _is_grad_enabled() and _any_requires_grad(operands):
        return _einsum_recorded(equation, operands, out_format)
    prepared = lookup(equation, operands, out_format) if memo else None   # (no autograd)
    if prepared is not None:
        try:
            return prepared(operands)
        except BroadcastShapes:
            pass
    what = f"einsum({equation!r})"
    _check_tensors(operands, what)
    assignment, taken, alias = _kernel_problem(equation, operands, what)
    return run(assignment, taken, out_format, what=what, alias=alias)


def _sums_small_integers(equation, operands) -> bool:
    """Whether this is one integer (or bool) operand narrower than int64 summed over an
    index: torch's einsum then sums in int64, as ``sum`` does (``int32`` wrapped around)."""
    if len(operands) != 1 or not isinstance(operands[0], torch.Tensor):
        return False
    dtype = operands[0].dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.int64:
        return False
    try:
        return bool(parse_einsum(equation, [operands[0].dim()]).reduction_vars)
    except (ValueError, TypeError):   # (the full path says what is wrong)
        return False


def _kernel_problem(equation, operands, what):
    """``(assignment, operands, alias)`` the kernels run for ``st.einsum(equation,
    *operands)``: sparse operands' diagonals taken (``diagonal.py``) and broadcast sizes of 1
    squeezed (``broadcast.py``); ``alias`` (the equation, to memoise the call under) is None
    when the operands changed, since a call memoised under the equation would be handed the
    operands as given."""
    assignment = parse_einsum(equation, [t.dim() for t in operands])
    assignment, taken = take_diagonals(assignment, operands, what)
    assignment, taken = squeeze_broadcast(assignment, taken)
    return assignment, taken, (equation if taken is operands else None)


def _einsum_epilogue(equation, operands, out_format, bias, activation):
    """One kernel for ``activation(einsum + bias)`` (``ops/epilogue.py``); with gradients
    required, under ``torch.compile`` or off the compiled backend, the same ops unfused."""
    from .epilogue import check_bias, unfused

    what = f"einsum({equation!r})"
    check_bias(bias, what)
    if out_format not in (None, "dense"):
        raise ValueError(f"{what}: a bias or activation gives a dense result; drop "
                         f"out_format={out_format!r} or apply them after the einsum")
    with_bias = operands if bias is None else (*operands, bias)
    if len({getattr(t, "dtype", None) for t in with_bias}) > 1 and all(
            isinstance(t, torch.Tensor) for t in with_bias):
        # one kernel computes in one type: torch's result type of einsum(...) + bias
        with_bias = promoted(with_bias)
        operands, bias = (with_bias, None) if bias is None else (with_bias[:-1], with_bias[-1])
    grads = _is_grad_enabled() and _any_requires_grad((*operands, bias))
    # (exp, sqrt and sigmoid of integers are floats, as torch's: a kernel computes in one
    # type, so the integer einsum runs first)
    integers = activation in FLOAT_MAPS and not result_dtype(with_bias).is_floating_point
    if grads or integers or _is_compiling() or backend() == "torch":
        return unfused(einsum(equation, *operands), bias, activation)
    _check_tensors(operands, what)
    if has_sparse_diagonal(parse_einsum(equation, [t.dim() for t in operands]), operands):
        return unfused(einsum(equation, *operands), bias, activation)   # (not worth fusing)
    shapes = tuple(tuple(t.shape) for t in operands)
    try:
        fused, bias_shape = _fused_assignment(equation, shapes, None if bias is None else
                                              tuple(bias.shape), activation, what)
    except BroadcastShapes:   # (neither is this)
        return unfused(einsum(equation, *operands), bias, activation)
    ops = operands if bias is None else (*operands, bias.reshape(bias_shape))
    out = run(fused, ops, None, what=what)
    _offer_epilogue(equation, operands, bias, bias_shape, activation, fused, ops)
    return out


def _offer_epilogue(equation, operands, bias, bias_shape, activation, fused, ops) -> None:
    """Offer the guarded shim of this fused call to ``einsum``'s fast path, when the
    equation runs as written for these operands (a relaid equation's shim would answer
    calls relayout rewrites). A bias passed with dimensions of size 1 the kernel drops
    (a relaid call's: ``F.linear``'s bias becomes a column, ``(out, 1)``) is reshaped by
    a wrapper that answers only biases of that very shape: without it every such call took
    the path above, parsing its equation (~0.1 ms of Python per call)."""
    if type(equation) is not str:
        return
    call = lookup(fused, ops, None)
    guarded = getattr(call, "cguarded", None) or getattr(call, "guarded", None)
    if guarded is None or relayout(equation, operands, None, bias) is not None:
        return
    if bias is not None and tuple(bias.shape) != bias_shape:
        guarded = _bias_reshaped(guarded, tuple(bias.shape), bias_shape)
    key = (equation, activation)
    known = _FAST_EPILOGUE.get(key, ())
    if guarded not in known:
        _FAST_EPILOGUE[key] = (guarded, *known[:_FAST_PER_EQUATION - 1])


@lru_cache(maxsize=256)
def _bias_reshaped(guarded, given: tuple, taken: tuple):
    """``guarded`` for calls whose bias (the last operand) has shape ``given``, reshaped
    to the kernel's ``taken``; None (not this shim) for any other bias shape, whose size-1
    dimensions may broadcast differently. (Cached: the same wrapper each time it is
    offered, so the fast path's table holds it once.)"""
    def call(ops):
        bias = ops[-1]
        if bias.shape != given:
            return None
        return guarded((*ops[:-1], bias.reshape(taken)))
    return call


@lru_cache(maxsize=512)
def _fused_assignment(equation, shapes, bias_shape, activation, what):
    """The epilogue assignment for these shapes, built once: the same object every call, so
    ``run``'s memo finds its kernel without scheduling or hashing a new tree."""
    from .epilogue import with_epilogue

    assignment = parse_einsum(equation, [len(s) for s in shapes])
    extents = var_extents(assignment, shapes)
    out_shape = tuple(extents[v] for v in assignment.out_vars)
    bias = None if bias_shape is None else torch.empty(bias_shape, device="meta")
    fused, ops = with_epilogue(assignment, [None] * len(shapes), out_shape, bias, activation,
                               what)
    return fused, (None if bias is None else tuple(ops[-1].shape))


_is_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling


def _traced_einsum(equation, operands, out_format):
    """``einsum`` as dynamo should see it: a ``torch.einsum`` call, which it records in the
    graph and whose ``__torch_function__`` (``SparseTensor``) runs ``torch_einsum`` while the
    graph is traced, below dynamo. Dynamo would otherwise trace this module's Python (memo
    tables, ctypes) and break the graph. A named ``out_format`` rides in the equation.
    (``is_compiling()`` stays true while the recorded graph runs on fake tensors, so the
    handler calls ``_einsum``, not ``einsum``.)"""
    if not any(isinstance(t, SparseTensor) for t in operands):
        if out_format not in (None, "dense"):
            raise NotImplementedError(
                f"einsum({equation!r}) of dense operands with out_format={out_format!r} "
                "under torch.compile: wrap the result with st.tensor outside the compiled "
                "function, or pass a SparseTensor operand")
        return torch.einsum(equation, *operands)
    return torch.einsum(mark_format(equation, out_format, f"einsum({equation!r})"),
                        *operands)


def torch_einsum(equation, *operands):
    """``torch.einsum`` on operands that include a SparseTensor: ``st.einsum``.

    Example:
        >>> import torch, sparsetorch as st
        >>> torch.einsum("ij,j->i", st.tensor(torch.eye(2), "csr"), torch.ones(2))
        tensor([1., 1.])
    """
    if isinstance(equation, str) and equation.startswith(EXPR_MARK):   # a lazy expression
        return recorded_eval(equation, operands)
    out_format = None
    if isinstance(equation, str) and FORMAT_MARK in equation:
        equation, out_format = equation.split(FORMAT_MARK)
    if not isinstance(equation, str):
        raise TypeError("torch.einsum with SparseTensor operands takes an equation string "
                        "(the sublist form is not supported)")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    # (not while compiling: the graph runs here on fake tensors, which have no memory for
    # the re-layout's copies; the compiled call re-lays its real operands)
    out = None if _is_compiling() else run_relaid(
        lambda eq, ops, _: _einsum(eq, ops, out_format), equation, operands, out_format, None)
    return out if out is not None else _einsum(equation, operands, out_format)


def _any_requires_grad(operands) -> bool:
    for t in operands:
        if getattr(t, "requires_grad", False):
            return True
    return False


def _einsum_recorded(equation, operands, out_format):
    """``einsum`` recorded for autograd: one node whose backward is derived from the
    notation (``sparsetorch.autograd``)."""
    from ..autograd.function import evaluate

    what = f"einsum({equation!r})"
    _check_tensors(operands, what)
    assignment, taken, alias = _kernel_problem(equation, operands, what)
    return evaluate(assignment, taken, out_format, what=what, alias=alias)


def _check_tensors(operands, what):
    for n, t in enumerate(operands):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: operand {n} is a {type(t).__name__}; pass torch tensors "
                            "or SparseTensors (convert with torch.as_tensor or st.tensor)")


@dataclass(frozen=True)
class Explanation:
    """What the compiler chose for one call, and the C it generated.

    ``str()`` (and ``print``) give a summary: loop order, formats, conversions, output,
    workspace, parallel strategy and tiles; ``.loops`` and ``.source`` hold the loop IR and
    the C source, and ``.full()`` prints everything."""

    assignment: str
    loop_order: tuple
    operand_formats: tuple
    conversions: tuple
    output_kind: str
    output_format: str
    workspace: tuple
    parallel: str
    tiles: str
    notes: tuple
    loops: str
    source: str

    def __str__(self) -> str:
        conv = ", ".join(f"operand {n} -> mode order {f.mode_order} ({f.name}; " + (
            "converted on every call)" if pads(f) else
            "pattern converted once and kept, values gathered per call)")
            for n, f in self.conversions) or "none"
        lines = [f"expression:   {self.assignment}",
                 f"loop order:   {', '.join(self.loop_order)}",
                 f"operands:     {', '.join(self.operand_formats)}",
                 f"conversions:  {conv}",
                 f"output:       {self.output_kind} ({self.output_format})",
                 f"workspace:    {', '.join(self.workspace) or 'none'}",
                 f"parallel:     {self.parallel}",
                 f"tiles:        {self.tiles}"]
        lines += [f"note:         {n}" for n in self.notes]
        return "\n".join(lines + [f"(the loop IR, {len(self.loops.splitlines())} lines, is in "
                                   f".loops; the generated C, {len(self.source.splitlines())} "
                                   "lines, in .source; all of it: .full())"])

    def full(self) -> str:
        """The summary followed by the loop IR and the generated C source.

        Example:
            >>> import torch, sparsetorch as st
            >>> e = st.explain("ij,j->i", st.tensor(torch.eye(2), format="csr"), torch.ones(2))
            >>> "C source:" in e.full() and "C source:" not in str(e)
            True
        """
        return "\n".join([str(self).rsplit("\n", 1)[0], "loop IR:", self.loops,
                          "C source:", self.source])


def explain(equation, *operands, out_format=None) -> Explanation:
    """Show what ``st.einsum(equation, *operands)`` (or a lazy expression's ``eval``) runs:
    loop order, formats, conversions, workspaces, parallel strategy and the C source.

    Example:
        >>> import torch, sparsetorch as st
        >>> A = st.tensor(torch.eye(3), format="csr")
        >>> st.explain("ij,jk->ik", A, torch.ones(3, 2)).loop_order
        ('i', 'j', 'k')
    """
    if isinstance(equation, LazyExpr):
        assignment, operands = equation.assignment(), equation.operands
    else:
        what = f"explain({equation!r})"
        _check_tensors(operands, what)
        plan = relayout(equation, operands, out_format, None)
        rewritten = plan.rewrite(operands) if plan is not None else None
        if rewritten is not None:
            inner, ops, _ = rewritten
            explanation = explain(inner, *ops, out_format=out_format)
            return replace(explanation, notes=(*explanation.notes, f"{equation!r} run as "
                                               f"{inner!r}: {_relayout_note(plan, inner)}"))
        given = operands
        assignment, operands, _ = _kernel_problem(equation, operands, what)
    kernel, computed, split = kernel_for(assignment, operands, out_format)
    names = tuple(_describe(t, split) for t in operands)
    rows = operands[kernel.balanced] if kernel.balanced is not None and not split else None
    explanation = _explanation(computed, kernel, names, rows)
    if not isinstance(equation, LazyExpr) and operands is not given:
        changed = ", ".join(str(n) for n, (a, b) in enumerate(zip(given, operands))
                            if a is not b)
        explanation = replace(explanation, notes=(
            *explanation.notes, f"operand(s) {changed} reshaped first: a sparse operand's "
            "diagonal gathered into a new tensor (one pass over its entries), dimensions of "
            "size 1 that broadcast taken out"))
    calls = []
    if kernel.column_blocked is not None and isinstance(rows, SparseTensor):
        calls.append(describe_column_blocks(rows, operands[kernel.column_blocked], l2_bytes(),
                                            sampled_block_bytes()))
    if kernel.held is not None and isinstance(rows, SparseTensor):
        calls.append(describe_held(operands[kernel.held.gathered].shape[-1], kernel.held))
    if transposed_product(assignment, operands, out_format) is not None:
        calls.append("runs instead as ops/transposed.py's Aᵀ X: threads own output rows and "
                     "take their entries of each CSR row from a table kept with the pattern "
                     "(no re-laid copy); the plan above is the compiler's for other formats")
    return replace(explanation, notes=(*explanation.notes, *calls)) if calls else explanation


def _relayout_note(plan, inner) -> str:
    if inner == plan.squeezed:
        return "its vectorised index has size 1 here, and the call runs without it"
    moved = ", ".join(str(n) for n, p in enumerate(plan.perms) if p is not None)
    return "; ".join(
        ([f"dense operand(s) {moved} copied with the vectorised index last"] if moved else [])
        + (["the result computed in that order, then permuted back into a contiguous tensor"]
           if plan.out_perm else [])) + " (ops/relayout.py)"


def _describe(operand, split: bool) -> str:
    fmt = getattr(operand, "format", None)
    if fmt is None:
        return "dense tensor"
    if fmt.blocksize is not None:
        how = ("split into block (compressed) and in-block (dense) indices" if split
               else "converted to csr: the expression mixes it with another sparse operand "
               "over a blocked index, or assembles a sparse result")
        return f"{fmt.name} {fmt.blocksize} {how}"
    return fmt.name


def _explanation(assignment: Assignment, kernel, names, rows=None) -> Explanation:
    """``rows``: the operand whose rows a balanced outer loop splits, if known as given."""
    from ..compiler.ir import For, If
    from .balance import describe

    par = "serial"
    # (a top-level If chooses between a cache-blocked nest and the plain one: describe the
    # plain one, its else branch)
    stmts = [x for fn in kernel.functions[:1] for s in fn.body.stmts
             for x in ((*s.orelse.stmts, *s.then.stmts) if isinstance(s, If) and s.orelse
                       else (s,))]
    top = [s for s in stmts if isinstance(s, For)]
    if top and top[0].parallel:
        p = top[0].parallel
        par = (f"outer loop {top[0].var} across threads, schedule({p.schedule}"
               f"{', ' + str(p.chunk) if p.chunk else ''})")
        if p.weights is not None and isinstance(rows, SparseTensor):
            par += f"; {describe(rows)}"
    out = kernel.output
    return Explanation(
        assignment=str(assignment), loop_order=kernel.schedule.order,
        operand_formats=names,
        conversions=kernel.schedule.conversions, output_kind=out.kind,
        output_format=out.format.name if out.format is not None else "dense tensor",
        workspace=tuple(f"{v} ({kernel.workspace_kind})" for v in kernel.workspace_vars),
        parallel=par,
        tiles=_tiles(kernel, rows), notes=kernel.notes,
        loops=kernel.describe_loops(), source=kernel.source)


def _tiles(kernel, rows=None) -> str:
    if not kernel.tile:
        return "none"
    text = f"{kernel.tile[0]} in register tiles of {kernel.tile[1]} values"
    if kernel.block_cap is not None and isinstance(rows, SparseTensor):   # long rows
        kb = block_coords(rows.nnz, *rows.format.storage_dims(rows.shape))
        text += (f"; {kernel.schedule.order[1]} in cache blocks of {kb} coordinates, panels "
                 f"of up to {kernel.tile[1] * panel_factors()[0]} values")
    for v, extent in kernel.jammed:
        text += (f"; {v} unrolled into {extent} of them side by side ({extent} x "
                 f"{kernel.tile[1]} values in registers: each dense row segment is loaded "
                 "once per stored block)")
    return text


__all__ = ["einsum", "explain", "Explanation"]
