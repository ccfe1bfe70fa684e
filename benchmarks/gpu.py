#!/usr/bin/env python
"""sparsetorch's Triton kernels on a CUDA GPU against torch.sparse (cuSPARSE), dense cuBLAS
and torch's own Triton BSR kernels (issue 35, "GPU benchmark").

    python benchmarks/gpu.py                      # full run on the first CUDA device
    python benchmarks/gpu.py --quick              # 3 matrices per set, < 2 minutes
    python benchmarks/gpu.py --dtype float16 --columns 256 --out /tmp/gpu.json
    python benchmarks/gpu.py --dry-run            # no GPU needed: load the data, build every
                                                  # case on the CPU, list them, time nothing
    SPARSETORCH_BACKEND=triton TRITON_INTERPRET=1 python benchmarks/gpu.py --device cpu \
        --sets rn50 --per-dir 1 --columns 8 --seq 64 --rounds 1 --min-time 0
                                                  # the whole timed path on the CPU, through
                                                  # Triton's interpreter (checks, not speed)

Cases
  spmm       W @ X, W a DLMC magnitude-pruned weight (transformer 0.7/0.9/0.98 and ResNet-50
             0.8/0.9/0.98, as shipped; M x K, normal values), X dense K x N, N in --columns
             (256, 2048). vs ``torch.sparse`` CSR ``W @ X`` (cuSPARSE SpMM), dense ``W @ X``
             (cuBLAS) and ``torch.sparse._triton_ops.bsr_dense_mm`` on W as 16 x 16 BSR.
  sddmm      ``st.einsum("ij,ik,jk->ij", mask, X, Y)`` with the same patterns as masks, inner
             dimension in --columns. vs ``torch.sparse.sampled_addmm(mask, X, Y.T, beta=0)``
             (cuSPARSE SDDMM) and dense ``(X @ Y.T) * mask`` (cuBLAS).
  attention  the sparse transformer layer ``st.ops.masked_attention(A, Q, K, V)``: A a local
             window plus strided mask (Child et al., 2019) of --seq rows, head dimension 64.
             vs dense ``scaled_dot_product_attention`` with the boolean mask (the product
             over all n^2 pairs) and torch.sparse unfused (``sampled_addmm``, COO
             ``torch.sparse.softmax``, ``mm``).

Every implementation's result is checked once against a float32 reference before timing
(float16: tolerance 2e-2 relative to the summed magnitudes); a wrong sparsetorch result is a
failure (exit status 1), a wrong or raising baseline is dropped with a note. Timing is
``sparsetorch.bench.compare`` (interleaved rounds, medians, per-round ratios) with a timer
that calls ``torch.cuda.synchronize()``, so a sample is the kernel's whole run; fast calls
are batched to --min-time per sample. ``x_vs_ours`` is their time over ours (> 1: we are
faster). ``pct_peak`` = useful FLOP/s (2 nnz N) over the device peak: --peak-fp32 for
float32 (default 67 TFLOP/s: H200 without tensor cores) and --peak-fp16 for float16 and
bfloat16 (990 TFLOP/s, dense tensor cores). JSON in benchmarks/results/gpu.json.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

import sparsetorch as st
from sparsetorch.bench import Report, compare, geomean, speedup

SETS = {"transformer": ("0.7", "0.9", "0.98"), "rn50": ("0.8", "0.9", "0.98")}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 matrices per (set, sparsity)")
    p.add_argument("--sets", default="transformer,rn50", help="DLMC models: transformer,rn50")
    p.add_argument("--columns", default="256,2048", help="dense columns N (and SDDMM's inner)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--kernels", default="spmm,sddmm,attention")
    p.add_argument("--seq", type=int, default=4096, help="attention sequence length")
    p.add_argument("--per-dir", type=int, default=0,
                   help="matrices per (set, sparsity); 0 = all (--quick: 3)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--min-time", type=float, default=2e-3)
    p.add_argument("--peak-fp32", type=float, default=67e12)
    p.add_argument("--peak-fp16", type=float, default=990e12)
    p.add_argument("--data", default=None, help="data root (default: st.datasets.data_root)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu.json"))
    p.add_argument("--device", default="cuda",
                   help="cuda (default); cpu only to check this script through Triton's "
                        "interpreter (SPARSETORCH_BACKEND=triton TRITON_INTERPRET=1)")
    p.add_argument("--dry-run", action="store_true",
                   help="load and build every case on the CPU, list them, time nothing")
    args = p.parse_args(argv)
    args.columns = [int(c) for c in args.columns.split(",")]
    args.sets = [s for s in args.sets.split(",") if s]
    args.kernels = set(args.kernels.split(","))
    unknown = [s for s in args.sets if s not in SETS]
    if unknown:
        p.error(f"--sets: unknown {unknown}; choose from {sorted(SETS)}")
    if args.per_dir == 0 and args.quick:
        args.per_dir = 3
    return args


def dlmc_weights(args, dtype):
    """(set, sparsity, name, W) for every selected DLMC matrix, on the CPU."""
    for model in args.sets:
        for sparsity in SETS[model]:
            paths = st.datasets.dlmc(model, sparsity=sparsity, root=args.data)
            if args.per_dir:   # spread over the folder: different layers, not the first few
                step = max(1, len(paths) // args.per_dir)
                paths = paths[::step][: args.per_dir]
            for n, path in enumerate(paths):
                W = st.io.read_smtx(path, values="normal", seed=n, dtype=dtype)
                yield model, sparsity, path.name.split(".smtx")[0], W


def attention_mask(n: int, window: int = 128, stride: int = 128) -> torch.Tensor:
    """Boolean n x n: each row sees the ``window`` positions up to itself and every
    ``stride``-th earlier position (the strided sparse transformer pattern)."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    return (j <= i) & ((i - j < window) | ((j % stride) == stride - 1))


