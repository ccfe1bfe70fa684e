"""Rewrites of an FX graph captured by dynamo: chains one loop nest can compute become one
call of a fused op (``runtime.py``). In: a ``GraphModule`` whose nodes carry dynamo's
``example_value`` (fake values, so a node's result type is known: SparseTensor or dense).
Out: the same module with each matched chain replaced by one ``call_function`` node, and a
``Fusion`` record per replacement.

Three passes, in this order (a later pass sees the earlier ones' fused nodes as operands):

1. ``attention``: SDDMM (``einsum("ij,ik,jk->ij", A, Q, K)`` or ``sampled_addmm(A, Q, Kᵀ,
   beta=0)``), optionally times/divided by a number, -> sparse softmax over dim 1 (or -1)
   -> ``@ V``  =>  ``st.ops.masked_attention``.
2. ``epilogue``: a product (``@``, ``matmul``, ``mm``, ``sparse.mm``, ``einsum``,
   ``F.linear``) of a SparseTensor with dense operands and a dense result, then optionally
   ``+ bias`` (``- bias``; a dense tensor or a number), then optionally an activation
   (relu, relu6, abs, neg, exp, sqrt)  =>  ``st.einsum(..., bias=, activation=)``.
3. ``elementwise``: a tree of two or more ``+ - * /``, ``neg``, ``relu``, ``abs``, ``sqrt``,
   ``exp`` over SparseTensors (and numbers)  =>  one ``st.lazy`` expression ``.eval()``.

A chain fuses only when its intermediate results are used nowhere else (not returned, not
read by another op), so nothing computed by the original graph is lost.
"""
from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from ..formats.tensor import SparseTensor
from . import runtime
from .runtime import Replay, Site, _In, _Step


@dataclass(frozen=True)
class Fusion:
    """One replacement in a compiled graph: the pattern, the original ops (graph node
    names, in order) and the fused call."""

    pattern: str
    replaced: tuple
    call: str

    def __str__(self):
        return f"{self.pattern}: {' -> '.join(self.replaced)}  =>  {self.call}"


# Canonical names of the ops the passes look at. Dynamo records Python operators
# (``operator.matmul``), torch functions (``torch._C._nn.linear`` for ``F.linear``) and
# method calls (``x.relu()``) as they were written, so all spellings are listed.
_FUNCS = {
    operator.matmul: "matmul", torch.matmul: "matmul", torch.mm: "mm", torch.sparse.mm: "mm",
    torch.einsum: "einsum", torch.functional.einsum: "einsum", F.linear: "linear",
    torch._C._nn.linear: "linear",
    operator.add: "add", torch.add: "add", operator.sub: "sub", torch.sub: "sub",
    operator.mul: "mul", torch.mul: "mul", operator.truediv: "div", torch.div: "div",
    torch.true_divide: "div", operator.neg: "neg", torch.neg: "neg",
    torch.relu: "relu", F.relu: "relu", F.relu6: "relu6", torch.abs: "abs",
    operator.abs: "abs", torch.exp: "exp", torch.sqrt: "sqrt",
    torch.sparse.softmax: "softmax", torch._C._sparse._sparse_softmax: "softmax",
    torch.sparse.sampled_addmm: "sampled_addmm",
    torch._C._sparse.sparse_sampled_addmm: "sampled_addmm",
}
_METHODS = {"matmul": "matmul", "__matmul__": "matmul", "mm": "mm", "add": "add",
            "__add__": "add", "sub": "sub", "__sub__": "sub", "mul": "mul", "__mul__": "mul",
            "div": "div", "__truediv__": "div", "neg": "neg", "__neg__": "neg",
            "relu": "relu", "abs": "abs", "exp": "exp", "sqrt": "sqrt",
            "to_dense": "to_dense"}
_ACTIVATIONS = ("relu", "relu6", "abs", "neg", "exp", "sqrt")
_ELEMENTWISE = ("add", "sub", "mul", "div", "neg", "relu", "abs", "sqrt", "exp")
# torch.matmul's semantics by operand ranks (as ``ops/matmul.py``; 1-D @ 1-D is a scalar,
# left out: nothing to gain)
_MATMUL = {(1, 2): "j,jk->k", (2, 1): "ij,j->i", (2, 2): "ij,jk->ik",
           (3, 3): "bij,bjk->bik", (3, 2): "bij,jk->bik", (2, 3): "ij,bjk->bik",
           (3, 1): "bij,j->bi", (1, 3): "j,bjk->bk"}
