"""st.nn.masks, st.nn.SparseAttention and st.models.SparseTransformer against dense torch:
masks against masks built densely from their definitions, attention against dense masked
softmax attention and torch.nn.MultiheadAttention (values and gradients, float32 and
float64, gradcheck), bad input, and the model's training steps."""
from __future__ import annotations

import dataclasses
import math
from functools import partial

import numpy as np
import pytest
import torch

import sparsetorch as st
from sparsetorch.models import SparseTransformer, dense_reference, reference
from sparsetorch.models.transformer import ReferenceAttention
from sparsetorch.nn import SparseAttention, attention, masks

from dense_check import private_kernel_cache  # noqa: F401
from helpers import one_thread  # noqa: F401  (tiny shapes: no OpenMP barriers)


# -- masks ---------------------------------------------------------------------------------
def _dense_window(L, w):
    i = torch.arange(L)
    return (i[:, None] - i[None, :]).abs() <= w


def _valid_csr(m):
    """Re-validate the builder's arrays (it skips validation for speed)."""
    st.SparseTensor.from_levels(m.shape, "csr", m.arrays, m.values, check=True)
    assert m.format.name == "csr" and bool((m.values == 1).all())


@pytest.mark.parametrize("L,w", [(1, 0), (5, 0), (7, 2), (6, 10), (33, 4)])
def test_sliding_window_matches_dense(L, w):
    m = masks.sliding_window(L, w)
    _valid_csr(m)
    assert torch.equal(m.to_dense() != 0, _dense_window(L, w))


@pytest.mark.parametrize("L,w,glob", [(9, 1, (0,)), (9, 1, (0, 4, 8)), (12, 2, 3),
                                      (10, 0, (5, 2, 5)), (6, 1, ()), (4, 3, 9)])
def test_longformer_matches_dense(L, w, glob):
    m = masks.longformer(L, w, global_tokens=glob)
    _valid_csr(m)
    g = torch.zeros(L, dtype=torch.bool)
    g[torch.arange(min(glob, L)) if isinstance(glob, int) else list(glob)] = True
    want = _dense_window(L, w) | g[:, None] | g[None, :]
    assert torch.equal(m.to_dense() != 0, want)


@pytest.mark.parametrize("L,block,win,glob,rand", [(64, 8, 3, 2, 3), (70, 8, 3, 1, 2),
                                                   (40, 4, 1, 0, 0), (32, 8, 5, 1, 9)])
