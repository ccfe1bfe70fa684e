"""st.freeze: the frozen copy computes what the model computes (sparse MobileNets, models
written here with residuals, keyword arguments, parameters read in forward), fuses the
expansion/depthwise pairs the graph shows, keeps hooks, leaves the model alone, and refuses
what it cannot honour (training, moving, pickling, untraceable models)."""
from __future__ import annotations

import copy
import pickle
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sparsetorch as st
from dense_check import private_kernel_cache  # noqa: F401
from test_sparsify import Branchy, TinyResNet, _randomise_bn


class ExpandThenDepthwise(nn.Module):
    """A pair the module tree does not show (no nn.Sequential): only the graph does."""

    def __init__(self):
        super().__init__()
        self.expand = nn.Conv2d(8, 32, 1)
        self.act = nn.ReLU6()
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.project = nn.Conv2d(32, 8, 1)
        self.scale = nn.Parameter(torch.tensor(0.5))   # read by forward: a get_attr node

    def forward(self, x, *, gain):
        y = self.project(F.relu(self.dw(self.act(self.expand(x)))))
        return x + gain * self.scale * y


class KeywordCall(nn.Module):
    """A traced-through module and a leaf called with keyword arguments, and dropout."""

    def __init__(self):
        super().__init__()
        self.inner = ExpandThenDepthwise()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = self.inner(x, gain=torch.ones(()))
        seq = y.flatten(2).transpose(1, 2)
        return self.drop(self.attn(seq, seq, seq, need_weights=False)[0])


def _same(frozen, model, *args, atol=1e-5, **kwargs):
    with torch.no_grad():
        expected = model(*args, **kwargs)
    got = frozen(*args, **kwargs)
    torch.testing.assert_close(got, expected, rtol=atol, atol=atol)
    return got


@pytest.mark.parametrize("build", [st.models.mobilenet_v1, st.models.mobilenet_v2])
@pytest.mark.parametrize("batch", [1, 3])
def test_sparse_mobilenets(build, batch):
    torch.manual_seed(0)
    sparse = st.sparsify(_randomise_bn(build(0.25, num_classes=10)), sparsity=0.8).eval()
    frozen = st.freeze(sparse)
    _same(frozen, sparse, torch.randn(batch, 3, 40, 40))
    if build is st.models.mobilenet_v2:   # every expansion runs fused with its depthwise
        assert len(re.findall(r"conv_0_0_features_\d+_conv_1_0\(", frozen.code)) == 16


def test_pair_fused_from_the_graph_and_parameters_read_in_forward():
    torch.manual_seed(1)
    sparse = st.sparsify(ExpandThenDepthwise(), sparsity=0.75).eval()
    frozen = st.freeze(sparse)
    assert "expand_dw" in frozen.code   # one step for the pair
    x = torch.randn(2, 8, 9, 7)
    _same(frozen, sparse, x, gain=torch.tensor(2.0))


def test_keyword_arguments_dropout_and_train_mode_model():
    torch.manual_seed(2)
    sparse = st.sparsify(KeywordCall(), sparsity=0.5)
    sparse.train()   # frozen copies run in eval mode whatever the model's mode
    frozen = st.freeze(sparse)
    assert sparse.training and "drop" not in frozen.code
    _same(frozen, copy.deepcopy(sparse).eval(), torch.randn(1, 8, 6, 6))


def test_user_resnet_dense_and_sparse():
    torch.manual_seed(3)
    dense = _randomise_bn(TinyResNet())
    x = torch.randn(2, 3, 10, 10)
    _same(st.freeze(dense), dense, x)
    sparse = st.sparsify(dense, sparsity=0.7)
    _same(st.freeze(sparse), sparse, x)


def test_hooks_run_and_keep_their_pair_unfused():
    torch.manual_seed(4)
    sparse = st.sparsify(ExpandThenDepthwise(), sparsity=0.75).eval()
    seen = []
    sparse.expand.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    frozen = st.freeze(sparse)
    assert "expand_dw" not in frozen.code
    _same(frozen, sparse, torch.randn(1, 8, 5, 5), gain=torch.ones(()))
    assert seen == [(1, 32, 5, 5), (1, 32, 5, 5)]   # the model's call, then the frozen copy's