# What dynamo adds to check a data-dependent size (a sparse result's nnz >= 0): reads of
# an inner tensor, its size, a comparison, an assertion. They hang off intermediate sparse
# results and go away with them.
_META = {builtins.getattr, torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
         torch.ops.aten._assert_scalar.default, torch.ops.aten.sym_constrain_range_for_size
         .default, operator.ge, operator.gt, operator.le, operator.lt, operator.eq,
         torch._check, torch._check_is_size}


def _kind(node):
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        try:
            return _FUNCS.get(node.target)
        except TypeError:       # an unhashable target
            return None
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def _value(a):
    return a.meta.get("example_value") if isinstance(a, fx.Node) else None


def _is_sparse(a) -> bool:
    return isinstance(_value(a), SparseTensor)


def _is_dense(a) -> bool:
    v = _value(a)
    return isinstance(v, torch.Tensor) and not isinstance(v, SparseTensor)


def _is_number(a) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool)


def _is_number_input(a) -> bool:
    """Whether ``a`` is a node whose value is a Python number given at each call: dynamo
    makes a number that changed between calls a graph input (a 0-d tensor and its
    ``.item()``), after which the chains reading it went unfused, a probe found."""
    return isinstance(_value(a), (torch.SymInt, torch.SymFloat))


def _meta_only(node) -> bool:
    """Whether ``node`` and everything downstream of it only check sizes (``_META``)."""
    if node.op != "call_function" or node.target not in _META:
        return False
    return all(_meta_only(u) for u in node.users)


def _users(node):
    return [u for u in node.users if not _meta_only(u)]


def _sole_user(node):
    """The one op reading ``node``, or None when it has several, or is a graph output."""
    users = _users(node)
    return users[0] if len(users) == 1 and users[0].op != "output" else None


def _operands(node):
    """``(a, b)`` of a binary op, or ``(a,)`` of a unary one; None with keyword arguments
    (``alpha=``, ``out=``, ``inplace=True``) the fused ops do not take."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    if node.target in (F.relu, F.relu6):
        inplace = kwargs.pop("inplace", args[1] if len(args) > 1 else False)
        args = args[:1]
        if inplace:
            return None
    return None if kwargs else args


def _same_dtype(nodes) -> bool:
    dtypes = {_value(n).dtype for n in nodes}
    return len(dtypes) == 1 and dtypes.pop() in (torch.float32, torch.float64)


# -- rewriting -------------------------------------------------------------------------------
def _replace(graph, chain, inputs, fn, site):
    """Replace the ``chain`` of nodes (graph order, the last one the result) by one call
    ``fn(site, *inputs)``; the site gets the replay of the originals."""
    index = {n: k for k, n in enumerate(chain)}
    pos = {n: k for k, n in enumerate(inputs)}

    def ref(n):
        return _Step(index[n]) if n in index else _In(pos[n])

    site.replay = Replay([(n.op, n.target, fx.node.map_arg(n.args, ref),
                           fx.node.map_arg(n.kwargs, ref)) for n in chain])

    def call(*args):
        return fn(site, *args)
    call.__name__ = f"fused_{site.pattern}"
    call.__module__ = __name__

    last = chain[-1]
    with graph.inserting_after(last):
        new = graph.call_function(call, tuple(inputs))
    new.meta = dict(last.meta)
    last.replace_all_uses_with(new)
    for n in reversed(chain):
        _erase_meta_users(graph, n)
        graph.erase_node(n)
    return Fusion(site.pattern, tuple(_describe(n) for n in chain), site.description)


def _erase_meta_users(graph, node):
    for u in list(node.users):
        _erase_meta_users(graph, u)
        graph.erase_node(u)


def _describe(node):
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def _externals(chain):
    """The nodes the chain reads from outside itself, in order of first use."""
    seen, inside = [], set(chain)
    for n in chain:
        for a in n.all_input_nodes:
            if a not in inside and a not in seen:
                seen.append(a)
    return seen


# -- pass 1: SDDMM -> softmax -> SpMM ---------------------------------------------------------
def _sddmm(node):
    """``(A, Q, K, k_transposed, ones, scale)`` when ``node`` is an SDDMM on a 2-D
    SparseTensor's pattern with dense 2-D factors, else None."""
    kind = _kind(node)
    if kind == "einsum" and not node.kwargs and isinstance(node.args[0], str):
        eq, ops = node.args[0].replace(" ", ""), node.args[1:]
        if len(ops) != 3 or "->" not in eq or "." in eq:   # (no ellipses: named indices)
            return None
        terms, out = eq.split("->")
        terms = terms.split(",")
        if len(out) != 2 or len(set(out)) != 2 or [len(t) for t in terms] != [2, 2, 2]:
            return None
        (a, b), c = out, terms[1][1]
        if terms[0] != a + b or terms[1][0] != a or c in (a, b) or terms[2] not in (b + c,
                                                                                    c + b):
            return None
        A, Q, K = ops
        transposed = terms[2] == c + b
    elif kind == "sampled_addmm":
        kwargs = dict(node.kwargs)
        if len(node.args) != 3 or kwargs.pop("beta", 1) != 0 or kwargs.pop("out", None):
            return None
        alpha = kwargs.pop("alpha", 1)
        if kwargs or not _is_number(alpha):
            return None
        A, Q, K = node.args
        transposed = True
    else:
        return None
    if not (_is_sparse(A) and _value(A).dim() == 2 and _is_sparse(node)):
        return None
    if not all(_is_dense(t) and _value(t).dim() == 2 for t in (Q, K)):
        return None
    if kind == "einsum":
        return A, Q, K, transposed, False, 1.0
    return A, Q, K, transposed, True, float(alpha)


