"""Helpers shared by several ``st.nn`` layer modules (kept here so no module imports another
module's private names).

Example:
    >>> import torch
    >>> check_pointwise(torch.nn.Conv2d(4, 8, 1))   # a 1x1 convolution passes
"""
from __future__ import annotations

import functools
import numbers

import torch
from torch import nn

from ..formats import SparseTensor
from ..formats.tensor import inherit_pattern_facts


class NoTorchScript:
    """Mixed into the sparse layers: TorchScript (``torch.jit.script``, ``torch.jit.trace``
    and the TorchScript ``torch.onnx.export``) cannot record calls to generated kernels, so
    each refuses with one clear error (a trace recorded nothing for them: its outputs were
    constants of the example inputs; scripting failed with an empty message). Costs nothing
    otherwise: torch calls ``_slow_forward`` instead of ``forward`` only while tracing.
    """

    def _refusal(self) -> TypeError:
        return TypeError(
            f"{type(self).__name__}: TorchScript (torch.jit.script, torch.jit.trace, "
            "torch.onnx.export's TorchScript exporter) cannot record sparsetorch's kernels; "
            "use torch.compile or torch.export (they record them as custom ops), or "
            "st.freeze for inference")

    def __prepare_scriptable__(self):
        raise self._refusal()

    def _slow_forward(self, *args, **kwargs):
        raise self._refusal()


def input_type_error(what: str, expected: str, x) -> TypeError:
    """The error for an input ``x`` that is not a tensor: ``"{what}: {expected}, got ..."``,
    or for a ``torch.fx.Proxy`` (``symbolic_trace``), what to do instead.

    Example:
        >>> str(input_type_error("Layer", "x must be a tensor", 3))
        'Layer: x must be a tensor, got int'
    """
    if isinstance(x, torch.fx.Proxy):
        return TypeError(f"{what}: torch.fx.symbolic_trace cannot trace into sparsetorch's "
                         "layers (their kernels need real tensors); keep them whole as leaf "
                         "modules (a Tracer whose is_leaf_module says so), or use st.freeze, "
                         "torch.compile or torch.export")
    return TypeError(f"{what}: {expected}, got {type(x).__name__}")


def check_sizes(what: str, least: int = 1, **sizes) -> None:
    """Raise a ``ValueError`` naming the first of ``sizes`` that is not an int (NumPy's
    count) of at least ``least``.

    Example:
        >>> check_sizes("Layer", in_features=3, out_features=2)
    """
    for name, n in sizes.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < least:
            kind = "a positive int" if least == 1 else f"an int >= {least}"
            raise ValueError(f"{what}: {name} must be {kind}, got {n!r}")


def check_dropout(what: str, p) -> None:
    """Raise unless ``p`` is a dropout probability: a number (not a bool) in [0, 1).

    Example:
        >>> check_dropout("Layer", 0.5)
    """
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"{what}: dropout must be a number in [0, 1), got {p!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{what}: dropout must be in [0, 1), got {p}")


def autocast_input(x, dtype: torch.dtype):
    """``x`` in a layer's ``dtype`` where ``torch.autocast`` is on for its device and both
    are floating point, else ``x`` itself (another dtype then gets the layer's TypeError).
    Under autocast the dense layer before a sparse one hands it a half-precision output;
    like an op autocast does not list, the sparse layer runs in its weights' type.

    Example:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_input(torch.ones(2, dtype=torch.bfloat16), torch.float32).dtype
        torch.float32
    """
    if x.dtype != dtype and type(x) is torch.Tensor and x.dtype.is_floating_point and \
            dtype.is_floating_point and torch.is_autocast_enabled(x.device.type):
        return x.to(dtype)
    return x


