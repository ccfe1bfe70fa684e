"""A sparse autoencoder: ``SparseLinear`` encoder and decoder (784 -> 256 -> 784 for MNIST).

In: dense ``(batch, in_features)`` rows or a 2-D SparseTensor of them (e.g. MNIST digits,
about 80% zeros). Out: dense reconstructions in ``(0, 1)``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..nn import SparseLinear


class SparseAutoencoder(nn.Module):
    """``sigmoid(decoder(relu(encoder(x))))`` with both layers ``SparseLinear`` of
    ``density`` (random patterns; ``blocksize`` stores them in BSR). Train it with
    ``F.mse_loss(model(x), dense_x)`` or binary cross-entropy. ``encode(x)`` gives the
    hidden code.

    Example:
        >>> import torch, sparsetorch as st
        >>> ae = st.models.SparseAutoencoder(16, 4, density=0.5)
        >>> ae(torch.rand(3, 16)).shape
        torch.Size([3, 16])
    """

    def __init__(self, in_features: int = 784, hidden: int = 256, density: float = 0.1, *,
                 blocksize=None, generator=None):
        super().__init__()
        # the activations run in the layers' kernels, as each output is written
        self.encoder = SparseLinear(in_features, hidden, density=density, blocksize=blocksize,
                                    generator=generator, activation="relu")
        self.decoder = SparseLinear(hidden, in_features, density=density, blocksize=blocksize,
                                    generator=generator, activation="sigmoid")

    def encode(self, x) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, x) -> torch.Tensor:
        return self.decoder(self.encoder(x))