def _scaled(node):
    """``(scores, factor, given)`` when ``node`` multiplies or divides sparse scores by a
    number: ``factor`` a float, or (``given``: ``"mul"`` or ``"div"``) the node of a number
    given at each call."""
    kind = _kind(node)
    args = _operands(node) if kind in ("mul", "div") else None
    if not args or len(args) != 2:
        return None
    x, y = args
    if kind == "mul" and _is_sparse(y) and not _is_sparse(x):
        x, y = y, x
    if not _is_sparse(x):
        return None
    if _is_number_input(y):
        return x, y, kind
    if kind == "mul" and _is_number(y):
        return x, float(y), None
    if kind == "div" and _is_number(y) and y != 0:
        return x, 1.0 / y, None
    return None


def attention_pass(graph):
    """Fuse SDDMM -> (scale) -> softmax -> SpMM chains; returns their ``Fusion`` records."""
    done = []
    for P in list(graph.nodes):
        if P.graph is None or _kind(P) != "softmax":      # erased by an earlier match
            continue
        args, kwargs = list(P.args), dict(P.kwargs)
        dim = args[1] if len(args) > 1 else kwargs.pop("dim", None)
        dtype = args[2] if len(args) > 2 else kwargs.pop("dtype", None)
        if kwargs or dtype is not None or dim not in (1, -1) or not P.args:
            continue
        M = _sole_user(P)
        if _kind(M) not in ("matmul", "mm") or M.kwargs or tuple(M.args)[:1] != (P,):
            continue
        V = M.args[1]
        if not (_is_dense(V) and _value(V).dim() == 2 and _is_dense(M)):
            continue
        S, chain, scale, given = P.args[0], [P, M], 1.0, None
        if _sole_user(S) is not P:
            continue
        scaled = _scaled(S)
        if scaled is not None:
            chain.insert(0, S)
            S, scale, given = scaled
            if _sole_user(S) is not chain[0]:
                continue
        found = _sddmm(S)
        if found is None:
            continue
        A, Q, K, transposed, ones, alpha = found
        if not _same_dtype([A, Q, K, V]):
            continue
        chain.insert(0, S)
        what = "sampled_addmm" if ones else "einsum SDDMM"
        times = f", scores {'x' if given != 'div' else '/'} a number given at each call" \
            if given else f", scores x {scale:g}" if scale != 1 else ""
        site = Site("attention", f"st.ops.masked_attention(A, Q, K, V) (from {what} -> "
                    f"softmax -> matmul{times})", None,
                    scale=alpha * (1.0 if given else scale), given=given,
                    k_transposed=transposed, ones=ones)
        done.append(_replace(graph, chain, [A, Q, K, V] + ([scale] if given else []),
                             runtime.attention, site))
    return done


