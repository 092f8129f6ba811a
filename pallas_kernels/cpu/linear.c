/* Matrix products against weights packed in column panels, for CPUs, called by XLA
 * through its FFI; built with decode.c into one library by __init__.py.
 *
 * Operands (row-major):
 *   x        f32[M, K]
 *   w        f32[P, K, NR]     a weight W [K, N] in panels of NR columns:
 *                              w[p, k, j] = W[k, p * NR + j], 0 past column N
 *            or f32[L, P, K, NR]  L such weights (a model's layers), one of them used
 *            or s8[(L,) P, K, NR] int8 weights (W8A16: paged_jax.linear.pack with
 *                              int8), with a 4th operand before params:
 *   scales   f32[(L,) P * NR]  column n's scale (its weights are q[k, n] * scales[n])
 *            or u8[(L,) P, K / 2, NR] 4-bit weights in groups of G along K (paged_jax.
 *                              linear.pack of two rows a byte: row 2i in the low nibble,
 *                              row 2i + 1 in the high one, each q in [0, 15]), with a 4th
 *                              and a 5th operand before params:
 *   scales   f32[(L,) P, K / G, NR]  each group's scale d and
 *   mins     f32[(L,) P, K / G, NR]  its minimum m: the weights are d * q + m
 *   params   i32[3]            {the weight to use (0 for a 3-D w), at most this many threads,
 *                              the rows to compute (R; outside [0, M]: all M)}
 * Result: y f32[M, N], N in (P * NR - NR, P * NR]; rows R .. M - 1 are 0. A step padded
 * to a power-of-two count of tokens thus pays only for its real ones.
 *
 * NR is paged_jax_linear_panel_width(): three vector registers of f32 lanes (48 with
 * AVX-512, 24 with AVX2, 12 otherwise). Packing is done once, when the weights are loaded
 * (paged_jax.linear.pack): the product then reads each panel front to back, one cache
 * line after the next, and never repacks a weight the way a general matrix product
 * must for each call.
 *
 * y[m, n] = sum of x[m, k] * W[k, n] for k = 0, 1, ... K - 1, added in that order into
 * one f32 sum per output (fused multiply-adds where the CPU has them). A row's result
 * does not depend on M, on the other rows or on the thread count. With int8 weights the
 * sum is over x[m, k] * q[k, n] (each q widened to f32 as it is read), then multiplied by
 * scales[n]: a quarter of the bytes read per product. With 4-bit weights each group of G
 * rows is summed on its own, sum of x[m, k] * q[k, n] over the group in order, and added
 * to the output as d * that + m * (the group's sum of x[m, k], computed once per call):
 * an eighth of the bytes.
 *
 * The work: MR rows of x by one panel at a time, in 3 * MR vector accumulators (AVX-512:
 * 8 rows, 24 of its 32 registers); each k loads the panel's NR weights once and
 * multiplies them by MR broadcast values of x. Rows go in blocks of ROW_BLOCK, each block
 * reading the panels of its thread while its x rows stay in cache; within a block a
 * panel is read from memory by its first MR rows and from L2 by the rest. Panels are
 * split over the threads in contiguous runs; the calling thread computes the first run
 * and hands the others to XLA's thread pool (run_jobs).
 *
 * Measured on a 2-core AMD EPYC (Zen 5), 32 rows, f32, SmolLM2-135M's shapes, 30
 * different weights one after the other: 355-408 GFLOP/s against 140-250 for XLA's own
 * dots and YNNPACK's.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "pool.h"

#if defined(__AVX512F__)
#define VL 16
#define MR 8
#elif defined(__AVX2__)
#define VL 8
#define MR 4
#else
#define VL 4
#define MR 4
#endif
#define NR (3 * VL)
#define ROW_BLOCK 64                   /* rows whose x stays in cache over the panels */
#define MIN_MACS_PER_THREAD (1 << 20) /* a thread only for at least this many products */

typedef float lv __attribute__((vector_size(4 * VL)));
typedef int8_t qv __attribute__((vector_size(VL)));
typedef uint8_t uv __attribute__((vector_size(VL)));

