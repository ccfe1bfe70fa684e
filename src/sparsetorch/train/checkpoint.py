"""Checkpoints for sparse training, written atomically (``sparsetorch._files``: a temporary
file in the same folder, then ``os.replace``), so a run killed while saving leaves the
previous checkpoint intact.

In: a path, the model, the trainer (which carries the optimizer and random generators) and
any picklable extras (epoch, data-order generator state, ...). Out: the same, restored.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from .._files import atomic_write


def save_checkpoint(path, *, model: torch.nn.Module, trainer, **extra) -> Path:
    """Write ``model`` weights, ``trainer.state_dict()`` (masks, step count, optimizer state,
    generator), torch's global CPU RNG state and ``extra`` to ``path`` atomically.

    Example:
        >>> import torch, tempfile, os, sparsetorch as st
        >>> model = torch.nn.Linear(4, 4)
        >>> t = st.train.Static(model, torch.optim.SGD(model.parameters(), lr=0.1), density=0.5)
        >>> p = st.train.save_checkpoint(os.path.join(tempfile.mkdtemp(), "c.pt"),
        ...                              model=model, trainer=t, epoch=3)
        >>> st.train.load_checkpoint(p, model=model, trainer=t)
        {'epoch': 3}
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"model": model.state_dict(), "trainer": trainer.state_dict(),
            "torch_rng": torch.get_rng_state(), "extra": extra}
    return atomic_write(path, lambda f: torch.save(blob, f), who="save_checkpoint")


def load_checkpoint(path, *, model: torch.nn.Module, trainer) -> dict:
    """Restore what ``save_checkpoint`` wrote into ``model`` and ``trainer`` (the trainer
    first, so truly sparse layers get their saved patterns before their values); returns the
    extras. Also restores torch's global CPU RNG state (dropout, shuffling by default).

    All or nothing: a checkpoint that does not fit (another architecture, a damaged file)
    raises with ``model`` and ``trainer`` as they were. The file is unpickled in full
    (``weights_only=False``: it holds generator states and extras), so load only
    checkpoints you trust."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: {path} does not exist")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:   # (pickle, zip and I/O errors of a damaged file)
        raise ValueError(f"load_checkpoint: {path} is not a readable checkpoint "
                         f"({type(e).__name__}: {e}); was it written completely by "
                         "st.train.save_checkpoint?") from e
    missing = {"model", "trainer", "torch_rng"} - set(blob) if isinstance(blob, dict) else \
        {"model", "trainer", "torch_rng"}
    if missing:
        raise ValueError(f"load_checkpoint: {path} lacks {sorted(missing)}; it was not written "
                         "by st.train.save_checkpoint")
    kept_model = {k: v.clone() for k, v in model.state_dict().items()}
    kept_trainer = copy.deepcopy(trainer.state_dict())
    try:
        trainer.load_state_dict(blob["trainer"])
        model.load_state_dict(blob["model"])
        torch.set_rng_state(blob["torch_rng"])
    except Exception:
        trainer.load_state_dict(kept_trainer)
        model.load_state_dict(kept_model)
        raise
    return blob.get("extra", {})
