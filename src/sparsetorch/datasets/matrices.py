"""Benchmark matrices: SuiteSparse Matrix Market files and DLMC pruned-weight patterns."""
from __future__ import annotations

import difflib
import os

from ..io.mtx import read_mtx, read_mtx_header
from ._paths import dataset_dir

_FIELDS = {"real", "integer", "pattern", "complex"}


def suitesparse(name=None, root=None, *, fields=None, format="csr", dtype=None,
                index_dtype=None):
    """List or read the shipped SuiteSparse matrices (``suitesparse/mtx/*.mtx``).

    With ``name=None``, returns the sorted matrix names (``'Group__Name'``), optionally only
    those whose Matrix Market field is in ``fields`` (e.g. ``("real", "integer",
    "pattern")`` leaves out the complex ones, which ``read_mtx`` rejects). With a name
    (``'HB__bcsstk13'``, ``'HB/bcsstk13'`` or just ``'bcsstk13'``), returns
    ``st.io.read_mtx(path, format, dtype, index_dtype)``.

    Example:
        >>> import sparsetorch as st
        >>> names = st.datasets.suitesparse(fields=("real",))          # doctest: +SKIP
        >>> st.datasets.suitesparse("bcsstk13").shape                  # doctest: +SKIP
        torch.Size([2003, 2003])
    """
    folder = dataset_dir("suitesparse/mtx", root)
    paths = {p.name[: -len(".mtx")]: p for p in folder.glob("*.mtx")}
    if name is None:
        names = sorted(paths)
        if fields is not None:
            wanted = {fields} if isinstance(fields, str) else set(fields)
            if not wanted <= _FIELDS:
                raise ValueError(f"suitesparse: fields={fields!r}; Matrix Market fields are "
                                 f"{', '.join(sorted(_FIELDS))}")
            names = [n for n in names if read_mtx_header(paths[n]).field in wanted]
        return names
    key = str(name).replace("/", "__")
    if key not in paths:
        matches = [n for n in paths if n.split("__")[-1] == key]
        if len(matches) != 1:
            close = difflib.get_close_matches(key, list(paths), n=3, cutoff=0.5)
            why = f"is ambiguous ({', '.join(sorted(matches))})" if matches else \
                f"is not in {folder}" + (f"; did you mean {', '.join(close)}?" if close else "")
            raise ValueError(f"suitesparse: matrix {name!r} {why}; list the names with "
                             "st.datasets.suitesparse()")
        key = matches[0]
    return read_mtx(paths[key], format=format, dtype=dtype, index_dtype=index_dtype)


def dlmc(model="transformer", pruning="magnitude_pruning", sparsity="0.9", root=None):
    """Sorted paths of the shipped DLMC ``.smtx.gz`` patterns for one model, pruning method
    and sparsity (read them with ``st.io.read_smtx``). Shipped: ``transformer`` at 0.7, 0.9,
    0.98 and ``rn50`` at 0.8, 0.9, 0.98, all ``magnitude_pruning``.

    Example:
        >>> import sparsetorch as st
        >>> paths = st.datasets.dlmc("rn50", sparsity=0.9)      # doctest: +SKIP
        >>> len(paths), st.io.read_smtx(paths[0]).shape         # doctest: +SKIP
        (54, torch.Size([64, 256]))
    """
    try:
        level = sparsity if isinstance(sparsity, str) else f"{float(sparsity):g}"
    except (TypeError, ValueError):
        raise TypeError(f"dlmc: sparsity must be a number or its text (0.9 or '0.9'), got "
                        f"{sparsity!r}") from None
    for what, part in (("model", model), ("pruning", pruning), ("sparsity", level)):
        part = str(part)   # (one folder name each: "../.." walked out of the data folder)
        if not part or part in (".", "..") or "/" in part or os.sep in part:
            raise ValueError(f"dlmc: {what}={part!r} is not the name of a shipped set; "
                             "st.datasets.dlmc's error for a missing one lists them")
    base = dataset_dir("dlmc", root)
    folder = base / str(model) / str(pruning) / level
    if not folder.is_dir():
        have = sorted(str(p.relative_to(base)) for p in base.glob("*/*/*") if p.is_dir())
        raise FileNotFoundError(f"dlmc: {folder} does not exist; shipped sets (model/pruning/"
                                f"sparsity) are: {', '.join(have) or 'none'}")
    return sorted(folder.glob("*.smtx*"), key=lambda p: p.name)
