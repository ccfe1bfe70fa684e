"""Register tiles: a dense index variable strip-mined into tiles of SIMD width whose
partial results stay in vector registers while a sparse loop runs between the tile loops
(Scorch's tiling of mixed sparse-dense loops), for lowering (``lower.py``), the K-blocked
SpMM nest (``kblock.py``) and masked attention (``attention.py``).
"""
from __future__ import annotations

from .ir import Bin, Decl, For, If, Lit, Sym, block
from .iterate import dim


def register_tiles(k: str, widths, fresh, body_for, flush_for, declare=True) -> list:
    """Strip-mine dense variable ``k`` (extent ``n_k``) into register tiles: full tiles of
    each constant width in ``widths`` (widest first, each a multiple of the next; they
    vectorise and stay in registers), then one remainder tile of variable width. A tile is
    ``(k0, length, tile array, lane variable)``; ``body_for(tile)`` gives the statements that
    accumulate into it (their innermost loop is a ``lane_loop``), ``flush_for(tile)`` the
    statement writing lane ``kk`` (with ``k`` declared) once the tile is complete (None:
    ``body_for`` writes it). ``declare=False`` leaves declaring the tile array to
    ``body_for`` (``kblock.py`` starts one per row)."""
    out, done = [], Lit(0)
    tile_args = (fresh, body_for, flush_for, declare)
    for width in widths:
        full = Bin("-", dim(k), Bin("%", dim(k), Lit(width)))
        out.append(_tile(k, width, done, full, width, *tile_args))
        done = full
    out.append(If(Bin("<", done, dim(k)),
                  block(_tile(k, widths[-1], done, None, None, *tile_args))))
    return out


def _tile(k, width, start, end, step, fresh, body_for, flush_for, declare):
    """Full tiles over [start, end) by ``step``, or (``step`` None) the one partial tile
    starting at ``start``."""
    k0, acc, kk = fresh("k0_"), fresh("tile"), fresh("kk")
    length = Lit(width) if step is not None else Bin("-", dim(k), Sym(k0))
    tile = (k0, length, acc, kk)
    body = block(Decl("val[]", acc, Lit(width)) if declare else None, body_for(tile))
    if flush_for is not None:
        body = block(body, lane_loop(k, tile, [flush_for(tile)]))
    if step is not None:
        return For(k0, start, end, body, step=step)
    return block(Decl("idx", k0, start), body)


def lane_loop(k: str, tile, stmts) -> For:
    """``for kk in tile: k = k0 + kk; stmts`` -- one vector step per register of the tile."""
    k0, length, _, kk = tile
    return For(kk, Lit(0), length, block(Decl("idx", k, Bin("+", Sym(k0), Sym(kk))), *stmts),
               simd=True)