def test_bigbird_structure(L, block, win, glob, rand):
    m = masks.bigbird(L, block, win, glob, rand, generator=torch.Generator().manual_seed(1))
    _valid_csr(m)
    d = m.to_dense() != 0
    nb = -(-L // block)
    # block-constant: every token pair agrees with its block pair
    blocks = torch.arange(L) // block
    bd = torch.zeros(nb, nb, dtype=torch.bool)
    bd[blocks[:, None].expand(L, L)[d], blocks[None, :].expand(L, L)[d]] = True
    assert torch.equal(d, bd[blocks][:, blocks])
    b = torch.arange(nb)
    fixed = ((b[:, None] - b[None, :]).abs() <= win // 2) | (b[None, :] < glob)
    assert bool(bd[fixed].all()) and bool(bd[:glob].all())   # window, global cols and rows
    extra = (bd & ~fixed)[glob:].sum(1)
    assert torch.equal(extra, torch.minimum(torch.tensor(rand), (~fixed)[glob:].sum(1)))


def test_bigbird_deterministic_given_generator():
    make = lambda seed: masks.bigbird(512, 16, generator=torch.Generator().manual_seed(seed))
    a, b, c = make(3), make(3), make(4)
    assert torch.equal(a.arrays["crd1"], b.arrays["crd1"])
    assert not torch.equal(a.arrays["pos1"], c.arrays["pos1"]) or \
        not torch.equal(a.arrays["crd1"], c.arrays["crd1"])


def test_masks_never_dense_at_large_L():
    """L x L at these sizes would take 4 GB (bigbird) to 256 GB (longformer) as float32."""
    L = 2 ** 18
    m = masks.longformer(L, 2, global_tokens=(0, L - 1), dtype=torch.float64)
    length = m.arrays["pos1"].diff()
    assert length[0] == length[-1] == L and bool((length[3:-3] == 7).all())
    assert m.dtype == torch.float64
    row = m.arrays["crd1"][m.arrays["pos1"][L // 2]:m.arrays["pos1"][L // 2 + 1]]
    assert row.tolist() == [0, L // 2 - 2, L // 2 - 1, L // 2, L // 2 + 1, L // 2 + 2, L - 1]
    b = masks.bigbird(2 ** 15, block=16, window_blocks=1, global_blocks=1, random_blocks=1)
    assert b.nnz == 16 * 2 ** 15 + (2 ** 15 - 16) * 48


def test_as_mask_and_block_diagonal():
    dense = torch.rand(6, 6) < 0.4
    m = masks.as_mask(dense)
    assert torch.equal(m.to_dense() != 0, dense)
    assert masks.as_mask(st.tensor(dense.float(), format="coo")).format.name == "csr"
    bd = masks.block_diagonal(m, 3).to_dense() != 0
    assert torch.equal(bd, torch.block_diag(dense, dense, dense))
    with pytest.raises(TypeError, match="bool"):
        masks.as_mask(torch.ones(3, 3))
    with pytest.raises(ValueError, match="length 5"):
        masks.as_mask(m, 5)
    with pytest.raises(ValueError, match="window_blocks must be odd"):
        masks.bigbird(64, 8, window_blocks=2)
    with pytest.raises(ValueError, match="positions in"):
        masks.longformer(8, 1, global_tokens=(9,))
    for not_positions in ([1.5], [True]):   # (1.5 was truncated to 1: a fuzzer's finding)
        with pytest.raises(ValueError, match="positions in"):
            masks.longformer(8, 1, global_tokens=not_positions)
    assert masks.longformer(8, 1, global_tokens=()).nnz == 22   # none: the window alone


def test_mask_builders_take_numpy_integers_and_name_bad_arguments():
    """numpy integers were refused by some builders and taken by the layers; non-sequence
    global tokens, a generator of another type and bad copy counts failed inside torch
    (a probe's findings)."""
    ref = masks.longformer(8, 1, global_tokens=2)
    for same in (masks.longformer(np.int64(8), np.int64(1), global_tokens=np.int64(2)),
                 masks.longformer(8, 1, global_tokens=np.array([0, 1])),
                 masks.longformer(8, 1, global_tokens=torch.tensor([1, 0]))):
        assert torch.equal(same.to_dense(), ref.to_dense())
    assert torch.equal(masks.as_mask(np.eye(3, dtype=bool)).to_dense(), torch.eye(3))
    for bad in (None, 2.0, "0", torch.tensor(2)):
        with pytest.raises(TypeError, match="global_tokens is a count .* or a sequence"):
            masks.longformer(8, 1, global_tokens=bad)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        masks.bigbird(8, generator=5)
    window = masks.sliding_window(3, 1)
    for copies in (-1, 2.5):
        with pytest.raises(ValueError, match="copies must be an int >= 0"):
            masks.block_diagonal(window, copies)
    with pytest.raises(TypeError, match="mask must be a 2-D SparseTensor"):
        masks.block_diagonal(torch.ones(2, 2, dtype=torch.bool), 2)


# -- attention -----------------------------------------------------------------------------
def _dense_attention(attn, x, allowed):
    """Dense masked multi-head attention with attn's weights: the definition."""
    B, L, E = x.shape
    H, d = attn.num_heads, attn.head_dim
    q, k, v = (t.reshape(B, L, H, d).transpose(1, 2) for t in
               torch.nn.functional.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1))          # empty rows: zeros, as ours
    return attn.out_proj((probs @ v).transpose(1, 2).reshape(B, L, E))


def _mask_with_single_entry_rows(L):
    """Longformer plus rows holding only their diagonal entry, and one empty row."""
    d = masks.longformer(L, 2, global_tokens=1).to_dense() != 0
    d[3] = False
    d[3, 3] = True
    d[L - 1] = False
    return d


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B,H", [(1, 1), (3, 2), (2, 4)])
def test_attention_matches_dense(dtype, B, H):
    torch.manual_seed(B * 10 + H)
    L, E = 11, 8
    allowed = _mask_with_single_entry_rows(L)
    attn = SparseAttention(E, H, mask=masks.as_mask(allowed)).to(dtype)
    x = torch.randn(B, L, E, dtype=dtype, requires_grad=True)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    with torch.no_grad():                                 # the fused kernel
        torch.testing.assert_close(attn(x), _dense_attention(attn, x, allowed), **tol)
    out, ref = attn(x), _dense_attention(attn, x, allowed)    # the differentiable chain
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(out)
    params = [x, attn.in_proj_weight, attn.in_proj_bias, attn.out_proj.weight]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b, **tol)


def test_attention_matches_multihead_attention():
    torch.manual_seed(0)
    L, E, H = 16, 12, 3
    mask = masks.bigbird(L, 4, 1, 1, 1, generator=torch.Generator().manual_seed(0))
    attn = SparseAttention(E, H, mask=mask)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True)
    mha.load_state_dict(attn.state_dict())
    x = torch.randn(2, L, E, requires_grad=True)
    out = attn(x)
    ref, _ = mha(x, x, x, attn_mask=mask.to_dense() == 0, need_weights=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, g)[0],
                               torch.autograd.grad(ref, x, g)[0], rtol=1e-5, atol=1e-5)


def test_attention_gradcheck_float64():
    torch.manual_seed(0)
    attn = SparseAttention(4, 2, mask=masks.as_mask(_mask_with_single_entry_rows(6))).double()
    x = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: attn(x), (x,))
    w = attn.in_proj_weight
    assert torch.autograd.gradcheck(
        lambda w: torch.func.functional_call(attn, {"in_proj_weight": w}, (x.detach(),)), (w,))