int paged_jax_linear_panel_width(void) { return NR; }

typedef struct {
  const float *x;
  const void *w;      /* f32 panels, int8 ones when scale is set, 4-bit ones with mins */
  const float *scale; /* int8: the columns' scales [P * NR]; 4-bit: [P, K / G, NR] */
  const float *mins;  /* 4-bit weights: the groups' minimums [P, K / G, NR], else NULL */
  const float *xsum;  /* 4-bit weights: each row's sum of x over each group [M, K / G] */
  float *y;
  int64_t M, K, N, G, first, last; /* panels [first, last); G: 4-bit group rows */
} LinearJob;

static inline lv load(const float *p) {
  lv v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* VL weights at element `at` of a panel: f32, or int8 widened to f32 (`q`, a constant
 * wherever this is inlined). */
static inline __attribute__((always_inline)) lv load_w(const void *w, int64_t at, const int q) {
  if (!q) return load((const float *)w + at);
  const int8_t *p = (const int8_t *)w + at;
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
  qv v;
  memcpy(&v, p, sizeof v);
  const lv f = __builtin_convertvector(v, lv);
#endif
  lv out;
  memcpy(&out, &f, sizeof out);
  return out;
}

/* y[0 .. mr) x [n0, n0 + NR) (clipped to N) = x[0 .. mr) @ panel wp [K, NR] (f32, or
 * int8 with `q`, times the panel's scales `sc`). `ahead`: a panel to fetch into the cache
 * meanwhile, row k with row k of this one (or NULL). */
static inline __attribute__((always_inline)) void tile(const float *x, const void *wp,
                                                      const void *ahead, float *y, int64_t K,
                                                      int64_t N, int64_t n0, const int mr,
                                                      const int q, const float *sc) {
  const int64_t bytes = q ? 1 : 4; /* of a weight */
  lv c[MR][3];
  for (int i = 0; i < mr; ++i) c[i][0] = c[i][1] = c[i][2] = (lv){};
  for (int64_t k = 0; k < K; ++k) {
    if (ahead)
      for (int64_t b = 0; b < NR * bytes; b += 64) /* the row's cache lines */
        __builtin_prefetch((const char *)ahead + k * NR * bytes + b, 0, 3);
    const lv b0 = load_w(wp, k * NR, q), b1 = load_w(wp, k * NR + VL, q),
             b2 = load_w(wp, k * NR + 2 * VL, q);
    for (int i = 0; i < mr; ++i) {
      const float a = x[i * K + k];
      c[i][0] += a * b0;
      c[i][1] += a * b1;
      c[i][2] += a * b2;
    }
  }
  if (q) {
    const lv s0 = load(sc), s1 = load(sc + VL), s2 = load(sc + 2 * VL);
    for (int i = 0; i < mr; ++i) {
      c[i][0] *= s0;
      c[i][1] *= s1;
      c[i][2] *= s2;
    }
  }
  const int64_t cols = N - n0 < NR ? N - n0 : NR;
  for (int i = 0; i < mr; ++i) {
    float *out = y + i * N + n0;
    if (cols == NR) {
      memcpy(out, &c[i][0], sizeof(lv));
      memcpy(out + VL, &c[i][1], sizeof(lv));
      memcpy(out + 2 * VL, &c[i][2], sizeof(lv));
    } else { /* the last panel of an N that is not a multiple of NR */
      float row[NR];
      memcpy(row, &c[i][0], sizeof(lv));
      memcpy(row + VL, &c[i][1], sizeof(lv));
      memcpy(row + 2 * VL, &c[i][2], sizeof(lv));
      memcpy(out, row, sizeof(float) * (size_t)cols);
    }
  }
}

/* VL 4-bit weights at byte `at` of a panel widened to f32: the low nibbles (row 2i)
 * when `high` is 0, else the high ones (row 2i + 1). */
static inline __attribute__((always_inline)) lv load_nibbles(const uint8_t *w, int64_t at,
                                                             const int high) {
  const uint8_t *p = w + at;
#if defined(__AVX512F__)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  const __m512 f = _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4)
                                           : _mm512_and_si512(v, _mm512_set1_epi32(15)));
#elif defined(__AVX2__)
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
  const __m256 f = _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4)
                                           : _mm256_and_si256(v, _mm256_set1_epi32(15)));
