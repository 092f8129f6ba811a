"""``Embed``: the token embedding table, quantized or not, held as the LM head (a tied
one) multiplies by it fastest: transposed ``[E, V]``, or packed for the CPU's C kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from paged_jax import linear

from ..quantization import (
    check_format,
    dequantize_int4,
    int8_group,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from .linear import dequantize8, zero_of


class Embed(nnx.Embed):
    """``nnx.Embed`` whose table may be held transposed, ``[E, V]`` instead of ``[V, E]``
    (``hold_transposed``), or packed for the CPU kernel as the weight ``[E, V]`` is
    (``hold_packed``: ``[P, E, NR]``). A tied LM head (``attend``) then multiplies by the
    table as it lies; lookups gather its columns."""

    transposed = False  # hold_transposed / hold_packed set them on the instance (static)
    packed = False
    # quantize sets it: "int8" or "fp8" (table int8 or float8_e4m3fn, scale f32 [V], one
    # a token; int8 for the CPU or kept from a GGUF's Q8_0 blocks: scale [V, E / 32],
    # groups along E, and from Q5_1 / Q5_K blocks zero [V, E / 32] too, their minimums)
    # or "int4" (table uint8 [V, E / 2], scale and zero f32 [V, E / 32]: groups along E;
    # a GGUF file's blocks kept: scale and zero perhaps f16, groups of 32 or 16)
    quantized = None
    # A GGUF file's blocks kept by default: a packed tied head multiplies the rows as
    # they are by its dequantized panels (Linear.float_rows)
    float_rows = False

    def quantize(self, fmt: str = "int8") -> Embed:
        """In place: the float table ``[V, E]`` becomes ``fmt`` (``"int8"``: int8 with f32
        scales ``self.scale``, ``[V, E / 32]`` for the CPU and one a token, ``[V]``,
        elsewhere, ``models.quantization.int8_group``; ``"int4"``: 4-bit groups of 32
        along E with a scale and a minimum each, ``self.scale`` and ``self.zero``);
        returns the module. Idempotent. Before ``hold_transposed`` / ``hold_packed``
        (raises ``ValueError`` after them)."""
        check_format(fmt)
        if self.quantized:
            return self
        if self.transposed or self.packed:
            raise ValueError("embedding: quantize before transposing or packing the table")
        table = self.embedding.get_value()
        if fmt == "int4":
            q, scale, zero = quantize_int4(table, axis=-1)
            self.zero = nnx.Param(jnp.asarray(zero))
        elif fmt == "int8":
            q, scale = quantize_int8(table, -1, int8_group(table, -1))
        else:
            q, scale = quantize_fp8(table, axis=-1)
        self.embedding.set_value(jnp.asarray(q))
        self.scale = nnx.Param(jnp.asarray(scale))
        self.quantized = fmt
        return self

    def _groups(self) -> bool:
        """Whether an int8 table's scales are per group of E (``[V, E / G]``, a GGUF's
        Q8_0 blocks kept; packed ``[P, E / G, NR]``) rather than one per token."""
        if self.quantized != "int8":
            return False
        table, scale = self.embedding.get_value(), self.scale.get_value()
        return scale.ndim == table.ndim

    def hold_transposed(self) -> Embed:
        """In place: the table becomes ``[E, V]``; returns the module. Idempotent. A 4-bit
        table stays ``[V, E / 2]`` (a tied head dequantizes it as it multiplies)."""
        if self.quantized == "int4" or self._groups():
            return self
        if not self.transposed and not self.packed:
            self.embedding.set_value(jnp.asarray(self.embedding.get_value().T))
            self.transposed = True
        return self

    def hold_packed(self) -> Embed:
        """In place: the table becomes ``paged_jax.linear.pack`` of its ``[E, V]``
        transpose, ``[P, E, NR]`` (int8 ones with their scales as ``pack_scales`` lays
        them out, or as a weight's for scales per group of E); returns the module.
        Idempotent. Raises ``ValueError`` for a table that is not f32, bf16 or quantized,
        or where the CPU kernels are not available. An fp8 table is packed as bf16, with its
        per-token scales as int8's (the same values: every e4m3 value is a bf16 one)."""
        if not self.packed:
            raw, groups = self.embedding.get_value(), self._groups()
            if self.quantized == "fp8":
                raw = raw.astype(jnp.bfloat16)
            self.embedding.set_value(linear.pack(raw if self.transposed else raw.T))
            if self.quantized == "int4":  # groups along E: [E / 32, V] packed as a weight
                self.scale.set_value(linear.pack(self.scale.get_value().T))
                self.zero.set_value(linear.pack(self.zero.get_value().T))
            elif groups:  # int8 groups along E: [E / G, V] packed as a weight
                self.scale.set_value(linear.pack(self.scale.get_value().T))
                if zero_of(self) is not None:
                    self.zero.set_value(linear.pack(self.zero.get_value().T))
            elif self.quantized:
                self.scale.set_value(linear.pack_scales(self.scale.get_value()))
            self.transposed, self.packed = False, True
        return self

    def table(self) -> jax.Array:
        """The table as ``nnx.Embed`` holds it, ``[V, E]``, whichever way it lies
        (dequantized: f32)."""
        table = self.embedding.get_value()
        if self.packed:
            table = linear.unpack(table, self.num_embeddings).T
        elif self.transposed:
            table = table.T
        if self.quantized == "int4":
            scale, zero = self.scale.get_value(), self.zero.get_value()
            if self.packed:
                scale = linear.unpack(scale, self.num_embeddings).T
                zero = linear.unpack(zero, self.num_embeddings).T
            return dequantize_int4(table, scale, zero, axis=-1)
        if self._groups():
            scale, zero = self.scale.get_value(), zero_of(self)
            if self.packed:
                scale = linear.unpack(scale, self.num_embeddings).T
                if zero is not None:
                    zero = linear.unpack(zero, self.num_embeddings).T
            return dequantize8(table.T, scale.T, None if zero is None else zero.T).T
        if self.quantized:
            scale = self.scale.get_value()[: self.num_embeddings]
            return table.astype(jnp.float32) * scale[:, None]
        return table

    def __call__(self, inputs: jax.Array) -> jax.Array:  # int[...] -> [..., E]
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise TypeError(f"inputs: expected an integer array, got {inputs.dtype}")
        if not self.transposed and not self.packed and not self.quantized:
            return super().__call__(inputs)
        table = self.embedding[...]
        if self.packed:  # token v: column v of the head's packed weight
            rows = linear.packed_columns(table, inputs)
        elif self.transposed:
            rows = jnp.moveaxis(jnp.take(table, inputs, axis=1), 0, -1)
        else:
            rows = jnp.take(table, inputs, axis=0)
        if self.quantized == "int4":  # the tokens' groups, dequantized
            scale, zero = self.scale[...], self.zero[...]
            if self.packed:
                scale = linear.packed_columns(scale, inputs)
                zero = linear.packed_columns(zero, inputs)
            else:
                scale, zero = jnp.take(scale, inputs, axis=0), jnp.take(zero, inputs, axis=0)
            rows = dequantize_int4(rows, scale, zero, axis=-1)
        elif self._groups():  # the tokens' groups of E (and their minimums)
            held = [self.scale[...]] + ([] if zero_of(self) is None else [self.zero[...]])
            if self.packed:
                held = [linear.packed_columns(a, inputs) for a in held]
            else:
                held = [jnp.take(a, inputs, axis=0) for a in held]
            g = rows.shape[-1] // held[0].shape[-1]
            rows = rows.astype(jnp.float32) * jnp.repeat(held[0], g, -1)
            if len(held) == 2:
                rows = rows + jnp.repeat(held[1], g, -1)
        elif self.quantized:  # (a packed scale's entry v is token v's)
            rows = rows.astype(jnp.float32) * self.scale[...][inputs][..., None]
        (rows,) = self.promote_dtype((rows,), dtype=self.dtype, inexact=False)
        return rows

    def attend(self, query: jax.Array) -> jax.Array:  # [..., E] -> [..., V]
        scale = self.scale[...] if self.quantized else None
        zero = zero_of(self)
        if self.packed:
            x = query.astype(jnp.float32)
            kept = {"float_rows": True} if self.float_rows else {}  # a GGUF file's blocks
            y = linear.matmul(
                x, self.embedding[...], self.num_embeddings, scales=scale, mins=zero, **kept
            )
            return y.astype(self.dtype or y.dtype)
        if self.quantized == "int4":
            table = dequantize_int4(self.embedding[...], scale, zero, axis=-1, dtype=self.dtype)
            query, table = self.promote_dtype((query, table), dtype=self.dtype)
            return jnp.dot(query, table.T)
        if self._groups():  # int8 groups along E, [V, E]: dequantized first
            z = None if zero is None else zero.T
            table = dequantize8(self.embedding[...].T, scale.T, z).astype(self.dtype or jnp.float32)
            query, table = self.promote_dtype((query, table), dtype=self.dtype)
            return jnp.dot(query, table)
        if not self.transposed and not self.quantized:
            return super().attend(query)
        table = self.embedding[...]
        query, table = self.promote_dtype((query, table), dtype=self.dtype)
        y = jnp.dot(query, table) if self.transposed else jnp.dot(query, table.T)
        if scale is None:
            return y
        return y * jnp.reshape(scale.astype(y.dtype), (1,) * (y.ndim - 1) + (-1,))