def test_attention_cross_seq_first_and_call_mask():
    torch.manual_seed(0)
    E, H = 8, 2
    attn = SparseAttention(E, H, batch_first=False)
    q, kv = torch.randn(5, 2, E), torch.randn(7, 2, E)          # (L, B, E)
    allowed = torch.rand(5, 7) < 0.5
    allowed[:, 0] = True
    out = attn(q, kv, kv, mask=masks.as_mask(allowed))
    mha = torch.nn.MultiheadAttention(E, H)
    mha.load_state_dict(attn.state_dict())
    ref, _ = mha(q, kv, kv, attn_mask=~allowed, need_weights=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_attention_mask_function_and_dropout():
    attn = SparseAttention(8, 2, mask=partial(masks.sliding_window, window=1), dropout=0.5)
    x = torch.randn(2, 9, 8)
    attn.eval()
    torch.testing.assert_close(attn(x), _dense_attention(attn, x, _dense_window(9, 1)))
    assert attn(torch.randn(1, 4, 8)).shape == (1, 4, 8)      # another length, another mask
    attn.train()
    x.requires_grad_()
    y = attn(x)
    y.sum().backward()
    assert x.grad is not None and not torch.allclose(y, attn.eval()(x))


def test_a_mask_function_is_called_once_per_length_and_its_masks_kept(monkeypatch):
    """(A probe found the layer kept the last length's mask only: L=8, then 6, then 8 drew
    a new random BigBird mask, and the same input gave outputs 0.46 apart.)"""
    calls = []

    def bigbird(L):
        calls.append(L)
        return masks.bigbird(L, block=2, window_blocks=1, global_blocks=0, random_blocks=1)

    attn = SparseAttention(8, 2, mask=bigbird).eval()
    x8, x6 = torch.randn(1, 8, 8), torch.randn(1, 6, 8)
    with torch.no_grad():
        first = attn(x8)
        attn(x6)
        torch.testing.assert_close(attn(x8), first, rtol=0, atol=0)
    assert calls == [8, 6]
    # within a budget of stored entries, least recently used out first (the newest stays)
    monkeypatch.setattr(attention, "_KEPT_MASK_ENTRIES", 1)
    with torch.no_grad():
        attn(torch.randn(1, 10, 8))
        attn(x8)
    assert calls == [8, 6, 10, 8] and list(attn._built) == [(bigbird, 8)]


def test_an_unhashable_mask_function():
    """A callable that does not hash (a dataclass with ``__call__``) keyed the built masks:
    every call failed with "unhashable type" (a probe's finding)."""
    @dataclasses.dataclass
    class Window:
        window: int

        def __call__(self, L):
            return masks.longformer(L, self.window, global_tokens=1)

    attn = SparseAttention(8, 2, mask=Window(1)).eval()
    x = torch.randn(2, 6, 8)
    with torch.no_grad():
        torch.testing.assert_close(attn(x),
                                   attn(x, mask=masks.longformer(6, 1, global_tokens=1)))
        assert attn(torch.randn(1, 5, 8)).shape == (1, 5, 8) and len(attn._built) == 2


def test_threads_making_a_layers_first_call_share_one_mask_draw():
    """(A probe's finding: 4 threads' first calls drew a random mask each, so first outputs
    differed from the layer's later ones.) The function sleeps to keep the window open."""
    import concurrent.futures
    import time

    calls = []

    def slow_bigbird(L):
        calls.append(L)
        time.sleep(0.05)
        return masks.bigbird(L, block=2, window_blocks=1, global_blocks=0, random_blocks=1)

    attn, x = SparseAttention(8, 2, mask=slow_bigbird).eval(), torch.randn(1, 8, 8)
    with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda _: attn(x), range(4)))
        later = attn(x)
    assert calls == [8]
    for out in outputs:   # (another mask moved outputs by ~0.1-0.5; rounding by threads)
        torch.testing.assert_close(out, later)


