"""MNIST from the shipped IDX files (``mnist/*-ubyte.gz``; uncompressed copies also work)."""
from __future__ import annotations

import gzip
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ._paths import dataset_dir

_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60000),
          False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10000)}


class MNIST(NamedTuple):
    images: torch.Tensor   # N x 28 x 28, uint8 (0..255) or float in [0, 1]
    labels: torch.Tensor   # N, int64


def mnist(root=None, train=True, dtype=torch.uint8) -> MNIST:
    """MNIST images and labels: ``train=True`` gives the 60000 training digits, ``False``
    the 10000 test digits. ``dtype=torch.uint8`` keeps raw pixels; a floating dtype scales
    them to [0, 1]. Returns ``MNIST(images, labels)`` (a named tuple).

    Example:
        >>> import torch, sparsetorch as st
        >>> X, y = st.datasets.mnist(train=False, dtype=torch.float32)   # doctest: +SKIP
        >>> X.shape, y.shape, round(X.mean().item(), 4)                  # doctest: +SKIP
        (torch.Size([10000, 28, 28]), torch.Size([10000]), 0.1325)
    """
    if not isinstance(dtype, torch.dtype) or not (dtype == torch.uint8 or
                                                   dtype.is_floating_point):
        raise TypeError(f"mnist: dtype={dtype} is not supported; use torch.uint8 (raw pixels) "
                        "or a floating dtype (scaled to [0, 1])")
    folder = dataset_dir("mnist", root)
    if not isinstance(train, (bool, np.bool_)):   # (bool("no") is True)
        raise TypeError(f"mnist: train must be True or False, got {train!r}")
    img_name, lbl_name, count = _FILES[bool(train)]
    images = _idx(folder, img_name, 2051, 3)
    labels = _idx(folder, lbl_name, 2049, 1)
    # (the other split's files in this one's place, or a damaged label, loaded: a probe)
    if images.shape != (count, 28, 28) or labels.shape[0] != count:
        raise ValueError(f"mnist: {folder} holds {images.shape} images and {labels.shape[0]} "
                         f"labels in {img_name}/{lbl_name}; expected {count} 28x28 images with "
                         "one label each")
    if labels.size and labels.max() > 9:
        raise ValueError(f"mnist: {folder / lbl_name} holds label {labels.max()}; digits are "
                         "labelled 0-9: the file is damaged; restore the shipped one")
    x = torch.from_numpy(images.copy())
    if dtype != torch.uint8:
        x = x.to(dtype) / 255
    return MNIST(x, torch.from_numpy(labels.astype(np.int64)))


def _idx(folder: Path, name: str, magic: int, ndim: int) -> np.ndarray:
    gz, raw = folder / (name + ".gz"), folder / name
    if gz.is_file():
        path = gz
        try:
            data = gzip.decompress(gz.read_bytes())
        except (OSError, EOFError) as e:   # (gzip.BadGzipFile is an OSError)
            raise ValueError(f"mnist: {gz} is not a readable gzip file ({e}); restore the "
                             "shipped MNIST files (see shared/data/README.md)") from e
    elif raw.is_file():
        path, data = raw, raw.read_bytes()
    else:
        raise FileNotFoundError(f"mnist: neither {gz} nor {raw} exists; restore the shipped "
                                "MNIST files (see shared/data/README.md)")
    head = 4 + 4 * ndim
    found = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
    if found != magic:
        raise ValueError(f"mnist: {path} starts with magic {found}, expected {magic}; it is "
                         "not an IDX file of the right kind")
    if len(data) < head:
        raise ValueError(f"mnist: {path} holds {len(data)} bytes, fewer than its {head}-byte "
                         "header; the file is truncated")
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    if len(data) - head != int(np.prod(dims)):
        raise ValueError(f"mnist: {path} declares shape {dims} but holds {len(data) - head} "
                         "bytes of data; the file is truncated or corrupt")
    return np.frombuffer(data, np.uint8, offset=head).reshape(dims)
