/* The greedy sampler's reductions for CPUs, called by XLA through its FFI; built with
 * decode.c and linear.c into one library by __init__.py.
 *
 * Operands: x f32[R, V] (a step's logits), params i32[1] {at most this many threads}.
 * Results: token i32[R], lse f32[R]. For each row:
 *   token = the first index of the row's maximum (of its first NaN, if it holds one), as
 *           jnp.argmax gives it;
 *   lse   = log(sum of exp(x - m)) + m with m the row's maximum, as jax.nn.logsumexp
 *           gives it: NaN for a row with a NaN, +inf for one with +inf, -inf for a row
 *           of -inf.
 * Two passes over the row: its maximum (vectors of LANES), then the sum of exponentials
 * (vec.h's exp_nonpositive, within 1 ulp of exp) and the first index holding the maximum.
 * Rows are split over threads in contiguous runs, the calling thread computing the first
 * and XLA's thread pool the others; a row's result does not depend on the others.
 *
 * Why: XLA:CPU's logsumexp and argmax of SmolLM2's 32 x 49,152 logits took 0.8-1.0 ms,
 * most of it in the exponentials, against a 35 ms decode step.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include "vec.h"
#define HAVE_LANES 1
#endif

#define MIN_ELEMENTS_PER_THREAD (1 << 16)

typedef struct {
  const float *x;
  int32_t *token;
  float *lse;
  int64_t V, first, last; /* rows [first, last) */
} RowsJob;

/* The row's maximum (NaN if it holds one). */
static float row_max(const float *x, int64_t V) {
  float m = -INFINITY;
  int64_t v = 0;
#if HAVE_LANES
  if (V >= LANES) {
    vf a = load_f32(x);
    vi nan = a != a;
    for (v = LANES; v + LANES <= V; v += LANES) {
      const vf b = load_f32(x + v);
      a = vmax(a, b);
      nan |= b != b;
    }
    m = max_lanes(a);
    for (int i = 0; i < LANES; ++i)
      if (nan[i]) return NAN;
  }
#endif
  for (; v < V; ++v) {
    if (x[v] != x[v]) return NAN;
    if (x[v] > m) m = x[v];
  }
  return m;
}

static void *run_rows_greedy(void *arg) {
  RowsJob *j = (RowsJob *)arg;
  const int64_t V = j->V;
  for (int64_t r = j->first; r < j->last; ++r) {
    const float *x = j->x + r * V;
    const float m = row_max(x, V);
    int64_t at = 0;
    if (m != m) { /* the first NaN; the sum is NaN */
      while (at < V && x[at] == x[at]) ++at;
      j->token[r] = (int32_t)at;
      j->lse[r] = NAN;
      continue;
    }
    while (at < V && x[at] != m) ++at;
    j->token[r] = (int32_t)(at < V ? at : 0);
    if (!isfinite(m)) { /* +inf: +inf; a row of -inf: -inf (the sum's log of 0) */
      j->lse[r] = m;
      continue;
    }
    float sum = 0.0f;
    int64_t v = 0;
#if HAVE_LANES
    vf s = (vf){};
    for (; v + LANES <= V; v += LANES) s += exp_nonpositive(load_f32(x + v) - m);
    sum = add_lanes(s);
#endif
    for (; v < V; ++v) sum += expf(x[v] - m);
    j->lse[r] = logf(sum) + m;
  }
  return NULL;
}

XLA_FFI_Error *PagedJaxGreedyRows(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 2 || frame->rets.size != 2)
    return fail(frame, "paged_jax greedy rows: expected 2 operands and 2 results");
  const XLA_FFI_Buffer *x = frame->args.args[0], *params = frame->args.args[1],
                       *token = frame->rets.rets[0], *lse = frame->rets.rets[1];
  if (x->rank != 2 || params->rank != 1 || token->rank != 1 || lse->rank != 1 ||
      x->dtype != XLA_FFI_DataType_F32 || params->dtype != XLA_FFI_DataType_S32 ||
      params->dims[0] != 1 || token->dtype != XLA_FFI_DataType_S32 ||
      lse->dtype != XLA_FFI_DataType_F32 || token->dims[0] != x->dims[0] ||
      lse->dims[0] != x->dims[0] || x->dims[1] < 1)
    return fail(frame, "paged_jax greedy rows: expected f32 x[R,V] (V >= 1), i32[1] params, "
                       "i32 token[R] and f32 lse[R]");
  const int64_t R = x->dims[0], V = x->dims[1];
  const int64_t threads =
      clamp_threads(*(const int32_t *)params->data, R * V / MIN_ELEMENTS_PER_THREAD, R);
  RowsJob jobs[MAX_THREADS];
  for (int64_t t = 0; t < threads; ++t)
    jobs[t] = (RowsJob){.x = (const float *)x->data, .token = (int32_t *)token->data,
                        .lse = (float *)lse->data, .V = V,
                        .first = R * t / threads, .last = R * (t + 1) / threads};
  if (R > 0) run_jobs(frame, jobs, sizeof(RowsJob), threads, run_rows_greedy);
  return NULL;
}