# -- pass 2: product + bias + activation -----------------------------------------------------
def _product(node):
    """``(equation, operands, linear_bias)`` when ``node`` multiplies a SparseTensor with
    dense operands into a dense result, else None."""
    kind = _kind(node)
    bias = None
    if kind in ("matmul", "mm"):
        if len(node.args) != 2 or node.kwargs:
            return None
        ops = tuple(node.args)
        if not all(isinstance(t, fx.Node) and isinstance(_value(t), torch.Tensor)
                   for t in ops):
            return None
        ranks = tuple(_value(t).dim() for t in ops)
        eq = _MATMUL.get(ranks) if kind == "matmul" or ranks == (2, 2) else None
    elif kind == "einsum":
        eq, ops = node.args[0], tuple(node.args[1:])
        if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
            ops = tuple(ops[0])
        if node.kwargs or not isinstance(eq, str) or "->" not in eq or "|" in eq or "." in eq:
            return None   # "|" carries an out_format through tracing (ops/einsum.py)
        eq = eq.replace(" ", "")
    elif kind == "linear":
        args, kwargs = list(node.args), dict(node.kwargs)
        bias = args[2] if len(args) > 2 else kwargs.pop("bias", None)
        if kwargs or len(args) < 2:
            return None
        ops = tuple(args[:2])
        if not all(isinstance(_value(t), torch.Tensor) for t in ops):
            return None
        x, w = (_value(t).dim() for t in ops)
        eq = {1: "i,oi->o", 2: "ni,oi->no"}.get(x) if w == 2 else None
        if bias is not None and not (_is_dense(bias) and _same_dtype([ops[0], bias])):
            return None
    else:
        return None
    if eq is None or not _is_dense(node):
        return None
    if not all(isinstance(t, fx.Node) and isinstance(_value(t), torch.Tensor) for t in ops):
        return None
    if not any(_is_sparse(t) for t in ops) or not _same_dtype(ops):
        return None
    return eq, ops, bias


def _bias_of(node, cur):
    """``(bias, negate)`` when ``node`` adds a dense tensor (or a number) to ``cur`` of the
    same dtype, the result keeping ``cur``'s rank."""
    kind = _kind(node)
    if kind not in ("add", "sub"):
        return None
    args = _operands(node)
    if not args or len(args) != 2 or cur not in args or args[0] is args[1]:
        return None
    other = args[1] if args[0] is cur else args[0]
    if kind == "sub" and args[0] is not cur:
        return None               # b - product: the product is negated, not the bias
    if _is_number(other) or _is_number_input(other):
        return other, kind == "sub"
    if not (_is_dense(other) and _same_dtype([cur, other])):
        return None
    if _value(other).dim() > _value(cur).dim() or _value(node).dim() != _value(cur).dim():
        return None
    return other, kind == "sub"


def _activation_of(node, cur):
    kind = _kind(node)
    if kind not in _ACTIVATIONS:
        return None
    args = _operands(node)
    return kind if args is not None and tuple(args) == (cur,) else None


