"""Ready-made sparse models built from ``sparsetorch.nn`` layers. See README.md here."""

__all__ = []
