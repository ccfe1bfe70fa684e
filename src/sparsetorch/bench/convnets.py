"""The sparse ConvNet workload (inference): ``st.freeze(st.sparsify(st.models.mobilenet_v1(),
0.9))`` (BN folded, ReLU fused, 1x1 convolutions and the classifier 90% sparse, run as one
flat function) on one 224 x 224 image, against the dense model with the same masks and BN
folded, in PyTorch eager NCHW and channels_last (the faster is kept).
``benchmarks/convnets.py`` has the full study (v2, batch 8, torch.compile, ONNX Runtime, a
sparsity sweep, per-layer profile).

Example:
    >>> from sparsetorch.bench.workloads import REGISTRY
    >>> import sparsetorch.bench.convnets
    >>> REGISTRY["convnets-mobilenet_v1"].modes
    ('infer',)
"""
from __future__ import annotations

import copy

import torch

from .steps import inference
from .workloads import OURS, Prepared, Workload, register

SPARSITY, BATCH = 0.9, 1


def masked_dense(sparse: torch.nn.Module, dense: torch.nn.Module) -> torch.nn.Module:
    """``dense`` with every weight that ``sparse`` stores sparsely multiplied by its mask:
    the same function as the sparse model, computed densely."""
    masked = copy.deepcopy(dense)
    for name, m in sparse.named_modules():
        if hasattr(m, "mask") and callable(m.mask):
            w = masked.get_submodule(name).weight
            w.data *= m.mask().view(w.shape[0], w.shape[1], *([1] * (w.dim() - 2)))
    return masked


def prepare(ctx, mode: str) -> Prepared:
    import sparsetorch as st

    prep = Prepared([], source="generated (a random image: the timing does not depend on it)",
                    size=f"MobileNet v1, batch {BATCH}, 224 x 224, {SPARSITY:.0%} sparse 1x1 "
                         "convolutions and classifier")
    if not hasattr(getattr(st, "models", None), "mobilenet_v1"):
        prep.skipped[OURS] = "st.models.mobilenet_v1 is not in this build"
        return prep
    torch.manual_seed(ctx.seed)
    dense = st.models.mobilenet_v1().eval()
    x = torch.randn(BATCH, 3, 224, 224)
    modules = st.sparsify(dense, sparsity=SPARSITY)
    sparse = st.freeze(modules)
    folded = st.nn.fold_batchnorms(masked_dense(modules, dense)).eval()
    channels_last = copy.deepcopy(folded).to(memory_format=torch.channels_last)
    x_cl = x.contiguous(memory_format=torch.channels_last)
    prep.impls += [
        inference(OURS, OURS, lambda: sparse(x),
                  "st.freeze(st.sparsify(...)): SparseConv2d 1x1, fused, one flat function"),
        inference("dense eager", "dense", lambda: folded(x), "BN folded, NCHW"),
        inference("dense channels_last", "dense", lambda: channels_last(x_cl),
                  "BN folded, channels_last"),
    ]
    prep.skipped["torch.sparse"] = "torch.sparse has no sparse convolution"
    prep.rtol, prep.atol = 1e-3, 1e-3
    return prep


register(Workload("convnets-mobilenet_v1", "convnets", prepare, modes=("infer",),
                  describe=f"MobileNet v1, {SPARSITY:.0%} sparse (st.sparsify), batch {BATCH}, "
                           "inference"))
