"""Transparent huge pages for CPU pools (paged_jax._hugepages)."""

from __future__ import annotations

import ctypes
import mmap
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_cases import HAS_CC

import paged_jax as pj
from paged_jax import _hugepages as hp
from paged_jax import cache as cache_mod

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory API")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping holding ``address``, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _address(m: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


def test_values_stay_zero_and_in_place_writes_land():
    z = jnp.zeros((4 << 20,), jnp.float32)  # 16 MiB: whole huge pages inside
    ptr = z.unsafe_buffer_pointer()
    hp.use_huge_pages(z)
    assert not np.asarray(z).any()
    out = jax.jit(lambda a: a.at[::4096].set(7.0), donate_argnums=0)(z)
    assert out.unsafe_buffer_pointer() == ptr  # the same memory, written in place
    got = np.asarray(out)
    assert (got[::4096] == 7.0).all() and got.sum() == 7.0 * (len(got) // 4096)


@linux_only
def test_backs_whole_huge_pages_where_the_kernel_asks_for_madvise():
    if hp.thp_mode() != "madvise":
        pytest.skip(f"THP mode is {hp.thp_mode()!r}; only 'madvise' needs the advice")
    z = jnp.zeros((8 << 20,), jnp.float32)  # 32 MiB
    backed = hp.use_huge_pages(z)
    assert backed % hp.HUGE_PAGE == 0 and backed >= z.nbytes - 2 * hp.HUGE_PAGE
    out = jax.jit(lambda a: a + 1.0, donate_argnums=0)(z)  # touches every page
    out.block_until_ready()  # (the pointer is known before the pages are written)
    inner = out.unsafe_buffer_pointer() + 2 * hp.HUGE_PAGE
    assert _anon_huge_kib(inner) >= 2048  # at least one huge page now backs it


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("PAGED_JAX_HUGE_PAGES", "0")
    assert hp.use_huge_pages(jnp.zeros((4 << 20,), jnp.float32)) == 0


def test_rejects_what_is_not_a_concrete_array():
    with pytest.raises(TypeError, match="zeros: expected a concrete jax.Array, got ndarray"):
        hp.use_huge_pages(np.zeros(4))
    with pytest.raises(TypeError, match="zeros: expected a concrete jax.Array"):
        jax.jit(hp.use_huge_pages)(jnp.zeros(4))


@linux_only
def test_only_private_anonymous_mappings_qualify(tmp_path):
    size = 4 * mmap.PAGESIZE
    private = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    shared = mmap.mmap(-1, size)  # MAP_SHARED: dropped pages would keep their data
    path = tmp_path / "backing"
    path.write_bytes(b"\0" * size)
    with open(path, "r+b") as f:
        backed_by_file = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE)
    try:
        for m, expected in ((private, True), (shared, False), (backed_by_file, False)):
            a = _address(m)
            assert hp._private_anonymous(a, a + size) is expected
    finally:
        for m in (private, shared, backed_by_file):
            m.close()


def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    monkeypatch.setattr(hp, "_THP_MODE", str(f))
    assert hp.thp_mode() == "madvise"
    f.write_text("[always] madvise never\n")
    assert hp.thp_mode() == "always"
    monkeypatch.setattr(hp, "_THP_MODE", str(tmp_path / "missing"))
    assert hp.thp_mode() is None


def test_does_nothing_unless_the_mode_is_madvise(monkeypatch):
    monkeypatch.setattr(hp, "thp_mode", lambda: "always")
    assert hp.use_huge_pages(jnp.zeros((4 << 20,), jnp.float32)) == 0


def test_cache_create_backs_its_pool_eagerly_only(monkeypatch):
    seen = []
    monkeypatch.setattr(cache_mod, "use_huge_pages", lambda x: seen.append(x.shape) or 0)
    c = pj.PagedKVCache.create(2, 8, 4, 2, 16, jnp.float32)
    assert seen == [c.kv_pages.shape]
    jax.eval_shape(lambda: pj.PagedKVCache.create(2, 8, 4, 2, 16, jnp.float32))
    assert seen == [c.kv_pages.shape]  # traced: nothing to advise


needs_cc = pytest.mark.skipif(not HAS_CC, reason="no C compiler here: pools are zero-filled by XLA")


@linux_only
@needs_cc
@pytest.mark.parametrize("anonymous", [True, False])
def test_lazy_zeros_read_zero_and_take_writes_in_place(monkeypatch, anonymous):
    # The buffer handed over full of NaN: its whole pages handed back and the partial
    # ones at either end zeroed (or, outside a private anonymous mapping, all of it
    # zeroed): every element reads 0, and a donated step writes the same memory.
    from paged_jax.kernels import cpu

    monkeypatch.setattr(cpu, "uninitialized", lambda shape, dtype: jnp.full(shape, np.nan, dtype))
    if not anonymous:
        monkeypatch.setattr(hp, "_private_anonymous", lambda start, stop: False)
    shape = (3, (17 << 20) // 3 + 5)  # not a whole number of pages
    z = hp.lazy_zeros(shape, jnp.float32)
    assert z is not None and z.shape == shape and z.dtype == jnp.float32
    ptr = z.unsafe_buffer_pointer()
    assert ptr % mmap.PAGESIZE and not np.asarray(z).any()  # partial pages at the ends
    out = jax.jit(lambda a: a.at[:, ::1024].set(3.0), donate_argnums=0)(z)
    assert out.unsafe_buffer_pointer() == ptr
    got = np.asarray(out)
    assert got.sum() == 3.0 * got[:, ::1024].size


def test_lazy_zeros_only_where_it_can(monkeypatch):
    small = (hp.LAZY_ZEROS_MIN_BYTES // 4 - 1,)
    assert hp.lazy_zeros(small, jnp.float32) is None  # small pools: XLA zero-fills
    big = (hp.LAZY_ZEROS_MIN_BYTES // 2,)
    assert jax.eval_shape(lambda: hp.lazy_zeros(big, jnp.bfloat16)) is None  # traced
    monkeypatch.setattr(hp, "_madvise", lambda: None)  # not Linux
    assert hp.lazy_zeros(big, jnp.bfloat16) is None


@linux_only
@needs_cc
def test_a_large_pool_is_lazy_and_the_engine_gives_the_same_tokens(monkeypatch):
    # The engine on a pool taken from lazy_zeros (the threshold lowered to take it) and
    # on one XLA zero-filled: the same greedy tokens and log-probs.
    from paged_jax import models

    params = pj.SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]

    def run():
        llm = pj.LLM(*models.load("tiny-llama"), num_pages=64, page_size=8)
        outs = llm.generate(prompts, params, progress=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    taken = []
    lazy = hp.lazy_zeros
    monkeypatch.setattr(hp, "LAZY_ZEROS_MIN_BYTES", 1)
    monkeypatch.setattr(cache_mod, "lazy_zeros", lambda *a: taken.append(a) or lazy(*a))
    from_lazy_pool = run()
    monkeypatch.undo()
    assert taken  # that engine's pool came from lazy_zeros
    assert from_lazy_pool == run()