def test_a_snapshot_the_model_left_unchanged():
    torch.manual_seed(5)
    sparse = st.sparsify(TinyResNet(), sparsity=0.5).train()
    state = copy.deepcopy(sparse.state_dict())
    frozen = st.freeze(sparse)
    assert sparse.training and all(p.requires_grad for p in sparse.parameters())
    x = torch.randn(1, 3, 8, 8)
    before = frozen(x)
    with torch.no_grad():
        for p in sparse.parameters():
            p.add_(1.0)
    torch.testing.assert_close(frozen(x), before)   # later changes do not reach it
    sparse.load_state_dict(state)
    _same(frozen, sparse.eval(), x)


def test_no_autograd_graph():
    sparse = st.sparsify(TinyResNet(), sparsity=0.5).eval()
    x = torch.randn(1, 3, 8, 8, requires_grad=True)
    assert not st.freeze(sparse)(x).requires_grad
    assert list(st.freeze(sparse).parameters()) == []


def test_refuses_training_moving_pickling():
    frozen = st.freeze(nn.Sequential(nn.Linear(3, 2)))
    assert frozen.eval() is frozen and st.freeze(frozen) is frozen
    with pytest.raises(ValueError, match="inference only.*freeze it again"):
        frozen.train()
    with pytest.raises(TypeError, match="cannot be moved or cast"):
        frozen.double()
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(frozen)


def test_untraceable_model_and_bad_arguments():
    with pytest.raises(ValueError, match="torch.fx cannot trace Branchy"):
        st.freeze(Branchy())
    with pytest.raises(TypeError, match="must be an nn.Module"):
        st.freeze(lambda x: x)
    frozen = st.freeze(st.sparsify(TinyResNet(), sparsity=0.5))
    with pytest.raises(ValueError, match=r"ChannelsFirstStem: input must be a dense \(N, 3, H, W\)"):
        frozen(torch.randn(1, 4, 8, 8))   # (the layers check their inputs as before)
    frozen = st.freeze(st.sparsify(ExpandThenDepthwise(), sparsity=0.5))
    with pytest.raises(ValueError, match="expand_depthwise3x3: expand_weight must be an"):
        frozen(torch.randn(1, 4, 8, 8), gain=torch.ones(()))


@pytest.mark.parametrize("sparsity, fused", [(0.9, True), (0.5, False)])
def test_pairs_with_long_rows_stay_two_kernels(sparsity, fused):
    """The fused kernel wins only where the expansion's rows are short (fuse.py)."""
    net = nn.Sequential(nn.Conv2d(64, 64, 1), nn.Conv2d(64, 64, 3, padding=1, groups=64))
    sparse = st.sparsify(net, sparsity=sparsity).eval()
    frozen = st.freeze(sparse)
    assert ("step_0_1(" in frozen.code) is fused
    assert (type(sparse).__name__ == "ExpandDepthwiseSequential") is fused
    _same(frozen, sparse, torch.randn(1, 64, 6, 6))


def test_plans_per_input_signature(monkeypatch):
    """Each step plans a call per input signature: shapes, layouts and thread counts
    interleaved, and more signatures than a step keeps (it forgets and plans again)."""
    import importlib
    monkeypatch.setattr(importlib.import_module("sparsetorch.nn.freeze"), "_MOST_PLANS", 3)
    torch.manual_seed(6)
    sparse = st.sparsify(_randomise_bn(st.models.mobilenet_v2(0.25, num_classes=10)),
                         sparsity=0.8).eval()
    frozen = st.freeze(sparse)
    old = torch.get_num_threads()
    try:
        for threads, (n, h) in zip([1, 2, 2, 1, 2, 2], [(1, 16), (2, 16), (1, 20), (1, 16),
                                                        (3, 12), (1, 20)]):
            torch.set_num_threads(threads)
            x = torch.randn(n, 3, h, h)
            _same(frozen, sparse, x)
            _same(frozen, sparse, x.contiguous(memory_format=torch.channels_last))
    finally:
        torch.set_num_threads(old)


def test_graph_model_layers_with_several_arguments():
    """Layers called with several arguments (a GCN's features and adjacency) freeze too."""
    torch.manual_seed(7)
    gcn = st.models.GCN(12, 8, 3).eval()
    x, edge_index = torch.randn(20, 12), torch.randint(0, 20, (2, 60))
    _same(st.freeze(gcn), gcn, x, edge_index)


