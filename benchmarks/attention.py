#!/usr/bin/env python
"""One ``st.nn.SparseAttention`` layer (E=128, H=4, B=1) against torch's attention with the
same weights and mask, forward (no grad) and forward + backward (gradients of x and weights).

    python benchmarks/attention.py              # L = 1024 and 4096, ~2-3 minutes on 2 cores
    python benchmarks/attention.py --quick      # L = 1024 only, fewer rounds

Implementations (``sparsetorch.models.transformer.ReferenceAttention`` for the torch ones):
  sparsetorch     the layer: projections, then ``st.ops.masked_attention`` on a block-diagonal
                  mask folding batch x heads into one call (fused SDDMM -> softmax -> SpMM;
                  with gradients, the differentiable sparse chain)
  per_head        forward only: the same layer with one ``masked_attention`` call per head
                  (the alternative to folding)
  sdpa            ``F.scaled_dot_product_attention`` with a boolean L x L mask (torch's best
                  dense configuration here)
  matmul          dense scores, ``masked_fill(-inf)``, softmax, product
  torch_sparse    ``torch.sparse.sampled_addmm`` on a block-diagonal CSR mask -> COO
                  ``torch.sparse.softmax`` -> ``torch.sparse.mm``
Masks: Longformer (window L/64 each side, one global token) and BigBird (block L/128,
3 window + 2 global + 3 random blocks), about 3-7% dense. Every implementation is checked
against the sparse layer (forward output, and x's gradient) before timing.
The table's speedup column is the median per-round ``t_sparsetorch / t_impl`` (the
harness's baseline is sparsetorch, so 0.2x means that implementation took 5x as long); the
notes at the end turn it round: sparsetorch's speedup over each implementation.
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="L=1024 only, fewer rounds")
    p.add_argument("--lengths", default=None, help="comma-separated L (1024,4096)")
    p.add_argument("--threads", type=int, default=2, help="threads for every library (2)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (7; 4 quick)")
    p.add_argument("--out", default=str(HERE / "results" / "attention.json"), help="JSON path")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:  # thread counts must be set before torch starts its pools
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import torch  # noqa: E402

import sparsetorch as st  # noqa: E402
from sparsetorch.bench import Report, compare, speedup  # noqa: E402
from sparsetorch.bench.harness import quiet_sparse_warnings  # noqa: E402
from sparsetorch.models.transformer import ReferenceAttention  # noqa: E402
from sparsetorch.nn import SparseAttention, masks  # noqa: E402

E, H, B = 128, 4, 1


def _masks(L):
    return {"longformer": masks.longformer(L, L // 64, global_tokens=1),
            "bigbird": masks.bigbird(L, block=L // 128,
                                     generator=torch.Generator().manual_seed(0))}


def _per_head(layer, mask):
    """The layer's forward with one fused call per head instead of the folded call."""
    scaled = mask.with_values(torch.full_like(mask.values, 1 / math.sqrt(layer.head_dim)))

    def forward(x):
        q, k, v = torch.nn.functional.linear(x, layer.in_proj_weight,
                                             layer.in_proj_bias).chunk(3, -1)
        d = layer.head_dim
        heads = [st.ops.masked_attention(scaled, q[b, :, h * d:(h + 1) * d],
                                         k[b, :, h * d:(h + 1) * d], v[b, :, h * d:(h + 1) * d])
                 for b in range(x.shape[0]) for h in range(layer.num_heads)]
        return layer.out_proj(torch.cat(heads, 1).reshape(x.shape))
    return forward


def _forward_case(fn, x):
    def run():
        with torch.no_grad():
            return fn(x)
    return run


def _train_case(module, x, g):
    def run():
        x.grad = None
        module.zero_grad(set_to_none=True)
        module(x).backward(g)
        return x.grad
    return run


def _check(results, name, report):
    ref = results["sparsetorch"]
    for impl, r in results.items():
        if not torch.allclose(r, ref, rtol=1e-4, atol=1e-4):
            report.notes.append(f"{name}: {impl} differs from sparsetorch by "
                                f"{(r - ref).abs().max().item():.2e}")
            return False
    return True


def _summary(report, what, res):
    over = ", ".join(f"{speedup(res, 'sparsetorch', over=impl):.2f}x {impl}"
                     for impl in res["impls"] if impl != "sparsetorch")
    report.notes.append(f"{what}: sparsetorch {over}")


def main():
    lengths = [int(v) for v in ARGS.lengths.split(",")] if ARGS.lengths else \
        ([1024] if ARGS.quick else [1024, 4096])
    rounds = ARGS.rounds or (4 if ARGS.quick else 5)
    report = Report("SparseAttention layer (E=128, H=4, B=1) vs torch",
                    meta={"threads": ARGS.threads})
    torch.manual_seed(0)
    for L in lengths:
        for mask_name, mask in _masks(L).items():
            layer = SparseAttention(E, H, mask=mask)
            refs = {impl: ReferenceAttention(layer, impl)
                    for impl in ("sdpa", "matmul", "torch_sparse")}
            x = torch.randn(B, L, E)
            fwd = {"sparsetorch": layer, "per_head": _per_head(layer, mask), **refs}
            case = f"L={L} {mask_name} ({mask.nnz / L ** 2:.1%})"
            outs = {k: _forward_case(f, x)() for k, f in fwd.items()}
            # Calls of 50 ms and more need no priming call (waking threads costs microseconds).
            opts = dict(baseline="sparsetorch", rounds=rounds, threads=ARGS.threads,
                        prime=L < 2048)
            if _check(outs, case + " forward", report):
                res = compare({k: _forward_case(f, x) for k, f in fwd.items()}, **opts)
                report.add(case, res, pass_="forward", L=L, mask=mask_name, nnz=mask.nnz)
                _summary(report, case + " forward", res)
            xg, g = x.clone().requires_grad_(), torch.randn(B, L, E)
            train = {"sparsetorch": layer, **refs}
            grads = {k: _train_case(m, xg, g)().clone() for k, m in train.items()}
            if _check(grads, case + " forward+backward", report):
                res = compare({k: _train_case(m, xg, g) for k, m in train.items()}, **opts)
                report.add(case, res, pass_="forward+backward", L=L, mask=mask_name,
                           nnz=mask.nnz)
                _summary(report, case + " forward+backward", res)
    report.print()
    print(f"wrote {report.write_json(ARGS.out)}")


if __name__ == "__main__":
    quiet_sparse_warnings()
    main()
