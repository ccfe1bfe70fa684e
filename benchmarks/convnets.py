#!/usr/bin/env python
"""Sparse MobileNets (issue 33) against the dense engines a user would pick instead.

    python benchmarks/convnets.py                # full run (several minutes on 2 cores)
    python benchmarks/convnets.py --quick        # v1 and v2 at 90%, batch 1 and 8, no compile
    python benchmarks/convnets.py --profile      # per-layer time breakdown of the sparse models
    python benchmarks/convnets.py --layers       # every 1x1 layer of v1 at 90% vs its conv2d
    python benchmarks/convnets.py --sweep        # 50-98% sparsity, break-even points, PNG
    python benchmarks/convnets.py --kernels      # 1x1 layers with/without the AVX2 strip kernel
    python benchmarks/convnets.py --quick --threads 1 --clock cpu   # on a busy machine

Sections
  models   ``st.freeze(st.sparsify(mobilenet_vX(), sparsity))`` (BN folded, ReLU/ReLU6
           fused, 1x1 convolutions and the classifier sparse, activations kept in (C, N, H,
           W) memory, run as one flat function; ``sparse_modules``: the same model called as
           its module tree, without ``st.freeze``) against (a) PyTorch dense with the
           same fusions (``st.nn.fold_batchnorms``): eager NCHW, channels_last and
           ``torch.compile`` (inductor; not in ``--quick``), the fastest of them per round
           named ``torch_best``; (b) ONNX Runtime 2-thread CPU session on the dense model
           exported by ``torch.onnx.export``. Batch 1 and 8, 224x224, float32, ``--threads``
           (2). At batch 8 the sparse model also runs image by image (``sparse_per_image``):
           folding the batch into the pixels vs a loop.
  sweep    sparse model at 50-98% sparsity, batch 1, against ``torch_best`` and ORT; the
           break-even sparsity (where the speedup crosses 1, interpolated linearly), a table
           and ``benchmarks/results/convnets_sweep.png``.
  layers   each 1x1 layer of MobileNet v1 at 90% (``SparseConv2d``, bias and ReLU fused) vs
           dense ``conv2d`` + bias + ReLU on the same input.
  kernels  each 1x1 layer of v1 and v2 at 90%, batch 1, through ``st.ops.spmm_narrow``
           with its AVX2 strip kernel forced on and off (AVX2-only CPUs), and which one
           the kernel's rule picks; then both frozen models (batch 1 and 8) frozen under
           the rule and with strips off.
  profile  the frozen sparse model's steps (each layer's call, or a fused expansion +
           depthwise pair) timed one by one around their calls (batch 1, the fastest of 10
           runs each), summed per kind: first conv, depthwise, sparse 1x1, classifier,
           expansion+depthwise; "between steps" is the rest of the forward.

Every ratio is a median of per-round ratios from ``sparsetorch.bench.compare`` (interleaved
rounds): > 1 means the sparse model is faster. Outputs are checked against the dense model
with the same masks before timing. Needs ``pip install onnx onnxruntime`` (the ``bench``
extra); without them the ORT column is left out and a note says so.
"""
from __future__ import annotations

import argparse
import copy
import io
import statistics
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

import sparsetorch as st
from sparsetorch.bench import Report, compare, pinned_threads, speedup

HERE = Path(__file__).resolve().parent
MODELS = {"mobilenet_v1": st.models.mobilenet_v1, "mobilenet_v2": st.models.mobilenet_v2}
SWEEP = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
TORCH_CASES = ("torch_eager", "torch_channels_last", "torch_compile")
# --clock cpu times by the process's CPU time: with one thread, the compute each case did,
# whatever else the machine runs (wall time on a machine loaded 10x over measures the
# scheduler); with more threads it sums them, so use it with --threads 1.
CLOCK = {"timer": time.perf_counter}