def test_attention_bad_input():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        SparseAttention(10, 3)
    attn = SparseAttention(8, 2, mask=masks.sliding_window(5, 1))
    with pytest.raises(ValueError, match="length 6"):
        attn(torch.randn(1, 6, 8))
    with pytest.raises(TypeError, match="float64 but the weights are torch.float32"):
        attn(torch.randn(1, 5, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="3-D"):
        attn(torch.randn(5, 8))
    with pytest.raises(ValueError, match="has 4 features"):
        attn(torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="no mask"):
        SparseAttention(8, 2)(torch.randn(1, 5, 8))
    with pytest.raises(TypeError, match="bool"):
        SparseAttention(8, 2, mask=torch.ones(5, 5))
    with pytest.raises(ValueError, match=r"2-D \(queries x keys\), got shape \(2, 5, 5\)"):
        SparseAttention(8, 2, mask=torch.ones(2, 5, 5, dtype=torch.bool))   # (said 'bool')
    with pytest.raises(TypeError, match=r"dropout must be a number in \[0, 1\), got '0.1'"):
        SparseAttention(8, 2, dropout="0.1")
    assert SparseAttention(8, np.int64(2)).num_heads == 2          # NumPy ints count
    for kw, said in ((dict(max_len=-1), "max_len must be a positive int, got -1"),
                     (dict(vocab_size=0), "vocab_size must be a positive int, got 0"),
                     (dict(num_layers=-1), "num_layers must be an int >= 0, got -1")):
        with pytest.raises(ValueError, match=f"SparseTransformer: {said}"):
            SparseTransformer(**{"vocab_size": 12, "num_classes": 3, "embed_dim": 8,
                                 "num_heads": 2, "max_len": 8, **kw})


@pytest.mark.parametrize("training", [False, True])
def test_attention_of_an_empty_batch_is_empty(training):
    """A batch of 0 sequences (the last shard of a split, a filtered batch) gives 0 outputs
    and a backward, as nn.MultiheadAttention does; it used to fail in a reshape."""
    attn = SparseAttention(8, 2, mask=masks.sliding_window(5, 1)).train(training)
    x = torch.randn(0, 5, 8, requires_grad=True)
    out = attn(x)
    assert out.shape == (0, 5, 8)
    out.sum().backward()
    assert x.grad.shape == x.shape


def test_model_refuses_token_ids_outside_the_vocabulary():
    model = _model().eval()
    for bad, seen in (([[1, 12]], "from 1 to 12"), ([[-1, 2]], "from -1 to 2")):
        with pytest.raises(ValueError, match=rf"token ids must lie in \[0, 12\) \(vocab_size\), "
                                             rf"got ids {seen}"):
            model(torch.tensor(bad))
    assert model(torch.tensor([[0, 11] * 8])).shape == (1, 3)
    assert model(torch.zeros(0, 16, dtype=torch.long)).shape == (0, 3)


# -- model ---------------------------------------------------------------------------------
def _model(**kw):
    return SparseTransformer(12, 3, embed_dim=16, num_heads=2, num_layers=2, ff_dim=32,
                             max_len=16, mask=masks.longformer(16, 2, global_tokens=1), **kw)


@pytest.mark.parametrize("impl", ["sdpa", "matmul", "torch_sparse"])
def test_model_matches_references(impl):
    torch.manual_seed(0)
    model = _model()
    tokens = torch.randint(0, 12, (3, 16))
    ref = reference(model, impl)
    out, want = model(tokens), ref(tokens)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad,
                               rtol=1e-4, atol=1e-5)
    assert type(dense_reference(model).layers[0].attn).__name__ == "ReferenceAttention"


