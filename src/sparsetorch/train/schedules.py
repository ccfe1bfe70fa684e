"""When masks change and by how much: the update-step rule, RigL's cosine drop fraction and
Zhu & Gupta's cubic sparsity schedule for gradual magnitude pruning.

In: the step count ``t`` (``step()`` calls completed before this one) and schedule settings.
Out: booleans (update now?) and fractions.
"""
from __future__ import annotations

import math


def is_update_step(t: int, delta_t: int, t_end: int, t_begin: int = 0) -> bool:
    """True when step ``t`` updates masks: ``t_begin <= t <= t_end`` and ``t - t_begin`` a
    multiple of ``delta_t`` (the begin step included, as in the official code).

    Example:
        >>> [t for t in range(0, 400) if is_update_step(t, 100, 300)]
        [0, 100, 200, 300]
    """
    return t_begin <= t <= t_end and (t - t_begin) % delta_t == 0


def cosine_drop_fraction(t: int, alpha: float, t_end: int) -> float:
    """RigL's drop fraction ``alpha / 2 * (1 + cos(pi * t / t_end))``, 0 after ``t_end``.

    Example:
        >>> cosine_drop_fraction(0, 0.3, 100), round(cosine_drop_fraction(50, 0.3, 100), 6)
        (0.3, 0.15)
    """
    if t > t_end:
        return 0.0
    return alpha / 2 * (1 + math.cos(math.pi * t / t_end)) if t_end else alpha


def cubic_sparsity(t: int, final_sparsity: float, t_begin: int, t_end: int,
                   initial_sparsity: float = 0.0) -> float:
    """Zhu & Gupta (2017): ``s_t = s_f + (s_i - s_f) * (1 - (t - t_begin) / (t_end -
    t_begin)) ** 3`` between ``t_begin`` and ``t_end``; ``s_i`` before, ``s_f`` after.

    Example:
        >>> [cubic_sparsity(t, 0.9, 0, 100) for t in (0, 50, 200)]
        [0.0, 0.7875, 0.9]
    """
    if t <= t_begin:
        return initial_sparsity
    if t >= t_end:
        return final_sparsity
    progress = (t - t_begin) / (t_end - t_begin)
    return final_sparsity + (initial_sparsity - final_sparsity) * (1 - progress) ** 3
