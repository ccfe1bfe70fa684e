"""The compiler pipeline in one memoised call: the compiler stage (``compiler.kernel``:
notation -> schedule -> output spec -> loop IR) then this one (``c.py``: loop IR -> C).

``compile_kernel`` is pure (no tensors): its inputs are the assignment, the operand formats
and the dtypes, so its result is memoised on exactly those and a repeated call with
same-structured operands does no scheduling or rendering at all.
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import lru_cache

# (module attributes read per call: tests patch the machine facts there)
from ..compiler import kernel as lowering
from ..compiler.kernel import CompiledKernel
from ..compiler.notation import Assignment
from ..compiler.schedule import OperandInfo
from .c import INDEX_CTYPES, VALUE_CTYPES, render_c


@lru_cache(maxsize=4096)
def compile_kernel(assignment: Assignment, infos: tuple[OperandInfo, ...], value_dtype: str,
                   index_dtypes: tuple[str, ...], out_format=None, static: tuple = (),
                   workspace: str = "dense", allow_scatter: bool = False) -> CompiledKernel:
    """``compiler.kernel.lower_kernel`` of the same arguments (but ``index_dtypes``, the
    C types of each operand's index arrays) with its C source rendered into ``source``.

    Example:
        >>> from sparsetorch.compiler.notation import parse_einsum
        >>> from sparsetorch.formats.format import as_format
        >>> k = compile_kernel(parse_einsum("ij,j->i", [2, 1]),
        ...                    (OperandInfo(as_format("csr", 2), False),
        ...                     OperandInfo(as_format("dense", 1), True)),
        ...                    "float32", ("int32", "int64"))
        >>> k.schedule.order, "void kernel_dense(" in k.source
        (('i', 'j'), True)
    """
    t0 = time.perf_counter()
    kernel = lowering.lower_kernel(assignment, infos, value_dtype, out_format, static, workspace,
                                   allow_scatter)
    header = f"sparsetorch kernel: {assignment}\nloop order: {', '.join(kernel.schedule.order)}"
    source = render_c(list(kernel.functions), VALUE_CTYPES[value_dtype],
                      {n: INDEX_CTYPES[d] for n, d in enumerate(index_dtypes)}, header,
                      lowering.vector_isa(), lowering.wide_gathers_from())
    return replace(kernel, source=source, compile_seconds=time.perf_counter() - t0)
