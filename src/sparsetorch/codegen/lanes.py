"""The vector shapes the renderer of ``vector.py`` writes for: per ISA and value type, a
register type and the spelling of each intrinsic (``Lanes``), and the errors by which a
loop the renderer cannot take is handed back.

AVX-512: values are 16 float or 8 double per register; masks are mask registers. AVX2 (with
FMA): 8 float or 4 double per 256-bit register; masks are lane vectors taken by
``maskload``/``maskstore``, and a gather is built from scalar loads (``st_gather_*``,
``intrinsics.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..compiler.kernel import ISA_BYTES


class Unsupported(Exception):
    """This loop has a shape the vector renderer does not handle."""


class NeedIndexLanes(Exception):
    """A per-lane index is needed: retry the loop with 8 lanes (int64 index vectors)."""


@dataclass(frozen=True)
class Lanes:
    """Intrinsic spelling for one vector shape of the value type on one ISA. AVX-512 masks
    are mask registers (``__mmask16``); AVX2 has none, so its masks are vectors whose set
    lanes are all ones (``__m256i``), taken by ``maskload``/``maskstore``."""

    vtype: str     # __m512 / __m256 / __m512d / __m256d
    pre: str       # _mm512 / _mm256
    suf: str       # ps / pd
    n: int         # lanes
    width: int     # value bytes
    isa: str       # avx512 / avx2

    def op(self, name, *args):
        return f"{self.pre}_{name}_{self.suf}({', '.join(args)})"

    def zero(self):
        return self.op("setzero")

    def set1(self, x):
        return self.op("set1", f"(val_t)({x})")

    def hsum(self, v):
        if self.vtype in ("__m256", "__m256d"):
            return f"st_hsum256{'d' if self.suf == 'pd' else ''}({v})"
        return self.op("reduce_add", v)

    def hmax(self, v):
        if self.vtype in ("__m256", "__m256d"):
            return f"st_hmax256{'d' if self.suf == 'pd' else ''}({v})"
        return self.op("reduce_max", v)

    def hsum4(self) -> str | None:
        """The helper that adds up four float32 registers into one ``__m128``, if any."""
        return {"__m512": "st_hsum4", "__m256": "st_hsum4_256"}.get(self.vtype)

    # -- masks -----------------------------------------------------------------------------
    def mask_decl(self, name, remaining) -> str:
        """``name``: lanes [0, remaining) of a step set (all if remaining >= n)."""
        if self.isa == "avx2":
            return f"const __m256i {name} = st_vmask{self.n}({remaining});"
        return f"const __mmask{self.n} {name} = st_mask{self.n}({remaining});"

    def masked_load(self, mask, ptr):
        if self.isa == "avx2":
            return self.op("maskload", ptr, mask)
        return self.op("maskz_loadu", mask, ptr)

    def tail_load(self, base, index, count, mask):
        """AVX2: lanes [0, count) of ``base + index`` (``count`` < a register), the rest
        undefined, by a plain load ending at the run's end, shifted into place, where that
        starts inside the array (``index >= lanes - count``): maskload, which it replaces,
        ran 2.3x slower on AMD Zen (``st_tail_load_*``, ``intrinsics.py``)."""
        return f"st_tail_load_{self.suf}256({base}, {index}, {count}, {mask})"

    def tail_store(self, ptr, value, count):
        """AVX2: lanes [0, count) of ``value`` to ``ptr`` (``count`` < a register) by plain
        stores (``st_tail_store_*``, ``intrinsics.py``), not maskstore."""
        return f"st_tail_store_{self.suf}256({ptr}, {value}, {count})"

    def keep(self, mask, old, new):
        """``new`` in the lanes of ``mask``, ``old`` in the others."""
        if self.isa == "avx2":
            cast = "_mm256_castsi256_ps" if self.suf == "ps" else "_mm256_castsi256_pd"
            return self.op("blendv", old, new, f"{cast}({mask})")
        return self.op("mask_mov", old, mask, new)

    def masked_store(self, ptr, mask, value):
        if self.isa == "avx2":
            return self.op("maskstore", ptr, mask, value)
        return self.op("mask_storeu", ptr, mask, value)

    # -- gathers ---------------------------------------------------------------------------
    def index_vtype(self, kind) -> str:
        """Register type of AVX-512 index lanes: 'vi32' int32 as stored, 'vi' int64."""
        return "__m256i" if kind == "vi32" and self.n == 8 else "__m512i"

    def gather_at(self, base, ptr, index_ctype):
        """AVX2: ``base[ptr[0]], ..., base[ptr[n-1]]`` (``st_gather_*``, scalar loads)."""
        return f"st_gather_{self.suf}_{'i32' if index_ctype == 'int32_t' else 'i64'}({base}, {ptr})"

    def gather(self, mask, index, base):
        scale = self.width
        return (f"_mm512_mask_i64gather_{self.suf}({self.zero()}, {mask}, {index}, "
                f"{base}, {scale})")

    def load_i32(self, mask, ptr):
        """One int32 index per lane, as stored (``self.n`` of them); ``mask`` None: all."""
        reg = "_mm512" if self.n == 16 else "_mm256"
        mask = mask if mask is not None else f"(__mmask{self.n})-1"
        return f"{reg}_maskz_loadu_epi32({mask}, {ptr})"

    def gather_i32(self, mask, index, base):
        """Values at ``load_i32`` indices: 16 or 8 lanes of float, 8 of double."""
        name = "mmask_i32gather" if self.vtype == "__m256" else "mask_i32gather"
        mask = mask if mask is not None else f"(__mmask{self.n})-1"
        return f"{self.pre}_{name}_{self.suf}({self.zero()}, {mask}, {index}, {base}, {self.width})"


SHAPES = {("avx512", "float", 16): Lanes("__m512", "_mm512", "ps", 16, 4, "avx512"),
           ("avx512", "float", 8): Lanes("__m256", "_mm256", "ps", 8, 4, "avx512"),
           ("avx512", "double", 8): Lanes("__m512d", "_mm512", "pd", 8, 8, "avx512"),
           ("avx2", "float", 8): Lanes("__m256", "_mm256", "ps", 8, 4, "avx2"),
           ("avx2", "double", 4): Lanes("__m256d", "_mm256", "pd", 4, 8, "avx2")}


def full_lanes(val_ctype: str, isa: str | None) -> int | None:
    """Values per register of ``isa`` for this value type, or None if not vectorised."""
    if isa not in ISA_BYTES:
        return None
    return {"float": ISA_BYTES[isa] // 4, "double": ISA_BYTES[isa] // 8}.get(val_ctype)
