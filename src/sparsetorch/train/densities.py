"""Per-layer densities for a global density target: uniform, Erdos-Renyi (ER) and
Erdos-Renyi-Kernel (ERK), as in RigL's official code (``rigl/sparse_utils.py``).

In: the masked layers' weight shapes ``{name: shape}`` and a global density (fraction kept).
Out: ``{name: density}`` and, from it, exact per-layer nonzero counts.

ER/ERK give layer ``l`` the density ``eps * p_l`` with ``p_l = sum(shape) / prod(shape)`` (ERK,
every dimension, conv kernels included) or ``(n_out + n_in) / (n_out * n_in)`` (ER, the first
two dimensions of a torch weight), ``eps`` chosen so that the kept count over these layers
equals the uniform one. A layer whose ``eps * p_l`` would exceed 1 is made dense, its zeros
are taken from the others' budget, and ``eps`` is solved again (the official loop).
Layers given a custom density are left out of the ERK solve, as there.
"""
from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

DISTRIBUTIONS = ("erk", "er", "uniform")


def layer_densities(shapes: Mapping[str, Sequence[int]], density: float,
                    distribution: str = "erk", custom: Mapping[str, float] | None = None,
                    erk_power_scale: float = 1.0) -> dict[str, float]:
    """Density of each layer for the global ``density`` under ``distribution``.

    ``custom`` fixes some layers' densities (they are left out of the ER/ERK solve, as in
    the official code); ``erk_power_scale`` < 1 softens ERK towards uniform (0 = uniform).

    Example:
        >>> d = layer_densities({"fc1": (300, 784), "fc2": (100, 300), "fc3": (10, 100)}, 0.1)
        >>> {k: round(v, 4) for k, v in d.items()}
        {'fc1': 0.0796, 'fc2': 0.2302, 'fc3': 1.0}
        >>> layer_densities({"a": (4, 4)}, 0.25, "uniform")
        {'a': 0.25}
    """
    _check_density("density", density)
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"layer_densities: distribution={distribution!r} is not one of "
                         f"{DISTRIBUTIONS}")
    custom = dict(custom or {})
    unknown = set(custom) - set(shapes)
    if unknown:
        raise ValueError(f"layer_densities: custom densities name layers {sorted(unknown)} that "
                         f"are not among the sparse layers {sorted(shapes)}")
    for name, d in custom.items():
        _check_density(f"custom density of {name!r}", d)
    for name, shape in shapes.items():
        if len(shape) < 2:
            raise ValueError(f"layer_densities: layer {name!r} has shape {tuple(shape)}; only "
                             "weights with >= 2 dimensions are sparsified (keep biases dense)")
        if 0 in tuple(shape):
            raise ValueError(f"layer_densities: layer {name!r} has shape {tuple(shape)}, no "
                             "weights; leave it out of the sparse layers")
    if isinstance(erk_power_scale, bool) or not isinstance(erk_power_scale, (int, float)):
        raise TypeError(f"layer_densities: erk_power_scale must be a number, got "
                        f"{type(erk_power_scale).__name__}")
    if not 0 <= erk_power_scale < math.inf:
        raise ValueError(f"layer_densities: erk_power_scale={erk_power_scale} must be a finite "
                         "number >= 0 (1: ERK, 0: uniform)")
    free = [n for n in shapes if n not in custom]
    if distribution == "uniform":
        out = {n: float(density) for n in free}
    else:
        out = _erdos_renyi(shapes, free, density, distribution == "erk", erk_power_scale)
    out.update({n: float(d) for n, d in custom.items()})
    return {n: out[n] for n in shapes}


def _erdos_renyi(shapes, free, density, include_kernel, power):
    log_raw = {}
    for n in free:
        shape = shapes[n]
        if include_kernel:
            log_raw[n] = power * (math.log(sum(shape)) - math.log(math.prod(shape)))
        else:
            n_out, n_in = shape[0], shape[1]
            log_raw[n] = math.log(n_in + n_out) - math.log(n_in * n_out)
    dense: set[str] = set()
    while True:
        rest = [n for n in free if n not in dense]
        if not rest:   # every layer dense: only possible at density 1
            return {n: 1.0 for n in free}
        # each p_l relative to the largest left (a common factor, which eps absorbs), from
        # logarithms: a large ``power`` underflowed every p_l ** power to 0 otherwise
        top = max(log_raw[n] for n in rest)
        raw = {n: math.exp(log_raw[n] - top) for n in rest}
        rhs, divisor = 0.0, 0.0
        for n in free:
            size = math.prod(shapes[n])
            n_zeros = size - kept_count(size, density)
            if n in dense:
                rhs -= n_zeros
            else:
                rhs += size - n_zeros
                divisor += raw[n] * size
        eps = rhs / divisor
        if eps <= 1:   # (the largest raw left is 1)
            break
        dense.update(n for n in rest if raw[n] == 1.0)
    return {n: 1.0 if n in dense else eps * raw[n] for n in free}


def kept_count(size: int, density: float) -> int:
    """Nonzeros a layer of ``size`` weights keeps at ``density``: ``size - floor((1 - density)
    * size)``, the official code's count (a relative tolerance absorbs float error in
    ``(1 - d) * size``, which grows with the size: 66999999.99999999 for 1e8 weights at 0.33).

    Example:
        >>> kept_count(1000, 0.1), kept_count(7, 0.5), kept_count(5, 0.0)
        (100, 4, 0)
        >>> kept_count(10 ** 8, 0.33)
        33000000
    """
    zeros = (1.0 - density) * size
    return size - int(math.floor(zeros + max(1e-9, 1e-12 * zeros)))


def _check_density(what: str, d) -> None:
    if isinstance(d, bool) or not isinstance(d, numbers.Real):   # (NumPy's too)
        raise TypeError(f"{what} must be a number in (0, 1], got {type(d).__name__}")
    if not 0.0 < d <= 1.0:
        raise ValueError(f"{what}={d} must be in (0, 1] (it is the fraction of weights kept; "
                         "sparsity 0.9 is density 0.1)")