def test_a_lone_layer_freezes():
    """A model that is itself one of the layers (torch.fx traces into a root, never takes
    it whole: its own refusal of tracing said "use st.freeze"), with its positional
    arguments and their defaults."""
    torch.manual_seed(3)
    layer = st.nn.SparseLinear(30, 6, density=0.3, activation="relu")
    _same(st.freeze(layer), layer, torch.randn(5, 30))
    conv = st.nn.GCNConv(12, 4).eval()
    _same(st.freeze(conv), conv, torch.randn(20, 12), torch.randint(0, 20, (2, 60)))
    attention = st.nn.SparseAttention(8, 2, mask=st.nn.masks.sliding_window(6, 2)).eval()
    frozen, q = st.freeze(attention), torch.randn(2, 6, 8)
    _same(frozen, attention, q)
    _same(frozen, attention, q, q, q)
    assert "step_layer" in frozen.code


def test_a_hooked_block_is_called_with_its_hooks():
    """A block torch.fx traced into ran its hook once, on a Proxy, while freezing, and the
    frozen model never."""
    sparse = st.sparsify(st.models.mobilenet_v2(0.25, num_classes=10), sparsity=0.9).eval()
    seen = []
    sparse.features[3].register_forward_hook(lambda m, i, out: seen.append(type(out)))
    frozen = st.freeze(sparse)
    assert seen == []
    _same(frozen, sparse, torch.randn(1, 3, 32, 32))
    assert seen == [torch.Tensor, torch.Tensor]   # the model's call, then the frozen copy's


class OptionalArguments(nn.Module):
    """Branches on arguments that are None or bools, which a traced placeholder cannot
    take: freezing baked the branch of an argument given, so a call leaving ``mask`` out
    multiplied by None, and one with ``mask=None`` passed to a layer taking None as "no
    mask" would have run without the default mask."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("default_mask", torch.tensor([1.0, 0.0, 1.0, 0.0]))

    def forward(self, x, mask=None, *, double=False, scale=2.0):
        if mask is None:
            mask = self.default_mask
        y = self.lin(x) * mask * scale
        return y * 2 if double else y


def test_optional_arguments_are_specialised_per_call():
    torch.manual_seed(6)
    model, x = OptionalArguments().eval(), torch.randn(3, 4)
    frozen = st.freeze(model)
    assert "default_mask" in frozen.code   # (the defaults' trace)
    for args, kwargs in [((x,), {}), ((x, None), {}), ((x, torch.rand(4)), {}),
                         ((x,), {"mask": torch.rand(4), "double": True}),
                         ((x, None), {"double": True, "scale": 0.5}), ((), {"x": x})]:
        _same(frozen, model, *args, **kwargs)
    for args, kwargs, match in [((x, None, True), {}, "too many positional"),
                                ((x,), {"x": x}, "multiple values for argument 'x'"),
                                ((), {}, "missing a required argument: 'x'"),
                                ((x,), {"masks": None}, "got an unexpected keyword argument 'masks'")]:
        with pytest.raises(TypeError, match="the frozen OptionalArguments: " + match):
            frozen(*args, **kwargs)


class RequiredMask(nn.Module):
    """None given for a parameter with no default, a required bool, positional-only and
    ``*args``/``**kwargs`` parameters (a probe's cases: the mask was dropped silently)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("causal", torch.tensor([1.0, 1.0, 0.0, 0.0]))

    def forward(self, x, mask, causal: bool, /, *rest, scale=1.0, **extra):
        y = self.lin(x) * (self.causal if mask is None else mask) * scale
        return y.tril() if causal else y   # (rest and extra: passed on, unused)


def test_none_and_bools_without_such_defaults_varargs_and_root_hooks():
    torch.manual_seed(7)
    model, x = RequiredMask().eval(), torch.randn(4, 4)
    frozen = st.freeze(model)
    for args, kwargs in [((x, None, True), {}), ((x, None, False), {"scale": 2.0}),
                         ((x, torch.rand(4), True, 5), {"shift": 3.0})]:
        _same(frozen, model, *args, **kwargs)
    with pytest.raises(TypeError, match="positional only, but was passed as a keyword"):
        frozen(x, mask=None, causal=True)
    hooked = nn.Sequential(nn.Linear(4, 4)).eval()
    hooked.register_forward_hook(lambda module, args, out: out * 0)
    assert not st.freeze(hooked)(x).any()   # (the root's hook ran: its forward alone did not)