def check_image(x, what: str, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """``x``, after raising unless it is a dense ``(N, channels, H, W)`` tensor of
    ``dtype`` (cast to it under autocast: ``autocast_input``).

    Example:
        >>> check_image(torch.ones(1, 3, 4, 4), "Stem", 3, torch.float32).shape
        torch.Size([1, 3, 4, 4])
    """
    if not isinstance(x, torch.Tensor):
        raise input_type_error(what, f"input must be a dense (N, {channels}, H, W) tensor", x)
    if isinstance(x, SparseTensor) or x.dim() != 4 or x.shape[1] != channels:
        raise ValueError(f"{what}: input must be a dense (N, {channels}, H, W) tensor; got "
                         f"{tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    if x.layout != torch.strided:   # (torch's "reshape is not implemented for sparse tensors")
        raise TypeError(f"{what}: input is a torch.sparse tensor ({x.layout}); pass "
                        "x.to_dense()")
    x = autocast_input(x, dtype)
    if x.dtype != dtype:
        raise TypeError(f"{what}: input is {x.dtype} but the weights are {dtype}; cast the "
                        f"input or the layer (.to(dtype))")
    return x


def check_conv_parameters(what: str, weight, bias, shape: str, shaped: bool) -> None:
    """Raise unless ``weight`` is a floating-point tensor (``shaped``: of the layer's
    ``shape``, described) and ``bias`` None or a tensor of its dtype: torch's own errors
    came only at the first call ("Input type (float) and bias type (double) should be the
    same"), or an AttributeError for a list.

    Example:
        >>> check_conv_parameters("Conv", torch.ones(2, 1, 3, 3), torch.ones(2, dtype=torch.float64),
        ...                       "(C, 1, kh, kw)", True)
        Traceback (most recent call last):
        TypeError: Conv: bias is torch.float64 but weight torch.float32; give both one dtype
    """
    if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point:
        raise TypeError(f"{what}: weight must be a floating-point tensor {shape}, got "
                        f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if not shaped:
        raise ValueError(f"{what}: weight must be {shape}, got {tuple(weight.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != weight.dtype):
        raise TypeError(f"{what}: bias is {getattr(bias, 'dtype', type(bias).__name__)} but "
                        f"weight {weight.dtype}; give both one dtype")


def keep_facts(weight: SparseTensor, layer: nn.Module) -> None:
    """Hand what the kernels worked out about the pattern back to the layer's kept wrapper
    (``_cached_weight[2]``), so the next forward's wrapper starts with it. Nothing under
    ``torch.compile``: the traced weight is built afresh, and tracing the kept wrapper (an
    alias of a Parameter) fails."""
    if torch.compiler.is_compiling():
        return
    cached = layer.__dict__.get("_cached_weight")
    if cached is not None and weight is not cached[2]:
        inherit_pattern_facts(weight, cached[2])


def check_pointwise(conv) -> None:
    """Raise unless ``conv`` is an ``nn.Conv2d`` that ``SparseConv2d.from_dense`` converts:
    1x1 kernel, one group, stride 1 or 2, no padding or dilation.

    Example:
        >>> import torch
        >>> check_pointwise(torch.nn.Conv2d(4, 8, 3))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: ...only 1x1 convolutions convert; this one has kernel_size=(3, 3) (need 1x1)...
    """
    if not isinstance(conv, nn.Conv2d):
        raise TypeError(f"SparseConv2d.from_dense: expected an nn.Conv2d, got {type(conv).__name__}")
    problems = []
    if tuple(conv.kernel_size) != (1, 1):
        problems.append(f"kernel_size={tuple(conv.kernel_size)} (need 1x1)")
    if conv.groups != 1:
        problems.append(f"groups={conv.groups} (need 1)")
    if conv.stride[0] != conv.stride[1] or conv.stride[0] not in (1, 2):
        problems.append(f"stride={tuple(conv.stride)} (need 1 or 2)")
    if tuple(conv.padding) != (0, 0) if not isinstance(conv.padding, str) else conv.padding != "valid":
        problems.append(f"padding={conv.padding} (need 0)")
    if tuple(conv.dilation) != (1, 1):
        problems.append(f"dilation={tuple(conv.dilation)} (need 1)")
    if problems:
        raise ValueError("SparseConv2d.from_dense: only 1x1 convolutions convert; this one has "
                         + ", ".join(problems) + ". Keep it dense (st.sparsify skips it).")


def member(module: nn.Module, name: str):
    """``getattr(module, name)``, read from the module's own tables for a parameter or a
    submodule: nn.Module finds those through its ``__getattr__`` fallback, after a failed
    ordinary lookup, ~2 us a name on a 2-core host (``self.lin.weight`` and ``self.bias``
    cost a GCN layer 6 us of a ~50 us forward on Cora). Anything else (a plain attribute,
    a parametrization's property) is read as an attribute.

    Example:
        >>> lin = torch.nn.Linear(2, 3)
        >>> member(lin, "weight") is lin.weight and member(lin, "in_features") == 2
        True
    """
    found = module._parameters.get(name)
    if found is None:
        found = module._modules.get(name)
    return found if found is not None else getattr(module, name)


def as_asked(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """``y``, a CHW layer's output, in plain NCHW memory where ``module.nchw_output`` asks
    for it (``st.sparsify`` sets it where the model reads the output in a way that needs
    it, such as ``.view``), else as the layer wrote it: (C, N, H, W) memory at batch > 1.

    Example:
        >>> y = torch.ones(3, 2, 1, 1).permute(1, 0, 2, 3)   # (N, C, H, W) in CNHW memory
        >>> layer = torch.nn.Identity()
        >>> as_asked(layer, y).is_contiguous()
        False
        >>> layer.nchw_output = True
        >>> as_asked(layer, y).is_contiguous()
        True
    """
    return y.contiguous() if module.__dict__.get("nchw_output", False) else y


def step_as_asked(module: nn.Module, run):
    """A layer's planned inference step ``run`` (a function of the input, or None) whose
    output ``as_asked`` puts in NCHW memory where ``module.nchw_output`` asks."""
    if run is None or not module.__dict__.get("nchw_output", False):
        return run
    return lambda x: run(x).contiguous()


def hooked(module: nn.Module) -> bool:
    """Whether ``module`` has forward or backward hooks of its own (global hooks aside).

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> handle = lin.register_forward_hook(lambda m, i, o: None)
        >>> hooked(lin), hooked(torch.nn.Linear(2, 2))
        (True, False)
    """
    return bool(module._forward_hooks or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks)


def outside_graph(fn):
    """``fn`` run eagerly under ``torch.compile`` (``torch.compiler.disable``, a graph
    break), applied at its first call: decorating at import would import ``torch._dynamo``
    for every user of sparsetorch, seconds on a busy machine. Callers that also run outside
    compile call ``fn`` itself there (the wrapper costs ~2 us a call).

    Example:
        >>> double = outside_graph(lambda x: 2 * x)
        >>> double(torch.ones(2)).tolist()
        [2.0, 2.0]
    """
    disabled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)
    return call
