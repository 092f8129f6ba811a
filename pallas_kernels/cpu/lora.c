/* LoRA adapters on rows of different adapters, the CPU's way (models.lora.delta).
 *
 * Row t of a step carries its adapter's slot s (ids[t] = s + 1; 0: no adapter). Its
 * delta is y[t] = (x[t] @ A_s) @ B_s, where the bank of a target holds every slot side
 * by side: a[L, K, S R] (slot s in columns [s R, s R + R)) and b[L, S R, N] (rows
 * [s R, s R + R)), and layer `l` is read where it lies. The products over all S slots
 * and a mask that XLA computes instead cost S times the FLOPs a row needs: with 8 slots
 * of rank 16 on SmolLM2-135M they made a 32-sequence decode step 1.4-1.6x the base
 * model's (docs/ENGINE.md). Rows are grouped by slot and multiplied LORA_ROWS at a time,
 * so a slot's A and B are read about once a call. Each output is one f32 sum in a fixed
 * order (over K, then over R), so a row's result depends on nothing but its inputs. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#define LORA_MIN_MACS_PER_THREAD (1 << 18)
#define LORA_MAX_RANK 1024

typedef struct {
  const float *x, *a, *b; /* x[T, K]; a[K, S R], b[S R, N] of the layer */
  const int32_t *order;   /* the rows with an adapter, grouped by slot */
  float *y, *scratch;     /* scratch[N]: where a short group's padding row goes */
  int64_t K, N, SR, R, S, first, last; /* positions [first, last) of `order` */
  const int32_t *ids;
} LoraJob;

#define LORA_ROWS 4 /* rows of one slot multiplied together: A_s and B_s read once */
#define LORA_NB 16   /* outputs a row sums at once over the rank */

/* Rows rows[0 .. LORA_ROWS) of slot s: out[i] = (x[rows[i]] @ A_s) @ B_s. Always
 * LORA_ROWS rows (a group short of them repeats its last row, whose result goes to
 * scratch), so every row is computed by the same instructions whatever rows share its
 * slot: code specialized to the group's size gave a row other roundings as the group
 * changed (FMAs contracted differently), which deterministic mode forbids. R is a
 * constant wherever this is inlined, so the rank's loops vectorize. */
static inline __attribute__((always_inline)) void lora_rows(const LoraJob *j, const int64_t *rows,
                                                            float *const *out, int64_t s,
                                                            const int64_t R) {
  float h[LORA_ROWS][LORA_MAX_RANK];
  const float *xs[LORA_ROWS];
  for (int64_t i = 0; i < LORA_ROWS; ++i) {
    xs[i] = j->x + rows[i] * j->K;
    for (int64_t r = 0; r < R; ++r) h[i][r] = 0;
  }
  const float *a = j->a + s * R;
  for (int64_t k = 0; k < j->K; ++k) {
    const float *ak = a + k * j->SR;
    for (int64_t i = 0; i < LORA_ROWS; ++i) {
      const float xk = xs[i][k];
#pragma omp simd
      for (int64_t r = 0; r < R; ++r) h[i][r] += xk * ak[r];
    }
  }
  const float *b = j->b + s * R * j->N;
  const int64_t N = j->N, whole = N - N % LORA_NB;
  for (int64_t n0 = 0; n0 < whole; n0 += LORA_NB) {
    float acc[LORA_ROWS][LORA_NB];
    for (int64_t i = 0; i < LORA_ROWS; ++i)
      for (int64_t q = 0; q < LORA_NB; ++q) acc[i][q] = 0;
    for (int64_t r = 0; r < R; ++r) {
      const float *br = b + r * N + n0;
      for (int64_t i = 0; i < LORA_ROWS; ++i) {
        const float hr = h[i][r];
#pragma omp simd
        for (int64_t q = 0; q < LORA_NB; ++q) acc[i][q] += hr * br[q];
      }
    }
    for (int64_t i = 0; i < LORA_ROWS; ++i) memcpy(out[i] + n0, acc[i], sizeof acc[i]);
  }
  for (int64_t i = 0; i < LORA_ROWS; ++i) /* the last N % LORA_NB outputs */
    for (int64_t n = whole; n < N; ++n) {
      float acc = 0;
      for (int64_t r = 0; r < R; ++r) acc += h[i][r] * b[r * N + n];
      out[i][n] = acc;
    }
}

