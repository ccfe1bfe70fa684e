"""How a SparseTensor looks to ``torch.compile``'s tracers: whether an inner tensor is
read by a tracer itself (dynamo, AOTAutograd) rather than by the traced code, and the
clear error for an attribute dynamo cannot record. ``tensor.py``'s properties ask these.

Example:
    >>> import torch
    >>> outside_tracer(torch.ones(2))     # a real tensor: no tracer's
    False
"""
from __future__ import annotations

import sys

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE
_FUNCTIONAL_MODE = torch._C._TorchDispatchModeKey.FUNCTIONAL


def outside_tracer(inner: torch.Tensor) -> bool:
    """Whether ``inner``, an inner tensor of a SparseTensor, is a tracer's tensor (fake or
    functional) read while that tracer's mode is off: by the tracer itself, not by the
    traced code. Dynamo looks up attributes of a tensor computed inside the compiled
    function that way, and AOTAutograd flattens wrappers to check them for mutations."""
    return ((isinstance(inner, FakeTensor) and torch._C._get_dispatch_mode(_FAKE_MODE) is None)
            or (isinstance(inner, FunctionalTensor)
                and torch._C._get_dispatch_mode(_FUNCTIONAL_MODE) is None))


def check_recordable(t, attr: str, what: str, fix: str) -> None:
    """Raise naming ``fix`` when dynamo reads ``attr`` (``what``, not a tensor) of a
    SparseTensor computed inside the compiled function: it cannot record that, and its own
    error ('SourcelessBuilder ...') does not say why."""
    if read_by_dynamo(t, depth=3):
        raise RuntimeError(
            f"SparseTensor.{attr}: this SparseTensor is computed inside the torch.compile'd "
            f"function, and dynamo cannot record {what} read from it; {fix}")


def read_by_dynamo(t, depth: int = 2) -> bool:
    """Whether dynamo is evaluating a property of ``t`` to record it (the property's getter
    is ``depth - 1`` frames up from here): ``t`` is a SparseTensor computed inside a
    compiled function, whose attributes dynamo reads on its fake value (in
    ``TensorVariable.dynamic_getattr``) and can record only when they are tensors
    ``__tensor_flatten__`` names. Best effort: should dynamo rename that method, the
    property returns and dynamo reports its own error."""
    if not (torch.compiler.is_compiling() and outside_tracer(t._values)):
        return False
    # the getter's caller: fakification also reads fakes with no mode on, and must succeed
    caller = sys._getframe(depth).f_code
    return caller.co_name == "dynamic_getattr" and "_dynamo" in caller.co_filename
