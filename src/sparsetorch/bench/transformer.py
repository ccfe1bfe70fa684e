"""The sparse transformer workloads: ``st.models.SparseTransformer`` (embedding 128, 4
heads, 2 layers) classifying one sequence of L = 1024 or 4096 tokens under a Longformer
mask (a window of 128 keys on each side and one global token: 2.5-26% of L x L stored),
inference and one training step on cross-entropy.

Baselines are the model's own references (``st.models.transformer.reference``), a deep
copy with the same weights whose attention runs in torch: ``"torch_sparse"``
(``sampled_addmm`` on a CSR mask, COO ``torch.sparse.softmax``, ``torch.sparse.mm``) and,
as dense torch, ``"sdpa"`` (``scaled_dot_product_attention`` with a boolean mask) and
``"matmul"`` (masked scores, softmax, product); the faster dense one is reported.

Example:
    >>> from sparsetorch.bench.workloads import REGISTRY
    >>> import sparsetorch.bench.transformer
    >>> REGISTRY["transformer-4096"].quick, REGISTRY["transformer-1024"].quick
    (False, True)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .steps import inference, training
from .workloads import OURS, Prepared, Workload, register

EMBED, HEADS, LAYERS, VOCAB, CLASSES, BATCH = 128, 4, 2, 1000, 2, 1
WINDOW, GLOBAL_TOKENS = 128, 1
LENGTHS = (1024, 4096)


def prepare(L: int, ctx, mode: str) -> Prepared:
    import sparsetorch as st

    prep = Prepared([], source="generated (random token ids: the timing does not depend on "
                    "them)", size=f"batch {BATCH}, L={L}, embedding {EMBED}, {HEADS} heads, "
                    f"{LAYERS} layers")
    if not hasattr(getattr(st, "models", None), "SparseTransformer"):
        prep.skipped[OURS] = "st.models.SparseTransformer is not in this build"
        return prep
    from ..models.transformer import reference
    from ..nn import masks

    torch.manual_seed(ctx.seed)
    mask = masks.longformer(L, WINDOW, global_tokens=GLOBAL_TOKENS)
    prep.size += f", Longformer mask {mask.nnz / L / L:.1%} of L x L"
    model = st.models.SparseTransformer(VOCAB, CLASSES, embed_dim=EMBED, num_heads=HEADS,
                                        num_layers=LAYERS, max_len=L, mask=mask)
    gen = torch.Generator().manual_seed(ctx.seed)
    tokens = torch.randint(0, VOCAB, (BATCH, L), generator=gen)
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)

    def loss(out):
        return F.cross_entropy(out, labels)

    def add(name, family, net, config):
        net.train(mode == "train")
        if mode == "infer":
            prep.impls.append(inference(name, family, lambda: net(tokens), config))
            return
        prep.impls.append(training(name, family, lambda: net(tokens), net.parameters(), loss,
                                   lambda: {k: p.grad for k, p in net.named_parameters()},
                                   config))

    add(OURS, OURS, model, "SparseAttention: SDDMM, sparse softmax, SpMM on the CSR mask")
    add("torch.sparse", "torch.sparse", reference(model, "torch_sparse"),
        "sampled_addmm (CSR), softmax (COO), sparse.mm")
    dense_bytes = BATCH * HEADS * L * L * 4
    if ctx.dense_fits(BATCH * HEADS, L, L):
        add("dense sdpa", "dense", reference(model, "sdpa"),
            "scaled_dot_product_attention, boolean mask")
        add("dense matmul", "dense", reference(model, "matmul"), "masked scores, softmax")
    else:
        prep.skipped["dense"] = (f"{dense_bytes >> 20} MiB of scores over the "
                                 f"{ctx.dense_limit_bytes >> 20} MiB dense limit")
    prep.rtol, prep.atol = 1e-3, 1e-4   # long softmax sums in another order
    return prep


for _L in LENGTHS:
    register(Workload(f"transformer-{_L}", "transformer",
                      lambda ctx, mode, L=_L: prepare(L, ctx, mode), quick=_L == 1024,
                      describe=f"sparse transformer classifier, L={_L}, Longformer mask"))
