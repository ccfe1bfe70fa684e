#!/usr/bin/env python
"""A task local attention cannot solve: the class of the last token, read at the first.

Sequences of ``--length`` random tokens (vocabulary 16); the label is whether the last
token is in the upper half of the vocabulary, and the classifier reads only position 0's
final state (``pool="first"``, a CLS token). A ``SparseTransformer`` with a Longformer mask
(a sliding window of ``--window`` keys each side plus one global token, position 0, which
attends to everything) trains on fresh batches and is scored on a held-out set. The same
model with the sliding window alone lets position 0 see at most ``layers * window``
positions away, far short of the last one, so it stays at chance (50%).

    python examples/transformer_synthetic.py             # ~2 minutes (both models)
    python examples/transformer_synthetic.py --length 512 --window 8 --no-baseline

Measured (2026-12-03, --threads 1 on a heavily loaded 2-core machine, ~1 minute a model):
Longformer 100.0% held-out accuracy (loss 0.004 at step 200), sliding window only 50%.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from sparsetorch.models import SparseTransformer
from sparsetorch.nn import masks

VOCAB = 16


def batch(n: int, length: int, generator: torch.Generator):
    tokens = torch.randint(0, VOCAB, (n, length), generator=generator)
    return tokens, (tokens[:, -1] >= VOCAB // 2).long()


def train(mask, args, label: str) -> float:
    """Train a fresh model with ``mask``; return held-out accuracy."""
    torch.manual_seed(0)
    model = SparseTransformer(VOCAB, 2, embed_dim=args.dim, num_heads=4, num_layers=2,
                              ff_dim=2 * args.dim, max_len=args.length, mask=mask,
                              pool="first")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(1)
    test_x, test_y = batch(1024, args.length, torch.Generator().manual_seed(2))
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = batch(args.batch, args.length, data)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps:
            print(f"  [{label}] step {step:4d}  loss {loss.item():.3f}  "
                  f"{time.perf_counter() - start:5.1f} s")
    model.eval()
    with torch.no_grad():
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    print(f"  [{label}] held-out accuracy {acc:.1%} (chance 50%)")
    return acc


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--window", type=int, default=4, help="keys on each side")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-baseline", action="store_true", help="skip the window-only model")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"longformer (window + global token 0)":
               train(masks.longformer(args.length, args.window, global_tokens=1), args,
                     "longformer")}
    if not args.no_baseline:
        results["sliding window only"] = train(masks.sliding_window(args.length, args.window),
                                               args, "window")
    for name, acc in results.items():
        print(f"{name:40s} {acc:.1%}")


if __name__ == "__main__":
    main()
