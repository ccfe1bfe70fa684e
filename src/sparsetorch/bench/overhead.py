"""The overhead metric of issue 32: a GCN forward on Cora against the sum of its kernels'
times (target: at most 20% more).

One forward is recorded: every top-level call the model makes to ``st.einsum`` (found by
identity in the ``sparsetorch.nn``/``sparsetorch.models`` modules) and to torch functions
that return a tensor (``F.linear`` on a SparseTensor, which runs a sparsetorch kernel,
``relu``, a dense ``F.linear``...), with the very arguments it passed. Each recorded call is
then replayed on its own and timed, interleaved with the whole forward, and the overhead is
``forward / sum(calls) - 1``: what the layers add around their kernels (argument checks,
the cached adjacency lookup, module calls).

A call replayed on its own finds its operands in its cores' caches, written by itself the
round before; in the forward each kernel reads what the previous one just wrote, with
several threads partly in another core's cache. So each ``st.einsum`` and ``F.linear``
call (the graph layers' dense products take torch's where its BLAS is fast: Intel CPUs)
is also timed where it runs, inside the forwards timed (the same interleaved rounds), and
``forward / sum(inside) - 1`` is reported beside the overhead: the layers' own code alone.
(Those two are swapped for timing wrappers; timing every torch function would take a
function mode, which slows every torch call inside them: a forward making other calls
gets no such line.)

Example:
    >>> import torch
    >>> calls = record(lambda: torch.relu(torch.ones(2)).detach() + 1)
    >>> [call.name for call in calls]      # (detach, a view, ran no kernel)
    ['ones', 'relu', 'add']
    >>> calls[1]().tolist()                # (a call repeats itself)
    [1.0, 1.0]
"""
from __future__ import annotations

import statistics
import sys
from contextlib import contextmanager
from time import perf_counter
from typing import Callable, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from .harness import compare


class Call(NamedTuple):
    """One recorded kernel call: calling it repeats it with the same arguments."""

    name: str
    func: Callable
    args: tuple
    kwargs: dict
    out: torch.Tensor

    def __call__(self):
        return self.func(*self.args, **self.kwargs)


class _Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls, self.inside = [], 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.inside and isinstance(out, torch.Tensor) and not _aliases(out, args):
            self.calls.append(Call(getattr(func, "__name__", str(func)), func, args, kwargs,
                                   out))
        return out


def _aliases(out: torch.Tensor, args) -> bool:
    """Whether ``out`` is a view of a dense argument or Parameter (``detach``, a slice): no
    kernel ran."""
    if type(out) is not torch.Tensor:
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(type(a) in (torch.Tensor, torch.nn.Parameter) and
               a.untyped_storage().data_ptr() == ptr for a in args)


_TIMED = ("st.einsum", "linear")   # the calls ``_swapped(..., linear=True)`` times


@contextmanager
def _swapped(on_call, depth, linear: bool = False):
    """Swap ``st.einsum`` wherever the layers imported it (and with ``linear``,
    ``torch.nn.functional.linear``, which they call through the module) for wrappers that
    call ``on_call(args, kwargs, out, seconds)`` after each top-level call; ``depth.inside``
    counts the calls under way (a ``_Recorder`` records none of their own torch calls)."""
    from ..ops import einsum

    def timed(func):
        def wrapper(*args, **kwargs):
            depth.inside += 1
            start = perf_counter()
            try:
                out = func(*args, **kwargs)
            finally:
                depth.inside -= 1
            if not depth.inside:
                on_call(args, kwargs, out, perf_counter() - start)
            return out
        return wrapper

    swapped = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(("sparsetorch.nn", "sparsetorch.models")):
            continue
        swapped += [(mod, attr, einsum) for attr, value in vars(mod).items()
                    if value is einsum]
    if linear:
        swapped.append((torch.nn.functional, "linear", torch.nn.functional.linear))
    for mod, attr, func in swapped:
        setattr(mod, attr, timed(func))
    try:
        yield
    finally:
        for mod, attr, func in swapped:
            setattr(mod, attr, func)


