"""Run one workload in one mode: build it, check every implementation against sparsetorch,
then time them side by side (``compare``) and turn the result into one table row.

The order matters. Sparsetorch's first call is timed alone (``first_s``: kernel compiles,
conversions, caches) and doubles as its correctness reference; each baseline's output (or
loss and gradients) is compared with ``allclose`` before anything is timed, and a baseline
that disagrees is not timed: the row says ``FAIL`` and the run exits non-zero.

Example:
    >>> import torch
    >>> from sparsetorch.bench.workloads import Impl, Prepared, Workload
    >>> x = torch.ones(3)
    >>> prep = Prepared([Impl("sparsetorch", "sparsetorch", lambda: x * 2, lambda: {"out": x * 2}),
    ...                  Impl("dense", "dense", lambda: x + x, lambda: {"out": x + x})])
    >>> row = run_case(Workload("toy", "toy", lambda c, m: prep), "infer", None, rounds=3)
    >>> row["check"], sorted(row["vs"])
    ('ok', ['dense'])
"""
from __future__ import annotations

import time

import torch

from .harness import compare, speedup
from .workloads import OURS, Context, Prepared, Workload

MIN_SAMPLE_S = 5e-3


def run_case(workload: Workload, mode: str, ctx: Context | None, *, rounds: int = 10,
             max_time: float | None = None, threads: int | None = None) -> dict:
    """Prepare, check and time ``workload`` in ``mode``; returns the row (a dict).

    Row keys: ``workload``, ``mode``, ``source``, ``size``, ``ours_s`` (median), ``first_s``
    (sparsetorch's first call), ``check`` (``"ok"`` or ``"FAIL: ..."``), ``vs``
    (family -> {``ratio``: median of per-round time(baseline) / time(ours), ``config``: the
    fastest configuration of that family, ``median_s``}), ``skipped`` (family -> reason),
    ``impls`` (every implementation's timing), ``notes``, ``error`` when preparing failed.
    """
    ctx = ctx or Context()
    row = {"workload": workload.name, "group": workload.group, "mode": mode, "vs": {},
           "skipped": {}, "impls": {}, "notes": [], "check": "not run"}
    try:
        prep: Prepared = workload.prepare(ctx, mode)
    except Exception as exc:  # one broken workload must not lose the others' numbers
        row.update(error=f"{type(exc).__name__}: {exc}", check="FAIL: could not prepare")
        return row
    row.update(source=prep.source, size=prep.size, skipped=dict(prep.skipped),
               notes=list(prep.notes))
    ours = [i for i in prep.impls if i.name == OURS]
    if not ours:
        row.update(check="skipped", error=prep.skipped.get(OURS, "no sparsetorch implementation"))
        return row
    ours = ours[0]

    from .. import runtime
    builds0 = runtime.stats()["build_seconds"]
    t0 = time.perf_counter()
    try:
        reference = _detached(ours.check())
    except Exception as exc:
        row.update(error=f"sparsetorch: {type(exc).__name__}: {exc}", check="FAIL: sparsetorch raised")
        return row
    row["first_s"] = time.perf_counter() - t0
    row["compile_s"] = runtime.stats()["build_seconds"] - builds0

    timed = {OURS: ours.run}
    config = {OURS: ours.config}
    family = {OURS: OURS}
    failures = []
    for impl in prep.impls:
        if impl is ours:
            continue
        try:
            problem = mismatch(reference, _detached(impl.check()), prep.rtol, prep.atol)
        except Exception as exc:
            said = row["skipped"].get(impl.family)   # keep a note already there (GAT's CSR)
            raised = f"{impl.name} raised {type(exc).__name__}: {exc}"
            row["skipped"][impl.family] = f"{said}; {raised}" if said else raised
            continue
        if problem:
            failures.append(f"{impl.name}: {problem}")
            continue
        timed[impl.name], config[impl.name], family[impl.name] = impl.run, impl.config, impl.family
    row["check"] = "ok" if not failures else "FAIL: " + "; ".join(failures)

    # min_time: calls under 5 ms are repeated within a sample, so timer resolution and
    # one descheduling do not decide a millisecond-long forward's number.
    res = compare(timed, baseline=OURS, rounds=rounds, warmup=1, min_time=MIN_SAMPLE_S,
                  max_time=max_time, threads=threads)
    row["threads"] = res["threads"]
    row["rounds"] = res["rounds"]
    for name, r in res["impls"].items():
        row["impls"][name] = {"family": family[name], "config": config[name],
                              "median_s": r["median_s"], "q1_s": r["q1_s"], "q3_s": r["q3_s"],
                              "error": r.get("error")}
    row["ours_s"] = res["impls"][OURS]["median_s"]
    for fam in dict.fromkeys(family.values()):
        if fam == OURS:
            continue
        members = [n for n in timed if family[n] == fam and res["impls"][n]["median_s"]]
        if not members:
            errs = [res["impls"][n].get("error") for n in timed if family[n] == fam]
            row["skipped"].setdefault(fam, f"raised while timed: {errs[0]}")
            continue
        best = min(members, key=lambda n: res["impls"][n]["median_s"])
        row["vs"][fam] = {"ratio": speedup(res, OURS, over=best), "impl": best,
                          "config": config[best], "median_s": res["impls"][best]["median_s"]}
    return row


def mismatch(reference: dict, other: dict, rtol: float, atol: float) -> str | None:
    """``None`` when every tensor of ``other`` is allclose to ``reference``'s under the
    same key (``atol`` scaled by the largest reference magnitude), else what differs.

    Example:
        >>> import torch
        >>> mismatch({"out": torch.ones(2)}, {"out": torch.ones(2)}, 1e-4, 1e-5) is None
        True
        >>> mismatch({"out": torch.ones(2)}, {"out": torch.zeros(2)}, 1e-4, 1e-5)
        "'out' differs: max abs error 1 (tolerance 1e-05 + 0.0001 * |ref|)"
    """
    if set(reference) != set(other):
        return f"outputs {sorted(other)} do not match sparsetorch's {sorted(reference)}"
    for key, ref in reference.items():
        got = other[key]
        if tuple(got.shape) != tuple(ref.shape):
            return f"{key!r} has shape {tuple(got.shape)}, sparsetorch {tuple(ref.shape)}"
        ref64, got64 = ref.double(), got.double()
        scale = ref64.abs().max().item() if ref64.numel() else 0.0
        tol = atol * max(scale, 1.0)
        if not torch.allclose(got64, ref64, rtol=rtol, atol=tol):
            err = (got64 - ref64).abs().max().item()
            return (f"{key!r} differs: max abs error {err:.3g} "
                    f"(tolerance {tol:.3g} + {rtol:g} * |ref|)")
    return None


def _detached(out: dict) -> dict:
    """Dense, detached, float copies of a check's tensors (SparseTensors densified)."""
    res = {}
    for k, v in out.items():
        if hasattr(v, "to_dense") and not isinstance(v, torch.Tensor):
            v = v.to_dense()
        elif isinstance(v, torch.Tensor) and v.layout != torch.strided:
            v = v.to_dense()
        res[k] = torch.as_tensor(v).detach().clone()
    return res