#else
  uv b;
  memcpy(&b, p, sizeof b);
  const lv f = __builtin_convertvector(high ? (uv)(b >> 4) : (uv)(b & (uint8_t)15), lv);
#endif
  lv out;
  memcpy(&out, &f, sizeof out);
  return out;
}

/* The 4-bit counterpart of tile: y[0 .. mr) x [n0, n0 + NR) = for each group g of G rows,
 * d[g] * (x @ q over the group) + m[g] * xs[i, g], with the panel's scales `sc` and
 * minimums `mn` ([K / G, NR]) and the rows' group sums `xs` ([mr, K / G], row stride
 * K / G). A group's sums stay in registers (3 * mr vectors, the weights of one row at a
 * time beside them: 16 registers with AVX2's 4 rows); the running total, touched once
 * per group, lives in memory. */
static inline __attribute__((always_inline)) void tile4(const float *x, const uint8_t *wp,
                                                       const uint8_t *ahead, float *y,
                                                       int64_t K, int64_t N, int64_t n0,
                                                       const int mr, int64_t G,
                                                       const float *sc, const float *mn,
                                                       const float *xs) {
  const int64_t groups = K / G;
  float acc[MR][NR];
  memset(acc, 0, sizeof acc);
  for (int64_t g = 0; g < groups; ++g) {
    lv t[MR][3];
    for (int i = 0; i < mr; ++i) t[i][0] = t[i][1] = t[i][2] = (lv){};
    for (int64_t k = g * G; k < (g + 1) * G; k += 2) {
      const int64_t at = (k / 2) * NR;
      if (ahead) __builtin_prefetch(ahead + at, 0, 3); /* the next panel, as this one */
      for (int half = 0; half < 2; ++half) {
        const lv w0 = load_nibbles(wp, at, half), w1 = load_nibbles(wp, at + VL, half),
                 w2 = load_nibbles(wp, at + 2 * VL, half);
        for (int i = 0; i < mr; ++i) {
          const float a = x[i * K + k + half];
          t[i][0] += a * w0;
          t[i][1] += a * w1;
          t[i][2] += a * w2;
        }
      }
    }
    for (int j = 0; j < 3; ++j) {
      const lv d = load(sc + g * NR + j * VL), m = load(mn + g * NR + j * VL);
      for (int i = 0; i < mr; ++i) {
        lv a;
        memcpy(&a, &acc[i][j * VL], sizeof a);
        a += t[i][j] * d + xs[i * groups + g] * m;
        memcpy(&acc[i][j * VL], &a, sizeof a);
      }
    }
  }
  const int64_t cols = N - n0 < NR ? N - n0 : NR;
  for (int i = 0; i < mr; ++i) memcpy(y + i * N + n0, acc[i], sizeof(float) * (size_t)cols);
}

static void run_rows4(LinearJob *j) {
  const int64_t M = j->M, K = j->K, N = j->N, G = j->G, groups = K / G;
  const int64_t panel = K / 2 * NR; /* bytes */
  for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int64_t m1 = M - m0 < ROW_BLOCK ? M : m0 + ROW_BLOCK;
    for (int64_t p = j->first; p < j->last; ++p) {
      const uint8_t *wp = (const uint8_t *)j->w + p * panel;
      const float *sc = j->scale + p * groups * NR, *mn = j->mins + p * groups * NR;
      const uint8_t *next = p + 1 < j->last ? wp + panel : NULL;
      int64_t m = m0;
#define TILE4(R) \
  tile4(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, R, G, sc, mn, j->xsum + m * groups)
      for (; m + MR <= m1; m += MR, next = NULL) TILE4(MR);
      switch (m1 - m) {
#if MR == 8
        case 7: TILE4(7); break;
        case 6: TILE4(6); break;
        case 5: TILE4(5); break;
        case 4: TILE4(4); break;
#endif
        case 3: TILE4(3); break;
        case 2: TILE4(2); break;
        case 1: TILE4(1); break;
        default: break;
      }
#undef TILE4
    }
  }
}

