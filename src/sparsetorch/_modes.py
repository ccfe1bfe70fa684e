"""What is kept between calls (a layer's cached adjacency, a re-laid pattern) is built with
``torch.inference_mode`` off: a tensor made under it is an inference tensor, which a later
call with autograd on cannot save for backward, and whose version counter (part of a
cache's key) cannot be read; the first call of a layer under ``inference_mode`` made every
later training call fail. And a gradient autograd hands a backward may be one of torch's
zero tensors, which have no memory to give a kernel (``materialized``); forward-mode AD's
dual tensors carry tangents no kernel reads, and ``torch.func``'s wrapped tensors have no
memory (``refuse_ad_transforms``). Facts about the machine are constants to
``torch.compile``'s tracer (``constant_to_tracer``).
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


# (private torch API, guarded: without it no transform is seen, as before it was checked)
_functorch = getattr(torch._C, "_functorch", None)
_transform_level = getattr(_functorch, "peek_interpreter_stack", lambda: None)
_transformed = getattr(_functorch, "is_functorch_wrapped_tensor", lambda t: False)


def ad_transforms_active() -> bool:
    """Whether forward-mode AD (``forward_ad.dual_level()``) or a ``torch.func`` transform
    (``vmap``, ``grad``, ``jacrev``, ``jvp``...) may be under way: two global reads, for
    the hot paths that check their operands only then (``refuse_ad_transforms``). (True
    also while ``torch.compile`` traces: dynamo's own interpreter is on the stack.)

    Example:
        >>> import torch
        >>> ad_transforms_active(), torch.func.vmap(lambda x: torch.tensor(
        ...     ad_transforms_active()) + x)(torch.zeros(1)).tolist()
        (False, [1.0])
    """
    return _forward_ad._current_level >= 0 or _transform_level() is not None


def _transforming() -> bool:
    # (dynamo, tracing, finds an interpreter on the stack too: its own, not the user's)
    return _transform_level() is not None and not torch.compiler.is_compiling()


def refuse_ad_transforms(what: str, tensors) -> None:
    """Raise a ``TypeError`` where one of ``tensors`` (or a SparseTensor's values) carries a
    forward-mode AD tangent (``torch.autograd.forward_ad``): the kernels compute the primal
    alone, so the result would come out without its tangent, silently; or is a ``torch.func``
    transform's wrapped tensor (``vmap``'s batched, ``grad``'s tracked ones): the kernels
    read plain tensors' memory, which those have none of (torch's error named no cause:
    "Cannot access data pointer of Tensor that doesn't have storage"). Costs two global
    reads outside both (``ad_transforms_active``).

    Example:
        >>> import torch
        >>> import torch.autograd.forward_ad as fwAD
        >>> with fwAD.dual_level():
        ...     x = fwAD.make_dual(torch.ones(2), torch.ones(2))
        ...     refuse_ad_transforms("op", [x])
        Traceback (most recent call last):
        TypeError: op: forward-mode AD (torch.autograd.forward_ad) is not supported: ...
        >>> torch.func.vmap(lambda x: refuse_ad_transforms("op", [x]))(torch.ones(2))
        Traceback (most recent call last):
        TypeError: op: torch.func transforms (vmap, grad, jacrev, jvp, ...) are not ...
    """
    dual, transformed = _forward_ad._current_level >= 0, _transforming()
    if not (dual or transformed):
        return
    for t in tensors:
        values = getattr(t, "_values", None)   # (a SparseTensor's: its tangent's place;
        t = values if isinstance(values, torch.Tensor) else t   # torch's is a method)
        if not isinstance(t, torch.Tensor):
            continue
        if transformed and _transformed(t):
            raise TypeError(f"{what}: torch.func transforms (vmap, grad, jacrev, jvp, ...) are "
                            "not supported: sparsetorch's kernels read the memory of plain "
                            "tensors, which the transforms' wrapped ones do not have; call it "
                            "on the whole batch (its ops take batches) or in a loop, and take "
                            "gradients with backward or torch.autograd.grad "
                            "(st.nn.SparseLinear alone runs under them, as a dense product)")
        if dual and _forward_ad.unpack_dual(t).tangent is not None:
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