def _close(got, ref, scale, dtype) -> bool:
    tol = 2e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-3
    got = got.to_dense() if hasattr(got, "to_dense") else got
    return bool(((got.float() - ref).abs() <= tol * scale + 1e-5 * scale.max()).all())


def _cuda_timer():
    torch.cuda.synchronize()
    return time.perf_counter()


class Runner:
    """Checks and times one case's implementations, adds them to the report."""

    def __init__(self, args, report: Report, device, peak: float):
        self.args, self.report, self.device, self.peak = args, report, device, peak
        self.failures: list[str] = []

    def run(self, kernel, case, impls: dict, ref, scale, flops, **fields):
        dtype = DTYPES[self.args.dtype]
        checked = {}
        for name, fn in impls.items():
            try:
                ok = _close(fn(), ref, scale, dtype)
            except Exception as err:   # a baseline lacking the op is reported, not fatal
                ok, why = False, f"{type(err).__name__}: {err}"
            else:
                why = "disagrees with the float32 reference"
            if ok:
                checked[name] = fn
            elif name == "sparsetorch":
                self.failures.append(f"{kernel} {case}: {why}")
                return
            else:
                self.report.note(f"{kernel} {case}: {name} dropped ({why})")
        res = compare(checked, baseline="sparsetorch", rounds=self.args.rounds, warmup=2,
                      min_time=self.args.min_time,
                      timer=_cuda_timer if self.device.type == "cuda" else time.perf_counter)
        rows = self.report.add(case, res, kernel=kernel, **fields)
        for row in rows:
            if row.get("median_s"):
                row["tflops"] = flops / row["median_s"] / 1e12
                row["pct_peak"] = 100 * flops / row["median_s"] / self.peak
            if row["impl"] != "sparsetorch":   # their time over ours: > 1, we are faster
                row["x_vs_ours"] = speedup(res, "sparsetorch", over=row["impl"])


def spmm_cases(args, device, dtype):
    """(case, fields, impls, ref, scale, flops) per DLMC weight and N."""
    from torch.sparse._triton_ops import bsr_dense_mm

    for model, sparsity, name, W in dlmc_weights(args, dtype):
        dense_w = W.to_dense()
        for N in args.columns:
            g = torch.Generator().manual_seed(N)
            X = torch.randn(W.shape[1], N, generator=g).to(dtype)
            if device is None:
                yield f"{model}/{sparsity}/{name}/N={N}", W, None
                continue
            ref = dense_w.double() @ X.double()
            scale = dense_w.double().abs() @ X.double().abs()
            Wc, Xc, Wd = W.to(device), X.to(device), dense_w.to(device)
            csr = Wd.to_sparse_csr()
            impls = {"sparsetorch": lambda Wc=Wc, Xc=Xc: Wc @ Xc,
                     "cusparse": lambda csr=csr, Xc=Xc: csr @ Xc,
                     "cublas": lambda Wd=Wd, Xc=Xc: Wd @ Xc}
            # (torch's Triton BSR kernel exists for CUDA only: in the CPU check the call
            # failed with "'NoneType' object is not callable")
            if all(s % 16 == 0 for s in W.shape) and str(device).startswith("cuda"):
                bsr = Wd.to_sparse_bsr(16)
                impls["torch_triton_bsr"] = lambda bsr=bsr, Xc=Xc: bsr_dense_mm(bsr, Xc)
            yield (f"{model}/{sparsity}/{name}/N={N}",
                   dict(model=model, sparsity=float(sparsity), N=N, nnz=W.nnz),
                   impls, ref.float().to(device), scale.float().to(device), 2 * W.nnz * N)


