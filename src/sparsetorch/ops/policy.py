"""Which backend runs a call, and the thresholds the call path's modules share: the leaf
of ``ops/`` (it imports nothing from the package), so ``execute.py`` and the helpers it
calls (``relaid.py``, ``relayout.py``, ``shim.py``, ``transpose.py``) read them without
importing each other.

Example:
    >>> backend() in ("c", "torch", "triton")
    True
    >>> asks_dense("dense"), asks_dense("csr")
    (True, False)
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

# ``os.environ.get`` encodes its key on every call (about 1 us, a tenth of a small call);
# the mapping it wraps is read directly where CPython exposes it, which sees every change
# made through ``os.environ`` (pytest's monkeypatch included).
_ENV_DATA = getattr(os.environ, "_data", None)
_BACKEND_KEY = os.environ.encodekey("SPARSETORCH_BACKEND") if _ENV_DATA is not None else None

# Below this work a call whose conversions only avoid a serial scatter runs the order as
# written (``_Prepared.written``): re-laying costs a fixed 30-80 us here (the kept pattern's
# lookup, the values gathered, a wrapper, the generic call path) and the scatter of a small
# result stays in cache. ``A.T @ X`` (CSR, uniform rows) ran as fast either way at 64-80K
# (1000 x 1000 with 8000 entries and 2000 x 2000 with 10000, 64 columns: 103 vs 103 us and
# 152 vs 152 us), the re-laid operand 1.7x faster at 320K, the scatter 2-3x faster at 12K.
_SCATTER_WORK = 1 << 16


def backend() -> str:
    """The active backend: ``"c"`` (generated C/OpenMP on the CPU and Triton on CUDA
    tensors, default), ``"triton"`` (Triton kernels everywhere: CPU tensors through Triton's
    interpreter, ``TRITON_INTERPRET=1``) or ``"torch"`` (pure-PyTorch fallback, correct but
    slow), from ``SPARSETORCH_BACKEND``."""
    name = _ENV_DATA.get(_BACKEND_KEY) if _ENV_DATA is not None else \
        os.environ.get("SPARSETORCH_BACKEND")
    if name is None:  # the common case, on every call: no string work
        return "c"
    if isinstance(name, bytes):
        name = os.fsdecode(name)
    name = name.lower()
    if name not in ("c", "torch", "triton"):
        raise ValueError(f"SPARSETORCH_BACKEND={name!r} is not a backend; use 'c', 'triton' "
                         "or 'torch'")
    return name


def uses_triton(device: torch.device) -> bool:
    """Whether calls on ``device`` run Triton kernels: CUDA tensors unless the torch
    backend is chosen, and every tensor under ``SPARSETORCH_BACKEND=triton``."""
    name = backend()
    return name == "triton" or (name == "c" and device.type == "cuda")


def asks_dense(out_format) -> bool:
    """Whether ``out_format`` names the dense result (``"dense"``)."""
    return type(out_format) is str and out_format == "dense"


@lru_cache(maxsize=None)
def torch_blas_is_fast() -> bool:
    """Whether torch's dense CPU matrix product beats the generated dense kernel on the
    small dense products of graph layers (``x W^T`` with a few to a few hundred columns):
    yes but on AMD CPUs, where MKL (the x86 wheels' BLAS) takes a slower generic path.
    Cora's 2708 x 16 times 16 -> 7, 2 threads: MKL's ``F.linear`` 79 us against the
    generated kernel's 50 on AMD Zen; 12.5 against 35 on Intel Sapphire Rapids.

    Example:
        >>> torch_blas_is_fast() in (True, False)
        True
    """
    from ..compiler.kernel import cpu_vendor   # (here, not at import: this module is a leaf)

    return cpu_vendor() != "AuthenticAMD" or not torch.backends.mkl.is_available()
