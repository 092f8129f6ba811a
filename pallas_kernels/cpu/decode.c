/* Paged decode attention for CPUs, called by XLA through its FFI (the C API in
 * jaxlib/include/xla/ffi/api/c_api.h); built and registered by __init__.py.
 *
 * Operands (row-major):
 *   q        [B, H, D]      f32 or bf16, one query token per sequence
 *   kv_pages [N, P, 2K, D]  f32 or bf16; a token's row 2k is KV head k's key, 2k + 1 its value
 *   kv_lens  i32[B]         sequence b's query sits at position kv_lens[b] - 1
 *   tables   i32[B, M]      sequence b's pages, in order
 *   params   f32[4]         {sm_scale, sliding window (0: none), soft cap (0: none), threads}
 * Result: o [B, H, D] in q's dtype.
 *
 * Sequence b attends to its keys [max(0, kv_lens[b] - window), kv_lens[b]), clipped to
 * the M * P slots its table holds; a row with kv_lens[b] <= 0 is padding (output 0). A
 * page id outside [0, N) reads page 0, the null page. Keys past kv_lens[b] are never
 * read, so stale or unwritten slots cannot leak in (not even as NaN).
 *
 * The work: one pass over each sequence's tokens, in order, with an online softmax per
 * query head in f32 (the running max, the sum of exponentials and the weighted values,
 * rescaled when the max grows). A token's K and V rows for all heads are adjacent
 * (2K * D elements), so the pass reads every page front to back; the rows a few tokens
 * ahead are prefetched, since a page boundary jumps to an unrelated address. Sequences
 * are split over `threads` threads in contiguous runs of about equal token counts. Each
 * sequence is computed alone and in a fixed order, so its result does not depend on the
 * rest of the batch or on the thread count.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

#define PREFETCH_TOKENS 4 /* how far ahead the next tokens' rows are fetched */
#define MAX_THREADS 64
#define MAX_GROUP 64                     /* query heads per KV head */
#define MIN_ELEMENTS_PER_THREAD (1 << 18) /* a thread only for at least this much K/V */

typedef struct {
  const void *q, *kv;
  void *out;
  const int32_t *lens, *tables;
  int64_t H, D, N, P, K, M, window, first, last; /* rows [first, last) */
  float scale, cap;
  int q16, kv16, ok;
} Job;

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Row `row` of a [rows, D] buffer as f32: a pointer into it, or a converted copy in tmp. */
static inline const float *row_f32(const void *base, int bf16, int64_t row, int64_t D,
                                   float *tmp) {
  if (!bf16) return (const float *)base + row * D;
  const uint16_t *h = (const uint16_t *)base + row * D;
  for (int64_t d = 0; d < D; ++d) tmp[d] = bf16_to_f32(h[d]);
  return tmp;
}

static inline float dot(const float *a, const float *b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

static inline int64_t clipped_len(const Job *j, int64_t b) {
  int64_t len = j->lens[b], slots = j->M * j->P;
  return len <= 0 ? 0 : (len < slots ? len : slots);
}

/* The id of the page holding token c of sequence b (the null page for a bad id). */
static inline int64_t page_of(const Job *j, int64_t b, int64_t c) {
  int64_t page = j->tables[b * j->M + c / j->P];
  return (page < 0 || page >= j->N) ? 0 : page;
}

static void *run_rows(void *arg) {
  Job *j = (Job *)arg;
  const int64_t H = j->H, D = j->D, P = j->P, K = j->K, K2 = 2 * K, G = H / K;
  const size_t elem = j->kv16 ? 2 : 4;
  /* q scaled to f32, the running sums per query head, a bf16 conversion row */
  float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * H * D + D + 2 * H));
  if (!buf) return NULL; /* j->ok stays 0 */
  float *qf = buf, *acc = qf + H * D, *tmp = acc + H * D, *mx = tmp + D, *sum = mx + H;
  float score[MAX_GROUP];

  for (int64_t b = j->first; b < j->last; ++b) {
    const int64_t len = clipped_len(j, b);
    const int64_t start = (j->window > 0 && len > j->window) ? len - j->window : 0;
    memset(acc, 0, sizeof(float) * (size_t)(H * D));
    for (int64_t h = 0; h < H; ++h) {
      const float *r = row_f32(j->q, j->q16, b * H + h, D, tmp);
      for (int64_t d = 0; d < D; ++d) qf[h * D + d] = r[d] * j->scale;
      mx[h] = -INFINITY;
      sum[h] = 0.0f;
    }
    for (int64_t c = start; c < len; ++c) {
      if (c + PREFETCH_TOKENS < len) {
        const int64_t ahead = c + PREFETCH_TOKENS;
        const char *rows = (const char *)j->kv +
                           (size_t)((page_of(j, b, ahead) * P + ahead % P) * K2 * D) * elem;
        for (size_t o = 0; o < (size_t)(K2 * D) * elem; o += 64) __builtin_prefetch(rows + o);
      }
      const int64_t row0 = (page_of(j, b, c) * P + c % P) * K2;
      for (int64_t k = 0; k < K; ++k) {
        const float *key = row_f32(j->kv, j->kv16, row0 + 2 * k, D, tmp);
        for (int64_t g = 0; g < G; ++g) {
          float s = dot(qf + (k * G + g) * D, key, D);
          if (j->cap > 0.0f) s = j->cap * tanhf(s / j->cap);
          score[g] = s;
        }
        const float *value = row_f32(j->kv, j->kv16, row0 + 2 * k + 1, D, tmp);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = k * G + g;
          float *a = acc + h * D;
          if (score[g] > mx[h]) { /* a new running max: rescale what was summed so far */
            const float r = expf(mx[h] - score[g]);
            sum[h] *= r;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= r;
            mx[h] = score[g];
          }
          const float p = expf(score[g] - mx[h]);
          sum[h] += p;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * value[d];
        }
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
      for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= inv;
    }
    if (j->q16) {
      uint16_t *o = (uint16_t *)j->out + b * H * D;
      for (int64_t i = 0; i < H * D; ++i) o[i] = f32_to_bf16(acc[i]);
    } else {
      memcpy((float *)j->out + b * H * D, acc, sizeof(float) * (size_t)(H * D));
    }
  }
  free(buf);
  j->ok = 1;
  return NULL;
}