def sddmm_cases(args, device, dtype):
    for model, sparsity, name, W in dlmc_weights(args, dtype):
        mask = W.with_values(torch.ones(W.nnz, dtype=dtype))
        dense_mask = mask.to_dense()
        for d in args.columns:
            g = torch.Generator().manual_seed(d)
            X = torch.randn(W.shape[0], d, generator=g).to(dtype)
            Y = torch.randn(W.shape[1], d, generator=g).to(dtype)
            if device is None:
                yield f"{model}/{sparsity}/{name}/d={d}", mask, None
                continue
            ref = dense_mask.double() * (X.double() @ Y.double().T)
            scale = dense_mask.double() * (X.double().abs() @ Y.double().abs().T)
            Mc, Xc, Yc, Md = mask.to(device), X.to(device), Y.to(device), dense_mask.to(device)
            csr = Md.to_sparse_csr()
            impls = {"sparsetorch": lambda: st.einsum("ij,ik,jk->ij", Mc, Xc, Yc),
                     "cusparse": lambda: torch.sparse.sampled_addmm(csr, Xc, Yc.T, beta=0.0),
                     "cublas": lambda: (Xc @ Yc.T) * Md}
            yield (f"{model}/{sparsity}/{name}/d={d}",
                   dict(model=model, sparsity=float(sparsity), N=d, nnz=W.nnz), impls,
                   ref.float().to(device), scale.float().to(device), 2 * W.nnz * d)


def attention_cases(args, device, dtype):
    n, d = args.seq, 64
    mask = attention_mask(n)
    A = st.tensor(mask.to(dtype), format="csr")
    g = torch.Generator().manual_seed(n)
    Q, K, V = (torch.randn(n, d, generator=g).to(dtype) / math.sqrt(math.sqrt(d))
               for _ in range(3))
    if device is None:
        yield f"attention/n={n}", A, None
        return
    scores = (Q.double() @ K.double().T).masked_fill(~mask, float("-inf"))
    ref = torch.softmax(scores, 1) @ V.double()
    scale = torch.softmax(scores, 1) @ V.double().abs()
    Ac, Qc, Kc, Vc, Mc = (t.to(device) for t in (A, Q, K, V, mask))
    csr = Ac.to_torch()

    def torch_sparse():
        s = torch.sparse.sampled_addmm(csr, Qc, Kc.T, beta=0.0)
        return torch.sparse.softmax(s.to_sparse_coo(), 1).to_sparse_csr() @ Vc

    impls = {"sparsetorch": lambda: st.ops.masked_attention(Ac, Qc, Kc, Vc),
             "dense_sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                 Qc[None], Kc[None], Vc[None], attn_mask=Mc[None], scale=1.0)[0],
             "torch_sparse": torch_sparse}
    yield (f"attention/n={n}", dict(model="attention", N=d, nnz=A.nnz), impls,
           ref.float().to(device), scale.float().to(device), 4 * A.nnz * d)


KERNELS = {"spmm": spmm_cases, "sddmm": sddmm_cases, "attention": attention_cases}


def dry_run(args) -> int:
    dtype = DTYPES[args.dtype]
    count = 0
    for kernel in ("spmm", "sddmm", "attention"):
        if kernel not in args.kernels:
            continue
        for case, operand, _ in KERNELS[kernel](args, None, dtype):
            count += 1
            print(f"{kernel:9s} {case}  {tuple(operand.shape)} nnz={operand.nnz}")
    print(f"dry run: {count} cases built on the CPU; nothing timed (run without --dry-run "
          "on a CUDA machine)")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False); "
              "--dry-run checks the data and cases without one", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("benchmarks/gpu.py needs Triton: pip install 'sparsetorch[gpu]'", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    peak = args.peak_fp32 if dtype == torch.float32 else args.peak_fp16
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    report = Report("gpu", meta=dict(device=name,
                                     dtype=args.dtype, peak_flops=peak,
                                     tf32=torch.backends.cuda.matmul.allow_tf32))
    runner = Runner(args, report, device, peak)
    for kernel in ("spmm", "sddmm", "attention"):
        if kernel not in args.kernels:
            continue
        for case, fields, impls, ref, scale, flops in KERNELS[kernel](args, device, dtype):
            runner.run(kernel, case, impls, ref, scale, flops, **fields)
    report.print(["kernel", "case", "impl", "median_s", "tflops", "pct_peak", "x_vs_ours"])
    for kernel in ("spmm", "sddmm", "attention"):
        rows = [r for r in report.rows if r.get("kernel") == kernel and r["impl"] != "sparsetorch"]
        for impl in sorted({r["impl"] for r in rows}):
            g = geomean(r.get("x_vs_ours") for r in rows if r["impl"] == impl)
            if g is not None:
                print(f"{kernel}: geomean {impl} time / sparsetorch time = {g:.2f}")
    for failure in runner.failures:
        print("FAILED", failure)
    path = report.write_json(args.out)
    print(f"wrote {path}")
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
