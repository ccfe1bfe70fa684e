#!/usr/bin/env python
"""One training step (and inference) of ``st.nn`` layers and ``st.models`` against what
users run today, same weights, outputs compared before timing.

    python benchmarks/nn_layers.py                    # ~2 minutes on 2 cores
    python benchmarks/nn_layers.py --threads 1 --only gcn

Sections
  linear  ``st.nn.SparseLinear(1024, 1024, density=0.1)`` on a 256 x 1024 batch against
          ``nn.Linear`` (dense, MKL): forward + backward (gradients of the input, weights and
          bias), and forward alone under ``no_grad``.
  gcn     one training step (forward, cross-entropy on all nodes, backward, Adam step) of
          ``st.models.GCN`` (dropout 0, 64 hidden units) on PubMed (19717 nodes; 500 random
          dense features, since the data ship without them) against the same two-layer GCN in
          plain torch with the normalised adjacency as a ``torch.sparse`` CSR tensor and as a
          coalesced COO tensor (``torch.sparse.mm``; both orders x W first, as ours).
          Forward alone too. Again with 64 random features: at 500 the dense products
          x W (and their gradient), the same in every implementation, take ~80% of a step.
  narrow  the dense products ``x W^T`` with few outputs that the graph layers run without
          autograd where torch's BLAS is slow (MKL on AMD; ``sparsetorch.nn.graph._linear``):
          ``F.linear`` against the generated kernel in both of its forms, inner products
          (``st.einsum("ij,kj->ik", x, W)``) and rows (``st.einsum("ij,jk->ik", x, W^T)``,
          four rows side by side), on 2708 and 8192 rows of 16-1024 inputs, 2-64 outputs.

  sparse-input
          ``st.nn.SparseLinear(V, 256, density=0.1)`` on 256 bag-of-words rows (20 or 100
          distinct words of V = 4096 or 30000, Zipf-distributed like a corpus's) given as a
          CSR SparseTensor, against the masked dense weight in ``F.linear`` on the dense rows
          and ``torch.sparse.mm`` of the rows as a torch CSR tensor with the masked weight:
          a training step (gradients of the weight and bias; the baselines multiply by the
          mask each step, so their gradients stay on the pattern) and inference (masked
          once).
  compiled
          ``torch.compile`` (inductor) of ``st.models.SparseAutoencoder(784, 256,
          density=0.1)`` on 256 random binary rows (13% on, as binarised MNIST; dense input)
          and of ``st.models.GCN`` (16 hidden units, dropout 0) on Cora and PubMed (CSR
          features), against the same models eager, and for the autoencoder the masked
          dense one (``F.linear``) eager and compiled: a training step (forward, loss,
          backward, Adam) and inference. Each implementation trains its own copy of the
          same starting weights. And ``SparseLinear(30000, 256, density=0.1)`` on the
          ``sparse-input`` section's bag-of-words rows (20 words, a CSR batch of 256),
          ``st.models.SparseTransformer`` (embedding 128, 4 heads, 2 layers, a Longformer
          mask of window 64, L = 1024, batch 2) and ``st.sparsify(mobilenet_v1(), 0.9)``
          (batch 1, inference) compiled against eager.
  exported
          ``torch.export`` (non-strict, the batch a ``Dim``) of
          ``st.models.SparseTransformer`` (embedding 128, 4 heads, 2 layers, L = 4096, a
          BigBird mask of 64-blocks, 3 window, 1 global and 2 random) against the same
          model eager, in inference at batch 2: each attention layer is one op there
          (``sparsetorch::block_diagonal_attention``), which keeps its folded mask.

Timing: ``sparsetorch.bench.compare`` (interleaved rounds, medians of per-round ratios;
``speedup`` > 1 means faster than the baseline, the first implementation listed).
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="threads for every library (2)")
    p.add_argument("--rounds", type=int, default=15, help="timed rounds per case (15)")
    p.add_argument("--only", default=None,
                   help="regex of sections to run (linear, gcn, narrow, sparse-input, "
                        "compiled, exported)")
    p.add_argument("--out", default=str(HERE / "results" / "nn_layers.json"), help="JSON path")
    return p.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:  # thread counts must be set before torch starts its pools
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import sparsetorch as st  # noqa: E402
from sparsetorch.bench import Report, compare  # noqa: E402
from sparsetorch.bench.harness import quiet_sparse_warnings  # noqa: E402


def run(report, case, impls, **fields):
    outs = {name: fn() for name, fn in impls.items()}
    first = next(iter(outs.values()))
    for name, out in outs.items():
        if not torch.allclose(out, first, rtol=1e-4, atol=1e-4):
            err = (out - first).abs().max().item()
            report.note(f"{case}: {name} disagrees with {next(iter(outs))} (max error {err:.3g})")
            return
    res = compare(impls, rounds=ARGS.rounds, threads=ARGS.threads, max_time=40.0)
    rows = report.add(case, res, **fields)
    print(f"  {case:22s} " + ", ".join(f"{r['impl']} {r['median_s'] * 1e3:.2f} ms "
                                       f"({r['speedup']:.2f}x)" for r in rows), flush=True)


def section_linear(report):
    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 1024)
    sparse = st.nn.SparseLinear.from_dense(dense, density=0.1, method="random",
                                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():   # the same function: the dense layer holds the masked weight
        dense.weight.copy_(sparse.weight.to_dense())
    x = torch.randn(256, 1024)

    def step(layer):
        def f():
            layer.zero_grad(set_to_none=True)
            xg = x.clone().requires_grad_()
            y = layer(xg)
            y.backward(torch.ones_like(y))
            return torch.cat([y.detach().flatten(), xg.grad.flatten(), layer.bias.grad])
        return f

    def infer(layer):
        def f():
            with torch.no_grad():
                return layer(x)
        return f

    run(report, "linear train 90%", {"nn.Linear": step(dense), "SparseLinear": step(sparse)},
        section="linear")
    run(report, "linear infer 90%", {"nn.Linear": infer(dense), "SparseLinear": infer(sparse)},
        section="linear")


class TorchSparseGCN(torch.nn.Module):
    """The two-layer GCN in plain torch: ``A`` a torch.sparse normalised adjacency."""

    def __init__(self, ours):
        super().__init__()
        self.w1 = torch.nn.Parameter(ours.conv1.lin.weight.detach().clone())
        self.b1 = torch.nn.Parameter(ours.conv1.bias.detach().clone())
        self.w2 = torch.nn.Parameter(ours.conv2.lin.weight.detach().clone())
        self.b2 = torch.nn.Parameter(ours.conv2.bias.detach().clone())

    def forward(self, x, A):
        h = torch.relu(torch.sparse.mm(A, x @ self.w1.T) + self.b1)
        return torch.sparse.mm(A, h @ self.w2.T) + self.b2


def section_gcn(report):
    g = st.datasets.planetoid("pubmed")
    for width in (g.num_features, 64):
        gcn_case(report, g, width)


def gcn_case(report, g, width):
    n, hidden = g.num_nodes, 64
    torch.manual_seed(0)
    x = torch.randn(n, width)
    ours = st.models.GCN(width, hidden, g.num_classes, dropout=0.0)
    A = st.nn.normalized_adjacency(g.adj, n)
    A_csr = A.to_torch()
    A_coo = A_csr.to_sparse_coo().coalesce()
    models = {"torch.sparse CSR": (TorchSparseGCN(ours), A_csr),
              "torch.sparse COO": (TorchSparseGCN(ours), A_coo), "st.models.GCN": (ours, g.adj)}
    opts = {k: torch.optim.Adam(m.parameters(), lr=0.01) for k, (m, _) in models.items()}

    def step(name):
        model, adj = models[name]

        def f():
            opts[name].zero_grad()
            out = model(x, adj)
            F.cross_entropy(out, g.labels).backward()
            opts[name].step()
            return out.detach()
        return f

    def infer(name):
        model, adj = models[name]

        def f():
            with torch.no_grad():
                return model(x, adj)
        return f

    fields = dict(section="gcn", nodes=n, edges=g.num_edges, hidden=hidden, features=width)
    run(report, f"gcn pubmed x{width} infer", {k: infer(k) for k in models}, **fields)
    # (outputs compared on the first step, when every copy still has the same weights)
    run(report, f"gcn pubmed x{width} train", {k: step(k) for k in models}, **fields)


def section_narrow(report):
    torch.manual_seed(0)
    for rows in (2708, 8192):
        for inputs in (16, 64, 256, 1024):
            for outputs in (2, 4, 8, 16, 32, 64):
                x, w = torch.randn(rows, inputs), torch.randn(outputs, inputs)
                wt = w.t().contiguous()
                with torch.no_grad():
                    run(report, f"narrow {rows}x{inputs}->{outputs}",
                        {"F.linear": lambda: F.linear(x, w),
                         "inner products": lambda: st.einsum("ij,kj->ik", x, w),
                         "rows": lambda: st.einsum("ij,jk->ik", x, wt)},
                        section="narrow", rows=rows, inputs=inputs, outputs=outputs)


def bag_of_words(rows: int, vocabulary: int, words: int, gen) -> torch.Tensor:
    """``rows`` dense rows of word counts: ``words`` distinct words each, drawn with Zipf
    weights (rank r: 1 / r), counts 1-3."""
    weights = 1.0 / torch.arange(1, vocabulary + 1, dtype=torch.float64)
    out = torch.zeros(rows, vocabulary)
    for r in range(rows):
        cols = torch.multinomial(weights, words, replacement=False, generator=gen)
        out[r, cols] = torch.randint(1, 4, (words,), generator=gen).float()
    return out


def section_sparse_input(report):
    gen = torch.Generator().manual_seed(0)
    for vocabulary in (4096, 30000):
        layer = st.nn.SparseLinear(vocabulary, 256, density=0.1, generator=gen)
        mask = layer.mask().float()
        weight = torch.nn.Parameter(layer.weight.to_dense().detach())
        bias = torch.nn.Parameter(layer.bias.detach().clone())
        for words in (20, 100):
            dense_x = bag_of_words(256, vocabulary, words, gen)
            ours_x, torch_x = st.tensor(dense_x, format="csr"), dense_x.to_sparse_csr()
            impls = {
                "F.linear (dense x, masked W)": lambda: F.linear(dense_x, weight * mask, bias),
                "torch.sparse.mm (CSR x)":
                    lambda: torch.sparse.mm(torch_x, (weight * mask).t()) + bias,
                "SparseLinear (CSR x)": lambda: layer(ours_x)}

            def step(fn, params):
                def f():
                    for p in params:
                        p.grad = None
                    y = fn()
                    y.backward(torch.ones_like(y))
                    return torch.cat([y.detach().flatten(), params[-1].grad])
                return f

            params = {"SparseLinear (CSR x)": [layer.values, layer.bias]}
            case = f"{vocabulary} words, {words} a row"
            fields = dict(section="sparse-input", vocabulary=vocabulary, words=words,
                          density=words / vocabulary)
            run(report, case + " train", {k: step(fn, params.get(k, [weight, bias]))
                                          for k, fn in impls.items()}, **fields)
            masked = (weight * mask).detach()   # (inference: masked once, outside the timing)
            with torch.no_grad():
                run(report, case + " infer", {
                    "F.linear (dense x, masked W)": lambda: F.linear(dense_x, masked, bias),
                    "torch.sparse.mm (CSR x)": lambda: torch.sparse.mm(torch_x, masked.t()) + bias,
                    "SparseLinear (CSR x)": lambda: layer(ours_x)}, **fields)


def section_compiled(report):
    import copy

    from sparsetorch.bench.autoencoder import TorchAutoencoder
    from sparsetorch.bench.graph_data import get
    from sparsetorch.bench.harness import named_data
    from sparsetorch.bench.workloads import Context

    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(256, 784, generator=gen) < 0.13).float()
    ae = st.models.SparseAutoencoder(784, 256, density=0.1, generator=gen)
    layers = [(m.weight.to_dense().detach(), m.mask(), m.bias.detach())
              for m in (ae.encoder, ae.decoder)]
    models = {"SparseAutoencoder": ae, "masked dense": TorchAutoencoder(layers, "dense")}
    cases = {"autoencoder": (models, lambda m: m(x), lambda out: F.mse_loss(out, x))}
    for name in ("cora", "pubmed"):
        g = get(Context(data_root=named_data()), name)
        gcn = st.models.GCN(g.num_features, 16, g.num_classes, dropout=0.0)
        features, adj = st.tensor(g.features, format="csr"), st.tensor(g.adj, format="csr")
        if g.source != "real":
            report.note(f"GCN {name}: {g.source}")
        cases[f"GCN {name}" + ("" if g.source == "real" else " (stand-in)")] = (
            {"GCN": gcn}, lambda m, f=features, a=adj: m(f, a),
            lambda out, y=g.labels: F.cross_entropy(out, y))
    bow = st.nn.SparseLinear(30000, 256, density=0.1, activation="relu", generator=gen)
    words = st.tensor(bag_of_words(256, 30000, 20, gen), format="csr")
    cases["SparseLinear 30000 -> 256, bag-of-words rows (CSR)"] = (
        {"SparseLinear": bow}, lambda m: m(words), lambda out: out.square().mean())
    from functools import partial
    transformer = st.models.SparseTransformer(
        100, 2, max_len=1024, mask=partial(st.nn.masks.longformer, window=64))
    tokens = torch.randint(0, 100, (2, 1024), generator=gen)
    classes = torch.randint(0, 2, (2,), generator=gen)
    cases["SparseTransformer L=1024, batch 2"] = (
        {"SparseTransformer": transformer}, lambda m: m(tokens),
        lambda out: F.cross_entropy(out, classes))
    mobilenet = st.sparsify(st.models.mobilenet_v1(), sparsity=0.9).eval()
    image = torch.randn(1, 3, 224, 224, generator=gen)
    cases["sparse MobileNet v1 90%, batch 1"] = ({"MobileNet": mobilenet},
                                                 lambda m: m(image), None)
    for case, (bases, forward, loss) in cases.items():
        train, infer = {}, {}
        for name, base in bases.items():
            for how in ("eager", "torch.compile"):
                model = copy.deepcopy(base)
                run_model = model if how == "eager" else torch.compile(model)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)

                def step(model=run_model, opt=opt):
                    opt.zero_grad(set_to_none=True)
                    out = forward(model)
                    loss(out).backward()
                    opt.step()
                    return out.detach()

                def evaluate(model=run_model):
                    with torch.no_grad():
                        return forward(model)

                train[f"{name} ({how})"], infer[f"{name} ({how})"] = step, evaluate
        run(report, f"{case} infer", infer, section="compiled")
        if loss is not None:
            run(report, f"{case} train", train, section="compiled")


def section_exported(report):
    from torch.export import Dim, export

    gen = torch.Generator().manual_seed(0)
    L = 4096
    mask = st.nn.masks.bigbird(L, 64, 3, 1, 2, generator=gen)
    model = st.models.SparseTransformer(100, 2, max_len=L, mask=mask).eval()
    tokens = torch.randint(0, 100, (2, L), generator=gen)
    program = export(model, (tokens,), dynamic_shapes={"tokens": {0: Dim("batch")}}).module()

    def infer(m):
        def f():
            with torch.no_grad():
                return m(tokens)
        return f
    run(report, f"SparseTransformer L={L}, batch 2 infer",
        {"eager": infer(model), "torch.export": infer(program)}, section="exported")


def main():
    quiet_sparse_warnings()
    report = Report(f"st.nn layers and models ({ARGS.threads} threads)")
    for name, section in (("linear", section_linear), ("gcn", section_gcn),
                          ("narrow", section_narrow), ("sparse-input", section_sparse_input),
                          ("compiled", section_compiled), ("exported", section_exported)):
        if ARGS.only is None or re.search(ARGS.only, name):
            print(f"{name}:", flush=True)
            section(report)
    report.print(["case", "impl", "median_s", "speedup"])
    print(f"wrote {report.write_json(ARGS.out)}")


if __name__ == "__main__":
    main()
