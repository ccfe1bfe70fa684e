"""Triton launches as a ``torch.library`` custom op, so ``torch.compile`` (and export,
``make_fx``) records a call on CUDA tensors as one opaque node that runs the generated Triton
kernel, as ``custom_ops.py`` does for the C kernels.

``sparsetorch::triton_call(str key, Tensor[] inputs, SymInt[] extents) -> Tensor`` runs the
call registered under ``key`` (its assignment, operand formats, requested output format and
result kind) on ``inputs``, the operands flattened as ``custom_ops.flatten`` does (a sparse
operand as its level arrays then its values), with every index variable's size in
``Assignment.all_vars`` order. The result is the dense output, or for a sampled call (SDDMM)
the values on the sparse operand's pattern. Recipes are recorded in the kernel cache
(``custom_ops.persist_recipe``), so a graph cached on disk by another process finds them.

Only calls whose kernel is known from the formats alone are recorded (``triton_run.
traced_kind``: no conversion of an operand, no shared-pattern product first); the rest run
the dense torch fallback, whose ops trace as they are. Eager calls launch directly
(``triton_run.run_triton``): the dispatcher's overhead buys nothing outside a trace.

Example (a CUDA device, or ``SPARSETORCH_BACKEND=triton`` with ``TRITON_INTERPRET=1``):
    >>> import torch, sparsetorch as st                     # doctest: +SKIP
    >>> A = st.tensor(torch.eye(3, device="cuda"), "csr")   # doctest: +SKIP
    >>> f = torch.compile(lambda A, x: A @ x)               # doctest: +SKIP
    >>> f(A, torch.ones(3, 2, device="cuda")).shape         # doctest: +SKIP
    torch.Size([3, 2])
"""
from __future__ import annotations

import hashlib

import torch

from ..compiler.notation import var_extents
from ..formats.pack import array_names
from ..formats.tensor import SparseTensor
from .custom_ops import flatten, persist_recipe, read_recipe
from .triton_run import infos_of, run_triton, stats, traced_kind

_RECIPES: dict = {}   # key -> _Recipe


class _Recipe:
    """One traced call: enough to rebuild its operands from the flat inputs and launch."""

    def __init__(self, assignment, infos, out_format, kind: str, dtype: torch.dtype):
        self.assignment, self.infos, self.out_format = assignment, infos, out_format
        self.kind, self.dtype = kind, dtype
        order = list(assignment.all_vars)
        dims = {}
        for acc in assignment.expr.accesses():
            dims.setdefault(acc.operand, [order.index(v) for v in acc.indices])
        self.dims = [dims[n] for n in range(len(infos))]
        self.out_index = [order.index(v) for v in assignment.out_vars]
        self.sampled = None
        if kind == "sampled":   # the one sparse operand whose pattern the result takes
            self.sampled = next(n for n, i in enumerate(infos) if not i.strided)

    def __getstate__(self):
        return (self.assignment, self.infos, self.out_format, self.kind, self.dtype)

    def __setstate__(self, state):
        self.__init__(*state)

    def formats(self):
        return [None if i.strided else i.format for i in self.infos]

    def operands(self, inputs, extents) -> list:
        out, at = [], 0
        for fmt, dims in zip(self.formats(), self.dims):
            if fmt is None:
                out.append(inputs[at])
                at += 1
                continue
            names = array_names(fmt)
            arrays = dict(zip(names, inputs[at: at + len(names)]))
            out.append(SparseTensor([extents[d] for d in dims], fmt, arrays,
                                    inputs[at + len(names)]))
            at += len(names) + 1
        return out

    def sampled_values(self, inputs):
        """The sampled operand's values among the flat inputs."""
        at = 0
        for n, fmt in enumerate(self.formats()):
            width = 1 if fmt is None else len(array_names(fmt)) + 1
            if n == self.sampled:
                return inputs[at + width - 1]
            at += width
        raise AssertionError("sampled operand not found")


def _key(recipe: _Recipe) -> str:
    digest = hashlib.sha1(repr(recipe.__getstate__()).encode()).hexdigest()[:16]
    return f"triton:{recipe.assignment}#{digest}"


def _recipe(key: str) -> _Recipe:
    recipe = _RECIPES.get(key)
    if recipe is None:
        recipe = read_recipe(key)
        if not isinstance(recipe, _Recipe):
            raise RuntimeError(
                f"sparsetorch: Triton call {key!r} is not registered in this process and the "
                "kernel cache holds no recipe for it (cleared, or SPARSETORCH_CACHE differs): "
                "re-trace the function in this process")
        _RECIPES[key] = recipe
    return recipe


def traced_call(assignment, tensors, infos, out_format):
    """The result of ``assignment`` on traced ``tensors`` as one ``triton_call`` node, or None
    where ``traced_kind`` knows no kernel for it (the caller runs the fallback)."""
    kind = traced_kind(assignment, infos, out_format, tensors[0].dtype)
    if kind is None:
        return None
    recipe = _Recipe(assignment, infos, out_format, kind, tensors[0].dtype)
    key = _key(recipe)
    if key not in _RECIPES:
        _RECIPES[key] = recipe
        persist_recipe(key, recipe)
    sizes = var_extents(assignment, [tuple(t.shape) for t in tensors])
    extents = [sizes[v] for v in assignment.all_vars]
    out = torch.ops.sparsetorch.triton_call(key, flatten(tensors), extents)
    if kind == "dense":
        return out
    source = tensors[recipe.sampled]
    shape = [extents[d] for d in recipe.out_index]
    return SparseTensor(shape, source.format, source._level_arrays, out)


@torch.library.custom_op("sparsetorch::triton_call", mutates_args=())
def triton_call(key: str, inputs: list[torch.Tensor], extents: list[int]) -> torch.Tensor:
    """Launch the Triton kernel of the call registered as ``key`` on the flat ``inputs``."""
    recipe = _recipe(key)
    operands = recipe.operands(inputs, list(extents))
    out = run_triton(recipe.assignment, operands, recipe.infos, recipe.out_format)
    if out is None:   # a blocked call no kernel covers: the fallback, inside the node
        out = _fallback(recipe.assignment, operands, recipe.out_format)
    return out.values if recipe.kind == "sampled" else out


def _fallback(assignment, tensors, out_format):
    from .fallback import run_dense

    stats["fallback"] += 1
    tensors = [t.asformat("csr", index_dtype=t.index_dtype)
               if isinstance(t, SparseTensor) and t.format.blocksize is not None else t
               for t in tensors]
    extents = var_extents(assignment, [tuple(t.shape) for t in tensors])
    return run_dense(assignment, tensors, infos_of(tensors), extents, out_format)


@triton_call.register_fake
def _(key, inputs, extents):
    recipe = _recipe(key)
    if recipe.kind == "sampled":
        values = recipe.sampled_values(inputs)
        return values.new_empty(values.shape, dtype=recipe.dtype)
    return inputs[-1].new_empty([extents[d] for d in recipe.out_index], dtype=recipe.dtype)