def record(forward) -> list:
    """``[Call]``: the top-level kernel calls of one ``forward()``, in order."""
    from ..ops import einsum
    recorder = _Recorder()

    def on_call(args, kwargs, out, _):
        recorder.calls.append(Call("st.einsum " + str(args[0]), einsum, args, kwargs, out))

    with torch.no_grad(), _swapped(on_call, recorder), recorder:
        forward()
    return recorder.calls


def _medians(times: list, n: int) -> list | None:
    """The median of each of ``n`` call positions over forwards' lists of call times; None
    where a forward made another number of calls."""
    if any(len(t) != n for t in times):
        return None
    return [statistics.median(t[k] for t in times) for k in range(n)]


def gcn_overhead(ctx, rounds: int = 10, threads=None, graph: str = "cora") -> dict:
    """``{"graph", "overhead", "forward_s", "kernels_s", "calls", "detail"}`` for
    ``st.models.GCN`` on ``graph`` (``overhead`` None, with why, when it cannot run)."""
    import sparsetorch as st

    from .gnn import GAT_HEADS, weights
    from .gnn_convs import ours
    from .graph_data import get

    try:
        g = get(ctx, graph)
        model = ours("gcn", weights("gcn", g, ctx.seed), st.tensor(g.features, format="csr"),
                     st.tensor(g.adj, format="csr"), heads=GAT_HEADS)
    except NotImplementedError as exc:
        return {"graph": graph, "overhead": None, "detail": f"not measured: {exc}"}
    model.eval()
    # the model called as users call it: the bench's zero-argument wrapper (``Bound``)
    # would add its own module call to the forward, ~2% here
    net, x, adj = model.model, model.x, model.adj
    forward = lambda: net(x, adj)  # noqa: E731
    with torch.no_grad():
        forward()                     # builds the cached adjacency and the kernels
    calls = record(forward)
    # Each forward also times its st.einsum and F.linear calls where they run (the
    # wrappers' two clock reads cost ~0.1 us a call, counted in the forward's time), in the
    # same interleaved rounds as the calls replayed on their own.
    inside = []

    def timed_forward():
        inside.append([])
        return forward()

    cases = {"forward": timed_forward}
    cases.update({f"{i}: {call.name}": call for i, call in enumerate(calls)})
    with torch.no_grad(), _swapped(lambda *call: inside[-1].append(call[-1]), _Recorder(),
                                   linear=True):
        res = compare(cases, baseline="forward", rounds=rounds, warmup=2, min_time=2e-3,
                      threads=threads)
    inside = _medians(inside, len(calls)) \
        if all(call.name.startswith(_TIMED) for call in calls) else None
    times = {k: v["median_s"] for k, v in res["impls"].items()}
    fwd = times.pop("forward")
    total = sum(times.values())
    over = fwd / total - 1
    detail = (f"GCN forward on {graph} ({g.source}) {fwd * 1e6:.0f}us vs {len(times)} kernel "
              f"calls {total * 1e6:.0f}us (" + ", ".join(f"{k.split(': ', 1)[1]} "
                                                      f"{v * 1e6:.0f}us" for k, v in times.items())
              + f"): {100 * over:+.0f}%; ")
    out = {"graph": graph, "overhead": over, "forward_s": fwd, "kernels_s": total,
           "calls": times}
    if inside is None:
        return {**out, "detail": detail + "the calls inside the forward: not timed (it "
                "makes kernel calls other than st.einsum and F.linear, or not the same "
                "ones each time)"}
    within = sum(inside)
    detail += (f"inside the forward the same calls took {within * 1e6:.0f}us ("
               + ", ".join(f"{t * 1e6:.0f}us" for t in inside)
               + f"; {100 * (within / total - 1):+.0f}% over on their own: each reads what "
               f"the one before just wrote, partly in the other core's cache): the layers' "
               f"code adds {100 * (fwd / within - 1):+.0f}%")
    return {**out, "inside_s": within, "inside_calls": inside,
            "layers_over_inside": fwd / within - 1, "detail": detail}
