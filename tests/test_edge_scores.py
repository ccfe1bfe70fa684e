"""ops/edge_scores.py: GAT's additive scores, ``leaky_relu(a[dst] + a[src])``, and their
gradient against the same torch ops, over dtypes, slopes (0, negative, over 1), sizes (no
entries, one thread, several), non-finite terms and repeated indices."""
from __future__ import annotations

import pytest
import torch

from dense_check import private_kernel_cache  # noqa: F401
from sparsetorch.ops import edge_scores
from sparsetorch.ops.edge_scores import additive_scores

CASES = [(0, 5), (1, 1), (9, 3), (edge_scores._PARALLEL_ENTRIES + 77, 1000),
         (edge_scores._PARALLEL_ENTRIES, 7)]   # (entries, terms): the last hits few terms


def _by_torch(a, dst, src, slope):
    return torch.nn.functional.leaky_relu(a[dst] + a[src], slope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("slope", [0.2, 0.0, -0.3, 1.5])
@pytest.mark.parametrize("entries, terms", CASES)
def test_against_torch(dtype, slope, entries, terms):
    gen = torch.Generator().manual_seed(entries + terms)
    a = torch.randn(terms, dtype=dtype, generator=gen)
    if terms >= 4:   # (NaN and infinities: torch's leaky_relu keeps NaN, inf * 0 is NaN)
        a[1], a[2], a[3] = float("nan"), float("inf"), -float("inf")
    dst, src = (torch.randint(0, terms, (entries,), generator=gen) for _ in range(2))
    g = torch.randn(entries, dtype=dtype, generator=gen)
    ours, theirs = a.clone().requires_grad_(), a.clone().requires_grad_()
    out = additive_scores(ours, dst, src, slope)
    expected = _by_torch(theirs, dst, src, slope)
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    out.backward(g)
    expected.backward(g)
    tol = 1e-12 if dtype == torch.float64 else 1e-4   # (sums in another order)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=tol, atol=tol * entries ** 0.5,
                               equal_nan=True)


def test_gradcheck_and_create_graph():
    a = torch.randn(6, dtype=torch.float64, requires_grad=True)
    dst, src = torch.tensor([0, 1, 1, 5, 3, 3]), torch.tensor([2, 2, 4, 5, 0, 3])
    assert torch.autograd.gradcheck(lambda a: additive_scores(a, dst, src, 0.2), (a,))
    assert torch.autograd.gradgradcheck(lambda a: additive_scores(a, dst, src, 0.2), (a,))
    # the gradient of the gradient reaches a itself, through a strided view too (the
    # gradient was taken at a detached copy: 'not used in the graph')
    b = torch.randn(12, dtype=torch.float64)[::2].requires_grad_()
    second = []
    for fn in (additive_scores, _by_torch):
        g, = torch.autograd.grad(fn(b * 2, dst, src, 0.2).pow(2).sum(), b, create_graph=True)
        second.append(torch.autograd.grad(g.pow(2).sum(), b)[0])
    torch.testing.assert_close(*second)


def test_other_inputs_take_torch_ops(monkeypatch):
    """A strided view, half precision, int32 indices and the torch backend give torch's
    results (the kernel takes contiguous float32/float64 terms and int64 indices)."""
    a = torch.randn(10, 2)[:, 0]
    dst, src = torch.tensor([0, 9, 4]), torch.tensor([3, 3, 8])
    for args in [(a, dst, src), (a.half(), dst, src), (a, dst.int(), src.int())]:
        torch.testing.assert_close(additive_scores(*args, 0.2), _by_torch(*args, 0.2))
    monkeypatch.setenv("SPARSETORCH_BACKEND", "torch")
    monkeypatch.setattr(edge_scores, "_AdditiveScores", None)   # (must not be reached)
    torch.testing.assert_close(additive_scores(a, dst, src, 0.2), _by_torch(a, dst, src, 0.2))
