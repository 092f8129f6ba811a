/* Writing a step's K/V rows into the paged pool for CPUs, called by XLA through its FFI;
 * built with decode.c into one library by __init__.py.
 *
 * Operands (row-major):
 *   pool     [L, N, P, R, D]  any dtype; token slot s of layer l is pool[l, s / P, s % P]
 *   rows     [T, R, D]        the pool's dtype: token t's row (its K and V heads)
 *   slots    i32[T]           token t's slot; outside [0, N * P): not written (dropped)
 *   params   i32[2]           {the layer l, the bytes of one element}
 * Result: the pool with the rows written, aliased to the pool operand
 * (input_output_aliases), so under donation nothing else moves: T rows of R * D elements.
 * Rows are written in order, so of two tokens with one slot the later one stays.
 *
 * Why not XLA's scatter: XLA:CPU has no 16-bit float scatter and widens the pool to f32
 * and back around it, every layer of every step: 2.5 s a step for SmolLM2's bf16 pool at
 * 32 sequences, against a millisecond for these copies.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

XLA_FFI_Error *PagedJaxWriteRows(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 4 || frame->rets.size != 1)
    return fail(frame, "paged_jax write rows: expected 4 operands and 1 result");
  const XLA_FFI_Buffer *pool = frame->args.args[0], *rows = frame->args.args[1],
                       *slots = frame->args.args[2], *params = frame->args.args[3],
                       *out = frame->rets.rets[0];
  if (pool->rank != 5 || rows->rank != 3 || slots->rank != 1 || params->rank != 1 ||
      out->rank != 5 || params->dims[0] != 2 || slots->dims[0] != rows->dims[0] ||
      rows->dims[1] != pool->dims[3] || rows->dims[2] != pool->dims[4] ||
      rows->dtype != pool->dtype || out->dtype != pool->dtype ||
      slots->dtype != XLA_FFI_DataType_S32 || params->dtype != XLA_FFI_DataType_S32)
    return fail(frame, "paged_jax write rows: expected pool[L,N,P,R,D], rows[T,R,D] of its "
                       "dtype, i32 slots[T] and i32 params[2]");
  const int32_t *p = (const int32_t *)params->data;
  const int64_t L = pool->dims[0], N = pool->dims[1], P = pool->dims[2];
  if (p[0] < 0 || p[0] >= L) return fail(frame, "paged_jax write rows: layer out of range");
  if (p[1] < 1 || p[1] > 8) return fail(frame, "paged_jax write rows: bad element size");
  const size_t row = (size_t)(pool->dims[3] * pool->dims[4]) * (size_t)p[1];
  const size_t layer_rows = (size_t)(N * P);
  char *dst = (char *)out->data;
  if (dst != pool->data) /* not aliased after all: the result starts as the pool */
    memcpy(dst, pool->data, (size_t)L * layer_rows * row);
  const int32_t *s = (const int32_t *)slots->data;
  const char *src = (const char *)rows->data;
  char *base = dst + (size_t)p[0] * layer_rows * row;
  for (int64_t t = 0; t < rows->dims[0]; ++t)
    if (s[t] >= 0 && (size_t)s[t] < layer_rows) memcpy(base + (size_t)s[t] * row, src + t * row, row);
  return NULL;
}

/* Whole pages of every layer, for copy-on-write and swapping (PagedJaxPages):
 *   mode 0, copy:  pool [L, N, P, R, D], src i32[n], dst i32[n] -> the pool (aliased) with
 *                  page src[i] copied to dst[i] in every layer, all reads before all writes
 *   mode 1, write: pool, data [L, n, P, R, D] of the pool's dtype, dst i32[n] -> the pool
 *                  (aliased) with data[:, i] in page dst[i]
 *   mode 2, read:  pool, src i32[n] -> [L, n, P, R, D]: page src[i] of every layer
 * with params i32[2] {mode, the bytes of one element} last. A dst outside [0, N) is not
 * written; a src outside it reads page 0 (the null page). */
XLA_FFI_Error *PagedJaxPages(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  const int64_t nargs = frame->args.size;
  if (nargs < 3 || nargs > 4 || frame->rets.size != 1)
    return fail(frame, "paged_jax pages: expected 3 or 4 operands and 1 result");
  const XLA_FFI_Buffer *pool = frame->args.args[0], *params = frame->args.args[nargs - 1],
                       *out = frame->rets.rets[0];
  if (params->rank != 1 || params->dims[0] != 2 || params->dtype != XLA_FFI_DataType_S32)
    return fail(frame, "paged_jax pages: expected i32 params[2]");
  const int32_t mode = ((const int32_t *)params->data)[0], size = ((const int32_t *)params->data)[1];
  if (mode < 0 || mode > 2 || nargs != (mode == 2 ? 3 : 4) || size < 1 || size > 8 ||
      pool->rank != 5 || out->rank != 5 || out->dtype != pool->dtype)
    return fail(frame, "paged_jax pages: bad mode, element size or shapes");
  const int64_t L = pool->dims[0], N = pool->dims[1];
  const size_t page = (size_t)(pool->dims[2] * pool->dims[3] * pool->dims[4]) * (size_t)size;
  const XLA_FFI_Buffer *ids = frame->args.args[mode == 1 ? 2 : 1];
  if (ids->rank != 1 || ids->dtype != XLA_FFI_DataType_S32)
    return fail(frame, "paged_jax pages: expected i32 page ids");
  const int64_t n = ids->dims[0];
  const int32_t *id = (const int32_t *)ids->data;
  const char *from = (const char *)pool->data;
  char *to = (char *)out->data;
  if (mode == 2) { /* read: out [L, n, ...] */
    if (out->dims[0] != L || out->dims[1] != n)
      return fail(frame, "paged_jax pages: expected a result [L, n, P, R, D]");
    for (int64_t l = 0; l < L; ++l)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t s = id[i] >= 0 && id[i] < N ? id[i] : 0;
        memcpy(to + ((size_t)(l * n + i)) * page, from + ((size_t)(l * N + s)) * page, page);
      }
    return NULL;
  }
  if (to != from) memcpy(to, from, (size_t)(L * N) * page); /* not aliased after all */
  const char *data = NULL;
  char *held = NULL;
  const int32_t *dst = id;
  if (mode == 1) {
    const XLA_FFI_Buffer *d = frame->args.args[1];
    if (d->rank != 5 || d->dtype != pool->dtype || d->dims[0] != L || d->dims[1] != n)
      return fail(frame, "paged_jax pages: expected data [L, n, P, R, D] of the pool's dtype");
    data = (const char *)d->data;
  } else { /* copy: every source page read before any is written */
    const XLA_FFI_Buffer *d = frame->args.args[2];
    if (d->rank != 1 || d->dims[0] != n || d->dtype != XLA_FFI_DataType_S32)
      return fail(frame, "paged_jax pages: expected i32 dst[n] beside src[n]");
    dst = (const int32_t *)d->data;
    held = malloc((size_t)(L * n) * page + 1);
    if (!held) return fail(frame, "paged_jax pages: out of memory");
    for (int64_t l = 0; l < L; ++l)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t s = id[i] >= 0 && id[i] < N ? id[i] : 0;
        memcpy(held + ((size_t)(l * n + i)) * page, to + ((size_t)(l * N + s)) * page, page);
      }
    data = held;
  }
  for (int64_t l = 0; l < L; ++l)
    for (int64_t i = 0; i < n; ++i)
      if (dst[i] >= 0 && dst[i] < N)
        memcpy(to + ((size_t)(l * N + dst[i])) * page, data + ((size_t)(l * n + i)) * page, page);
  free(held);
  return NULL;
}
