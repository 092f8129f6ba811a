"""Where paged-jax keeps what it downloads or builds: one root for every cache."""

from __future__ import annotations

import os
import pathlib

CACHE_ENV = "PAGED_JAX_CACHE"


def cache_root() -> pathlib.Path:
    """``$PAGED_JAX_CACHE``, else ``$XDG_CACHE_HOME/paged-jax``, else ``~/.cache/paged-jax``.
    Under it: ``models/`` (downloaded models), ``kernels/`` (the C kernels built for this
    CPU) and ``xla/`` (compiled steps; ``$PAGED_JAX_COMPILATION_CACHE`` moves only that)."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "paged-jax"
