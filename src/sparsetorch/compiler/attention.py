"""Masked attention as one loop nest: SDDMM -> row softmax -> SpMM, fused per row; and the
row softmax alone (``row_softmax_function``), over a CSR operand's stored values, with its
gradient (``row_softmax_grad_function``).

``out[i, :] = sum_j softmax_j(A[i, j] * (Q[i, :] . K[j, :])) V[j, :]`` over the stored
entries ``j`` of row ``i`` of a CSR mask ``A`` (missing entries are -inf before the softmax;
an empty row gives zeros). Each row runs three passes over its own entries while they are
in L1: scores (a vector sum over the head dimension, kept in a scratch array of nnz values,
never a dense score matrix), max-shifted exponentials and their sum, then the weighted sum
of V rows in register tiles over the value dimension. The three stages are the ones the
compiler generates separately (an SDDMM sum loop, a sampled map, an SpMM tile), sharing the
row loop and the IR, so the same renderers vectorise them.

Memory traffic per row: its entries' indices and values twice, each K row and V row touched
once, Q row once, the output row written once. Parallel strategy: rows split by stored
entries (one balanced range per thread, as for CSR kernels).
"""
from __future__ import annotations

from .ir import (Assign, Bin, Call, Cond, Decl, For, Function, Lit, Load, Param, Parallel,
                 Sym, block, max_update, verify)
from .jam import jam_sums
from .tiles import lane_loop, register_tiles
from .notation import UNARY


def attention_function(tile_width: int | None, copies: int = 1) -> Function:
    """The fused kernel over operands A (CSR: ``t0_pos1``, ``t0_crd1``, ``t0_vals``), Q
    (``t1``, n_i x n_k), K (``t2``, n_j x n_k), V (``t3``, n_j x n_d), a scratch array of
    nnz values (``t4_vals``) and the output (n_i x n_d); a row's scores are summed
    ``copies`` side by side (``jam.jam_sums``, as SDDMM's are: ``kernel.sum_copies``).
    ``tile_width`` None: the plain nest the block-shaped renderer reads
    (``codegen/triton.py``), each output element an inner product over the row's entries.

    Example:
        >>> from sparsetorch.compiler.ir import dump
        >>> "parallel balanced" in dump(attention_function(16))
        True
        >>> "sum into dot_j0, dot_j1, dot_j2, dot_j3" in dump(attention_function(16, 4))
        True
    """
    names = iter(range(1, 1 << 30))

    def fresh(base):
        return f"{base}{next(names)}"

    def row(array, var, width):
        return Load(array, Bin("+", Bin("*", Sym("i" if var == "q" else "j"), Sym(width)),
                               Sym("k" if var != "v" else "d")))

    i, lo, hi = Sym("i"), Sym("lo"), Sym("hi")
    scores = [
        Decl("idx", "j", Load("t0_crd1", Sym("p"))),
        Decl("val", "dot", Lit(0)),
        For("k", Lit(0), Sym("n_k"), block(
            Assign(Sym("dot"), Bin("*", row("t1_vals", "q", "n_k"),
                                   row("t2_vals", "k", "n_k")), "+=")), reduction="dot"),
        Assign(Load("t4_vals", Sym("p")), Bin("*", Load("t0_vals", Sym("p")), Sym("dot")))]

    def weighted_sum(tile):
        k0, length, acc, kk = tile
        return [For("p", lo, hi, block(
            Decl("idx", "j", Load("t0_crd1", Sym("p"))),
            Decl("val", "w", Bin("*", Load("t4_vals", Sym("p")), Sym("inv"))),
            lane_loop("d", tile, [Assign(Load(acc, Sym(kk)),
                                         Bin("*", Sym("w"), row("t3_vals", "v", "n_d")),
                                         "+=")])))]

    def inner_products():   # out[i, d] = sum_p w[p] V[j, d], one d after another
        return For("d", Lit(0), Sym("n_d"), block(
            Decl("val", "acc", Lit(0)),
            For("p", lo, hi, block(
                Decl("idx", "j", Load("t0_crd1", Sym("p"))),
                Assign(Sym("acc"), Bin("*", Bin("*", Load("t4_vals", Sym("p")), Sym("inv")),
                                       row("t3_vals", "v", "n_d")), "+=")), reduction="acc"),
            Assign(Load("out_vals", Bin("+", Bin("*", i, Sym("n_d")), Sym("d"))),
                   Sym("acc"))))

    def write(tile):
        return Assign(Load("out_vals", Bin("+", Bin("*", i, Sym("n_d")), Sym("d"))),
                      Load(tile[2], Sym(tile[3])))

    body = block(
        Decl("idx", "lo", Load("t0_pos1", i)),
        Decl("idx", "hi", Load("t0_pos1", Bin("+", i, Lit(1)))),
        For("p", lo, hi, block(*scores)),
        *_row_max("t4_vals"),
        *_exponentials("t4_vals", "t4_vals"),
        inner_products() if tile_width is None else
        register_tiles("d", (tile_width,), fresh, weighted_sum, write))
    params = (Param("nt", "idx"), Param("n_i", "idx"), Param("n_j", "idx"),
              Param("n_k", "idx"), Param("n_d", "idx"), Param("t0_pos1", "idx0*"),
              Param("t0_crd1", "idx0*"), Param("t0_vals", "val*"), Param("t1_vals", "val*"),
              Param("t2_vals", "val*"), Param("t3_vals", "val*"),
              Param("t4_vals", "val*", const=False), Param("out_vals", "val*", const=False))
    nest = block(For("i", Lit(0), Sym("n_i"), body, Parallel("balanced", weights="t0_pos1")))
    if tile_width is not None:
        nest, _ = jam_sums(nest, copies)
    fn = Function("attention", params, nest)
    verify(fn)
    return fn