# -- the implementations ----------------------------------------------------------------------
def _dense_cases(model: torch.nn.Module, x: torch.Tensor, with_compile: bool) -> dict:
    folded = st.nn.fold_batchnorms(model).eval()
    cl = copy.deepcopy(folded).to(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    cases = {"torch_eager": lambda: folded(x), "torch_channels_last": lambda: cl(x_cl)}
    if with_compile:
        compiled = torch.compile(folded)
        compiled(x)   # compile outside the timing
        cases["torch_compile"] = lambda: compiled(x)
    return cases


def _ort_case(model: torch.nn.Module, x: torch.Tensor, threads: int):
    """ONNX Runtime on the dense model (its own graph optimisations fold BN), or None."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (x,), buf, input_names=["x"], output_names=["y"],
                          dynamo=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    # ORT's intra-op threads spin after a run by default and keep a core busy for tens of
    # ms, which the next case timed in the same round pays: on this 2-core machine the
    # sparse v1 took 23.4 ms (median) right after an ORT run against 9.9 ms alone, and ORT
    # itself ran no faster spinning (alone, 2 threads: v1 18.6 vs 17.9 ms, v2 11.4 vs
    # 11.8 ms). Off, each engine runs as it would alone.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(buf.getvalue(), opts, providers=["CPUExecutionProvider"])
    feed = {"x": x.numpy()}
    return lambda: sess.run(None, feed)


def _check(sparse, dense, x) -> None:
    """The sparse model equals the dense model with the same masks (float32 tolerance)."""
    masked = copy.deepcopy(dense)
    for name, m in sparse.named_modules():
        if hasattr(m, "mask") and callable(m.mask):
            w = masked.get_submodule(name).weight
            w.data *= m.mask().view(w.shape[0], w.shape[1], *([1] * (w.dim() - 2)))
    torch.testing.assert_close(sparse(x), masked(x), rtol=1e-3, atol=1e-3)


@torch.no_grad()   # inference: no case records autograd (the parameters require grad)
def _models_case(report, name, dense, sparsity, batch, threads, rounds, with_compile,
                 extra_cases=None):
    x = torch.randn(batch, 3, 224, 224)
    modules = st.sparsify(dense, sparsity=sparsity)
    sparse = st.freeze(modules)
    _check(modules, dense, x)
    torch.testing.assert_close(sparse(x), modules(x), rtol=1e-5, atol=1e-5)
    cases = {"sparse": lambda: sparse(x), "sparse_modules": lambda: modules(x),
             **_dense_cases(dense, x, with_compile)}
    if extra_cases:
        cases.update(extra_cases(sparse, x))
    ort_fn = _ort_case(dense, x, threads)
    if ort_fn is not None:
        cases["ort"] = ort_fn
    res = compare(cases, baseline="sparse", rounds=rounds, warmup=2, threads=threads,
                  timer=CLOCK["timer"])
    best = _best_torch(res)
    rows = report.add(f"{name} b{batch} s{sparsity}", res, model=name, batch=batch,
                      sparsity=sparsity)
    x_best = speedup(res, "sparse", over="torch_best") if best else None
    x_ort = speedup(res, "sparse", over="ort") if ort_fn is not None else None
    # Ratios of the fastest rounds too: on a busy machine (preempted threads) the least
    # disturbed round of each is closer to what an idle machine gives than the median.
    mins = {k: v.get("min_s") for k, v in res["impls"].items()}
    x_best_min = mins["torch_best"] / mins["sparse"] if best else None
    x_ort_min = mins["ort"] / mins["sparse"] if ort_fn is not None else None
    for r in rows:
        r.update(x_torch_best=x_best, x_ort=x_ort)
    return {"model": name, "batch": batch, "sparsity": sparsity, "x_torch_best": x_best,
            "x_ort": x_ort, "x_torch_best_min": x_best_min, "x_ort_min": x_ort_min,
            "torch_winner": best}


def _best_torch(res: dict) -> str | None:
    """Add ``torch_best`` (per round, the fastest PyTorch configuration) to ``res``; return
    the configuration that was fastest by median."""
    impls = res["impls"]
    names = [n for n in TORCH_CASES if n in impls and impls[n]["times_s"]]
    if not names:
        return None
    per_round = [min(ts) for ts in zip(*(impls[n]["times_s"] for n in names))]
    q1, med, q3 = statistics.quantiles(per_round, n=4, method="inclusive")
    base = impls[res["baseline"]]["times_s"]
    impls["torch_best"] = {"times_s": per_round, "median_s": med, "min_s": min(per_round),
                           "q1_s": q1, "q3_s": q3, "number": 1, "error": None,
                           "speedup": statistics.median(b / t for b, t in zip(base, per_round))}
    return min(names, key=lambda n: impls[n]["median_s"])


# -- sections ---------------------------------------------------------------------------------
def models_section(report, quick, threads, rounds, batches=(1, 8)) -> list[dict]:
    out = []
    per_image = lambda sparse, x: {"sparse_per_image": lambda: torch.cat(
        [sparse(x[i:i + 1]) for i in range(x.shape[0])])}
    for name, build in MODELS.items():
        dense = build().eval()
        for batch in batches:
            out.append(_models_case(report, name, dense, 0.9, batch, threads, rounds,
                                    with_compile=not quick,
                                    extra_cases=per_image if batch > 1 else None))
    return out


def sweep_section(report, threads, rounds, sparsities=SWEEP) -> list[dict]:
    out = []
    for name, build in MODELS.items():
        dense = build().eval()
        for s in sparsities:
            out.append(_models_case(report, name, dense, s, 1, threads, rounds,
                                    with_compile=False))
    return out


def break_even(points: list[tuple[float, float]]) -> float | None:
    """Lowest sparsity where ``speedup`` reaches 1, linearly interpolated between measured
    ``(sparsity, speedup)`` points; None if it never does.

    Example:
        >>> break_even([(0.5, 0.6), (0.7, 0.9), (0.8, 1.1)])
        0.75
    """
    points = sorted(p for p in points if p[1] is not None)
    for (s0, r0), (s1, r1) in zip([(None, None)] + points, points):
        if r1 >= 1:
            if s0 is None or r0 >= 1:
                return s1
            return round(s0 + (1 - r0) * (s1 - s0) / (r1 - r0), 4)
    return None


@torch.no_grad()
def layers_section(report, threads, rounds) -> list[dict]:
    """Each SparseConv2d of v1 at 90% vs dense conv2d (+ bias, ReLU) at its input shape."""
    dense = st.models.mobilenet_v1().eval()
    sparse = st.sparsify(dense, sparsity=0.9)
    folded = st.nn.fold_batchnorms(dense)
    inputs = _layer_inputs(sparse, torch.randn(1, 3, 224, 224))
    out = []
    for name, x in inputs.items():
        layer, conv = sparse.get_submodule(name), folded.get_submodule(name)
        w = conv.weight.detach() * layer.mask()[:, :, None, None]
        b = conv.bias.detach()
        res = compare({"sparse": lambda: layer(x),
                       "conv2d": lambda: torch.relu(torch.nn.functional.conv2d(x, w, b))},
                      baseline="conv2d", rounds=rounds, warmup=2, min_time=2e-3,
                      threads=threads, timer=CLOCK["timer"])
        shape = f"{layer.in_channels}->{layer.out_channels} {x.shape[2]}x{x.shape[3]}"
        report.add(f"v1 {name} {shape}", res, layer=name)
        out.append({"layer": name, "shape": shape,
                    "x_conv2d": res["impls"]["sparse"]["speedup"]})
    return out


@torch.no_grad()
def kernels_section(report, threads, rounds) -> list[dict]:
    """Each 1x1 layer of v1 and v2 at 90%, batch 1, through ``spmm_narrow`` as frozen
    models call it, with its AVX2 strip kernel and without (the chunk kernel, or einsum
    where that runs): the measurement behind ``ops.narrow._STRIP_FROM``; ``picked`` says
    which one the rule takes. (v2's expansions run fused with their depthwise layers in a
    frozen model; they are here as more shapes.) Then each frozen model, batch 1 and 8,
    frozen under the rule and with strips off. Empty but for a note on other CPUs."""
    from sparsetorch.compiler.kernel import vector_isa
    from sparsetorch.nn.conv import _band
    from sparsetorch.ops import narrow

    if vector_isa() != "avx2":
        report.note("kernels: the strip kernel runs on AVX2-only CPUs; not measured here")
        return []
    out = []
    for model, build in MODELS.items():
        sparse = st.sparsify(build().eval(), sparsity=0.9)
        for name, x in _layer_inputs(sparse, torch.randn(1, 3, 224, 224)).items():
            layer = sparse.get_submodule(name)
            xs, _, cols = layer._columns(x)
            band = _band(1, xs.shape[2], xs.shape[3])
            runs = {}
            for case, on in (("strips", True), ("without", False)):
                with _strips(narrow, on):   # (einsum where no kernel is left)
                    runs[case] = narrow.prepared_spmm_narrow(
                        layer.weight, cols, layer.bias, layer.activation, band) or \
                        (lambda c, layer=layer: st.einsum(
                            "oc,cp->op", layer.weight, c,
                            bias=None if layer.bias is None else layer.bias[:, None],
                            activation=layer.activation))
            picked = narrow._kernel_for(layer.weight, cols, layer.bias, band)
            res = compare({k: (lambda run=run: run(cols)) for k, run in runs.items()},
                          baseline="without", rounds=rounds, warmup=2, min_time=2e-3,
                          threads=threads, timer=CLOCK["timer"])
            shape = f"{layer.in_channels}->{layer.out_channels} {xs.shape[2]}x{xs.shape[3]}"
            report.add(f"{model} {name} {shape}", res, layer=name)
            out.append({"model": model, "layer": name, "shape": shape,
                        "x_strips": res["impls"]["strips"]["speedup"],
                        "picked": "strips" if picked and picked[1] is None else "without"})
        for batch in (1, 8):
            x = torch.randn(batch, 3, 224, 224)
            frozen = {}
            for case, rule in (("rule", None), ("without", False)):
                with _strips(narrow, rule):
                    frozen[case] = st.freeze(sparse)
            res = compare({k: (lambda f=f: f(x)) for k, f in frozen.items()},
                          baseline="without", rounds=rounds, warmup=2, min_time=2e-3,
                          threads=threads, timer=CLOCK["timer"])
            report.add(f"{model} b{batch} frozen", res)
            out.append({"model": model, "layer": f"frozen, batch {batch}",
                        "x_strips": res["impls"]["rule"]["speedup"]})
    return out


@contextmanager
def _strips(narrow, on: bool | None):
    """``spmm_narrow``'s strip kernel forced on (True) or off (False) while the block
    prepares kernels (its rule, None)."""
    saved = dict(narrow._STRIP_FROM)
    if on is not None:
        narrow._STRIP_FROM.update(dict.fromkeys(saved, 0 if on else float("inf")))
    try:
        yield
    finally:
        narrow._STRIP_FROM.update(saved)


def _layer_inputs(model, x) -> dict:
    """``{name: input}`` of each SparseConv2d in ``model`` on ``x``."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, st.nn.SparseConv2d):
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args, name=name: seen.setdefault(name, args[0].clone())))
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def profile_section(threads, reps: int = 10) -> list[dict]:
    """Per-step time of each frozen sparse model at 90%, batch 1 (``st.freeze``: a step is
    one layer's call, or a fused expansion + depthwise pair, named after its modules): the
    fastest of ``reps`` runs of each step, timed around its call in the frozen forward, and
    of the whole forward; "between steps" is the rest (the forward's own lines, the pooling,
    the timers)."""
    rows = []
    for name, build in MODELS.items():
        sparse = st.sparsify(build().eval(), sparsity=0.9)
        frozen = st.freeze(sparse)
        x = torch.randn(1, 3, 224, 224)
        times: dict[str, list[float]] = {}
        steps = frozen._graph_module.forward.__globals__   # (the step functions it calls)
        timer = CLOCK["timer"]
        for key in [k for k in steps if k.startswith("step_")]:
            def timed(*args, _step=steps[key], _key=key, **kwargs):
                t0 = timer()
                out = _step(*args, **kwargs)
                times.setdefault(_key, []).append(timer() - t0)
                return out
            steps[key] = timed
        with pinned_threads(threads):
            for _ in range(2):
                frozen(x)
            times.clear()
            totals = []
            for _ in range(reps):
                t0 = timer()
                frozen(x)
                totals.append(timer() - t0)
        total = min(totals)
        modules = dict(sparse.named_modules())
        kinds: dict[str, float] = {}
        for key, ts in times.items():
            best = min(ts)   # the least disturbed run: robust to preemption on a busy machine
            kind = _kind(key, modules)
            kinds[kind] = kinds.get(kind, 0.0) + best
            rows.append({"model": name, "step": key, "kind": kind, "ms": best * 1e3})
        print(f"== profile {name} 90% batch 1, frozen: {total * 1e3:.2f} ms per forward ==")
        for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<22} {t * 1e3:8.3f} ms  {100 * t / total:5.1f}%")
        print(f"  {'(between steps)':<22} {(total - sum(kinds.values())) * 1e3:8.3f} ms")
        for r in sorted((r for r in rows if r["model"] == name), key=lambda r: -r["ms"])[:8]:
            print(f"    {r['step']:<44} {r['kind']:<20} {r['ms']:7.3f} ms")
    return rows


