"""JAX's persistent compilation cache, on by default for ``LLM`` and the CLI.

A compiled step is written to a directory on disk, so the next process that runs the
same model with the same shape buckets loads it instead of compiling it again. The
directory: ``compilation_cache=`` of ``LLM``, else the environment variable
``PAGED_JAX_COMPILATION_CACHE``, else ``xla/`` under paged-jax's cache root
(``$PAGED_JAX_CACHE``, else ``$XDG_CACHE_HOME/paged-jax``, else ``~/.cache/paged-jax``).
``False``, or the variable set to ``0`` or ``off``, leaves the cache off. If the process
already configured JAX's cache (``jax.config.jax_compilation_cache_dir``), that setting is
kept.

JAX's cache is process-wide: turning it on for one engine turns it on for every jitted
function compiled afterwards (each entry is keyed by the program, its shapes, the jax
version and the device, so entries never mix).
"""

from __future__ import annotations

import os
import pathlib

import jax

from paged_jax.paths import cache_root

CACHE_ENV = "PAGED_JAX_COMPILATION_CACHE"
_OFF = ("0", "off", "false", "no")


def default_dir() -> pathlib.Path:
    """``xla/`` under paged-jax's cache root (``$PAGED_JAX_CACHE``, else
    ``$XDG_CACHE_HOME/paged-jax``, else ``~/.cache/paged-jax``)."""
    return cache_root() / "xla"


def resolve(setting: bool | str | os.PathLike | None) -> pathlib.Path | None:
    """The directory ``setting`` asks for (see the module docstring), or None for off."""
    if isinstance(setting, bool):
        return default_dir() if setting else None
    if setting is None:
        env = os.environ.get(CACHE_ENV)
        if env is None or env.strip() == "":
            return default_dir()
        if env.strip().lower() in _OFF:
            return None
        return pathlib.Path(env).expanduser()
    if isinstance(setting, (str, os.PathLike)):
        return pathlib.Path(setting).expanduser()
    raise TypeError(
        f"compilation_cache: expected a bool, a directory path or None, got {setting!r}"
    )


def enable(setting: bool | str | os.PathLike | None = None) -> pathlib.Path | None:
    """Turns the persistent cache on as ``setting`` asks; returns the directory in use.

    Returns the directory JAX already uses if the process configured one, and None when
    the cache stays off. A directory that cannot be created leaves the cache off (a
    warning, not an error: the engine works without it, only starts slower).
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return pathlib.Path(current)
    path = resolve(setting)
    if path is None:
        return None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        import logging

        logging.getLogger("paged_jax").warning(
            "compilation cache off: cannot create %s (%s)", path, e.strerror or e
        )
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Steps compile in seconds; cache anything that took a tenth of that, of any size.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