static inline __attribute__((always_inline)) void run_rows(LinearJob *j, const int q) {
  const int64_t M = j->M, K = j->K, N = j->N, panel = K * NR * (q ? 1 : 4); /* bytes */
  for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int64_t m1 = M - m0 < ROW_BLOCK ? M : m0 + ROW_BLOCK;
    for (int64_t p = j->first; p < j->last; ++p) {
      const char *wp = (const char *)j->w + p * panel;
      const float *sc = q ? j->scale + p * NR : NULL;
      /* The block's first tile fetches the thread's next panel: 7-10% faster at 32 rows x
       * 576 x 1536 and SmolLM2's head on the machine above, the same at 1536 x 576. */
      const char *next = p + 1 < j->last ? wp + panel : NULL;
      int64_t m = m0;
      for (; m + MR <= m1; m += MR, next = NULL)
        tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, MR, q, sc);
      switch (m1 - m) { /* the last rows: a tile per count, each fully unrolled */
#if MR == 8
        case 7: tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, 7, q, sc); break;
        case 6: tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, 6, q, sc); break;
        case 5: tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, 5, q, sc); break;
        case 4: tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, 4, q, sc); break;
#endif
        case 3: tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, 3, q, sc); break;
        case 2: tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, 2, q, sc); break;
        case 1: tile(j->x + m * K, wp, next, j->y + m * N, K, N, p * NR, 1, q, sc); break;
        default: break;
      }
    }
  }
}

static void *run_linear(void *arg) {
  LinearJob *j = (LinearJob *)arg;
  if (j->mins)
    run_rows4(j);
  else if (j->scale)
    run_rows(j, 1); /* two copies, each with its weight type fixed */
  else
    run_rows(j, 0);
  return NULL;
}

