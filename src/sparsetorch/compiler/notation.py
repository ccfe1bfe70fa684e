"""Index notation: expression trees over indexed operands, and the einsum parser.

An ``Assignment`` says ``out[out_vars] = sum over the other variables of expr``. Expressions
are immutable trees: ``Access`` (operand number + index variables), ``Add``, ``Mul``,
``Scale`` (by a constant), ``Unary`` (a named elementwise map), and at the root only
``Epilogue`` (a map applied to each output element once its sum is complete: bias,
activation), whose function refers to that sum as ``Result()``. Operands are referred to by
position, so one tree describes every call with same-structured inputs and can key caches.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

# Unary maps: C expression template, torch reference, and whether f(0) == 0 (a map that keeps
# zeros keeps sparsity; one that does not, like exp, makes the result dense).
UNARY = {
    "neg": ("(-({x}))", lambda t: -t, True),
    "abs": ("{fabs}({x})", lambda t: t.abs(), True),
    "relu": ("st_relu({x})", lambda t: t.clamp_min(0), True),
    "exp": ("{exp}({x})", lambda t: t.exp(), False),
    "sqrt": ("{sqrt}({x})", lambda t: t.sqrt(), True),
    "relu6": ("st_relu6({x})", lambda t: t.clamp(0, 6), True),
    "sigmoid": ("(1 / (1 + {exp}(-({x}))))", lambda t: t.sigmoid(), False),
}


class Expr:
    """Base of expression nodes (trees are built by ``ops/expr.py``'s ``LazyExpr``)."""

    def accesses(self) -> tuple:
        """Every ``Access`` in the tree, left to right."""
        raise NotImplementedError


@dataclass(frozen=True)
class Access(Expr):
    operand: int
    indices: tuple[str, ...]

    def accesses(self) -> tuple:
        return (self,)

    def __str__(self):
        return f"T{self.operand}[{','.join(self.indices)}]"


class _Node(Expr):
    """An inner node: its accesses are its children's, left to right."""

    def children(self):
        return [v for v in vars(self).values() if isinstance(v, Expr)]

    def accesses(self) -> tuple:
        # Kept with the node (trees are immutable, and the parsed einsum of a repeated call
        # is the same object): every call path walks the accesses several times.
        found = self.__dict__.get("_accesses")
        if found is None:
            found = tuple(acc for child in self.children() for acc in child.accesses())
            self.__dict__["_accesses"] = found
        return found


@dataclass(frozen=True)
class Add(_Node):
    a: Expr
    b: Expr

    def __str__(self):
        return f"({self.a} + {self.b})"


@dataclass(frozen=True)
class Mul(_Node):
    a: Expr
    b: Expr

    def __str__(self):
        return f"{self.a} * {self.b}"


@dataclass(frozen=True)
class Scale(_Node):
    factor: float   # (an int where the expression scales integers exactly: ops/expr.py)
    a: Expr

    def __str__(self):
        return f"{self.factor:g} * {self.a}"


@dataclass(frozen=True)
class Unary(_Node):
    fn: str
    a: Expr

    def __post_init__(self):
        if self.fn not in UNARY:
            raise ValueError(f"unknown unary map {self.fn!r}; supported: {', '.join(UNARY)}")

    def __str__(self):
        return f"{self.fn}({self.a})"


@dataclass(frozen=True)
class Result(Expr):
    """Inside an ``Epilogue``'s function: the completed sum of the epilogue's body."""

    def accesses(self) -> tuple:
        return ()

    def __str__(self):
        return "sum"


@dataclass(frozen=True)
class Epilogue(_Node):
    """``fn`` applied to each output element after ``body`` is summed into it: the bias add
    and activation of a layer, fused into the kernel's output write. Only at the root of an
    assignment; the result is dense (the function may be nonzero where the sum is not).
    ``fn`` may read dense operands indexed by output variables only (a bias ``b[k]``).

    Example:
        >>> e = Epilogue(Mul(Access(0, ("i", "j")), Access(1, ("j",))),
        ...              Unary("relu", Add(Result(), Access(2, ("i",)))))
        >>> str(Assignment(("i",), e))
        'out[i] = sum_{j} relu((sum + T2[i])) <- T0[i,j] * T1[j]'
    """

    body: Expr
    fn: Expr

    def __str__(self):
        return f"{self.fn} <- {self.body}"


@dataclass(frozen=True)
class Assignment:
    """``out[out_vars] = sum_{other vars} expr``."""

    out_vars: tuple[str, ...]
    expr: Expr

    def __hash__(self):  # cached: assignments key the per-call memo tables
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.out_vars, self.expr))
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self):  # string hashes differ between processes: never pickle one
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def all_vars(self) -> tuple[str, ...]:
        seen = dict.fromkeys(self.out_vars)
        for acc in self.expr.accesses():
            seen.update(dict.fromkeys(acc.indices))
        return tuple(seen)

    @property
    def reduction_vars(self) -> tuple[str, ...]:
        return tuple(v for v in self.all_vars if v not in self.out_vars)

    def __str__(self):
        red = f"sum_{{{','.join(self.reduction_vars)}}} " if self.reduction_vars else ""
        return f"out[{','.join(self.out_vars)}] = {red}{self.expr}"


