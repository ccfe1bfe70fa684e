"""C99 + OpenMP renderer: a printer over the loop IR (``compiler/ir.py``).

Expressions and statements are rendered by small rule tables; nothing here decides what to
compute. Loop variables and positions are ``int64_t`` (a 32-bit loop index mixed with 64-bit
sizes stops GCC's vectoriser); index arrays keep their stored width (int32 halves index
traffic) and are widened on load. Pointers are ``restrict``: operands never alias the output.
"""
from __future__ import annotations

from ..compiler.ir import (Assign, Bin, Block, Call, Comment, Cond, Decl, For, Function, If,
                           Lit, Load, Raw, Sym, While)

VALUE_CTYPES = {"float32": "float", "float64": "double", "int32": "int32_t",
                "int64": "int64_t"}
INDEX_CTYPES = {"int32": "int32_t", "int64": "int64_t"}

_PRELUDE = """\
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
typedef {val} val_t;

static int st_cmp_i64(const void* a, const void* b) {{
  int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
  return (x > y) - (x < y);
}}
static inline int64_t st_min(int64_t a, int64_t b) {{ return a < b ? a : b; }}
static inline int64_t st_max(int64_t a, int64_t b) {{ return a > b ? a : b; }}
"""

# Runtime helper statements, by name (see ir.Raw).
_RAW = {
    "alloc_workspace": ["val_t* ws_vals = (val_t*)calloc(ws_size ? ws_size : 1, sizeof(val_t));",
                        "char* ws_mark = (char*)calloc(ws_size ? ws_size : 1, 1);",
                        "int64_t* ws_list = (int64_t*)malloc((ws_size ? ws_size : 1) * "
                        "sizeof(int64_t));",
                        "int64_t ws_n = 0;"],
    "free_workspace": ["free(ws_vals); free(ws_mark); free(ws_list);"],
    "sort_touched": ["if (ws_n > 1) qsort(ws_list, ws_n, sizeof(int64_t), st_cmp_i64);"],
}

_MATH = {"float": {"fabs": "fabsf", "exp": "expf", "sqrt": "sqrtf"},
         "double": {"fabs": "fabs", "exp": "exp", "sqrt": "sqrt"},
         "int32_t": {"fabs": "abs", "exp": "exp", "sqrt": "sqrt"},
         "int64_t": {"fabs": "llabs", "exp": "exp", "sqrt": "sqrt"}}


class _CRenderer:
    def __init__(self, val_ctype: str, index_ctypes: dict):
        self.val = val_ctype
        self.index = index_ctypes
        self.math = _MATH[val_ctype]

    # -- expressions -----------------------------------------------------------------------
    def expr(self, e) -> str:
        if isinstance(e, Sym):
            return e.name
        if isinstance(e, Lit):
            v = e.value
            if isinstance(v, float):
                text = repr(v) if v == v and abs(v) != float("inf") else \
                    "NAN" if v != v else ("INFINITY" if v > 0 else "-INFINITY")
                return f"((val_t){text})"
            return str(int(v))
        if isinstance(e, Load):
            return f"{e.array}[{self.expr(e.index)}]"
        if isinstance(e, Bin):
            if e.op in ("min", "max"):
                return f"st_{e.op}({self.expr(e.a)}, {self.expr(e.b)})"
            return f"({self.expr(e.a)} {e.op} {self.expr(e.b)})"
        if isinstance(e, Cond):
            return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"
        if isinstance(e, Call):
            return e.template.format(x=self.expr(e.arg), **self.math)
        raise TypeError(f"cannot render expression {e!r}")

    # -- statements ------------------------------------------------------------------------
    def stmt(self, s, pad: str) -> list[str]:
        if isinstance(s, Block):
            return [line for x in s.stmts for line in self.stmt(x, pad)]
        if isinstance(s, Decl):
            ctype = {"idx": "int64_t", "val": "val_t", "i32": "int32_t"}[s.ctype]
            init = f" = {self.expr(s.init)}" if s.init is not None else ""
            return [f"{pad}{ctype} {s.name}{init};"]
        if isinstance(s, Assign):
            return [f"{pad}{self.expr(s.target)} {s.op} {self.expr(s.value)};"]
        if isinstance(s, For):
            return self.loop(s, pad)
        if isinstance(s, While):
            return [f"{pad}while ({self.expr(s.cond)}) {{", *self.stmt(s.body, pad + "  "),
                    f"{pad}}}"]
        if isinstance(s, If):
            out = [f"{pad}if ({self.expr(s.cond)}) {{", *self.stmt(s.then, pad + "  ")]
            if s.orelse is not None:
                out += [f"{pad}}} else {{", *self.stmt(s.orelse, pad + "  ")]
            return out + [f"{pad}}}"]
        if isinstance(s, Comment):
            return [f"{pad}/* {s.text} */"]
        if isinstance(s, Raw):
            return [pad + line for line in _RAW[s.code]]
        raise TypeError(f"cannot render statement {s!r}")

    def loop(self, s: For, pad: str) -> list[str]:
        head = (f"{pad}for (int64_t {s.var} = {self.expr(s.start)}; {s.var} < "
                f"{self.expr(s.end)}; {s.var}++) {{")
        body = [*self.stmt(s.body, pad + "  "), f"{pad}}}"]
        par = s.parallel
        if par is None:
            return [head, *body]
        sched = par.schedule + (f", {par.chunk}" if par.chunk else "")
        if not par.private_workspace:
            return [f"{pad}#pragma omp parallel for schedule({sched}) num_threads(nt)",
                    head, *body]
        # Each thread owns a workspace for the whole loop.
        inner = pad + "  "
        return [f"{pad}#pragma omp parallel num_threads(nt)", f"{pad}{{",
                *(inner + line for line in _RAW["alloc_workspace"]),
                f"{inner}#pragma omp for schedule({sched})",
                *(("  " + line) for line in [head, *body]),
                *(inner + line for line in _RAW["free_workspace"]), f"{pad}}}"]

    def param(self, p) -> str:
        if not p.ctype.endswith("*"):
            return f"int64_t {p.name}"
        base = p.ctype[:-1]
        if base == "val":
            ctype = "val_t"
        elif base == "i64":
            ctype = "int64_t"
        else:  # idx{n}: operand n's index width
            ctype = self.index[int(base[3:])]
        const = "const " if p.const else ""
        return f"{const}{ctype}* restrict {p.name}"

    def function(self, fn: Function) -> str:
        params = ",\n    ".join(self.param(p) for p in fn.params)
        lines = [f"void {fn.name}(\n    {params}) {{", *self.stmt(fn.body, "  "), "}"]
        return "\n".join(lines)


def render_c(functions, val_ctype: str, index_ctypes: dict, header: str = "") -> str:
    """C source for ``functions`` (IR ``Function``s sharing one value type).

    ``index_ctypes`` maps operand number to its index C type (``int32_t``/``int64_t``).

    Example:
        >>> from sparsetorch.compiler.ir import Function, Param, block, Assign, Load, Lit
        >>> f = Function("k", (Param("out_vals", "val*", const=False),),
        ...              block(Assign(Load("out_vals", Lit(0)), Lit(1.0))))
        >>> "out_vals[0] = ((val_t)1.0);" in render_c([f], "float", {})
        True
    """
    r = _CRenderer(val_ctype, index_ctypes)
    parts = [f"/* {line} */" for line in header.splitlines()] if header else []
    parts.append(_PRELUDE.format(val=val_ctype))
    parts += [r.function(fn) for fn in functions]
    return "\n".join(parts) + "\n"