def _kind(step: str, modules: dict) -> str:
    """What a frozen step computes, from its name (the module path, dots as underscores;
    a fused pair's two paths joined)."""
    paths = {n.replace(".", "_"): m for n, m in modules.items() if n}
    module = paths.get(step[len("step_"):])
    if module is None:   # (a fused pair's name)
        return "expansion+depthwise"
    if isinstance(module, st.nn.SparseConv2d):
        return "sparse 1x1"
    if isinstance(module, st.nn.ChannelsFirstDepthwise):
        return "depthwise"
    if isinstance(module, (st.nn.ChannelsFirstStem, torch.nn.Conv2d)):
        return "first conv (dense)"
    if isinstance(module, st.nn.SparseLinear):
        return "classifier"
    return type(module).__name__


# -- harness entry point and CLI --------------------------------------------------------------
def run(quick: bool = True, threads: int = 2) -> list[dict]:
    """Rows of the models section (``sparsetorch bench`` calls this): MobileNet v1 and v2 at
    90%, sparse vs PyTorch's best dense and ONNX Runtime; ``quick``: batch 1, 3 rounds, no
    ``torch.compile``; else batch 1 and 8, 10 rounds."""
    report = Report("convnets", quiet=True)
    models_section(report, quick, threads, rounds=3 if quick else 10,
                   batches=(1,) if quick else (1, 8))
    return report.rows


