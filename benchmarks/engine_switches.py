"""The engine benchmark's A/B switches: context managers under which engines built draw
restricted rows another way (``sort_free``), run the GPU decode kernel's walk with or
without prefetch (``decode_prefetch``), send W8A16 products through the few-row kernel
or XLA (``w8a16_kernel``), run decode steps on the ragged kernel (``decode_kernel``), or
multiply a mixture's experts another way (``expert_way``).
Each restores what it changed; the engine's cached step functions are dropped where a
setting read at trace time changed (``traced_setting``)."""

from __future__ import annotations

import contextlib
import dataclasses


@contextlib.contextmanager
def sort_free(way: str):
    """While active, engines built draw restricted rows ``way`` on this backend ("default":
    as ``SORT_FREE_BACKENDS`` says; "off": the candidates and the full-sort fallback)."""
    import jax

    from paged_jax.engine import runner

    saved = runner.SORT_FREE_BACKENDS
    if way != "default":
        table = dict(saved)
        table.pop(jax.default_backend(), None)
        if way != "off":
            table[jax.default_backend()] = way
        runner.SORT_FREE_BACKENDS = table
    try:
        yield
    finally:
        runner.SORT_FREE_BACKENDS = saved


@contextlib.contextmanager
def traced_setting(owner, name: str, value):
    """While active, ``owner.name`` is ``value``: a module-level setting the engine's step
    reads when it is traced. The engine's step functions are cached per model
    (``runner._make_run``), so the cache is emptied on the way in and, where the setting
    changed, on the way out, and each engine traces its own step."""
    from paged_jax.engine import runner

    saved = getattr(owner, name)
    setattr(owner, name, value)
    runner._make_run.cache_clear()
    try:
        yield
    finally:
        if getattr(owner, name) != saved:
            runner._make_run.cache_clear()
        setattr(owner, name, saved)


def decode_prefetch(way: str):
    """While active, the Pallas GPU decode kernel's walk is ``way``: "default" (as
    ``tuning.DECODE_PREFETCH`` says), "on" (loading each next block ahead) or "off"."""
    from paged_jax.kernels.gpu import tuning

    if way == "default":
        return contextlib.nullcontext()
    return traced_setting(tuning, "DECODE_PREFETCH", way == "on")


@contextlib.contextmanager
def w8a16_kernel(way: str):
    """While active, W8A16 products (int8, fp8 weight-only) on a GPU go through the
    few-row Pallas product ("on"), XLA's dots ("off"), or as
    ``models.layers.KERNELS["w8a16"]`` says ("default"); the engine's cached steps are
    traced again (``traced_setting``)."""
    from paged_jax.engine import runner
    from paged_jax.models.layers import KERNELS, use_kernel

    if way == "default":
        yield
        return
    platforms = ("gpu",) if way == "on" else ()
    saved = KERNELS["w8a16"].platforms
    runner._make_run.cache_clear()
    try:
        with use_kernel("w8a16", platforms):
            yield
    finally:
        if platforms != saved:
            runner._make_run.cache_clear()


@contextlib.contextmanager
def decode_kernel(on: bool):
    """While active with ``on=False``, every engine step is built with ``decode_only=False``
    (the ragged kernel for decode steps too): the engine as it was before the decode path."""
    from paged_jax.metadata import AttentionMetadata

    orig = AttentionMetadata.__dict__["from_batch"]
    if not on:
        AttentionMetadata.from_batch = classmethod(
            lambda cls, b, **kw: dataclasses.replace(orig.__func__(cls, b, **kw), decode_only=False)
        )
    try:
        yield
    finally:
        AttentionMetadata.from_batch = orig


def expert_way(way: str):
    """While active, engines built multiply a mixture's experts ``way`` (one of
    ``moe.EXPERT_PRODUCTS``) on every platform, or as ``moe.EXPERT_WAYS`` says
    ("default"); the engine's cached steps are traced again (``traced_setting``)."""
    from paged_jax.models.layers import moe

    if way == "default":
        return contextlib.nullcontext()
    if way not in moe.EXPERT_PRODUCTS:
        raise ValueError(f"way: expected 'default' or one of {moe.EXPERT_PRODUCTS}, got {way!r}")
    return traced_setting(moe, "EXPERT_WAYS", {k: way for k in moe.EXPERT_WAYS})
