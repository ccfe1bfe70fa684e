"""Loop IR: an immutable, C-like tree that lowering builds and renderers print.

Expressions: ``Sym`` (a scalar variable or parameter), ``Lit``, ``Load`` (array[index]),
``Bin``, ``Cond`` (c ? a : b), ``Call`` (a math function or unary-map template).
Statements: ``Decl``, ``Assign`` (``=`` or ``+=``, to a Sym or an array element), ``For``
(with an optional ``Parallel`` annotation), ``While``, ``If``, ``Block``, ``Comment``, and
``Helper`` for the few runtime helpers (workspace allocation, hashing, sorting) that each
renderer spells out.
A ``Function`` has typed parameters. ``verify`` checks that every symbol is declared before
use and every array is a parameter; ``dump`` prints the tree for ``explain()``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields


class Node:
    pass


# -- expressions ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sym(Node):
    name: str


@dataclass(frozen=True)
class Lit(Node):
    value: object


@dataclass(frozen=True)
class Load(Node):
    array: str
    index: Node


@dataclass(frozen=True)
class Bin(Node):
    op: str            # + - * / < <= == != && || min max
    a: Node
    b: Node


@dataclass(frozen=True)
class Cond(Node):
    cond: Node
    a: Node
    b: Node


@dataclass(frozen=True)
class Call(Node):
    template: str      # C template with {x}; math names resolved by the renderer
    arg: Node


# -- statements -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decl(Node):
    """A scalar (``ctype`` 'idx' = int64_t, 'val' = the value type) or, with ctype 'val[]',
    a zero-filled local array of ``init`` (a Lit) values: a register tile; with 'idx[]', an
    uninitialised local array of ``init`` indices (cursors); with 'val*', a read-only
    pointer to values (``init``: an array or pointer), loaded from like an array."""

    ctype: str
    name: str
    init: Node | None = None


@dataclass(frozen=True)
class Assign(Node):
    target: Node       # Sym or Load
    value: Node
    op: str = "="


# Inside a balanced parallel loop: the end of the row range this thread is working on (a
# loop with step > 1 clips its last group of rows to it).
RANGE_END = "st_hi"

# Names each workspace kind declares (its allocation helper defines them).
WORKSPACE_NAMES = {"dense": ("ws_vals", "ws_mark", "ws_bits", "ws_list", "ws_n", "ws_stamp"),
                   "hash": ("ws", "ws_n", "ws_list", "ws_sorted")}


@dataclass(frozen=True)
class Parallel:
    """Run the loop's iterations across threads. ``schedule`` is an OpenMP schedule kind, or
    'balanced': rows split into ranges holding equal shares of ``pos[n] + n`` (stored
    entries plus rows), found by binary search in the ``weights`` position array. A function
    with an ``nc`` parameter splits them into ``nc`` ranges per thread taken dynamically from
    a shared counter when ``nc > 1``, and one range per thread otherwise (or without it).
    ``workspace`` ('dense' or 'hash') is allocated privately by each thread."""

    schedule: str = "static"
    chunk: int | None = None
    workspace: str | None = None
    weights: str | None = None


@dataclass(frozen=True)
class For(Node):
    """``for var in [start, end) by step``. ``simd`` asks for vector code; ``reduction``
    names a scalar the iterations sum into (lets the renderer reassociate that sum), or a
    tuple of scalars when the loop computes several sums side by side (``jam_sums``).
    ``combine="max"`` makes ``reduction`` a maximum instead: the body updates it as
    ``m = (v > m ? v : m)`` (``max_update``), which the renderers may regroup too.
    ``entries``, on a loop over stored positions, is how many positions its level stores
    (its coordinate array's length): renderers may read coordinates ahead of the loop, up to
    there (prefetches); None where not known."""

    var: str
    start: Node
    end: Node
    body: "Block"
    parallel: Parallel | None = None
    step: int = 1
    simd: bool = False
    reduction: str | tuple | None = None
    combine: str = "+"
    entries: Node | None = None


@dataclass(frozen=True)
class While(Node):
    cond: Node
    body: "Block"


@dataclass(frozen=True)
class If(Node):
    cond: Node
    then: "Block"
    orelse: "Block | None" = None


@dataclass(frozen=True)
class Block(Node):
    stmts: tuple = ()


@dataclass(frozen=True)
class Comment(Node):
    text: str


@dataclass(frozen=True)
class Helper(Node):
    """A named runtime helper statement (``alloc_dense``, ``hash_add``, ``sort_touched``...)
    with expression arguments; ``uses``/``defines`` name the symbols it reads and declares,
    so ``verify`` stays honest."""

    name: str
    args: tuple = ()
    uses: tuple = ()
    defines: tuple = ()


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str         # 'idx' (int64 scalar), 'val*', 'idx{n}*' (operand n's index width), 'i64*'
    const: bool = True


@dataclass(frozen=True)
class Function(Node):
    name: str
    params: tuple
    body: Block
    doc: tuple = field(default=())


def block(*stmts) -> Block:
    """A Block from statements, flattening nested lists/Blocks and dropping Nones."""
    out = []
    for s in stmts:
        if s is None:
            continue
        if isinstance(s, (list, tuple)):
            out.extend(block(*s).stmts)
        elif isinstance(s, Block):
            out.extend(s.stmts)
        else:
            out.append(s)
    return Block(tuple(out))


def max_update(acc: str, value: Node) -> Assign:
    """``acc = (value > acc ? value : acc)``: the update of a ``combine="max"`` loop."""
    return Assign(Sym(acc), Cond(Bin(">", value, Sym(acc)), value, Sym(acc)))


def max_operand(s: Node, acc: str) -> Node | None:
    """The ``value`` of ``max_update(acc, value)`` if ``s`` is one, else None.

    Example:
        >>> max_operand(max_update("m", Load("x", Sym("p"))), "m")
        Load(array='x', index=Sym(name='p'))
    """
    if isinstance(s, Assign) and s.op == "=" and s.target == Sym(acc) and \
            isinstance(s.value, Cond) and s.value.b == Sym(acc) and \
            s.value.cond == Bin(">", s.value.a, Sym(acc)):
        return s.value.a
    return None


# -- verifier ---------------------------------------------------------------------------------
class IRError(AssertionError):
    pass


def verify(fn: Function) -> None:
    """Check scoping: symbols are declared (or parameters/loop vars) before use; arrays are
    pointer parameters. Raises ``IRError`` naming the first problem."""
    arrays = {p.name for p in fn.params if p.ctype.endswith("*")}
    scalars = {p.name for p in fn.params if not p.ctype.endswith("*")}

    def expr(e, scope):
        if isinstance(e, Sym):
            if e.name not in scope:
                raise IRError(f"{fn.name}: symbol {e.name!r} used before declaration")
        elif isinstance(e, Load):
            if e.array not in arrays and e.array not in scope:
                raise IRError(f"{fn.name}: array {e.array!r} is not a parameter")
            expr(e.index, scope)
        elif isinstance(e, Bin):
            expr(e.a, scope), expr(e.b, scope)
        elif isinstance(e, Cond):
            expr(e.cond, scope), expr(e.a, scope), expr(e.b, scope)
        elif isinstance(e, Call):
            expr(e.arg, scope)
        elif not isinstance(e, Lit):
            raise IRError(f"{fn.name}: unexpected expression {e!r}")

    def stmts(b: Block, scope: set):
        scope = set(scope)
        for s in b.stmts:
            if isinstance(s, Decl):
                if s.init is not None:
                    expr(s.init, scope)
                scope.add(s.name)
            elif isinstance(s, Assign):
                expr(s.value, scope)
                expr(s.target, scope)
            elif isinstance(s, For):
                expr(s.start, scope), expr(s.end, scope)
                if s.entries is not None:
                    expr(s.entries, scope)
                private = WORKSPACE_NAMES.get(s.parallel.workspace, ()) if s.parallel else ()
                if s.parallel and s.parallel.weights:
                    private = (*private, RANGE_END)
                stmts(s.body, scope | {s.var} | set(private))
            elif isinstance(s, While):
                expr(s.cond, scope)
                stmts(s.body, scope)
            elif isinstance(s, If):
                expr(s.cond, scope)
                stmts(s.then, scope)
                if s.orelse is not None:
                    stmts(s.orelse, scope)
            elif isinstance(s, Block):
                stmts(s, scope)
            elif isinstance(s, Helper):
                for arg in s.args:
                    expr(arg, scope)
                for u in s.uses:
                    if u not in scope and u not in arrays:
                        raise IRError(f"{fn.name}: raw statement uses undeclared {u!r}")
                scope.update(s.defines)
            elif not isinstance(s, Comment):
                raise IRError(f"{fn.name}: unexpected statement {s!r}")

    stmts(fn.body, scalars | arrays)


# -- rewriting --------------------------------------------------------------------------------
_FIELD_NAMES: dict = {}   # node class -> its field names (``fields`` is slow: half of
                          # jam_sums' time, which is most of SDDMM's compile)


def rewrite(node, visit):
    """Bottom-up rewrite of an IR tree: children first, then ``visit`` on the rebuilt node
    (unchanged subtrees are kept, not copied).

    Example:
        >>> e = Bin("+", Sym("i"), Sym("n"))
        >>> rewrite(e, lambda x: Sym("m") if x == Sym("n") else x)
        Bin(op='+', a=Sym(name='i'), b=Sym(name='m'))
    """
    kind = type(node)
    if kind is Sym or kind is Lit:   # leaves, most of the nodes: no fields to walk
        return visit(node)
    if kind is tuple:
        items = tuple(rewrite(x, visit) for x in node)
        return node if all(a is b for a, b in zip(items, node)) else items
    if not isinstance(node, Node):
        return node
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(f.name for f in fields(node))
    values, changed = [], False
    for name in names:
        old = getattr(node, name)
        new = rewrite(old, visit)
        values.append(new)
        changed = changed or new is not old
    # (every field is an ``__init__`` argument, in order: ``replace`` would look them up again)
    return visit(kind(*values) if changed else node)


def substitute(node, mapping: dict):
    """``node`` with each symbol in ``mapping`` (``Sym`` -> expression) replaced.

    Example:
        >>> substitute(Bin("+", Sym("k"), Lit(1)), {Sym("k"): Sym("kk")})
        Bin(op='+', a=Sym(name='kk'), b=Lit(value=1))
    """
    return rewrite(node, lambda n: mapping.get(n, n) if isinstance(n, Sym) else n)


def names_read(e: Node) -> set:
    """The scalar symbols an expression reads (inside array indices too).

    Example:
        >>> sorted(names_read(Bin("+", Load("x", Sym("i")), Sym("n"))))
        ['i', 'n']
    """
    return _collected(e, lambda n: n.name if isinstance(n, Sym) else None)


def arrays_read(e: Node) -> set:
    """The arrays an expression reads elements of (empty for None).

    Example:
        >>> sorted(arrays_read(Load("x", Load("crd", Sym("p")))))
        ['crd', 'x']
    """
    return _collected(e, lambda n: n.array if isinstance(n, Load) else None)


def loads(e: Node) -> set:
    """The array elements (``Load`` nodes) an expression or statement reads or writes.

    Example:
        >>> sorted(repr(x.index) for x in loads(Load("x", Load("crd", Sym("p")))))
        ["Load(array='crd', index=Sym(name='p'))", "Sym(name='p')"]
    """
    return _collected(e, lambda n: n if isinstance(n, Load) else None)


def _collected(e: Node, pick) -> set:
    """``pick(n)`` of every node ``n`` of ``e`` for which it is not None."""
    found = set()

    def visit(n):
        got = pick(n)
        if got is not None:
            found.add(got)
        return n
    rewrite(e, visit)
    return found


def statements(b: Block):
    """Every statement of ``b``, those nested in loops and branches included, in order.

    Example:
        >>> loop = For("i", Lit(0), Sym("n"), block(Comment("x")))
        >>> [type(s).__name__ for s in statements(block(loop))]
        ['For', 'Comment']
    """
    for s in b.stmts:
        yield s
        if isinstance(s, (For, While)):
            yield from statements(s.body)
        elif isinstance(s, If):
            yield from statements(s.then)
            if s.orelse is not None:
                yield from statements(s.orelse)


# -- printer ----------------------------------------------------------------------------------
def dump(node, indent: int = 0) -> str:
    """A readable, indentation-structured listing of the IR (for ``explain``)."""
    pad = "  " * indent

    def e(x):
        if isinstance(x, Sym):
            return x.name
        if isinstance(x, Lit):
            return repr(x.value)
        if isinstance(x, Load):
            return f"{x.array}[{e(x.index)}]"
        if isinstance(x, Bin):
            return f"{x.op}({e(x.a)}, {e(x.b)})" if x.op in ("min", "max") else \
                f"({e(x.a)} {x.op} {e(x.b)})"
        if isinstance(x, Cond):
            return f"({e(x.cond)} ? {e(x.a)} : {e(x.b)})"
        if isinstance(x, Call):
            return x.template.replace("{x}", e(x.arg))
        return repr(x)

    if isinstance(node, Function):
        head = f"{pad}function {node.name}({', '.join(p.name for p in node.params)})"
        return head + "\n" + dump(node.body, indent + 1)
    if isinstance(node, Block):
        return "\n".join(dump(s, indent) for s in node.stmts)
    if isinstance(node, Decl):
        return f"{pad}{node.ctype} {node.name}" + (f" = {e(node.init)}" if node.init else "")
    if isinstance(node, Assign):
        return f"{pad}{e(node.target)} {node.op} {e(node.value)}"
    if isinstance(node, For):
        notes = [f"parallel {node.parallel.schedule}"] if node.parallel else []
        notes += ["simd"] if node.simd else []
        if node.reduction:
            sums = node.reduction if isinstance(node.reduction, tuple) else (node.reduction,)
            what = "sum" if node.combine == "+" else node.combine
            notes.append(f"{what} into {', '.join(sums)}")
        step = f" by {node.step}" if node.step != 1 else ""
        tag = f"  [{', '.join(notes)}]" if notes else ""
        return f"{pad}for {node.var} in [{e(node.start)}, {e(node.end)}){step}{tag}\n" + \
            dump(node.body, indent + 1)
    if isinstance(node, While):
        return f"{pad}while {e(node.cond)}\n" + dump(node.body, indent + 1)
    if isinstance(node, If):
        out = f"{pad}if {e(node.cond)}\n" + dump(node.then, indent + 1)
        if node.orelse is not None:
            out += f"\n{pad}else\n" + dump(node.orelse, indent + 1)
        return out
    if isinstance(node, Comment):
        return f"{pad}# {node.text}"
    if isinstance(node, Helper):
        return f"{pad}{node.name}({', '.join(map(e, node.args))})"
    return f"{pad}{node!r}"
