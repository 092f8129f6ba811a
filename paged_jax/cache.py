"""The paged KV cache: a jit-able pytree and its functional operations.

``PagedKVCache`` owns the device memory of the cache and nothing else: which page holds
which token is decided on the host (``paged_jax.BlockManager``) and reaches these
methods as int32 arrays (slot mappings, page ids). Every method returns a new cache;
under ``jax.jit(..., donate_argnums=...)`` XLA updates the pool in place, so a step
costs the bytes it writes, not a copy of the pool (``tests/test_cache.py`` proves it
with buffer pointers and compiled memory statistics).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import _quant
from paged_jax._hugepages import lazy_zeros, use_huge_pages
from paged_jax.block_manager import layer_groups

NULL_PAGE = 0
"""Page id that is never allocated: padding slots write here, padding table rows point here."""


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata=dict(static=True), **kwargs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged K/V storage for every layer of a decoder.

    Attributes:
      kv_pages: ``dtype[L, N, P, 2K, D]``. K of kv head h at combined head 2h, V at 2h + 1.
      kv_scales: ``f32[L, N, P, 2K]`` per-token, per-head dequantization scales when the
        cache dtype is int8 or fp8 (see ``paged_jax._quant``), else ``None``.
      num_layers, page_size, num_kv_heads, head_dim: static (Python ints).
      layer_groups: static; None, or a hybrid pool's layout
        ``(group_windows, layer_group, layer_slot)`` (``paged_jax.layer_groups``): each
        page then holds ``num_layers`` layer slots of one group, model layer ``l`` lives in
        slot ``layer_slot[l]`` of its group's pages and reads that group's block table
        (``AttentionMetadata`` with a leading group axis; ``HybridBlockManager``).

    Slot ``s`` addresses token offset ``s % P`` of page ``s // P``; valid slots lie in
    ``[0, N * P)``. Page 0 is the null page (``NULL_PAGE``).
    """

    kv_pages: jax.Array
    kv_scales: jax.Array | None
    num_layers: int = _static()
    page_size: int = _static()
    num_kv_heads: int = _static()
    head_dim: int = _static()
    layer_groups: tuple | None = _static(default=None)

    def __post_init__(self):
        # Pytree transformations rebuild the class with placeholder leaves; check only
        # when the leaves are real arrays (or tracers, which are jax.Array too).
        kv = self.kv_pages
        if not isinstance(kv, (jax.Array, np.ndarray)):
            return
        expected = (self.num_layers, None, self.page_size, 2 * self.num_kv_heads, self.head_dim)
        if kv.ndim != 5 or any(
            e is not None and a != e for a, e in zip(kv.shape, expected, strict=True)
        ):
            raise ValueError(
                "kv_pages: expected shape [num_layers, num_pages, page_size, 2*num_kv_heads, "
                f"head_dim] = [{self.num_layers}, N, {self.page_size}, "
                f"{2 * self.num_kv_heads}, {self.head_dim}], got {tuple(kv.shape)}"
            )
        quantized = _quant.is_quantized_dtype(kv.dtype)
        scales = self.kv_scales
        if quantized and scales is None:
            raise ValueError(f"kv_scales: required for a {kv.dtype} cache, got None")
        if not quantized and scales is not None:
            raise ValueError(f"kv_scales: only allowed for int8/fp8 caches, cache is {kv.dtype}")
        if scales is not None and isinstance(scales, (jax.Array, np.ndarray)):
            if tuple(scales.shape) != tuple(kv.shape[:4]):
                raise ValueError(
                    f"kv_scales: expected shape {tuple(kv.shape[:4])}, got {tuple(scales.shape)}"
                )

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = jnp.bfloat16,
        *,
        layer_windows: Sequence[int | None] | None = None,
    ) -> PagedKVCache:
        """A zero-filled cache of ``num_pages`` pages (page 0 included, never allocated).

        ``dtype``: f32, bf16, f16, or int8 / float8_e4m3fn / float8_e5m2 (quantized, with
        per-token scales); None: f32 (what ``LLM`` passes a model's ``make_cache`` when no
        ``cache_dtype`` was asked for, for the model to choose). ``layer_windows``: each
        of the ``num_layers`` layers' sliding window (None: full attention) for a hybrid
        pool (``layer_groups``), whose pages hold one layer group each; None (default):
        every page holds every layer.
        """
        groups = None
        if layer_windows is not None:
            layer_windows = tuple(layer_windows)
            if len(layer_windows) != num_layers:
                raise ValueError(
                    f"layer_windows: expected {num_layers} entries (one per layer), got "
                    f"{len(layer_windows)}"
                )
            groups = layer_groups(layer_windows)
            num_layers = max(groups[2]) + 1  # layer slots of a page
        for name, value, minimum in (
            ("num_layers", num_layers, 1),
            ("num_pages", num_pages, 2),
            ("page_size", page_size, 1),
            ("num_kv_heads", num_kv_heads, 1),
            ("head_dim", head_dim, 1),
        ):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{name}: expected a Python int, got {type(value).__name__}")
            if value < minimum:
                raise ValueError(f"{name}: expected >= {minimum}, got {value}")
        dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
        if dtype not in _quant.FLOAT_KV_DTYPES + _quant.QUANT_DTYPES:
            allowed = ", ".join(str(d) for d in _quant.FLOAT_KV_DTYPES + _quant.QUANT_DTYPES)
            raise TypeError(f"dtype: expected one of {allowed}, got {dtype}")
        shape = (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)
        kv_pages = lazy_zeros(shape, dtype)  # a large pool on CPU: zero pages on first touch
        if kv_pages is None:
            kv_pages = jnp.zeros(shape, dtype)
        if not isinstance(kv_pages, jax.core.Tracer):  # created eagerly: on CPU, 2 MiB pages
            use_huge_pages(kv_pages)
        kv_scales = jnp.ones(shape[:4], jnp.float32) if _quant.is_quantized_dtype(dtype) else None
        return cls(
            kv_pages=kv_pages,
            kv_scales=kv_scales,
            num_layers=int(num_layers),
            page_size=int(page_size),
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            layer_groups=groups,
        )

    # ------------------------------------------------------------------ properties
    @property
    def num_pages(self) -> int:
        return self.kv_pages.shape[1]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def dtype(self) -> jnp.dtype:
        return self.kv_pages.dtype

    @property
    def quantized(self) -> bool:
        return self.kv_scales is not None

    @property
    def num_groups(self) -> int:
        """Layer groups with block tables of their own (1 unless ``layer_groups``)."""
        return 1 if self.layer_groups is None else len(self.layer_groups[0])

    def locate(self, layer: int | jax.Array) -> tuple[int | jax.Array | None, int | jax.Array]:
        """``(group, slot)`` of model layer ``layer`` (an int or a traced i32 scalar):
        ``(None, layer)`` unless the pool has ``layer_groups``."""
        if self.layer_groups is None:
            return None, layer
        _, group, slot = self.layer_groups
        if isinstance(layer, (int, np.integer)):
            return group[layer], slot[layer]
        return jnp.asarray(group, jnp.int32)[layer], jnp.asarray(slot, jnp.int32)[layer]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in a page: across all layers (K and V, plus scales if
        quantized), or with ``layer_groups`` across one group's layer slots."""
        per_row = self.head_dim * self.dtype.itemsize + (4 if self.quantized else 0)
        return self.num_layers * 2 * self.num_kv_heads * per_row

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (null page included)."""
        return self.num_slots * self.bytes_per_token

    def layer(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """The attention inputs of one layer: ``(kv_pages[N, P, 2K, D], k_scale, v_scale)``.

        Scales are ``f32[N, P, K]`` for a quantized cache, else ``None``; pass all three to
        ``ragged_paged_attention`` / ``paged_attention``.
        """
        kv = self.kv_pages[layer]
        if self.kv_scales is None:
            return kv, None, None
        scales = self.kv_scales[layer]
        return kv, scales[..., 0::2], scales[..., 1::2]

    def attention_inputs(
        self, layer: int | jax.Array, page_indices: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
        """One layer's attention inputs without copying the layer out of the pool.

        Returns ``(kv_pages, page_indices, k_scale, v_scale)`` to pass to
        ``ragged_paged_attention`` / ``paged_attention`` in place of ``layer(layer)`` and
        the block tables ``page_indices: i32[S, M]``. For a 16- or 32-bit cache
        ``kv_pages`` is the whole pool viewed as ``[L * N, P, 2K, D]`` (a reshape, which
        XLA makes a bitcast) and the tables are shifted by ``layer * N``: layer l's page p
        is page ``l * N + p`` of the view. ``layer(l)`` instead slices ``kv_pages[l]``,
        which XLA materializes as a copy of the layer (``N * P * 2K * D`` elements) when
        the slice feeds a Pallas kernel (4x the decode attention's time on an H100:
        docs/DECISIONS.md, "The layer view of the pool"). The layer index may be
        traced. Quantized caches return ``layer(layer)`` and the tables unchanged: their
        scales are stored interleaved (``[..., 2K]``), so splitting them copies anyway.
        """
        if self.quantized:
            kv, k_scale, v_scale = self.layer(layer)
            return kv, page_indices, k_scale, v_scale
        L, N = self.num_layers, self.num_pages
        flat = self.kv_pages.reshape((L * N,) + tuple(self.kv_pages.shape[2:]))
        # An id outside [0, N) must not reach another layer's pages: it reads the null page.
        tables = self._read_ids(page_indices) + jnp.asarray(layer, jnp.int32) * N
        return flat, tables, None, None

    # ------------------------------------------------------------------ writes
    def write(
        self,
        layer: int | jax.Array,
        k: jax.Array,  # [T, K, D]
        v: jax.Array,  # [T, K, D]
        slot_mapping: jax.Array,  # i32[T]
        *,
        backend: str = "xla",
        interpret: bool = False,
    ) -> PagedKVCache:
        """Writes token t's K/V of ``layer`` to slot ``slot_mapping[t]``; returns the new cache.

        ``backend``: ``"xla"`` (an in-place scatter under donation, every platform) or
        ``"pallas_tpu"`` (a DMA per token row, ``paged_jax.kernels.tpu.write_rows``;
        ``interpret=True`` runs it on CPU).

        Padding tokens should use a slot of the null page (``0 <= slot < page_size``).
        Slots must be distinct outside the null page; slots outside ``[0, N*P)`` are
        rejected by ``validate_slot_mapping`` (eager) and dropped under jit.
        Quantized caches quantize each (token, head) row with its own scale.
        """
        _check_layer(layer, self.num_layers)
        T = slot_mapping.shape[0] if slot_mapping.ndim == 1 else None
        for name, x in (("k", k), ("v", v)):
            if x.ndim != 3 or x.shape[1:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name}: expected shape [T, num_kv_heads={self.num_kv_heads}, "
                    f"head_dim={self.head_dim}], got {tuple(x.shape)}"
                )
            if not jnp.issubdtype(x.dtype, jnp.floating):
                raise TypeError(f"{name}: expected a floating dtype, got {x.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"v: expected shape {tuple(k.shape)} (as k), got {tuple(v.shape)}")
        _check_index_array("slot_mapping", slot_mapping, ndim=1)
        if T != k.shape[0]:
            raise ValueError(
                f"slot_mapping: expected shape [{k.shape[0]}] (one slot per token of k), "
                f"got {tuple(slot_mapping.shape)}"
            )
        kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], 2 * self.num_kv_heads, self.head_dim)
        if backend == "pallas_tpu":
            from paged_jax.kernels.tpu import write_rows

            scales = None
            if self.quantized:
                kv, scales = _quant.quantize_rows(kv, self.dtype)
                scales = write_rows(
                    self.kv_scales, scales, slot_mapping, layer, interpret=interpret
                )
            new_kv = write_rows(self.kv_pages, kv, slot_mapping, layer, interpret=interpret)
            return dataclasses.replace(self, kv_pages=new_kv, kv_scales=scales)
        if backend != "xla":
            raise ValueError(f"backend: expected 'xla' or 'pallas_tpu', got {backend!r}")
        if kv.shape[0] == 1:  # XLA makes a one-row scatter an update that copies the pool
            kv = jnp.concatenate([kv, kv])
            slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), -1, slot_mapping.dtype)])
        pages = slot_mapping // self.page_size
        offsets = slot_mapping % self.page_size
        # mode="drop": an out-of-range slot must never wrap around onto a live page.
        pages = jnp.where(slot_mapping < 0, self.num_pages, pages)
        if _narrow_on_cpu(self.kv_pages):  # 8- and 16-bit values by the CPU kernel
            from paged_jax.kernels import cpu

            scales = self.kv_scales  # (a quantized cache's f32 scales: XLA's scatter)
            if self.quantized:
                kv, row_scales = _quant.quantize_rows(kv, self.dtype)
                scales = scales.at[layer, pages, offsets].set(row_scales, mode="drop")
            new_kv = cpu.write_rows(self.kv_pages, kv.astype(self.dtype), slot_mapping, layer)
            return dataclasses.replace(self, kv_pages=new_kv, kv_scales=scales)
        if self.quantized:
            kv_q, scales = _quant.quantize_rows(kv, self.dtype)
            new_kv = self.kv_pages.at[layer, pages, offsets].set(kv_q, mode="drop")
            new_scales = self.kv_scales.at[layer, pages, offsets].set(scales, mode="drop")
            return dataclasses.replace(self, kv_pages=new_kv, kv_scales=new_scales)
        new_kv = self.kv_pages.at[layer, pages, offsets].set(kv.astype(self.dtype), mode="drop")
        return dataclasses.replace(self, kv_pages=new_kv)

    def copy_pages(
        self,
        src: jax.Array,  # i32[n]
        dst: jax.Array,  # i32[n]
    ) -> PagedKVCache:
        """Copies page ``src[i]`` to page ``dst[i]`` in every layer (copy-on-write).

        All reads happen before all writes. Pad with ``(0, 0)`` pairs (null page onto
        itself). ``dst`` entries other than 0 must be distinct.
        """
        _check_index_array("src", src, ndim=1)
        _check_index_array("dst", dst, ndim=1)
        if src.shape != dst.shape:
            raise ValueError(f"dst: expected shape {tuple(src.shape)} (as src), got {dst.shape}")
        src, dst = self._read_ids(src), self._write_ids(dst)
        if _narrow_on_cpu(self.kv_pages):
            from paged_jax.kernels import cpu

            new_kv = cpu.copy_pages(self.kv_pages, src, dst)
        else:
            new_kv = self.kv_pages.at[:, dst].set(self.kv_pages[:, src], mode="drop")
        new_scales = self.kv_scales
        if self.quantized:
            new_scales = self.kv_scales.at[:, dst].set(self.kv_scales[:, src], mode="drop")
        return dataclasses.replace(self, kv_pages=new_kv, kv_scales=new_scales)

    # ------------------------------------------------------------------ swap
    def read_pages(self, pages: jax.Array) -> jax.Array:  # pages: i32[n]
        """K/V of ``pages`` in every layer: ``dtype[L, n, P, 2K, D]`` (swap out to host).

        For a quantized cache also fetch ``read_page_scales(pages)``.
        """
        _check_index_array("pages", pages, ndim=1)
        if _narrow_on_cpu(self.kv_pages):
            from paged_jax.kernels import cpu

            return cpu.read_pages(self.kv_pages, self._read_ids(pages))
        return self.kv_pages[:, self._read_ids(pages)]

    def read_page_scales(self, pages: jax.Array) -> jax.Array:  # pages: i32[n]
        """Scales of ``pages`` in every layer: ``f32[L, n, P, 2K]`` (quantized caches only)."""
        if not self.quantized:
            raise ValueError(f"read_page_scales: the cache is {self.dtype}, it has no scales")
        _check_index_array("pages", pages, ndim=1)
        return self.kv_scales[:, self._read_ids(pages)]

    def write_pages(
        self,
        pages: jax.Array,  # i32[n]
        data: jax.Array,  # dtype[L, n, P, 2K, D]
        scales: jax.Array | None = None,  # f32[L, n, P, 2K]
    ) -> PagedKVCache:
        """Stores ``data`` (as returned by ``read_pages``) into ``pages`` (swap in from host)."""
        _check_index_array("pages", pages, ndim=1)
        expected = (self.num_layers, pages.shape[0]) + tuple(self.kv_pages.shape[2:])
        if tuple(data.shape) != expected:
            raise ValueError(f"data: expected shape {expected}, got {tuple(data.shape)}")
        if jnp.dtype(data.dtype) != self.dtype:
            raise TypeError(f"data: expected dtype {self.dtype} (the cache's), got {data.dtype}")
        if self.quantized != (scales is not None):
            need = "required" if self.quantized else "not allowed"
            raise ValueError(f"scales: {need} for a {self.dtype} cache")
        pages = self._write_ids(pages)
        if _narrow_on_cpu(self.kv_pages):
            from paged_jax.kernels import cpu

            new_kv = cpu.write_pages(self.kv_pages, data, pages)
        else:
            new_kv = self.kv_pages.at[:, pages].set(data, mode="drop")
        new_scales = self.kv_scales
        if self.quantized:
            if tuple(scales.shape) != expected[:4]:
                raise ValueError(f"scales: expected shape {expected[:4]}, got {scales.shape}")
            new_scales = self.kv_scales.at[:, pages].set(scales, mode="drop")
        return dataclasses.replace(self, kv_pages=new_kv, kv_scales=new_scales)

    # ------------------------------------------------------------------ page-id policy
    # One rule for every page op: ids outside [0, N) are never wrapped (JAX indexing would
    # turn -1 into the last page, a live one). Writes to them are dropped; reads of them
    # read the null page.
    def _write_ids(self, pages: jax.Array) -> jax.Array:
        return jnp.where((pages >= 0) & (pages < self.num_pages), pages, self.num_pages)

    def _read_ids(self, pages: jax.Array) -> jax.Array:
        return jnp.where((pages >= 0) & (pages < self.num_pages), pages, NULL_PAGE)

    # ------------------------------------------------------------------ host checks
    def validate_slot_mapping(self, slot_mapping) -> None:
        """Eager check: every slot in ``[0, N*P)`` and no non-null slot written twice."""
        slots = np.asarray(slot_mapping)
        if slots.size and (slots.min() < 0 or slots.max() >= self.num_slots):
            bad = slots[(slots < 0) | (slots >= self.num_slots)][0]
            raise ValueError(f"slot_mapping: slots must lie in [0, {self.num_slots}), got {bad}")
        live = slots[slots >= self.page_size]
        uniq, counts = np.unique(live, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"slot_mapping: slot {uniq[counts > 1][0]} is written twice")


def _narrow_on_cpu(pool: jax.Array) -> bool:
    """Whether ``pool``'s rows and pages are written (and pages read) by the CPU kernels
    (``kernels.cpu.write_rows``, ``copy_pages``, ``write_pages``, ``read_pages``) rather
    than by XLA's scatter and gather: a pool of 8- or 16-bit values (bf16, f16, fp8, int8)
    where ``narrow_pools_by_cpu_kernels()``. XLA:CPU widens a bf16 pool to f32 and back
    around each scatter: 2.5 s a step for SmolLM2 at 32 sequences."""
    return pool.dtype.itemsize < 4 and narrow_pools_by_cpu_kernels()


def narrow_pools_by_cpu_kernels() -> bool:
    """Whether a KV pool of 8- or 16-bit values is written and read by the CPU kernels
    here: they run (``paged_jax.linear.available``: the CPU, the kernels built,
    ``PAGED_JAX_BACKEND`` not ``xla``) on one device (a pool sharded over several CPU
    devices keeps XLA's ops, which its partitioner splits)."""
    if jax.device_count() != 1:
        return False
    from paged_jax import linear

    return linear.available()


def _check_layer(layer, num_layers: int) -> None:
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < num_layers:
        raise ValueError(f"layer: expected 0 <= layer < {num_layers}, got {layer}")


def _check_index_array(name: str, x, *, ndim: int) -> None:
    if not hasattr(x, "dtype") or x.ndim != ndim:
        shape = getattr(x, "shape", type(x).__name__)
        raise ValueError(f"{name}: expected an int32 array of rank {ndim}, got {shape}")
    if jnp.dtype(x.dtype) != jnp.int32:
        raise TypeError(f"{name}: expected dtype int32, got {x.dtype}")
