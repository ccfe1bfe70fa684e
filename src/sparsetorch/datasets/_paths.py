"""Where the shipped data live: ``root=``, else ``$SPARSETORCH_DATA``, else a ``shared/data``
folder found by walking up from the package source (``<repo>/../shared/data`` or
``<repo>/shared/data``), then from the working directory. Loaders only read from there.
"""
from __future__ import annotations

import os
from pathlib import Path

ENV = "SPARSETORCH_DATA"
_HOW = (f"pass root='/path/to/shared/data' or set {ENV}=/path/to/shared/data (the folder "
        "holding planetoid/, graphs/, mnist/, dlmc/ and suitesparse/)")


def _candidates() -> list[Path]:
    """``shared/data`` under every ancestor of the package source, then of the cwd."""
    out: list[Path] = []
    for start in (Path(__file__).resolve(), Path.cwd().resolve()):
        for parent in start.parents if start.is_file() else (start, *start.parents):
            cand = parent / "shared" / "data"
            if cand not in out:
                out.append(cand)
    return out


def data_root(root=None) -> Path:
    """The folder holding sparsetorch's datasets, resolved as documented above.

    An explicit ``root`` or ``$SPARSETORCH_DATA`` must exist (no silent fallback when one is
    given); otherwise the first ``shared/data`` folder found wins. Raises
    ``FileNotFoundError`` listing every place it looked.

    Example:
        >>> import sparsetorch as st
        >>> root = st.datasets.data_root()     # doctest: +SKIP
        >>> sorted(p.name for p in root.iterdir())[:2]   # doctest: +SKIP
        ['README.md', 'SHA256SUMS']
    """
    if root is not None:
        if str(root) == "":   # (Path("") is the working directory)
            raise ValueError(f"sparsetorch data: root='' names no folder; {_HOW}")
        path = Path(root).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"sparsetorch data: root={str(root)!r} is not a folder; "
                                    f"{_HOW}")
        return _holding_data(path, f"root={str(root)!r}")
    env = os.environ.get(ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"sparsetorch data: {ENV}={env!r} is not a folder; fix "
                                    f"or unset it, or {_HOW}")
        return _holding_data(path, f"{ENV}={env!r}")
    looked = _candidates()
    for cand in looked:
        if cand.is_dir():
            return cand
    places = "\n  ".join(str(p) for p in looked)
    raise FileNotFoundError(f"sparsetorch data: no data folder found. Looked at root= (not "
                            f"given), ${ENV} (not set), and:\n  {places}\nTo fix, {_HOW}.")


SUBFOLDERS = ("planetoid", "graphs", "mnist", "dlmc", "suitesparse")


def _holding_data(path: Path, named: str) -> Path:
    """``path`` if it holds one of the datasets' folders: a folder named by the user that
    holds none (say, one level too high: the folder inside is suggested) would make every
    loader say "missing"."""
    if any((path / sub).is_dir() for sub in SUBFOLDERS):
        return path
    inner = next((c for c in (path / "data", path / "shared" / "data")
                  if any((c / sub).is_dir() for sub in SUBFOLDERS)), None)
    fix = f"did you mean {str(inner)!r}?" if inner else _HOW
    raise FileNotFoundError(f"sparsetorch data: {named} holds none of the dataset folders "
                            f"({', '.join(s + '/' for s in SUBFOLDERS)}); {fix}")


def dataset_dir(sub: str, root=None) -> Path:
    """``data_root(root) / sub``, or a ``FileNotFoundError`` naming it and the fix."""
    base = data_root(root)
    path = base / sub
    if not path.is_dir():
        raise FileNotFoundError(f"sparsetorch data: {path} does not exist (data root {base}); "
                                f"copy the {sub}/ folder there, or {_HOW}")
    return path


def need_file(path: Path, what: str) -> Path:
    """``path`` if it is a file, else a ``FileNotFoundError`` naming ``what`` and the fix."""
    if not path.is_file():
        raise FileNotFoundError(f"sparsetorch data: {what} needs {path}, which is missing; "
                                f"restore it from the shipped data (see shared/data/README.md)"
                                f", or {_HOW}")
    return path
