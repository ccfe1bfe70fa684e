"""Sparse training: RigL, SET, SNFS, Static and gradual magnitude pruning, with ERK/ER/uniform
layer densities, masked (dense weights + masks) or truly sparse (``st.nn.SparseLinear``)
layers, DDP support and atomic, exactly resumable checkpoints.

Example:
    >>> import torch, sparsetorch as st
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(20, 30), nn.ReLU(), nn.Linear(30, 10))
    >>> opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    >>> rigl = st.train.RigL(model, opt, density=0.2, total_steps=1000)
    >>> {k: round(v, 3) for k, v in rigl.densities.items()}
    {'0.weight': 0.167, '2.weight': 0.267}
"""
from .algorithms import SET, SNFS, MagnitudePruning, RigL, Static
from .checkpoint import load_checkpoint, save_checkpoint
from .densities import DISTRIBUTIONS, kept_count, layer_densities
from .engine import SparseTrainer
from .schedules import cosine_drop_fraction, cubic_sparsity, is_update_step

__all__ = ["RigL", "SET", "SNFS", "Static", "MagnitudePruning", "SparseTrainer",
           "layer_densities", "kept_count", "DISTRIBUTIONS", "save_checkpoint",
           "load_checkpoint", "cosine_drop_fraction", "cubic_sparsity", "is_update_step"]