def _plot(sweep: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for model in MODELS:
        pts = [r for r in sweep if r["model"] == model]
        for key, style in (("x_torch_best", "-o"), ("x_ort", "--s")):
            xs = [100 * r["sparsity"] for r in pts if r[key] is not None]
            ys = [r[key] for r in pts if r[key] is not None]
            if xs:
                ax.plot(xs, ys, style, label=f"{model} vs {key[2:]}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("sparsity of 1x1 convolutions and classifier (%)")
    ax.set_ylabel("speedup over dense (batch 1)")
    ax.set_title("Sparse MobileNets, 224x224, float32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="models section only, no torch.compile")
    p.add_argument("--profile", action="store_true", help="only the per-layer breakdown")
    p.add_argument("--layers", action="store_true", help="only the v1 per-layer comparison")
    p.add_argument("--sweep", action="store_true", help="only the sparsity sweep (and its PNG)")
    p.add_argument("--kernels", action="store_true",
                   help="only the 1x1 layers with spmm_narrow's AVX2 strip kernel and without")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--batches", default="1,8", help="batch sizes of the models section (1,8)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time (default) or process CPU time (busy machine, --threads 1)")
    p.add_argument("--out", default=str(HERE / "results" / "convnets.json"))
    a = p.parse_args(argv)
    report = Report("convnets", meta={"clock": a.clock, "threads": a.threads})
    if a.clock == "cpu":
        CLOCK["timer"] = time.process_time
        report.note("times are process CPU time, not wall time" +
                    ("" if a.threads == 1 else f" (summed over {a.threads} threads)"))
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        report.note("onnxruntime is not installed (pip install onnx onnxruntime): no ORT column")
    if a.profile:
        profile_section(a.threads)
        return 0
    rounds = a.rounds or (5 if a.quick else 10)
    summary = {}
    if a.kernels:
        summary["kernels"] = kernels_section(report, a.threads, rounds)
    elif not (a.layers or a.sweep):
        summary["models"] = models_section(report, a.quick, a.threads, rounds,
                                           tuple(int(b) for b in a.batches.split(",")))
    if a.layers or not (a.quick or a.sweep or a.kernels):
        summary["layers"] = layers_section(report, a.threads, rounds)
    if a.sweep or not (a.quick or a.layers or a.kernels):
        sweep = sweep_section(report, a.threads, rounds)
        summary["sweep"] = sweep
        summary["break_even"] = {
            (m, k): break_even([(r["sparsity"], r[k]) for r in sweep if r["model"] == m])
            for m in MODELS for k in ("x_torch_best", "x_ort")}
        png = _plot(sweep, Path(a.out).with_name("convnets_sweep.png"))
        if png:
            print(f"plot: {png}")
    report.print(["case", "impl", "median_s", "speedup", "x_torch_best", "x_ort", "spread"])
    for section, rows in summary.items():
        print(f"== {section} ==")
        if isinstance(rows, dict):
            for k, v in rows.items():
                print(f"  {k}: {v}")
            continue
        for r in rows:
            print("  " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in r.items()))
    report.meta["summary"] = {k: (v if not isinstance(v, dict) else
                                  {"/".join(kk): vv for kk, vv in v.items()})
                              for k, v in summary.items()}
    report.write_json(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
