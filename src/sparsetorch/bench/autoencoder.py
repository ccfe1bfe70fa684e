"""The sparse autoencoder workload: ``st.models.SparseAutoencoder(784, 256, density=0.1)``
(90%-sparse encoder and decoder, ``sigmoid(dec(relu(enc(x))))``) on a batch of 256 MNIST
digits binarised at 0.5 (about 13% of pixels on), trained on the reconstruction MSE.

Baselines, from the same weights and pattern: torch.sparse (each weight a CSR or COO tensor
built from a values parameter over the fixed pattern, ``torch.sparse.mm``) and dense torch
(``F.linear`` with the weight times its 0/1 mask, so the gradient stays on the pattern).
Sparsetorch takes the batch as a SparseTensor; the baselines take it dense (a sparse times
sparse product would be their slowest path).

Example:
    >>> from sparsetorch.bench.workloads import REGISTRY
    >>> import sparsetorch.bench.autoencoder
    >>> REGISTRY["autoencoder-mnist"].quick
    True
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .harness import Report, load_or_generate
from .steps import inference, training
from .workloads import OURS, Prepared, Workload, register

IN, HIDDEN, DENSITY, BATCH = 784, 256, 0.1, 256
PIXELS_ON = 0.13   # MNIST binarised at 0.5: the stand-in's density


def batch(ctx) -> tuple[torch.Tensor, str]:
    """``(x, source)``: 256 binarised digits (float32 0/1, ``BATCH x 784``)."""
    def real():
        from ..datasets import mnist
        if ctx.data_root is None:
            raise FileNotFoundError("no data folder found")
        return (mnist(ctx.data_root, train=True, dtype=torch.float32).images[:BATCH]
                .reshape(BATCH, IN) > 0.5).float()

    def fake():
        gen = torch.Generator().manual_seed(ctx.seed)
        return (torch.rand(BATCH, IN, generator=gen) < PIXELS_ON).float()

    said = Report("mnist", quiet=True)
    x, source = load_or_generate("mnist", real, fake, report=said)
    return x, ("real" if source == "real" else
               f"generated stand-in ({BATCH} random binary images, {PIXELS_ON:.0%} on); "
               f"{said.notes[-1]}")


class TorchAutoencoder(nn.Module):
    """The same autoencoder in torch: ``layout`` "csr"/"coo" (values over a fixed pattern,
    torch.sparse.mm) or "dense" (masked dense weights)."""

    def __init__(self, layers: list, layout: str):
        super().__init__()
        self.layout = layout
        self.values = nn.ParameterList()
        self.biases = nn.ParameterList()
        self.patterns = []
        for dense, mask, bias in layers:
            self.biases.append(nn.Parameter(bias.detach().clone()))
            if layout == "dense":
                self.values.append(nn.Parameter(dense.detach().clone()))
                self.patterns.append(mask.float())
                continue
            # The pattern from the mask (a stored weight may be 0); boolean indexing reads
            # row-major, which is CSR's and coalesced COO's order.
            self.values.append(nn.Parameter(dense[mask].detach().clone()))
            if layout == "csr":
                m = mask.to_sparse_csr()
                self.patterns.append((m.crow_indices(), m.col_indices()))
            else:
                self.patterns.append(mask.nonzero().t().contiguous())
        self.shapes = [tuple(d.shape) for d, _, _ in layers]

    def _weight(self, k: int):
        v, pat, shape = self.values[k], self.patterns[k], self.shapes[k]
        if self.layout == "dense":
            return v * pat
        if self.layout == "csr":
            return torch.sparse_csr_tensor(pat[0], pat[1], v, shape)
        return torch.sparse_coo_tensor(pat, v, shape, is_coalesced=True)

    def _linear(self, k: int, x):
        w = self._weight(k)
        if self.layout == "dense":
            return F.linear(x, w, self.biases[k])
        return torch.sparse.mm(w, x.t()).t() + self.biases[k]

    def forward(self, x):
        return torch.sigmoid(self._linear(1, torch.relu(self._linear(0, x))))

    def grads(self) -> dict:
        out = {}
        for k, name in enumerate(("enc", "dec")):
            g = self.values[k].grad
            if self.layout == "csr":
                g = torch.sparse_csr_tensor(*self.patterns[k], g, self.shapes[k]).to_dense()
            elif self.layout == "coo":
                g = torch.sparse_coo_tensor(self.patterns[k], g, self.shapes[k]).to_dense()
            else:
                g = g * self.patterns[k]
            out[f"{name}.weight"], out[f"{name}.bias"] = g, self.biases[k].grad
        return out


def prepare(ctx, mode: str) -> Prepared:
    import sparsetorch as st

    x, source = batch(ctx)
    prep = Prepared([], source=source, size=f"batch {BATCH}, {IN}-{HIDDEN}-{IN}, "
                    f"{1 - DENSITY:.0%}-sparse weights, inputs {x.mean():.0%} nonzero")
    if not hasattr(getattr(st, "models", None), "SparseAutoencoder"):
        prep.skipped[OURS] = "st.models.SparseAutoencoder is not in this build"
        return prep
    model = st.models.SparseAutoencoder(IN, HIDDEN, density=DENSITY,
                                        generator=torch.Generator().manual_seed(ctx.seed))
    x_sparse = st.tensor(x, format="csr")
    layers = [(m.weight.to_dense().detach(), m.mask(), m.bias.detach())
              for m in (model.encoder, model.decoder)]

    def loss(out):
        return F.mse_loss(out, x)

    def our_grads():
        out = {}
        for name, m in (("enc", model.encoder), ("dec", model.decoder)):
            out[f"{name}.weight"] = m.weight.with_values(m.values.grad).to_dense()
            out[f"{name}.bias"] = m.bias.grad
        return out

    def add(name, family, forward, params, grads, config):
        if mode == "infer":
            prep.impls.append(inference(name, family, forward, config))
        else:
            prep.impls.append(training(name, family, forward, params, loss, grads, config))

    add(OURS, OURS, lambda: model(x_sparse), model.parameters(), our_grads,
        "CSR weights, CSR input batch")
    for layout in ("csr", "coo", "dense"):
        base = TorchAutoencoder(layers, layout)
        family = "dense" if layout == "dense" else "torch.sparse"
        add(family if layout == "dense" else f"torch.sparse {layout.upper()}", family,
            lambda base=base: base(x), base.parameters(), base.grads,
            "masked dense weights, F.linear" if layout == "dense" else
            f"{layout.upper()} weights, torch.sparse.mm, dense input")
    return prep


register(Workload("autoencoder-mnist", "autoencoder", prepare, quick=True,
                  describe=f"sparse autoencoder {IN}-{HIDDEN}-{IN}, {1 - DENSITY:.0%}-sparse "
                           f"weights, batch {BATCH} of binarised MNIST"))
