"""In-place value updates of a SparseTensor (ops/inplace.py): checkpoints load into
SparseTensor buffers, torch.optim steps SparseTensor parameters (SGD itself, any optimizer
through ``W.values``) exactly as it steps the same weights dense and masked, and updates
that would change the pattern raise with the fix.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparsetorch as st

F64 = torch.float64


def _weight(seed=0, shape=(6, 5)):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(shape, dtype=F64, generator=g)
    d[torch.rand(shape, generator=g) < 0.5] = 0
    d[0] = 0   # an empty row
    return d


class _Pruned(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.register_buffer("A", st.tensor(d, format="csr"))


def test_load_state_dict_into_a_sparse_buffer():
    d = _weight()
    src, dst = _Pruned(d), _Pruned(d)
    dst.A.values.zero_()
    arrays = dict(dst.A._level_arrays)
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.A.to_dense(), d)
    assert all(dst.A._level_arrays[k] is arrays[k] for k in arrays)   # values copied in place
    other = _Pruned(_weight(seed=1))                              # another pattern
    with pytest.raises(RuntimeError, match="assign=True"):   # (torch wraps our ValueError)
        other.load_state_dict(src.state_dict())
    other.load_state_dict(src.state_dict(), assign=True)
    assert torch.equal(other.A.to_dense(), d)


@pytest.mark.parametrize("momentum, weight_decay, nesterov", [
    (0.0, 0.0, False), (0.9, 0.01, False), (0.9, 0.0, True)])
def test_sgd_steps_a_sparse_parameter_like_a_masked_dense_one(momentum, weight_decay,
                                                              nesterov):
    d = _weight(seed=2)
    mask = (d != 0).to(F64)
    W = st.tensor(d, format="csr").requires_grad_()
    Wd = d.clone().requires_grad_()
    x = torch.randn(4, 5, dtype=F64)
    kw = dict(lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    _train_both(torch.optim.SGD([W], **kw), torch.optim.SGD([Wd], **kw),
                lambda: F.linear(x, W).tanh().sum(), lambda: F.linear(x, Wd * mask).tanh().sum())
    torch.testing.assert_close(W.to_dense(), Wd.detach() * mask, rtol=1e-12, atol=1e-12)


def _train_both(opt, dense_opt, loss, dense_loss, steps=3):
    """``steps`` optimizer steps of the sparse and the masked dense model side by side."""
    for _ in range(steps):
        for o, f in ((opt, loss), (dense_opt, dense_loss)):
            o.zero_grad()
            f().backward()
            o.step()


def test_adam_takes_the_values_and_explains_itself_when_given_the_tensor():
    d = _weight(seed=3)
    mask = (d != 0).to(F64)
    x = torch.randn(4, 5, dtype=F64)
    W = st.tensor(d, format="csr").requires_grad_()
    F.linear(x, W).sum().backward()
    with pytest.raises(NotImplementedError, match=r"pass W\.values"):
        torch.optim.Adam([W]).step()
    W = st.tensor(d, format="csr").requires_grad_()
    Wd = d.clone().requires_grad_()
    _train_both(torch.optim.Adam([W.values], lr=0.01), torch.optim.Adam([Wd], lr=0.01),
                lambda: F.linear(x, W).square().sum(),
                lambda: F.linear(x, Wd * mask).square().sum())
    torch.testing.assert_close(W.to_dense(), Wd.detach() * mask, rtol=1e-12, atol=1e-12)


def test_inplace_ops_keep_the_pattern():
    A = st.tensor(_weight(seed=4), format="csr")
    d = A.to_dense()
    B = A.clone()   # equal arrays, not the same objects
    assert A.mul_(2) is A and torch.equal(A.to_dense(), 2 * d)
    A.div_(torch.tensor(2.0)).add_(B, alpha=3).sub_(B)
    torch.testing.assert_close(A.to_dense(), 3 * d)
    A.addcmul_(B, B, value=0.5).addcdiv_(B, B.with_values(B.values.abs() + 1))
    A.lerp_(B, 0.25)
    ref = 3 * d + 0.5 * d * d + d / (d.abs() + 1)
    torch.testing.assert_close(A.to_dense(), ref + 0.25 * (d - ref))
    Z = torch.zeros_like(A)
    assert Z.format == A.format and Z.nnz == A.nnz and not Z.to_dense().any()
    assert A.zero_() is A and not A.to_dense().any()
    assert A.coalesce() is A and A.is_coalesced()


def test_the_same_pattern_at_another_index_width_updates_in_place():
    """Equal coordinates stored as int64 instead of int32 are the same pattern (a copy_
    between them was refused as 'another pattern' though entries and shapes matched)."""
    d = _weight(seed=5)
    A = st.tensor(d, format="csr")
    B = st.tensor(2 * d, format="csr", index_dtype=torch.int64)
    assert A.copy_(B) is A and torch.equal(A.to_dense(), 2 * d)
    A.add_(B)
    assert torch.equal(A.to_dense(), 4 * d) and A.index_dtype == torch.int32
    moved = d.roll(1, 0)   # the same entry count, other coordinates
    assert not torch.equal(moved != 0, d != 0)
    with pytest.raises(ValueError, match="another pattern"):
        A.copy_(st.tensor(moved, format="csr", index_dtype=torch.int64))


def test_updates_that_would_change_the_pattern_raise():
    A = st.tensor(_weight(seed=5), format="csr")
    before = A.values.clone()
    other = st.tensor(_weight(seed=6), format="csr")
    with pytest.raises(ValueError, match="another pattern"):
        A.add_(other)
    with pytest.raises(NotImplementedError, match="implicit zero"):
        A.add_(1.0)
    with pytest.raises(TypeError, match="same pattern"):
        A.mul_(torch.ones(6, 5, dtype=F64))
    with pytest.raises(ValueError, match="another pattern"):
        A.copy_(other)
    assert torch.equal(A.values, before)   # nothing changed on error