def presence(expr: Expr, present) -> object:
    """Evaluate where ``expr`` can be nonzero, given ``present(access)`` for each access.

    ``present`` returns True, False or any object supporting ``&``/``|`` (the lowering passes
    symbolic conditions). ``*`` intersects, ``+`` unions, and a map with f(0) != 0 is
    everywhere present. Constants True/False are folded.
    """
    if isinstance(expr, Access):
        return present(expr)
    if isinstance(expr, Epilogue):   # e.g. a bias: nonzero where the sum is absent
        return True
    if isinstance(expr, Scale):
        return presence(expr.a, present)
    if isinstance(expr, Unary):
        return presence(expr.a, present) if UNARY[expr.fn][2] else True
    a, b = presence(expr.a, present), presence(expr.b, present)
    if isinstance(expr, Mul):
        if a is False or b is False:
            return False
        return b if a is True else a if b is True else a & b
    if a is True or b is True:
        return True
    return b if a is False else a if b is False else a | b


def factor_out(expr: Expr, inner: set) -> tuple:
    """``(summand, factor)`` with ``expr == factor * summand``, ``factor`` the product of the
    factors of ``expr`` (and its scalar scales) that use none of the variables ``inner``:
    a sum over ``inner`` of ``expr`` is then ``factor * sum(summand)``, one multiply per
    sum instead of one per term. ``factor`` is an expression, a float (scales alone), or
    None when nothing can leave the sum (or nothing would be left in it).

    Example:
        >>> a, x, y = Access(0, ("i", "j")), Access(1, ("i", "k")), Access(2, ("j", "k"))
        >>> summand, factor = factor_out(Scale(2.0, Mul(Mul(a, x), y)), {"k"})
        >>> print(summand, "|", factor)
        T1[i,k] * T2[j,k] | 2 * T0[i,j]
    """
    scale, fixed, varying = 1, [], []   # (int factors stay ints: exact for integers)
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, Mul):
            stack += [e.b, e.a]
        elif isinstance(e, Scale):
            scale *= e.factor
            stack.append(e.a)
        elif inner & {v for acc in e.accesses() for v in acc.indices}:
            varying.append(e)
        else:
            fixed.append(e)
    if not varying or (not fixed and scale == 1.0):
        return expr, None
    factor = _product(fixed)
    if scale != 1.0:
        factor = Scale(scale, factor) if factor is not None else scale
    return _product(varying), factor


def _product(factors):
    """The product of expression nodes, left to right (None for none)."""
    out = None
    for f in factors:
        out = f if out is None else Mul(out, f)
    return out


@lru_cache(maxsize=1024)
def _parse_cached(equation: str, ndims: tuple) -> Assignment:
    return _parse(equation, ndims)


def parse_einsum(equation: str, ndims) -> Assignment:
    """Parse ``"ij,jk->ik"`` (or implicit-output ``"ij,jk"``) for operands of the given orders.
    An ellipsis stands for an operand's unnamed dimensions as in ``torch.einsum``: aligned
    from the right across operands, leading the output of an implicit one, summed when an
    explicit output leaves it out.

    Example:
        >>> str(parse_einsum("ij,jk->ik", [2, 2]))
        'out[i,k] = sum_{j} T0[i,j] * T1[j,k]'
        >>> str(parse_einsum("...ij,jk", [3, 2]))
        'out[A,i,k] = sum_{j} T0[A,i,j] * T1[j,k]'
    """
    if not isinstance(equation, str):
        raise TypeError(f"einsum: the equation must be a string such as 'ij,jk->ik', got "
                        f"{type(equation).__name__}")
    return _parse_cached(equation, tuple(ndims))