static XLA_FFI_Error *fail(const XLA_FFI_CallFrame *frame, const char *msg) {
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = msg;
  args.errc = XLA_FFI_Error_Code_INVALID_ARGUMENT;
  return frame->api->XLA_FFI_Error_Create(&args);
}

static int is_float(const XLA_FFI_Buffer *x) {
  return x->dtype == XLA_FFI_DataType_F32 || x->dtype == XLA_FFI_DataType_BF16;
}

XLA_FFI_Error *PagedJaxDecodeAttention(XLA_FFI_CallFrame *frame) {
  /* XLA first asks which FFI version the handler speaks. */
  if (frame->extension_start && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    XLA_FFI_Metadata_Extension *ext = (XLA_FFI_Metadata_Extension *)frame->extension_start;
    ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    ext->metadata->traits = 0;
    return NULL;
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 5 || frame->rets.size != 1)
    return fail(frame, "paged_jax decode: expected 5 operands and 1 result");
  const XLA_FFI_Buffer *q = frame->args.args[0], *kv = frame->args.args[1],
                       *lens = frame->args.args[2], *tables = frame->args.args[3],
                       *params = frame->args.args[4], *out = frame->rets.rets[0];
  if (q->rank != 3 || kv->rank != 4 || lens->rank != 1 || tables->rank != 2 ||
      params->rank != 1 || out->rank != 3)
    return fail(frame, "paged_jax decode: expected q[B,H,D], kv_pages[N,P,2K,D], kv_lens[B], "
                       "tables[B,M], params[4] and o[B,H,D]");
  if (!is_float(q) || !is_float(kv) || out->dtype != q->dtype ||
      lens->dtype != XLA_FFI_DataType_S32 || tables->dtype != XLA_FFI_DataType_S32 ||
      params->dtype != XLA_FFI_DataType_F32 || params->dims[0] != 4)
    return fail(frame, "paged_jax decode: expected f32/bf16 q and kv_pages, i32 kv_lens and "
                       "tables, f32[4] params, o in q's dtype");
  const int64_t B = q->dims[0], H = q->dims[1], D = q->dims[2], K = kv->dims[2] / 2;
  if (kv->dims[3] != D || kv->dims[2] % 2 || K == 0 || H % K || H / K > MAX_GROUP ||
      lens->dims[0] != B || tables->dims[0] != B || out->dims[0] != B || out->dims[1] != H ||
      out->dims[2] != D)
    return fail(frame, "paged_jax decode: operand shapes disagree (or > 64 query heads per "
                       "KV head)");
  const float *p = (const float *)params->data;
  Job base = {
      .q = q->data, .kv = kv->data, .out = out->data,
      .lens = (const int32_t *)lens->data, .tables = (const int32_t *)tables->data,
      .H = H, .D = D, .N = kv->dims[0], .P = kv->dims[1], .K = K, .M = tables->dims[1],
      .window = (int64_t)p[1], .scale = p[0], .cap = p[2],
      .q16 = q->dtype == XLA_FFI_DataType_BF16, .kv16 = kv->dtype == XLA_FFI_DataType_BF16,
  };
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) tokens += clipped_len(&base, b);
  int64_t threads = (int64_t)p[3];
  const int64_t by_work = tokens * 2 * K * D / MIN_ELEMENTS_PER_THREAD;
  if (threads > by_work) threads = by_work;
  if (threads > B) threads = B;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  if (threads < 1) threads = 1;

  Job jobs[MAX_THREADS];
  pthread_t tid[MAX_THREADS];
  int started[MAX_THREADS];
  int64_t b = 0, done = 0;
  for (int64_t t = 0; t < threads; ++t) { /* contiguous runs of about tokens / threads */
    jobs[t] = base;
    jobs[t].first = b;
    const int64_t target = tokens * (t + 1) / threads;
    while (b < B && (done < target || t == threads - 1)) done += clipped_len(&base, b++);
    jobs[t].last = b;
  }
  for (int64_t t = 1; t < threads; ++t)
    started[t] = pthread_create(&tid[t], NULL, run_rows, &jobs[t]) == 0;
  run_rows(&jobs[0]);
  int ok = jobs[0].ok;
  for (int64_t t = 1; t < threads; ++t) {
    if (started[t])
      pthread_join(tid[t], NULL);
    else
      run_rows(&jobs[t]); /* no thread to be had: run it here */
    ok &= jobs[t].ok;
  }
  return ok ? NULL : fail(frame, "paged_jax decode: out of memory");
}
