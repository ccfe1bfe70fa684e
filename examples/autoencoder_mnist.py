#!/usr/bin/env python
"""Train ``st.models.SparseAutoencoder`` (784 -> 256 -> 784, 90%-sparse SparseLinear
weights) on MNIST digits fed as sparse rows, and print the reconstruction loss falling.

    python examples/autoencoder_mnist.py                  # 3 epochs on 10k digits (~1 min)
    python examples/autoencoder_mnist.py --train 60000 --epochs 10 --density 0.05

Each batch of digits (about 81% zero pixels) is handed to the model as a CSR SparseTensor;
at 19% nonzero pixels the encoder multiplies it densified, which is faster there (see
``SparseLinear``: sparse inputs pay below about 3% density); the decoder takes the dense
code. Loss:
mean squared error of the sigmoid reconstruction; Adam, learning rate 1e-3, batch 128. The
test loss is printed before training and after every epoch. Data: ``st.datasets.mnist``.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import sparsetorch as st


def test_loss(model, images, batch=1000) -> float:
    model.eval()
    with torch.no_grad():
        total = sum(F.mse_loss(model(st.tensor(x, "csr")), x, reduction="sum").item()
                    for x in images.split(batch))
    return total / images.numel()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train", type=int, default=10000, help="training digits used (10000)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    train = st.datasets.mnist(train=True, dtype=torch.float32).images[:args.train].flatten(1)
    test = st.datasets.mnist(train=False, dtype=torch.float32).images[:2000].flatten(1)
    model = st.models.SparseAutoencoder(784, 256, density=args.density)
    print(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    print(f"before training: test MSE {test_loss(model, test):.4f}")
    for epoch in range(1, args.epochs + 1):
        model.train()
        start = time.perf_counter()
        for idx in torch.randperm(len(train)).split(args.batch):
            x = train[idx]
            opt.zero_grad()
            F.mse_loss(model(st.tensor(x, "csr")), x).backward()
            opt.step()
        print(f"epoch {epoch}: test MSE {test_loss(model, test):.4f} "
              f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