def epilogue_pass(graph):
    """Fuse product (+ bias) (-> activation) chains; returns their ``Fusion`` records."""
    done = []
    for node in list(graph.nodes):
        if node.graph is None:
            continue
        found = _product(node)
        if found is None:
            continue
        eq, ops, bias = found
        chain, cur, negate, act = [node], node, False, None
        nxt = _sole_user(cur)
        while _kind(nxt) == "to_dense" and len(nxt.args) == 1 and not nxt.kwargs:
            chain.append(nxt)   # dense.to_dense() is the tensor itself
            cur, nxt = nxt, _sole_user(nxt)
        if bias is None and nxt is not None:
            b = _bias_of(nxt, cur)
            if b is not None:
                (bias, negate), cur = b, nxt
                chain.append(nxt)
                nxt = _sole_user(cur)
        if nxt is not None and (act := _activation_of(nxt, cur)) is not None:
            chain.append(nxt)
        if bias is None and act is None:
            continue
        inputs = list(ops) + ([bias] if isinstance(bias, fx.Node) else [])
        extra = [] if bias is None else ["bias=-b" if negate else "bias=b"]
        extra += [] if act is None else [f"activation={act!r}"]
        call = f"st.einsum({eq!r}, ..., {', '.join(extra)})"
        site = Site("epilogue", call, None, equation=eq,
                    sparse=tuple(_is_sparse(t) for t in ops),
                    bias="input" if isinstance(bias, fx.Node) else bias, negate=negate,
                    activation=act)
        done.append(_replace(graph, chain, inputs, runtime.epilogue, site))
    return done


# -- pass 3: elementwise trees -----------------------------------------------------------------
def _elementwise(node) -> bool:
    """Whether ``node`` is an elementwise op ``st.lazy`` expresses on SparseTensor operands
    (numbers allowed where the eager op accepts them without densifying)."""
    kind = _kind(node)
    if kind not in _ELEMENTWISE:
        return False
    args = _operands(node)
    if args is None or not isinstance(_value(node), torch.Tensor):
        return False
    numbers = [a for a in args if not isinstance(a, fx.Node) or _is_number_input(a)]
    nodes = [a for a in args if isinstance(a, fx.Node) and not _is_number_input(a)]
    if not nodes or not all(_is_sparse(a) for a in nodes):
        return False
    if not all(_is_number(a) or _is_number_input(a) for a in numbers):
        return False
    if kind in ("add", "sub"):
        return len(args) == 2 and not numbers      # A + c raises eagerly (c != 0)
    if kind == "mul":
        return len(args) == 2
    if kind == "div":   # (a divisor given at each call is checked there: runtime.py)
        return len(args) == 2 and _is_sparse(args[0]) and \
            (_is_number_input(args[1]) or _is_number(args[1]) and args[1] != 0)
    return len(args) == 1


def elementwise_pass(graph):
    """Fuse trees of two or more elementwise ops; returns their ``Fusion`` records."""
    ok = {n for n in graph.nodes if _elementwise(n)}

    def inner(n):   # computed only for its one user, itself in a tree: fold it in
        return n in ok and _is_sparse(n) and _sole_user(n) in ok

    done = []
    for root in list(graph.nodes):
        if root not in ok or inner(root):
            continue
        tree, stack = [], [root]
        while stack:
            n = stack.pop()
            if n not in tree:
                tree.append(n)
                stack.extend(a for a in n.all_input_nodes if inner(a))
        if len(tree) < 2:
            continue
        order = {n: k for k, n in enumerate(graph.nodes)}
        tree.sort(key=order.__getitem__)
        leaves = _externals(tree)
        index = {n: k for k, n in enumerate(tree)}
        steps = [(_kind(n), tuple(_Step(index[a]) if a in index else _In(leaves.index(a))
                                  if isinstance(a, fx.Node) else a for a in _operands(n)))
                 for n in tree]
        site = Site("elementwise", f"st.lazy expression of {len(tree)} ops, one .eval()",
                    None, steps=steps)
        done.append(_replace(graph, tree, leaves, runtime.elementwise, site))
        ok -= set(tree)
    return done


def fuse(gm: fx.GraphModule):
    """Run the three passes over ``gm`` (in place) and recompile it; returns the list of
    ``Fusion`` records.

    Example:
        >>> import torch
        >>> from torch import fx
        >>> gm = fx.symbolic_trace(lambda x: torch.relu(x + 1))   # no fake values: no match
        >>> fuse(gm), gm(torch.tensor([-3., 1.]))
        ([], tensor([0., 2.]))
    """
    graph = gm.graph
    fusions = attention_pass(graph) + epilogue_pass(graph) + elementwise_pass(graph)
    if fusions:
        graph.lint()
        gm.recompile()
    return fusions