@pytest.mark.parametrize("impl", ["sdpa", "matmul", "torch_sparse"])
def test_references_of_a_query_attending_to_nothing(impl):
    """A mask row with no entries: zeros, as the sparse layer gives (the matmul reference
    softmaxed a row of -inf to NaN, a probe's finding)."""
    torch.manual_seed(0)
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    allowed[2] = False
    attn = SparseAttention(8, 2, mask=masks.as_mask(allowed)).eval()
    x = torch.randn(2, 4, 8)
    with torch.no_grad():
        torch.testing.assert_close(ReferenceAttention(attn, impl)(x), attn(x))


def test_model_training_reduces_loss():
    torch.manual_seed(0)
    model = _model(dropout=0.1, pool="first")
    tokens = torch.randint(0, 12, (8, 16))
    labels = tokens[:, -1] % 3           # needs the last token, beyond token 0's window
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(tokens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    with pytest.raises(TypeError, match="integer ids"):
        model(torch.randn(2, 16))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.randint(0, 12, (1, 20)))


@pytest.mark.slow
def test_attention_under_torch_compile():
    """The mask is built outside the graph (a graph break); the rest compiles."""
    torch.manual_seed(0)
    attn = SparseAttention(8, 2, mask=masks.longformer(10, 2, global_tokens=1))
    x = torch.randn(2, 10, 8, requires_grad=True)
    compiled = torch.compile(attn, backend="aot_eager")
    out, ref = compiled(x), attn(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0],
                               torch.autograd.grad(ref.sum(), x)[0])


def _small_transformer(mask):
    torch.manual_seed(0)
    return SparseTransformer(20, 3, embed_dim=8, num_heads=2, ff_dim=16, num_layers=2,
                             max_len=16, mask=mask)


def test_non_strict_export_builds_a_mask_on_its_first_call():
    """A mask function (or a per-call bool or COO mask) met for the first time while
    exporting non-strictly was built from fake tensors: torch failed on its data-dependent
    sizes or data pointers; only a mask an eager call had kept exported (a probe's
    finding). Now it is built from real tensors and enters the graph as a constant."""
    from torch.export import Dim, export
    model = _small_transformer(partial(masks.longformer, window=2, global_tokens=1)).eval()
    program = export(model, (torch.randint(0, 20, (2, 12)),), strict=False,
                     dynamic_shapes={"tokens": {0: Dim("batch", min=1, max=64)}})
    tokens = torch.randint(0, 20, (3, 12))
    torch.testing.assert_close(program.module()(tokens), model(tokens))

    class PerCall(torch.nn.Module):
        def __init__(self, mask):
            super().__init__()
            self.attn, self.mask = SparseAttention(8, 2), mask

        def forward(self, x):
            return self.attn(x, mask=self.mask)

    allowed = torch.ones(6, 6, dtype=torch.bool).tril()
    for mask in (allowed, st.tensor(allowed.float(), format="coo")):
        layer = PerCall(mask).eval()
        program = export(layer, (torch.randn(2, 6, 8),), strict=False,
                         dynamic_shapes={"x": {0: Dim("b", min=1, max=64)}})
        x = torch.randn(3, 6, 8)
        torch.testing.assert_close(program.module()(x), layer(x))


@pytest.mark.parametrize("strict", [False, True])
def test_export_keeps_the_batch_dynamic(strict):
    """``torch.export`` with a dynamic batch: the copies of the mask the batch and heads
    need were built in the graph, which fixed the batch (a constraint violation), and
    strict export stopped at the mask's graph break. Now one op per layer takes the
    sequence's mask and the copy count, and the program runs any batch as eager."""
    from torch.export import Dim, export
    model = _small_transformer(masks.longformer(12, 2, global_tokens=1)).eval()
    program = export(model, (torch.randint(0, 20, (2, 12)),), strict=strict,
                     dynamic_shapes={"tokens": {0: Dim("batch", min=1, max=64)}})
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.sparsetorch.block_diagonal_attention.default) == 2
    exported = program.module()
    for batch in (1, 5):
        tokens = torch.randint(0, 20, (batch, 12))
        out, ref = exported(tokens), model(tokens)
        torch.testing.assert_close(out, ref)
        g = torch.randn_like(out)
        names = [n for n, p in model.named_parameters() if n.startswith("layers.0.attn")]
        assert len(names) == 4
        mine = dict(exported.named_parameters())
        for a, b in zip(torch.autograd.grad(out, [mine[n] for n in names], g),
                        torch.autograd.grad(ref, [dict(model.named_parameters())[n]
                                                  for n in names], g)):
            torch.testing.assert_close(a, b)

