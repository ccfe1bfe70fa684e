#!/usr/bin/env python
"""Fine-tune a sparsified CNN: accuracy is the user's, speed is ours.

A small MobileNet-style CNN (stem, depthwise-separable blocks, an inverted residual, written
here as a user would) is trained dense on MNIST for a few hundred steps, made 90% sparse by
``st.sparsify`` (magnitude pruning of every 1x1 convolution and the classifier, batch norm
kept since we keep training: ``fold_bn=False``), then fine-tuned with the pattern fixed: the
optimizer steps the stored values only (``SparseConv2d.values``), gradients are sampled on
the pattern. Prints the loss before and after fine-tuning and test accuracy at each stage,
and checks that no pruned weight came back.

    python examples/sparse_finetune.py            # ~2 CPU-minutes
    python examples/sparse_finetune.py --steps 100 --sparsity 0.95
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import sparsetorch as st


class SmallNet(nn.Module):
    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        w = width

        def block(cin, cout, stride):   # depthwise 3x3, then pointwise 1x1
            return nn.Sequential(nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False),
                                 nn.BatchNorm2d(cin), nn.ReLU(),
                                 nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout),
                                 nn.ReLU())
        self.stem = nn.Sequential(nn.Conv2d(1, w, 3, 2, 1, bias=False), nn.BatchNorm2d(w), nn.ReLU())
        self.b1 = block(w, 2 * w, 1)
        self.b2 = block(2 * w, 4 * w, 2)
        self.res = nn.Sequential(nn.Conv2d(4 * w, 8 * w, 1, bias=False), nn.BatchNorm2d(8 * w),
                                 nn.ReLU6(), nn.Conv2d(8 * w, 4 * w, 1, bias=False),
                                 nn.BatchNorm2d(4 * w))
        self.head = nn.Linear(4 * w, classes)

    def forward(self, x):
        x = self.b2(self.b1(self.stem(x)))
        x = x + self.res(x)
        return self.head(x.mean((2, 3)))


def train(model, images, labels, steps, batch, lr, seed):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, images.shape[0], (batch,), generator=g)
        loss = F.cross_entropy(model(images[idx]), labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@torch.no_grad()
def accuracy(model, images, labels):
    model.eval()
    return (model(images).argmax(1) == labels).float().mean().item()


def _masks(model):
    return {n: m.mask().clone() for n, m in model.named_modules() if hasattr(m, "mask")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    train_x, train_y = st.datasets.mnist(train=True, dtype=torch.float32)
    test_x, test_y = st.datasets.mnist(train=False, dtype=torch.float32)
    train_x, test_x = train_x[:, None], test_x[:2000, None]
    test_y = test_y[:2000]

    dense = SmallNet()
    train(dense, train_x, train_y, a.steps, a.batch, 3e-3, seed=1)
    print(f"dense after {a.steps} steps: test accuracy {accuracy(dense, test_x, test_y):.3f}")

    sparse = st.sparsify(dense, sparsity=a.sparsity, fold_bn=False)
    print(f"sparsified at {a.sparsity:.0%}: test accuracy {accuracy(sparse, test_x, test_y):.3f} "
          f"(before fine-tuning)")
    masks = _masks(sparse)
    losses = train(sparse, train_x, train_y, a.steps, a.batch, 1e-3, seed=2)
    k = max(1, len(losses) // 10)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print(f"fine-tuning loss: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    print(f"sparse after fine-tuning: test accuracy {accuracy(sparse, test_x, test_y):.3f}")
    after = _masks(sparse)
    assert all(torch.equal(masks[n], after[n]) for n in masks), "the sparsity pattern changed"
    print(f"pattern fixed: {len(masks)} sparse layers kept their masks")
    if not last < first:
        raise SystemExit("fine-tuning loss did not fall")


if __name__ == "__main__":
    main()