def _row_max(src: str) -> list:
    """``m``, the maximum of ``src`` over a row's entries ``[lo, hi)`` (-inf if none), a
    maximum reduction the renderer runs in vector steps."""
    return [Decl("val", "m", Lit(float("-inf"))),
            For("p", Sym("lo"), Sym("hi"), block(max_update("m", Load(src, Sym("p")))),
                reduction="m", combine="max")]


def _exponentials(src: str, dst: str) -> list:
    """Statements over a row's entries ``[lo, hi)`` with their maximum in ``m``: ``dst[p] =
    exp(src[p] - m)``, their sum ``z``, and ``inv``, its reciprocal (0 for an empty row; NaN
    where ``z`` is, so a row holding NaN or +inf is NaN throughout, as torch's softmax)."""
    p = Sym("p")
    e = Call(UNARY["exp"][0], Bin("-", Load(src, p), Sym("m")))
    return [Decl("val", "z", Lit(0)),
            For("p", Sym("lo"), Sym("hi"), block(
                Decl("val", "e", e), Assign(Load(dst, p), Sym("e")),
                Assign(Sym("z"), Sym("e"), "+=")), reduction="z"),
            Decl("val", "inv", Cond(Bin("!=", Sym("z"), Lit(0)), Bin("/", Lit(1.0), Sym("z")),
                                    Lit(0)))]


def row_softmax_function() -> Function:
    """Softmax over the stored entries of each row of a CSR operand (``t0_pos1``,
    ``t0_vals``; missing entries count as -inf) into ``out_vals``, its pattern's values: per
    row the maximum, then the shifted exponentials and their sum, then the scaling. The
    attention kernel's middle stages on stored values instead of scores.

    Memory traffic: each row's values read twice and its results written and rescaled while
    they are in L1; parallel strategy: rows split by stored entries (one balanced range per
    thread).

    Example:
        >>> from sparsetorch.compiler.ir import dump
        >>> "parallel balanced" in dump(row_softmax_function())
        True
    """
    p = Sym("p")
    return _over_rows("row_softmax", ("t0_vals",), [
        *_row_max("t0_vals"),
        *_exponentials("t0_vals", "out_vals"),
        For("p", Sym("lo"), Sym("hi"), block(
            Assign(Load("out_vals", p), Bin("*", Load("out_vals", p), Sym("inv")))))])


def row_softmax_grad_function() -> Function:
    """The gradient of ``row_softmax_function``: with its output ``y`` (``t0_vals``) and the
    output's gradient ``g`` (``t1_vals``) on the same CSR rows (``t0_pos1``), ``out_vals[p]
    = y[p] * (g[p] - s)`` where ``s`` is the row's sum of ``g * y``. Traffic: ``y`` and
    ``g`` of a row read twice (the second time from L1), its gradient written once; rows
    split by stored entries, as in the forward kernel.

    Example:
        >>> from sparsetorch.compiler.ir import dump
        >>> "sum into s" in dump(row_softmax_grad_function())
        True
    """
    p = Sym("p")
    y, g = Load("t0_vals", p), Load("t1_vals", p)
    return _over_rows("row_softmax_grad", ("t0_vals", "t1_vals"), [
        Decl("val", "s", Lit(0)),
        For("p", Sym("lo"), Sym("hi"), block(Assign(Sym("s"), Bin("*", g, y), "+=")),
            reduction="s"),
        For("p", Sym("lo"), Sym("hi"), block(
            Assign(Load("out_vals", p), Bin("*", y, Bin("-", g, Sym("s"))))))])


def _over_rows(name: str, inputs: tuple, stmts: list) -> Function:
    """Function ``name`` running ``stmts`` for each row ``i`` of a CSR operand (its entries
    ``[lo, hi)`` of ``t0_pos1``) in parallel, reading value arrays ``inputs`` and writing
    ``out_vals``."""
    i = Sym("i")
    body = block(Decl("idx", "lo", Load("t0_pos1", i)),
                 Decl("idx", "hi", Load("t0_pos1", Bin("+", i, Lit(1)))), *stmts)
    params = (Param("nt", "idx"), Param("n_i", "idx"), Param("t0_pos1", "idx0*"),
              *(Param(a, "val*") for a in inputs), Param("out_vals", "val*", const=False))
    fn = Function(name, params, block(
        For("i", Lit(0), Sym("n_i"), body, Parallel("balanced", weights="t0_pos1"))))
    verify(fn)
    return fn