def _parse(equation: str, ndims) -> Assignment:
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    if "->" in rhs:
        raise ValueError(f"einsum: equation {equation!r} has more than one '->'; write "
                         "inputs->output once")
    terms = lhs.split(",")
    if len(terms) != len(ndims):
        raise ValueError(f"einsum: equation {equation!r} names {len(terms)} operands but "
                         f"{len(ndims)} were given")
    if "." in eq:
        terms, rhs = _expand_ellipsis(terms, rhs, arrow, ndims)
    for n, (term, nd) in enumerate(zip(terms, ndims)):
        if not _letters(term):
            raise ValueError(f"einsum: operand {n} subscript {term!r} must be letters a-z, "
                             "A-Z only (torch.einsum's)")
        if len(term) != nd:
            raise ValueError(f"einsum: operand {n} has {nd} dimensions but subscript "
                             f"{term!r} names {len(term)}")
    if arrow or "..." in lhs:   # an implicit output with an ellipsis: rhs was made for it
        out = rhs
        if not _letters(out) or len(set(out)) != len(out):
            raise ValueError(f"einsum: output subscript {out!r} must be distinct letters a-z, "
                             "A-Z")
        missing = set(out) - set("".join(terms))
        if missing:
            raise ValueError(f"einsum: output index {sorted(missing)[0]!r} appears in no "
                             "operand")
    else:  # implicit: indices appearing exactly once, alphabetically (numpy's rule)
        counts = {c: "".join(terms).count(c) for c in "".join(terms)}
        out = "".join(sorted(c for c, k in counts.items() if k == 1))
    expr = product([Access(n, tuple(term)) for n, term in enumerate(terms)])
    if expr is None:
        raise ValueError("einsum: no operands")
    return Assignment(tuple(out), expr)


def _letters(term: str) -> bool:
    # (str.isalpha takes any script's letters, which torch.einsum refuses)
    return all(c.isascii() and c.isalpha() for c in term)


def product(factors):
    """The einsum product of ``factors`` (expressions), left to right; None for none.

    Example:
        >>> str(product([Access(0, ("i",)), Access(1, ("i",))]))
        'T0[i] * T1[i]'
    """
    expr = None
    for f in factors:
        expr = f if expr is None else Mul(expr, f)
    return expr


def _expand_ellipsis(terms: list, rhs: str, arrow: str, ndims) -> tuple[list, str]:
    """``terms`` and the output subscript with each ``...`` replaced by letters the equation
    does not use, one per unnamed dimension, shared right-aligned across operands (sizes of
    1 among them broadcast: ``ops/broadcast.py``). Without an arrow the
    output is the ellipsis letters followed by the indices used once, in alphabetical order."""
    counts = []
    for n, (term, nd) in enumerate(zip(terms, ndims)):
        if "." not in term:
            counts.append(0)
            continue
        named = term.replace("...", "", 1)
        if "." in named:
            raise ValueError(f"einsum: operand {n} subscript {term!r} may hold one ellipsis "
                             "('...') and no other '.'")
        if len(named) > nd:
            raise ValueError(f"einsum: operand {n} has {nd} dimensions but subscript "
                             f"{term!r} names {len(named)} besides the ellipsis")
        counts.append(nd - len(named))
    used = set("".join(terms) + rhs)
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in used]
    width = max(counts)
    if width > len(free):
        raise ValueError(f"einsum: the ellipsis covers {width} dimensions, more than the "
                         f"{len(free)} letters the equation leaves unused")
    letters = "".join(free[:width])
    terms = [t.replace("...", letters[width - k:]) for t, k in zip(terms, counts)]
    if arrow:
        if rhs.count("...") > 1 or "." in rhs.replace("...", "", 1):
            raise ValueError(f"einsum: output subscript {rhs!r} may hold one ellipsis ('...') "
                             "and no other '.'")
        return terms, rhs.replace("...", letters)
    named = "".join(terms)
    once = sorted(c for c in set(named) if named.count(c) == 1 and c not in letters)
    return terms, letters + "".join(once)


class BroadcastShapes(ValueError):
    """Operand sizes that differ only where one is 1: ``torch.einsum`` broadcasts them
    (``ops/broadcast.py`` squeezes such dimensions before scheduling); raised by the size
    checks so that a caller can do that, a plain ValueError to any other."""


def size_mismatch(v: str, a: int, b: int, where: str) -> ValueError:
    """The error for index ``v`` used with sizes ``a`` and ``b``; ``where`` says where, e.g.
    "in operand 0 but 3 in operand 1": a BroadcastShapes when one of them is 1."""
    return (BroadcastShapes if 1 in (a, b) else ValueError)(
        f"einsum: index {v!r} has size {a} {where}")


def var_extents(assignment: Assignment, shapes) -> dict:
    """Size of every index variable, checking that all uses agree."""
    sizes: dict[str, int] = {}
    for acc in assignment.expr.accesses():
        shape = shapes[acc.operand]
        for d, v in enumerate(acc.indices):
            if v in sizes and sizes[v] != shape[d]:
                raise size_mismatch(v, sizes[v], shape[d], f"in one operand but {shape[d]} "
                                    f"in operand {acc.operand} (dimension {d})")
            sizes[v] = int(shape[d])
    if prod(sizes[v] for v in assignment.out_vars) >= 2 ** 63:
        raise ValueError(f"the result's shape {tuple(sizes[v] for v in assignment.out_vars)} "
                         "holds more elements than a torch tensor can describe (2^63 - 1); "
                         "use smaller dimensions or split the expression")
    return sizes