XLA_FFI_Error *PagedJaxLinear(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  const int64_t nargs = frame->args.size;
  if (nargs < 3 || nargs > 5 || frame->rets.size != 1)
    return fail(frame, "paged_jax linear: expected 3 to 5 operands and 1 result");
  /* q: 0 f32 weights, 1 int8 ones and their scales, 2 4-bit ones, scales and minimums */
  const int q = (int)nargs - 3;
  const XLA_FFI_Buffer *x = frame->args.args[0], *w = frame->args.args[1],
                       *scales = q ? frame->args.args[2] : NULL,
                       *mins = q == 2 ? frame->args.args[3] : NULL,
                       *params = frame->args.args[2 + q], *y = frame->rets.rets[0];
  if (x->rank != 2 || (w->rank != 3 && w->rank != 4) || params->rank != 1 || y->rank != 2)
    return fail(frame, "paged_jax linear: expected x[M,K], w[(L,)P,K,NR], params[3], y[M,N]");
  const XLA_FFI_DataType wt = q == 0 ? XLA_FFI_DataType_F32
                              : q == 1 ? XLA_FFI_DataType_S8
                                       : XLA_FFI_DataType_U8;
  if (x->dtype != XLA_FFI_DataType_F32 || w->dtype != wt || y->dtype != XLA_FFI_DataType_F32 ||
      params->dtype != XLA_FFI_DataType_S32 || params->dims[0] != 3)
    return fail(frame, "paged_jax linear: expected f32 x and y, f32 w (s8 with scales, u8 with "
                       "scales and minimums), and i32[3] params");
  const int64_t *wd = w->dims + (w->rank - 3); /* P, K (K / 2 for 4-bit), NR */
  const int64_t L = w->rank == 4 ? w->dims[0] : 1;
  const int64_t K = x->dims[1], P = wd[0], N = y->dims[1];
  if (wd[1] * (q == 2 ? 2 : 1) != K || wd[2] != NR || y->dims[0] != x->dims[0] ||
      N > P * NR || N <= P * NR - NR)
    return fail(frame, "paged_jax linear: operand shapes disagree (w's panels must be this "
                       "build's panel width and cover N)");
  if (q == 1 && (scales->dtype != XLA_FFI_DataType_F32 || scales->rank != w->rank - 2 ||
                 scales->dims[scales->rank - 1] != P * NR ||
                 (w->rank == 4 && scales->dims[0] != L)))
    return fail(frame, "paged_jax linear: expected f32 scales [(L,) P * NR] with s8 weights");
  int64_t G = 0;
  if (q == 2) {
    const int64_t *sd = scales->dims + (scales->rank - 3), *md = mins->dims + (mins->rank - 3);
    int ok = scales->dtype == XLA_FFI_DataType_F32 && mins->dtype == XLA_FFI_DataType_F32 &&
             scales->rank == w->rank && mins->rank == w->rank && sd[0] == P && sd[2] == NR &&
             sd[1] > 0 && md[0] == P && md[1] == sd[1] && md[2] == NR;
    if (w->rank == 4) ok = ok && scales->dims[0] == L && mins->dims[0] == L;
    if (ok) {
      G = K / sd[1];
      ok = G * sd[1] == K && G % 2 == 0;
    }
    if (!ok)
      return fail(frame, "paged_jax linear: expected f32 scales and minimums [(L,) P, K / G, "
                         "NR] with u8 weights, G even");
  }
  const int32_t *p = (const int32_t *)params->data;
  if (p[0] < 0 || p[0] >= L) return fail(frame, "paged_jax linear: weight index out of range");
  const int64_t M = (p[2] >= 0 && p[2] < x->dims[0]) ? p[2] : x->dims[0]; /* rows computed */
  memset((float *)y->data + M * N, 0, sizeof(float) * (size_t)((x->dims[0] - M) * N));
  if (M == 0 || N == 0) return NULL;
  if (K == 0) {
    memset(y->data, 0, sizeof(float) * (size_t)(M * N));
    return NULL;
  }
  const int64_t threads = clamp_threads(p[1], M * K * P * NR / MIN_MACS_PER_THREAD, P);
  const size_t wbytes = q == 0 ? 4 : 1, wrows = (size_t)(q == 2 ? K / 2 : K);
  const void *weight = (const char *)w->data + (size_t)p[0] * (size_t)P * wrows * NR * wbytes;
  const float *scale = NULL, *mn = NULL;
  float *xsum = NULL;
  if (q == 1) scale = (const float *)scales->data + (size_t)p[0] * (size_t)(P * NR);
  if (q == 2) {
    const size_t groups = (size_t)(K / G), per = (size_t)P * groups * NR;
    scale = (const float *)scales->data + (size_t)p[0] * per;
    mn = (const float *)mins->data + (size_t)p[0] * per;
    xsum = (float *)malloc(sizeof(float) * (size_t)M * groups);
    if (!xsum) return fail(frame, "paged_jax linear: out of memory");
    const float *xd = (const float *)x->data;
    for (int64_t m = 0; m < M; ++m)
      for (size_t g = 0; g < groups; ++g) {
        float s = 0;
        for (int64_t k = (int64_t)g * G; k < ((int64_t)g + 1) * G; ++k) s += xd[m * K + k];
        xsum[m * (int64_t)groups + (int64_t)g] = s;
      }
  }
  LinearJob jobs[MAX_THREADS];
  for (int64_t t = 0; t < threads; ++t)
    jobs[t] = (LinearJob){.x = (const float *)x->data, .w = weight, .scale = scale, .mins = mn,
                          .xsum = xsum, .y = (float *)y->data, .M = M, .K = K, .N = N, .G = G,
                          .first = P * t / threads, .last = P * (t + 1) / threads};
  run_jobs(frame, jobs, sizeof(LinearJob), threads, run_linear);
  free(xsum);
  return NULL;
}