static void *run_lora(void *arg) {
  const LoraJob *j = arg;
  int64_t p = j->first;
  while (p < j->last) { /* groups of LORA_ROWS rows of one slot */
    const int64_t s = (int64_t)j->ids[j->order[p]] - 1;
    int64_t rows[LORA_ROWS];
    float *out[LORA_ROWS];
    int64_t m = 0;
    while (m < LORA_ROWS && p + m < j->last && j->ids[j->order[p + m]] - 1 == s) {
      rows[m] = j->order[p + m];
      out[m] = j->y + rows[m] * j->N;
      ++m;
    }
    for (int64_t i = m; i < LORA_ROWS; ++i) { /* padding: the last row again, to scratch */
      rows[i] = rows[m - 1];
      out[i] = j->scratch;
    }
    switch (j->R) {
      case 8: lora_rows(j, rows, out, s, 8); break;
      case 16: lora_rows(j, rows, out, s, 16); break;
      case 32: lora_rows(j, rows, out, s, 32); break;
      case 64: lora_rows(j, rows, out, s, 64); break;
      default: lora_rows(j, rows, out, s, j->R); break;
    }
    p += m;
  }
  return NULL;
}

XLA_FFI_Error *PagedJaxLoraDelta(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 5 || frame->rets.size != 1)
    return fail(frame, "paged_jax lora: expected 5 operands and 1 result");
  const XLA_FFI_Buffer *x = frame->args.args[0], *a = frame->args.args[1],
                       *b = frame->args.args[2], *ids = frame->args.args[3],
                       *params = frame->args.args[4], *y = frame->rets.rets[0];
  if (x->rank != 2 || a->rank != 3 || b->rank != 3 || ids->rank != 1 || params->rank != 1 ||
      y->rank != 2)
    return fail(frame, "paged_jax lora: expected x[T,K], a[L,K,SR], b[L,SR,N], ids[T], "
                       "params[3], y[T,N]");
  if (x->dtype != XLA_FFI_DataType_F32 || a->dtype != XLA_FFI_DataType_F32 ||
      b->dtype != XLA_FFI_DataType_F32 || y->dtype != XLA_FFI_DataType_F32 ||
      ids->dtype != XLA_FFI_DataType_S32 || params->dtype != XLA_FFI_DataType_S32 ||
      params->dims[0] != 3)
    return fail(frame, "paged_jax lora: expected f32 x, a, b and y, i32 ids and params[3]");
  const int64_t T = x->dims[0], K = x->dims[1], L = a->dims[0], SR = a->dims[2],
                N = b->dims[2];
  if (a->dims[1] != K || b->dims[0] != L || b->dims[1] != SR || ids->dims[0] != T ||
      y->dims[0] != T || y->dims[1] != N)
    return fail(frame, "paged_jax lora: operand shapes disagree");
  const int32_t *p = (const int32_t *)params->data;
  const int64_t layer = p[0], R = p[1];
  if (layer < 0 || layer >= L) return fail(frame, "paged_jax lora: layer index out of range");
  if (R < 1 || R > LORA_MAX_RANK || SR % R)
    return fail(frame, "paged_jax lora: the rank must divide the bank's width (at most 1024)");
  if (T == 0 || N == 0) return NULL;
  const float *al = (const float *)a->data + layer * K * SR;
  const float *bl = (const float *)b->data + layer * SR * N;
  const int32_t *id = (const int32_t *)ids->data;
  const int64_t S = SR / R;
  /* rows without an adapter are zeros; the others, grouped by slot (a counting sort, in
   * row order within a slot), are the jobs' work */
  int32_t *order = malloc(sizeof(int32_t) * (size_t)T);
  int64_t *start = calloc((size_t)S + 1, sizeof(int64_t));
  if (!order || !start) {
    free(order);
    free(start);
    return fail(frame, "paged_jax lora: out of memory");
  }
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = (int64_t)id[t] - 1;
    if (s < 0 || s >= S)
      memset((float *)y->data + t * N, 0, sizeof(float) * (size_t)N);
    else
      ++start[s + 1];
  }
  for (int64_t s = 0; s < S; ++s) start[s + 1] += start[s];
  const int64_t rows = start[S];
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = (int64_t)id[t] - 1;
    if (s >= 0 && s < S) order[start[s]++] = (int32_t)t;
  }
  free(start);
  const int64_t threads =
      clamp_threads(p[2], rows * (K + N) * R / LORA_MIN_MACS_PER_THREAD, rows);
  float *scratch = malloc(sizeof(float) * (size_t)(threads * N));
  if (!scratch) {
    free(order);
    return fail(frame, "paged_jax lora: out of memory");
  }
  LoraJob jobs[MAX_THREADS];
  for (int64_t t = 0; t < threads; ++t)
    jobs[t] = (LoraJob){.x = (const float *)x->data, .a = al, .b = bl, .order = order,
                        .ids = id, .y = (float *)y->data, .scratch = scratch + t * N, .K = K,
                        .N = N, .SR = SR, .R = R, .S = S, .first = rows * t / threads,
                        .last = rows * (t + 1) / threads};
  if (rows) run_jobs(frame, jobs, sizeof(LoraJob), threads, run_lora);
  free(scratch);
  free(order);
  return NULL;
}
