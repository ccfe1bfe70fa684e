"""What is kept between calls (a layer's cached adjacency, a re-laid pattern) is built with
``torch.inference_mode`` off: a tensor made under it is an inference tensor, which a later
call with autograd on cannot save for backward, and whose version counter (part of a
cache's key) cannot be read; the first call of a layer under ``inference_mode`` made every
later training call fail. And a gradient autograd hands a backward may be one of torch's
zero tensors, which have no memory to give a kernel (``materialized``); forward-mode AD's
dual tensors carry tangents no kernel reads (``refuse_dual``). Facts about the machine are
constants to ``torch.compile``'s tracer (``constant_to_tracer``).
"""
from __future__ import annotations

import functools

import torch
from torch.autograd import forward_ad as _forward_ad


def outside_inference_mode(fn):
    """``fn`` run with ``torch.inference_mode`` off (as it is, where it is not on).

    Example:
        >>> import torch
        >>> make = outside_inference_mode(lambda: torch.ones(2))
        >>> with torch.inference_mode():
        ...     make().is_inference()
        False
    """
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False):
            return fn(*args, **kwargs)
    return run


def version(t: torch.Tensor):
    """``t._version``, the count of in-place writes a cache's key holds; for an inference
    tensor, which has none (and may be written in place under ``inference_mode``), a new
    object each call: a key that matches nothing, so what was kept is rebuilt.

    Example:
        >>> import torch
        >>> version(torch.zeros(2).add_(1))
        1
        >>> with torch.inference_mode():
        ...     t = torch.zeros(2)
        >>> version(t) == version(t)
        False
    """
    return object() if t.is_inference() else t._version


_is_batched = torch._C._functorch.is_batchedtensor
_is_legacy_batched = torch._C._functorch.is_legacy_batchedtensor   # (is_grads_batched's)


def materialized(grad: torch.Tensor) -> torch.Tensor:
    """``grad``, or zeros of its shape where it is one of torch's efficient zero tensors
    (``sgn``'s and ``abs``'s gradients of a gradient are), whose data pointer is null: a
    kernel reading it crashed the process. Dense torch gives zero gradients then, and so
    does a backward given these zeros. A batch of gradients (``torch.autograd.grad(...,
    is_grads_batched=True)``, a vectorised jacobian: vmap) has no memory either, and is
    refused with a ``TypeError`` that says so.

    Example:
        >>> import torch
        >>> z = torch._efficientzerotensor(2)
        >>> z.data_ptr() == 0, materialized(z).data_ptr() != 0
        (True, True)
    """
    if _is_batched(grad) or _is_legacy_batched(grad):
        raise TypeError("sparsetorch's kernels cannot take a batch of gradients "
                        "(is_grads_batched=True, jacobian(vectorize=True), torch.func.vmap); "
                        "compute them one at a time (is_grads_batched=False, "
                        "vectorize=False)")
    if not grad._is_zerotensor():
        return grad
    return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)


def refuse_dual(what: str, tensors) -> None:
    """Raise a ``TypeError`` where one of ``tensors`` (or a SparseTensor's values) carries a
    forward-mode AD tangent (``torch.autograd.forward_ad``): the kernels compute the primal
    alone, so the result would come out without its tangent, silently. Costs one global
    read outside ``forward_ad.dual_level()``.

    Example:
        >>> import torch
        >>> import torch.autograd.forward_ad as fwAD
        >>> with fwAD.dual_level():
        ...     x = fwAD.make_dual(torch.ones(2), torch.ones(2))
        ...     refuse_dual("op", [x])
        Traceback (most recent call last):
        TypeError: op: forward-mode AD (torch.autograd.forward_ad) is not supported: ...
    """
    if _forward_ad._current_level < 0:
        return
    for t in tensors:
        values = getattr(t, "_values", None)   # (a SparseTensor's: its tangent's place;
        t = values if isinstance(values, torch.Tensor) else t   # torch's is a method)
        if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
            raise TypeError(f"{what}: forward-mode AD (torch.autograd.forward_ad) is not "
                            "supported: sparsetorch's kernels would drop the tangent; use "
                            "reverse mode (backward, torch.autograd.grad, "
                            "torch.autograd.functional.jacobian)")


def constant_to_tracer(fn):
    """``fn`` marked so that ``torch.compile``'s tracer calls it while tracing and keeps its
    result as a constant (``torch.compiler.assume_constant_result``) instead of tracing
    into it: for facts about the machine (the CPU, whether kernels build) whose finding
    reads files, which would otherwise break the graph. The public decorator imports
    ``torch._dynamo`` (1.1 s added to ``import sparsetorch``) only to set this attribute;
    ``tests/test_rows_op.py`` compiles a marked function's caller with ``fullgraph=True``
    to notice if torch ever marks it otherwise.

    Example:
        >>> constant_to_tracer(lambda: 3)()
        3
    """
    fn._dynamo_marked_constant = True
    return fn
