/* Matrix products against weights packed in column panels, for CPUs, called by XLA
 * through its FFI; built with decode.c into one library by __init__.py.
 *
 * Operands (row-major):
 *   x        f32[M, K]
 *   w        f32[P, K, NR]     a weight W [K, N] in panels of NR columns:
 *                              w[p, k, j] = W[k, p * NR + j], 0 past column N
 *            or f32[L, P, K, NR]  L such weights (a model's layers), one of them used
 *            or s8[(L,) P, K, NR] int8 weights, K a multiple of 4, in quads of rows:
 *                              panel p's bytes [4 NR i, 4 NR (i + 1)) hold, for each column
 *                              j in turn, W[4i .. 4i + 3, p * NR + j] (paged_jax.linear.
 *                              pack with int8), with a 4th operand before params:
 *   scales   f32[(L,) P * NR]  column n's scale (its weights are q[k, n] * scales[n]),
 *            or f32[(L,) P, K / G, NR]  a scale per column and group of G rows (G a
 *                              multiple of 4, as GGUF's Q8_0 blocks of 32)
 *            or u8[(L,) P, K / 2, NR] 4-bit weights in groups of G along K (G a multiple
 *                              of 8), each q in [0, 15], in octets of rows: panel p's bytes
 *                              [4 NR i, 4 NR (i + 1)) hold, for each column j in turn and
 *                              r = 0 .. 3, W[8i + r, j] in the low nibble and W[8i + 4 + r,
 *                              j] in the high one; with a 4th and a 5th operand:
 *   scales   f32[(L,) P, K / G, NR]  each group's scale d and
 *   mins     f32[(L,) P, K / G, NR]  its minimum m: the weights are d * q + m
 *            (int8 weights with scales per group take mins too: GGUF's Q5_1 and Q5_K
 *            blocks, q in [0, 31], as d * q + m)
 *            4-bit weights may come without mins, params[4] then an offset o: the weights
 *            are d * (q - o) (GGUF's Q4_0, Q5_0, Q6_K blocks: o 8, 16, 32); their scales
 *            (and mins alike) may be f16 rather than f32 (a GGUF file's own precision);
 *            and a last operand may add high bits to each 4-bit value:
 *   high     u8[(L,) P, K hb / 8, NR]  hb (1 or 2) bits above each value, q then in [0, 2 **
 *                              (4 + hb)) (GGUF's 5- and 6-bit blocks): a row of 4 NR
 *                              bytes serves 4 / hb octets of rows, byte 4 j + r of it
 *                              holding, for its o-th octet i, the bits of W[8i + r, j] at
 *                              2 o hb and of W[8i + 4 + r, j] at (2 o + 1) hb
 *                              (paged_jax.kernels.cpu.pack_high)
 *            or bf16[(L,) P, K, NR] 16-bit float weights, K even, in pairs of rows: panel p's
 *                              values [2 NR i, 2 NR (i + 1)) hold, for each column j in turn,
 *                              W[2i, j] and W[2i + 1, j]; perhaps with a 3rd operand before
 *                              params: scales f32[(L,) P * NR], column n's (fp8 weights held
 *                              so, an e4m3 value being a bf16 one: q[k, n] * scales[n])
 *   params   i32[3] to i32[6]  {the weight to use (0 for a 3-D w), at most this many threads,
 *                              the rows to compute (R; outside [0, M]: all M), (int8 or
 *                              4-bit weights, K a multiple of 32) 1 where the weights were
 *                              rotated along K (below), else 0, the 4-bit offset above, and
 *                              1 for float rows (below), else 0}
 * Result: y f32[M, N], N in (P * NR - NR, P * NR]; rows R .. M - 1 are 0. A step padded
 * to a power-of-two count of tokens thus pays only for its real ones.
 *
 * NR is paged_jax_linear_panel_width(): three vector registers of f32 lanes (48 with
 * AVX-512, 24 with AVX2, 12 otherwise). Packing is done once, when the weights are loaded
 * (paged_jax.linear.pack): the product then reads each panel front to back, one cache
 * line after the next, and never repacks a weight the way a general matrix product
 * must for each call.
 *
 * f32 weights: y[m, n] = sum of x[m, k] * W[k, n] for k = 0, 1, ... K - 1, added in that
 * order into one f32 sum per output (fused multiply-adds where the CPU has them).
 *
 * Quantized weights multiply quantized rows of x (W8A8, as llama.cpp's Q8 x Q8 and
 * Q4 x Q8): each row of x is cut into blocks of B inputs (int8: B = 32, the last block
 * the rest of K; 4-bit: B = G, the weights' groups), and a block with largest magnitude
 * a gets the scale dx = a / 127 and the values xq = x * (127 / a) rounded to the nearest
 * integer (ties to even), in [-127, 127] (a = 0: dx = 0, xq = 0). Each block's sum of
 * xq[m, k] * q[k, n] is an exact int32, so it does not depend on how the CPU adds it
 * (VNNI's vpdpbusd, AVX2's vpmaddubsw or plain C give the same bits). Then, with the
 * blocks b in order, into one f32 sum per output:
 *   int8:  y[m, n] = scales[n] * sum over b of dx[m, b] * isum[m, b, n]
 *          (scales per group: sum over b of isum[m, b, n] * (d[b, n] * dx[m, b]), B = G)
 *   4-bit, and int8 groups with mins:
 *          y[m, n] = sum over b of isum[m, b, n] * (d[b, n] * dx[m, b])
 *                                 + m[b, n] * (the block's sum of xq, times dx[m, b])
 * that is, the dequantized weights times the quantized rows: the rows' rounding errors
 * meet the weights as they are, d q + m, not the unsigned q (the sum of x itself in the
 * second term moved SmolLM2's log-likelihood 6% instead of 1%).
 * With rotated weights (params[3] = 1: the weights are R W, R the orthonormal Hadamard
 * matrix of order 32 applied to each block of 32 rows of W), each row of x is rotated the
 * same way before it is quantized, x R (R is symmetric and its own inverse), so that
 * (x R)(R W) = x W: within each block of 32 inputs, from the first: for h = 1, 2, 4, 8,
 * 16, each pair (v[i], v[i + h]) with i's bit h clear becomes (v[i] + v[i + h], v[i] -
 * v[i + h]), then every value is multiplied by the f32 nearest 1 / sqrt(32) (in f32, so
 * paged_jax.kernels.cpu.rotate_blocks gives the same bits). A block's outlier is spread
 * over its 32 inputs, and the block's scale no longer rounds its other inputs to 0.
 * Float rows (params[5] = 1; 4-bit weights, or int8 ones with scales per group): each
 * panel of the weights is dequantized once into an f32 panel, d * q then + m (or (q -
 * o) * d), a product and a sum each rounded on its own as the gguf package dequantizes
 * in numpy, and the rows of x multiply it as they are, exactly as f32 weights: the sums
 * of x @ W on the dequantized W, bit for bit, at the quantized weights' bytes (a GGUF
 * file's blocks kept by default).
 * bf16 weights multiply the rows of x rounded to bf16 (to nearest, ties to even):
 *   y[m, n] = scales[n] * sum over pairs i, in order, of bf16(x[m, 2i]) * W[2i, n]
 *                                                     + bf16(x[m, 2i + 1]) * W[2i + 1, n]
 * into one f32 sum per output (each product of two bf16 values is exact in f32; how a
 * pair's two are added in is the instruction's: AVX-512 BF16's vdpbf16ps, which also
 * reads bf16 subnormals as 0, or two FMAs elsewhere, so the paths agree to f32
 * rounding, not bitwise). Twice the multiply-adds an instruction of f32's FMA, half the
 * bytes.
 * Rows are quantized on their own, so a row's result does not depend on M, on the other
 * rows or on the thread count, on every path. On CPUs with integer dot products this
 * multiplies four times as many pairs per instruction as f32 does, and reads a quarter
 * (int8) or an eighth (4-bit) of the bytes.
 *
 * The work: MR rows of x by one panel at a time, in 3 * MR vector accumulators (AVX-512:
 * 8 rows, 24 of its 32 registers); each k loads the panel's NR weights once and
 * multiplies them by MR broadcast values of x. Rows go in blocks of ROW_BLOCK, each block
 * reading the panels of its thread while its x rows stay in cache; within a block a
 * panel is read from L2 by its tiles of MR rows, each tile fetching a part of the next
 * panel from memory meanwhile (software prefetch, spread over the block). Panels are
 * split over the threads in contiguous runs; the calling thread computes the first run
 * and hands the others to XLA's thread pool (run_jobs). Quantized weights go QMR rows at
 * a time: each block's int32 sums and the f32 totals both stay in registers.
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
#define QMR 4    /* rows of a quantized tile: 3 * QMR int32 and 3 * QMR f32 accumulators */
#define QBLOCK 32 /* inputs per block of a row quantized for int8 weights */
#define ROW_BLOCK 64                   /* rows whose x stays in cache over the panels */
#define MIN_MACS_PER_THREAD (1 << 20) /* a thread only for at least this many products */

/* How a quad of int8 pairs is multiplied and added into an int32 lane: 1 AVX-512 VNNI's
 * vpdpbusd (unsigned by signed bytes: an int8 weight is read as w + 128 and the block's
 * 128 * sum of xq taken off after), 2 AVX-512BW's vpmaddubsw, 3 AVX2's (both with the
 * signs moved onto the weights, so no pair overflows 16 bits), 0 plain C. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QDOT 1
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define QDOT 2
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define QDOT 3
#else
#define QDOT 0
#endif

typedef float lv __attribute__((vector_size(4 * VL)));
typedef int32_t iv __attribute__((vector_size(4 * VL)));
typedef int8_t bv __attribute__((vector_size(4 * VL))); /* VL columns x 4 rows of bytes */
typedef uint8_t ubv __attribute__((vector_size(4 * VL)));
typedef uint32_t uv __attribute__((vector_size(4 * VL))); /* VL columns x 2 rows of bf16 */

/* bf16 weights by AVX-512 BF16's dot product of pairs, or widened to f32 and two FMAs */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BDOT 1
#else
#define BDOT 0
#endif

int paged_jax_linear_panel_width(void) { return NR; }

typedef struct {
  const float *x;
  const void *w;      /* f32 panels, int8 ones when scale is set, 4-bit ones with mins */
  const float *scale; /* int8: the columns' scales [P * NR]; 4-bit: [P, K / G, NR] */
  const float *mins;  /* the groups' minimums [P, K / G, NR] (4-bit, int8 groups), or NULL */
  const float *xsum;  /* with mins: each row's quantized sum over each group [M, K / G] */
  const int8_t *xq;   /* quantized weights: x quantized, [M, K] */
  const float *dx;    /* and each block's scale [M, blocks] */
  const int32_t *xc;  /* int8 weights: what each block's int32 sums carry besides x @ q */
  float *y;
  int64_t M, K, N, B, first, last; /* panels [first, last); B: a block's inputs */
  int grouped;                      /* int8 weights: scales per group of B rows */
  const uint32_t *xb;               /* bf16 weights: x's rows in bf16 pairs [M, K / 2] */
  /* 4-bit weights kept from GGUF blocks: */
  const uint8_t *high;  /* the weights' high bits, [P, K hb / 8, NR] (planes), or NULL */
  int hb;               /* the high bits a weight: 0, 1 or 2 */
  int half;             /* scales (and mins) are f16, read through wide */
  int offset;           /* without mins: the weights are scale * (q - offset) */
  float *wide;          /* this job's [2, K / B, NR] f32: a panel's scales and mins widened */
  float *panel;         /* float rows: this job's [K, NR] f32, a panel's weights dequantized */
} LinearJob;

static inline lv load(const float *p) {
  lv v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* A tile's share of the next panel, fetched into the cache while the tile computes:
 * `rows` rows of NR lanes from `at`, one row every `every` of the tile's k (rows 0: none). */
typedef struct {
  const char *at;
  int64_t rows, every;
} Ahead;

/* Tile t of `tiles` (the row block's tiles, each over `lanes_k` rows of a panel) fetches
 * the t-th of `tiles` equal parts of the next panel (`next`, or NULL), so the fetch is
 * spread over the whole block rather than crowded into its first tile. */
static inline Ahead ahead_share(const void *next, int64_t lanes_k, int64_t t, int64_t tiles) {
  Ahead a = {NULL, 0, 1};
  if (!next || tiles < 1) return a;
  const int64_t part = (lanes_k + tiles - 1) / tiles, first = t * part;
  a.rows = lanes_k - first < part ? lanes_k - first : part;
  if (a.rows <= 0) return (Ahead){NULL, 0, 1};
  a.at = (const char *)next + first * NR * 4;
  a.every = lanes_k / a.rows > 0 ? lanes_k / a.rows : 1;
  return a;
}

/* One step of a tile's fetch, at its k: the next of its rows' cache lines when it is due. */
#define FETCH_AHEAD(a, k, due, row)                                                  \
  do {                                                                               \
    if ((row) < (a).rows && (k) == (due)) {                                          \
      for (int64_t b_ = 0; b_ < NR * 4; b_ += 64)                                    \
        __builtin_prefetch((a).at + (row) * NR * 4 + b_, 0, 3);                      \
      ++(row);                                                                       \
      (due) += (a).every;                                                            \
    }                                                                                \
  } while (0)

/* y[0 .. mr) x [n0, n0 + NR) (clipped to N) = x[0 .. mr) @ the f32 panel wp [K, NR], into
 * y (row stride N), fetching `ahead`'s share of the next panel meanwhile. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *wp,
                                                      Ahead ahead, float *y, int64_t K,
                                                      int64_t N, int64_t n0, const int mr) {
  lv c[MR][3];
  for (int i = 0; i < mr; ++i) c[i][0] = c[i][1] = c[i][2] = (lv){};
  int64_t due = 0, row = 0;
  for (int64_t k = 0; k < K; ++k) {
    FETCH_AHEAD(ahead, k, due, row);
    const lv b0 = load(wp + k * NR), b1 = load(wp + k * NR + VL), b2 = load(wp + k * NR + 2 * VL);
    for (int i = 0; i < mr; ++i) {
      const float a = x[i * K + k];
      c[i][0] += a * b0;
      c[i][1] += a * b1;
      c[i][2] += a * b2;
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

/* acc[c] + the sum over r < 4 of w[4c + r] * x4's byte r, for the VL columns c of one
 * quad of rows: w signed int8 weights when `s`, else unsigned 4-bit values in [0, 15];
 * x4 four int8 of a quantized row. With QDOT 1 and `s` the result also holds 128 * (the
 * sum of x4's bytes), which the caller takes off (xc). */
static inline __attribute__((always_inline)) iv qdot(iv acc, bv w, int32_t x4, const int s) {
#if QDOT == 1
  const __m512i xb = _mm512_set1_epi32(x4);
  const __m512i wu = s ? _mm512_xor_si512((__m512i)w, _mm512_set1_epi8((char)0x80)) : (__m512i)w;
  return (iv)_mm512_dpbusd_epi32((__m512i)acc, wu, xb);
#elif QDOT == 2
  const __m512i xb = _mm512_set1_epi32(x4);
  __m512i p;
  if (s) { /* |x| times w with x's sign: each pair at most 2 * 127 * 127 in magnitude */
    const __mmask64 neg = _mm512_movepi8_mask(xb);
    const __m512i ws = _mm512_mask_sub_epi8((__m512i)w, neg, _mm512_setzero_si512(), (__m512i)w);
    p = _mm512_maddubs_epi16(_mm512_abs_epi8(xb), ws);
  } else {
    p = _mm512_maddubs_epi16((__m512i)w, xb);
  }
  return (iv)_mm512_add_epi32((__m512i)acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#elif QDOT == 3
  const __m256i xb = _mm256_set1_epi32(x4);
  const __m256i p = s ? _mm256_maddubs_epi16(_mm256_sign_epi8(xb, xb),
                                             _mm256_sign_epi8((__m256i)w, xb))
                      : _mm256_maddubs_epi16((__m256i)w, xb);
  return (iv)_mm256_add_epi32((__m256i)acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#else
  int8_t x[4];
  memcpy(x, &x4, 4);
  for (int c = 0; c < VL; ++c)
    for (int r = 0; r < 4; ++r)
      acc[c] += (s ? (int32_t)w[4 * c + r] : (int32_t)(uint8_t)w[4 * c + r]) * (int32_t)x[r];
  return acc;
#endif
}

static inline bv load_b(const int8_t *p) {
  bv v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline int32_t quad_at(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

/* The quantized counterpart of tile, for one panel and mr <= QMR rows: int8 weights
 * (`s` 1: wp [K / 4, 4 NR], the panel's column scales sc [NR]; `s` 2: the groups' scales
 * sc [K / B, NR]; `s` 3: those and the groups' minimums mn [K / B, NR]) or 4-bit ones
 * (`s` 0: wp [K / 8, 4 NR] bytes, the groups' scales sc and minimums mn [K / B, NR]).
 * xq [mr, K]: the rows quantized; dx [mr, blocks] their blocks' scales; xc [mr, blocks]
 * (int8 weights) what each block's int32 sums carry besides x @ q; xs [mr, blocks] (with
 * minimums) each block's sum of xq times its scale. */
static inline __attribute__((always_inline)) void qtile(
    const int8_t *xq, const float *dx, const int32_t *xc, const float *xs, const int8_t *wp,
    const int8_t *ahead, float *y, int64_t K, int64_t N, int64_t n0, const int mr, const int s,
    int64_t B, const float *sc, const float *mn, const uint8_t *hp, const int hb) {
  const int64_t blocks = (K + B - 1) / B;
  lv f[QMR][3];
  for (int i = 0; i < mr; ++i) f[i][0] = f[i][1] = f[i][2] = (lv){};
  for (int64_t g = 0; g < blocks; ++g) {
    const int64_t k0 = g * B, k1 = k0 + B < K ? k0 + B : K;
    iv t[QMR][3];
    for (int i = 0; i < mr; ++i) t[i][0] = t[i][1] = t[i][2] = (iv){};
    if (s) {
      for (int64_t k = k0; k < k1; k += 4) {
        const int8_t *at = wp + k * NR; /* quad k / 4: 4 * NR bytes */
        if (ahead)
          for (int64_t c = 0; c < 4 * NR; c += 64) __builtin_prefetch(ahead + k * NR + c, 0, 3);
        const bv w0 = load_b(at), w1 = load_b(at + 4 * VL), w2 = load_b(at + 8 * VL);
        for (int i = 0; i < mr; ++i) {
          const int32_t x4 = quad_at(xq + i * K + k);
          t[i][0] = qdot(t[i][0], w0, x4, 1);
          t[i][1] = qdot(t[i][1], w1, x4, 1);
          t[i][2] = qdot(t[i][2], w2, x4, 1);
        }
      }
    } else {
      for (int64_t k = k0; k < k1; k += 8) {
        const int8_t *at = wp + k / 2 * NR; /* octet k / 8: 4 * NR bytes */
        if (ahead)
          for (int64_t c = 0; c < 4 * NR; c += 64)
            __builtin_prefetch(ahead + k / 2 * NR + c, 0, 3);
        const ubv b0 = (ubv)load_b(at), b1 = (ubv)load_b(at + 4 * VL),
                  b2 = (ubv)load_b(at + 8 * VL);
        bv l0 = (bv)(b0 & (uint8_t)15), l1 = (bv)(b1 & (uint8_t)15), l2 = (bv)(b2 & (uint8_t)15);
        bv h0 = (bv)(b0 >> 4), h1 = (bv)(b1 >> 4), h2 = (bv)(b2 >> 4);
        if (hp) { /* the octet's high bits: above each nibble, values to 4 + hb bits */
          const int64_t octet = k / 8, per = 4 / hb; /* octets a plane row holds */
          const uint8_t *pr = hp + octet / per * 4 * NR;
          const int lo = (int)(2 * (octet % per)) * hb, up = lo + hb;
          const uint8_t mask = (uint8_t)((1 << hb) - 1);
          const ubv p0 = (ubv)load_b((const int8_t *)pr),
                    p1 = (ubv)load_b((const int8_t *)pr + 4 * VL),
                    p2 = (ubv)load_b((const int8_t *)pr + 8 * VL);
          l0 |= (bv)(((p0 >> lo) & mask) << 4);
          l1 |= (bv)(((p1 >> lo) & mask) << 4);
          l2 |= (bv)(((p2 >> lo) & mask) << 4);
          h0 |= (bv)(((p0 >> up) & mask) << 4);
          h1 |= (bv)(((p1 >> up) & mask) << 4);
          h2 |= (bv)(((p2 >> up) & mask) << 4);
        }
        for (int i = 0; i < mr; ++i) {
          const int32_t x4 = quad_at(xq + i * K + k), x4h = quad_at(xq + i * K + k + 4);
          t[i][0] = qdot(qdot(t[i][0], l0, x4, 0), h0, x4h, 0);
          t[i][1] = qdot(qdot(t[i][1], l1, x4, 0), h1, x4h, 0);
          t[i][2] = qdot(qdot(t[i][2], l2, x4, 0), h2, x4h, 0);
        }
      }
    }
    for (int i = 0; i < mr; ++i) {
      const float d = dx[i * blocks + g];
      if (s) {
        const int32_t c = xc[i * blocks + g];
        if (s == 3) {
          const float sx = xs[i * blocks + g];
          for (int v = 0; v < 3; ++v)
            f[i][v] += __builtin_convertvector(t[i][v] - c, lv) * (load(sc + g * NR + v * VL) * d) +
                       load(mn + g * NR + v * VL) * sx;
        } else if (s == 2)
          for (int v = 0; v < 3; ++v)
            f[i][v] += __builtin_convertvector(t[i][v] - c, lv) * (load(sc + g * NR + v * VL) * d);
        else
          for (int v = 0; v < 3; ++v) f[i][v] += __builtin_convertvector(t[i][v] - c, lv) * d;
      } else {
        const float sx = xs[i * blocks + g];
        for (int v = 0; v < 3; ++v)
          f[i][v] += __builtin_convertvector(t[i][v], lv) * (load(sc + g * NR + v * VL) * d) +
                     load(mn + g * NR + v * VL) * sx;
      }
    }
  }
  if (s == 1)
    for (int i = 0; i < mr; ++i)
      for (int v = 0; v < 3; ++v) f[i][v] *= load(sc + v * VL);
  const int64_t cols = N - n0 < NR ? N - n0 : NR;
  for (int i = 0; i < mr; ++i) {
    float row[NR];
    memcpy(row, &f[i][0], sizeof(lv));
    memcpy(row + VL, &f[i][1], sizeof(lv));
    memcpy(row + 2 * VL, &f[i][2], sizeof(lv));
    memcpy(y + i * N + n0, row, sizeof(float) * (size_t)cols);
  }
}

/* f16 (binary16) h as f32, exactly (subnormals, infinities and NaNs too). */
static inline float f32_of_f16(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, f = h & 1023u;
  uint32_t bits;
  if (e == 31)
    bits = sign | 0x7F800000u | (f << 13);
  else if (e)
    bits = sign | ((e + 112) << 23) | (f << 13);
  else { /* zero or subnormal: f * 2^-24, exact in f32 */
    const float v = (float)f * 5.9604644775390625e-8f;
    memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

/* Panel p's n scales and minimums of 4-bit weights in f32, into j->wide [2, n]: widened
 * from f16 where they are held so, and without minimums -offset times each scale. */
static void widen(const LinearJob *j, int64_t p, int64_t n) {
  float *sc = j->wide, *mn = j->wide + n;
  if (j->half) {
    const uint16_t *s16 = (const uint16_t *)j->scale + p * n;
    for (int64_t i = 0; i < n; ++i) sc[i] = f32_of_f16(s16[i]);
    if (j->mins) {
      const uint16_t *m16 = (const uint16_t *)j->mins + p * n;
      for (int64_t i = 0; i < n; ++i) mn[i] = f32_of_f16(m16[i]);
      return;
    }
  } else {
    memcpy(sc, j->scale + p * n, sizeof(float) * (size_t)n);
    if (j->mins) {
      memcpy(mn, j->mins + p * n, sizeof(float) * (size_t)n);
      return;
    }
  }
  const float off = (float)-j->offset;
  for (int64_t i = 0; i < n; ++i) mn[i] = off * sc[i];
}

/* Rows m0 .. m1 of a quantized product by the panels [first, last) of job j. */
static inline __attribute__((always_inline)) void run_rows_q(LinearJob *j, const int s) {
  const int64_t M = j->M, K = j->K, N = j->N, B = j->B, blocks = (K + B - 1) / B;
  const int64_t panel = s ? K * NR : K / 2 * NR; /* bytes */
  for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int64_t m1 = M - m0 < ROW_BLOCK ? M : m0 + ROW_BLOCK;
    for (int64_t p = j->first; p < j->last; ++p) {
      const int8_t *wp = (const int8_t *)j->w + p * panel;
      const float *sc = s == 1 ? j->scale + p * NR : j->scale + p * blocks * NR;
      const float *mn = (s == 0 || s == 3) && j->mins ? j->mins + p * blocks * NR : NULL;
      const uint8_t *hp = s == 0 && j->high ? j->high + p * (K * j->hb / 8) * NR : NULL;
      if (s == 0 && j->wide) { /* f16 scales, or no mins: this panel's in f32 */
        widen(j, p, blocks * NR);
        sc = j->wide;
        mn = j->wide + blocks * NR;
      }
      const int8_t *next = p + 1 < j->last ? wp + panel : NULL;
      int64_t m = m0;
#define QTILE(R)                                                                          \
  qtile(j->xq + m * K, j->dx + m * blocks, s ? j->xc + m * blocks : NULL,                \
        mn ? j->xsum + m * blocks : NULL, wp, next, j->y + m * N, K, N, p * NR, R, s, B, sc, \
        mn, hp, j->hb)
      for (; m + QMR <= m1; m += QMR, next = NULL) QTILE(QMR);
      switch (m1 - m) {
        case 3: QTILE(3); break;
        case 2: QTILE(2); break;
        case 1: QTILE(1); break;
        default: break;
      }
#undef QTILE
    }
  }
}

static inline uv load_u(const uint32_t *p) {
  uv v;
  memcpy(&v, p, sizeof v);
  return v;
}

/* bf16 weights: y[0 .. mr) x [n0, n0 + NR) = the rows xb [mr, K / 2] (bf16 pairs) @ the
 * panel wp [K / 2, NR] (a column's pair in each u32), times the column scales sc [NR]
 * (or NULL); `ahead` as in tile. */
static inline __attribute__((always_inline)) void btile(const uint32_t *xb, const uint32_t *wp,
                                                       Ahead ahead, float *y, int64_t K2,
                                                       int64_t N, int64_t n0, const int mr,
                                                       const float *sc) {
  lv c[MR][3];
  for (int i = 0; i < mr; ++i) c[i][0] = c[i][1] = c[i][2] = (lv){};
  int64_t due = 0, row = 0;
  for (int64_t k = 0; k < K2; ++k) {
    FETCH_AHEAD(ahead, k, due, row);
    const uv w[3] = {load_u(wp + k * NR), load_u(wp + k * NR + VL), load_u(wp + k * NR + 2 * VL)};
#if BDOT
    for (int i = 0; i < mr; ++i) {
      const __m512bh xb2 = (__m512bh)_mm512_set1_epi32((int)xb[i * K2 + k]);
      for (int v = 0; v < 3; ++v)
        c[i][v] = (lv)_mm512_dpbf16_ps((__m512)c[i][v], (__m512bh)w[v], xb2);
    }
#else
    lv lo[3], hi[3]; /* the pair's even and odd rows, widened */
    for (int v = 0; v < 3; ++v) {
      lo[v] = (lv)(w[v] << 16);
      hi[v] = (lv)(w[v] & 0xFFFF0000u);
    }
    for (int i = 0; i < mr; ++i) {
      const uint32_t x2 = xb[i * K2 + k], xl = x2 << 16, xh = x2 & 0xFFFF0000u;
      float a, b;
      memcpy(&a, &xl, 4);
      memcpy(&b, &xh, 4);
      for (int v = 0; v < 3; ++v) c[i][v] = c[i][v] + a * lo[v] + b * hi[v];
    }
#endif
  }
  if (sc)
    for (int i = 0; i < mr; ++i)
      for (int v = 0; v < 3; ++v) c[i][v] *= load(sc + v * VL);
  const int64_t cols = N - n0 < NR ? N - n0 : NR;
  for (int i = 0; i < mr; ++i) {
    float row[NR];
    memcpy(row, &c[i][0], sizeof(lv));
    memcpy(row + VL, &c[i][1], sizeof(lv));
    memcpy(row + 2 * VL, &c[i][2], sizeof(lv));
    memcpy(y + i * N + n0, row, sizeof(float) * (size_t)cols);
  }
}

/* Rows of an f32 (`half` 0) or a bf16 (`half` 1) product by the panels [first, last) of
 * job j, in 4-byte lanes: NR floats a row of an f32 panel, NR pairs of a bf16 one. */
static inline __attribute__((always_inline)) void run_rows(LinearJob *j, const int half) {
  const int64_t M = j->M, K = j->K, N = j->N, K2 = K / 2;
  const int64_t panel = half ? K2 * NR : K * NR; /* lanes */
  for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
    const int64_t m1 = M - m0 < ROW_BLOCK ? M : m0 + ROW_BLOCK;
    for (int64_t p = j->first; p < j->last; ++p) {
      const float *wp = (const float *)j->w + p * panel;
      /* The block's tiles fetch the thread's next panel, each a part of it (ahead_share).
       * The whole fetch in the first tile was 7-10% faster than none at 32 rows x 576 x 1536
       * and SmolLM2's head on the machine above; on a 2-core Intel Xeon (AVX-512) it asked
       * for 16 bytes a cycle, more than memory gives, and spread over the block's 4 tiles
       * 30 different weights of 576 x 3072, 1536 x 576 and 576 x 960 went from 159-174 to
       * 177-250 GFLOP/s at 32 rows (and the peer benchmark's decode from about 390 to 420
       * tokens/s). */
      const float *next = p + 1 < j->last ? wp + panel : NULL;
      const float *sc = half && j->scale ? j->scale + p * NR : NULL; /* bf16: the columns' */
      const int64_t tiles = (m1 - m0 + MR - 1) / MR, lanes_k = half ? K2 : K;
      int64_t m = m0;
#define TILE(R)                                                                              \
  (half ? btile(j->xb + m * K2, (const uint32_t *)wp,                                        \
                ahead_share(next, lanes_k, (m - m0) / MR, tiles), j->y + m * N, K2, N,       \
                p * NR, R, sc)                                                               \
        : tile(j->x + m * K, wp, ahead_share(next, lanes_k, (m - m0) / MR, tiles),           \
               j->y + m * N, K, N, p * NR, R))
      for (; m + MR <= m1; m += MR) TILE(MR);
      switch (m1 - m) { /* the last rows: a tile per count, each fully unrolled */
#if MR == 8
        case 7: TILE(7); break;
        case 6: TILE(6); break;
        case 5: TILE(5); break;
        case 4: TILE(4); break;
#endif
        case 3: TILE(3); break;
        case 2: TILE(2); break;
        case 1: TILE(1); break;
        default: break;
      }
#undef TILE
    }
  }
}

/* Panel p of job j's quantized weights dequantized into j->panel, the f32 panel layout
 * [K, NR]: int8 groups q d (+ m), 4-bit values (with their high bits) u d + m, or (u -
 * offset) d without mins; a product, then a sum, never fused into one rounding, as the
 * gguf package dequantizes its blocks in numpy, so that the weights are those very f32
 * values. */
__attribute__((noinline, optimize("fp-contract=off"))) static void dequantize_panel(
    const LinearJob *j, int64_t p) {
  const int64_t K = j->K, B = j->B, blocks = (K + B - 1) / B;
  const int four = j->wide || (j->mins && !j->grouped);
  const float *sc = j->scale + p * blocks * NR, *mn = j->mins ? j->mins + p * blocks * NR : NULL;
  if (j->wide) { /* f16 scales, or an offset: widened first */
    widen(j, p, blocks * NR);
    sc = j->wide;
    mn = j->offset ? NULL : j->wide + blocks * NR;
  }
  float *out = j->panel;
  if (!four) { /* int8 in quads of rows: lane c of a quad's u32s holds column c's 4 rows */
    const int8_t *wp = (const int8_t *)j->w + p * K * NR;
    for (int64_t k0 = 0; k0 < K; k0 += 4) {
      const float *d = sc + (k0 / B) * NR, *m = mn ? mn + (k0 / B) * NR : NULL;
      for (int v = 0; v < 3; ++v) {
        uv lanes;
        memcpy(&lanes, wp + k0 * NR + 4 * VL * v, sizeof lanes);
        const lv dv = load(d + v * VL), mv = m ? load(m + v * VL) : (lv){};
        for (int r = 0; r < 4; ++r) { /* byte r, sign-extended */
          const iv q = ((iv)(lanes << (24 - 8 * r))) >> 24;
          lv w = __builtin_convertvector(q, lv) * dv;
          if (m) w = w + mv;
          memcpy(out + (k0 + r) * NR + v * VL, &w, sizeof w);
        }
      }
    }
    return;
  }
  /* 4-bit: lane c of an octet's u32s holds column c's rows r (low nibbles) and 4 + r
   * (high ones) in byte r; a plane row's lane the octets' high bits alike */
  const uint8_t *wp = (const uint8_t *)j->w + p * (K / 2) * NR;
  const uint8_t *hp = j->high ? j->high + p * (K * j->hb / 8) * NR : NULL;
  const int hb = j->hb, per = hb ? 4 / hb : 1;
  const float off = (float)j->offset;
  for (int64_t octet = 0; octet < K / 8; ++octet) {
    const int64_t k0 = 8 * octet;
    const float *d = sc + (k0 / B) * NR, *m = mn ? mn + (k0 / B) * NR : NULL;
    const int at = (int)(2 * (octet % per)) * hb;
    for (int v = 0; v < 3; ++v) {
      uv lanes, plane = (uv){};
      memcpy(&lanes, wp + octet * 4 * NR + 4 * VL * v, sizeof lanes);
      if (hp) memcpy(&plane, hp + octet / per * 4 * NR + 4 * VL * v, sizeof plane);
      const lv dv = load(d + v * VL), mv = m ? load(m + v * VL) : (lv){};
      for (int r = 0; r < 4; ++r) {
        uv lo = (lanes >> (8 * r)) & 15u, up = (lanes >> (8 * r + 4)) & 15u;
        if (hp) {
          const uv bits = plane >> (8 * r + at);
          lo |= (bits & ((1u << hb) - 1)) << 4;
          up |= ((bits >> hb) & ((1u << hb) - 1)) << 4;
        }
        lv wl = __builtin_convertvector(lo, lv), wu = __builtin_convertvector(up, lv);
        if (m) {
          wl = wl * dv + mv;
          wu = wu * dv + mv;
        } else {
          wl = (wl - off) * dv;
          wu = (wu - off) * dv;
        }
        memcpy(out + (k0 + r) * NR + v * VL, &wl, sizeof wl);
        memcpy(out + (k0 + 4 + r) * NR + v * VL, &wu, sizeof wu);
      }
    }
  }
}

/* Float rows: each panel of job j dequantized once (dequantize_panel), then every row of
 * x times it as tile multiplies an f32 panel: the same sums, in the same order, as the
 * f32 kernel on the dequantized weights. */
static void run_rows_dequantized(LinearJob *j) {
  const int64_t M = j->M, K = j->K, N = j->N;
  for (int64_t p = j->first; p < j->last; ++p) {
    dequantize_panel(j, p);
    const float *wp = j->panel;
    int64_t m = 0;
#define FTILE(R) tile(j->x + m * K, wp, (Ahead){NULL, 0, 1}, j->y + m * N, K, N, p * NR, R)
    for (; m + MR <= M; m += MR) FTILE(MR);
    switch (M - m) {
#if MR == 8
      case 7: FTILE(7); break;
      case 6: FTILE(6); break;
      case 5: FTILE(5); break;
      case 4: FTILE(4); break;
#endif
      case 3: FTILE(3); break;
      case 2: FTILE(2); break;
      case 1: FTILE(1); break;
      default: break;
    }
#undef FTILE
  }
}

static void *run_linear(void *arg) {
  LinearJob *j = (LinearJob *)arg;
  if (j->panel)
    run_rows_dequantized(j);
  else if (j->xb)
    run_rows(j, 1);
  else if (j->mins && j->grouped)
    run_rows_q(j, 3); /* a copy per weight type, each with it fixed */
  else if (j->mins || j->wide) /* 4-bit weights (wide: f16 scales or no mins) */
    run_rows_q(j, 0);
  else if (j->scale && j->grouped)
    run_rows_q(j, 2);
  else if (j->scale)
    run_rows_q(j, 1);
  else
    run_rows(j, 0);
  return NULL;
}

/* v[0, K) rotated in place, each block of ROTATION values on its own, as the header
 * defines it (K a multiple of ROTATION). */
#define ROTATION 32
static void rotate_row(float *v, int64_t K) {
#if defined(__AVX512F__)
  /* The same additions in the same order, 16 lanes at a time: for h < 16 each lane meets
   * its partner (lane ^ h) by a permute, a lane with bit h clear keeping v + partner
   * (a + c) and one with it set partner - v (a - c); then h = 16 across the halves. */
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __mmask16 high[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
  const __m512 norm = _mm512_set1_ps(0.17677669529663687f);
  for (int64_t b = 0; b < K; b += ROTATION) {
    __m512 lo = _mm512_loadu_ps(v + b), hi = _mm512_loadu_ps(v + b + 16);
    for (int i = 0; i < 4; ++i) {
      const __m512i idx = _mm512_xor_si512(lane, _mm512_set1_epi32(1 << i));
      const __m512 pl = _mm512_permutexvar_ps(idx, lo), ph = _mm512_permutexvar_ps(idx, hi);
      lo = _mm512_mask_blend_ps(high[i], _mm512_add_ps(lo, pl), _mm512_sub_ps(pl, lo));
      hi = _mm512_mask_blend_ps(high[i], _mm512_add_ps(hi, ph), _mm512_sub_ps(ph, hi));
    }
    const __m512 a = _mm512_add_ps(lo, hi), c = _mm512_sub_ps(lo, hi);
    _mm512_storeu_ps(v + b, _mm512_mul_ps(a, norm));
    _mm512_storeu_ps(v + b + 16, _mm512_mul_ps(c, norm));
  }
  return;
#endif
  for (int64_t b = 0; b < K; b += ROTATION) {
    float *r = v + b;
    for (int h = 1; h < ROTATION; h <<= 1)
      for (int i = 0; i < ROTATION; i += 2 * h)
        for (int k = i; k < i + h; ++k) {
          const float a = r[k], c = r[k + h];
          r[k] = a + c;
          r[k + h] = a - c;
        }
    for (int k = 0; k < ROTATION; ++k) r[k] *= 0.17677669529663687f; /* 1 / sqrt(32) */
  }
}

/* Rows [0, M) of x [M, K] quantized in blocks of B inputs (the header's definition),
 * each rotated first where `rot` (into `tmp`, K floats):
 * xq [M, K], dx [M, blocks]; with int8 weights (xc not NULL) xc [M, blocks] gets what the
 * block's int32 sums carry besides x @ q (128 * the sum of its xq where QDOT is 1, else 0);
 * with 4-bit ones (xs not NULL) xs [M, blocks] gets the block's sum of xq times dx. */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t B, int8_t *xq,
                          float *dx, int32_t *xc, float *xs, float *tmp) {
  const int64_t blocks = (K + B - 1) / B;
  for (int64_t m = 0; m < M; ++m) {
    const float *in = x + m * K;
    if (tmp) {
      memcpy(tmp, in, sizeof(float) * (size_t)K);
      rotate_row(tmp, K);
      in = tmp;
    }
    for (int64_t g = 0; g < blocks; ++g) {
      const int64_t k0 = g * B, k1 = k0 + B < K ? k0 + B : K;
      float a = 0;
      int64_t k = k0;
#if defined(__AVX512F__)
      /* the largest magnitude 16 lanes at a time (a NaN is passed over, as below: maxps
       * returns its second operand when either is NaN) */
      __m512 top = _mm512_setzero_ps();
      for (; k + 16 <= k1; k += 16) top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(in + k)), top);
      a = _mm512_reduce_max_ps(top);
#endif
      for (; k < k1; ++k) {
        const float v = in[k] < 0 ? -in[k] : in[k];
        a = v > a ? v : a;
      }
      const float inv = a > 0 ? 127.0f / a : 0.0f;
      int32_t total = 0;
      k = k0;
#if defined(__AVX512F__)
      __m512i sum = _mm512_setzero_si512();
      for (; k + 16 <= k1; k += 16) { /* round to nearest even, as nearbyintf below */
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(in + k),
                                                           _mm512_set1_ps(inv)));
        const __m512i c = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)),
                                           _mm512_set1_epi32(-127));
        _mm_storeu_si128((__m128i *)(xq + m * K + k), _mm512_cvtepi32_epi8(c));
        sum = _mm512_add_epi32(sum, c);
      }
      total = _mm512_reduce_add_epi32(sum);
#endif
      for (; k < k1; ++k) {
        float r = __builtin_nearbyintf(in[k] * inv);
        r = r > 127 ? 127 : r < -127 ? -127 : r;
        xq[m * K + k] = (int8_t)r;
        total += (int32_t)r;
      }
      dx[m * blocks + g] = a / 127.0f;
      if (xc) xc[m * blocks + g] = QDOT == 1 ? 128 * total : 0;
      if (xs) xs[m * blocks + g] = (float)total * (a / 127.0f);
    }
  }
}

/* x rounded to bf16, to nearest with ties to even (a NaN stays a NaN). */
static inline uint16_t bf16_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Rows [0, M) of x [M, K] (K even) in bf16, two a u32, even input in the low half: xb
 * [M, K / 2], what vdpbf16ps reads as a pair. */
static void round_rows_bf16(const float *x, int64_t M, int64_t K, uint32_t *xb) {
  uint16_t *out = (uint16_t *)xb; /* the pairs' halves in order, little-endian */
  for (int64_t m = 0; m < M; ++m) {
    const float *in = x + m * K;
    uint16_t *o = out + m * K;
    int64_t k = 0;
#if BDOT
    for (; k + 32 <= K; k += 32) { /* the same rounding as bf16_of */
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + k + 16), _mm512_loadu_ps(in + k));
      _mm512_storeu_si512((void *)(o + k), (__m512i)v);
    }
#endif
    for (; k < K; ++k) o[k] = bf16_of(in[k]);
  }
}

XLA_FFI_Error *PagedJaxLinear(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  const int64_t nargs = frame->args.size;
  if (nargs < 3 || nargs > 6 || frame->rets.size != 1)
    return fail(frame, "paged_jax linear: expected 3 to 6 operands and 1 result");
  /* q, by the weights' dtype: 0 f32 weights, alone; 1 int8 ones, with their scales (and
   * with scales per group perhaps minimums); 2 4-bit ones, with scales, perhaps minimums
   * and perhaps their high bits (u8) */
  const XLA_FFI_Buffer *x = frame->args.args[0], *w = frame->args.args[1];
  const int bf = w->dtype == XLA_FFI_DataType_BF16; /* bf16 weights, perhaps column scales */
  const int q = w->dtype == XLA_FFI_DataType_S8 ? 1 : w->dtype == XLA_FFI_DataType_U8 ? 2 : 0;
  const int extra = (int)nargs - 3; /* operands between the weights and params */
  if (bf ? extra > 1 : q == 2 ? extra < 1 : extra != q && !(q == 1 && extra == 2))
    return fail(frame, "paged_jax linear: expected f32 weights alone, s8 ones with scales (and "
                       "mins), u8 ones with scales (mins, high bits), bf16 ones perhaps with "
                       "scales");
  const XLA_FFI_Buffer *scales = extra ? frame->args.args[2] : NULL, *mins = NULL, *high = NULL,
                       *params = frame->args.args[2 + extra], *y = frame->rets.rets[0];
  for (int a = 3; a < 2 + extra; ++a) { /* u8: the high bits; else minimums */
    const XLA_FFI_Buffer *b = frame->args.args[a];
    if (q == 2 && b->dtype == XLA_FFI_DataType_U8 && !high)
      high = b;
    else if (!mins && !high)
      mins = b;
    else
      return fail(frame, "paged_jax linear: expected scales, then mins, then high bits");
  }
  if (high && q != 2) return fail(frame, "paged_jax linear: only 4-bit weights take high bits");
  if (x->rank != 2 || (w->rank != 3 && w->rank != 4) || params->rank != 1 || y->rank != 2)
    return fail(frame, "paged_jax linear: expected x[M,K], w[(L,)P,K,NR], params[3 or 4], y[M,N]");
  const XLA_FFI_DataType wt = bf       ? XLA_FFI_DataType_BF16
                              : q == 0 ? XLA_FFI_DataType_F32
                              : q == 1 ? XLA_FFI_DataType_S8
                                       : XLA_FFI_DataType_U8;
  if (x->dtype != XLA_FFI_DataType_F32 || w->dtype != wt || y->dtype != XLA_FFI_DataType_F32 ||
      params->dtype != XLA_FFI_DataType_S32 || params->dims[0] < 3 || params->dims[0] > 6)
    return fail(frame, "paged_jax linear: expected f32 x and y, f32 w (s8 with scales, u8 with "
                       "scales and minimums), and i32[3] to i32[6] params");
  const int64_t *wd = w->dims + (w->rank - 3); /* P, K (K / 2 for 4-bit), NR */
  const int64_t L = w->rank == 4 ? w->dims[0] : 1;
  const int64_t K = x->dims[1], P = wd[0], N = y->dims[1];
  if (wd[1] * (q == 2 ? 2 : 1) != K || wd[2] != NR || y->dims[0] != x->dims[0] ||
      N > P * NR || N <= P * NR - NR)
    return fail(frame, "paged_jax linear: operand shapes disagree (w's panels must be this "
                       "build's panel width and cover N)");
  /* int8 weights' scales: one a column [(L,) P * NR], or one a column per group of G
   * rows [(L,) P, K / G, NR] (grouped: G a multiple of 4, the rows' blocks then G) */
  if (bf && (K % 2 || (scales && (scales->dtype != XLA_FFI_DataType_F32 ||
                                  scales->rank != w->rank - 2 ||
                                  scales->dims[scales->rank - 1] != P * NR ||
                                  (w->rank == 4 && scales->dims[0] != L)))))
    return fail(frame, "paged_jax linear: bf16 weights need K even, and f32 scales [(L,) P * "
                       "NR] if any");
  const int grouped = q == 1 && scales->rank == w->rank;
  if (q == 1 && mins && !grouped)
    return fail(frame, "paged_jax linear: int8 weights take mins only with scales per group");
  if (q == 1 && !grouped &&
      (scales->dtype != XLA_FFI_DataType_F32 || scales->rank != w->rank - 2 ||
       scales->dims[scales->rank - 1] != P * NR || (w->rank == 4 && scales->dims[0] != L)))
    return fail(frame, "paged_jax linear: expected f32 scales [(L,) P * NR] or [(L,) P, K / G, "
                       "NR] with s8 weights");
  int64_t G = 0;
  if (q == 1 && K % 4)
    return fail(frame, "paged_jax linear: int8 weights need K a multiple of 4 (quads of rows)");
  if (q == 2 || grouped) {
    const int64_t *sd = scales->dims + (scales->rank - 3);
    const int64_t *md = mins ? mins->dims + (mins->rank - 3) : sd;
    /* 4-bit weights' scales (and mins) may be f16 */
    const int f16 = q == 2 && scales->dtype == XLA_FFI_DataType_F16;
    int ok = (scales->dtype == XLA_FFI_DataType_F32 || f16) && scales->rank == w->rank &&
             sd[0] == P && sd[2] == NR && sd[1] > 0;
    if (mins)
      ok = ok && mins->dtype == scales->dtype && mins->rank == w->rank && md[0] == P &&
           md[1] == sd[1] && md[2] == NR;
    if (w->rank == 4) ok = ok && scales->dims[0] == L && (!mins || mins->dims[0] == L);
    if (ok) {
      G = K / sd[1];
      ok = G * sd[1] == K && G % (q == 2 ? 8 : 4) == 0;
    }
    if (!ok)
      return fail(frame, q == 2 ? "paged_jax linear: expected f32 or f16 scales (and minimums "
                                  "alike) [(L,) P, K / G, NR] with u8 weights, G a multiple "
                                  "of 8"
                                : "paged_jax linear: expected f32 scales [(L,) P, K / G, NR] "
                                  "with s8 weights, G a multiple of 4");
  }
  /* 4-bit weights' high bits: hb a weight, [(L,) P, K hb / 8, NR] */
  int hb = 0;
  if (high) {
    const int64_t *hd = high->dims + (high->rank - 3);
    hb = (int)(hd[1] * 8 / K);
    if (high->rank != w->rank || hd[0] != P || hd[2] != NR || (hb != 1 && hb != 2) ||
        hd[1] * 8 != K * hb || K % (16 / hb) || (w->rank == 4 && high->dims[0] != L))
      return fail(frame, "paged_jax linear: expected u8 high bits [(L,) P, K hb / 8, NR], hb 1 "
                         "(K a multiple of 32) or 2 (of 16)");
  }
  const int32_t *p = (const int32_t *)params->data;
  if (p[0] < 0 || p[0] >= L) return fail(frame, "paged_jax linear: weight index out of range");
  const int rot = params->dims[0] >= 4 && p[3] != 0;
  const int offset = params->dims[0] >= 5 ? p[4] : 0; /* 4-bit without mins */
  if (offset && (q != 2 || mins))
    return fail(frame, "paged_jax linear: an offset needs 4-bit weights without mins");
  const int float_rows = params->dims[0] == 6 && p[5] != 0; /* weights dequantized, x as is */
  if (float_rows && (rot || !(q == 2 || grouped)))
    return fail(frame, "paged_jax linear: float rows need int8 weights with scales per group "
                       "or 4-bit ones, not rotated");
  if (rot && (!q || K % ROTATION))
    return fail(frame, "paged_jax linear: rotated rows need int8 or 4-bit weights and K a "
                       "multiple of 32");
  const int64_t M = (p[2] >= 0 && p[2] < x->dims[0]) ? p[2] : x->dims[0]; /* rows computed */
  memset((float *)y->data + M * N, 0, sizeof(float) * (size_t)((x->dims[0] - M) * N));
  if (M == 0 || N == 0) return NULL;
  if (K == 0) {
    memset(y->data, 0, sizeof(float) * (size_t)(M * N));
    return NULL;
  }
  const int64_t threads = clamp_threads(p[1], M * K * P * NR / MIN_MACS_PER_THREAD, P);
  const size_t wbytes = bf ? 2 : q == 0 ? 4 : 1, wrows = (size_t)(q == 2 ? K / 2 : K);
  const void *weight = (const char *)w->data + (size_t)p[0] * (size_t)P * wrows * NR * wbytes;
  const float *scale = NULL, *mn = NULL;
  const int64_t B = G ? G : QBLOCK, blocks = q ? (K + B - 1) / B : 0;
  void *buf = NULL; /* quantized rows: xq [M, K], dx, xc and xs [M, blocks] (as needed) */
  int8_t *xq = NULL;
  float *dx = NULL, *xs = NULL;
  int32_t *xc = NULL;
  if (q && !float_rows) {
    const size_t per = (size_t)(M * blocks);
    /* dx, xc, xs, then a rotated row (where rotated), then xq */
    const size_t tmp = rot ? (size_t)K : 0;
    buf = malloc(sizeof(float) * (per * 3 + tmp) + (size_t)(M * K));
    if (!buf) return fail(frame, "paged_jax linear: out of memory");
    dx = (float *)buf;
    if (q == 1) xc = (int32_t *)(dx + per);
    if (mins || q == 2) xs = dx + 2 * per;
    xq = (int8_t *)(dx + 3 * per + tmp);
    quantize_rows((const float *)x->data, M, K, B, xq, dx, xc, xs, rot ? dx + 3 * per : NULL);
  }
  if ((q == 1 && !grouped) || (bf && scales))
    scale = (const float *)scales->data + (size_t)p[0] * (size_t)(P * NR);
  uint32_t *xb = NULL; /* bf16 weights: the rows in bf16 pairs */
  if (bf) {
    xb = malloc(sizeof(uint32_t) * (size_t)(M * (K / 2)));
    if (!xb) return fail(frame, "paged_jax linear: out of memory");
    round_rows_bf16((const float *)x->data, M, K, xb);
  }
  const int half = q == 2 && scales->dtype == XLA_FFI_DataType_F16;
  float *wide = NULL; /* 4-bit with f16 scales or without mins: each thread's f32 panel */
  if (q == 2 || grouped) {
    const size_t per = (size_t)P * (size_t)blocks * NR, bytes = half ? 2 : 4;
    scale = (const float *)((const char *)scales->data + (size_t)p[0] * per * bytes);
    if (mins) mn = (const float *)((const char *)mins->data + (size_t)p[0] * per * bytes);
  }
  if (q == 2 && (half || !mins)) {
    wide = malloc(sizeof(float) * 2 * (size_t)(blocks * NR) * (size_t)threads);
    if (!wide) {
      free(buf);
      free(xb);
      return fail(frame, "paged_jax linear: out of memory");
    }
  }
  const uint8_t *hi = high ? (const uint8_t *)high->data + (size_t)p[0] * (size_t)(P * (K * hb / 8) * NR)
                           : NULL;
  float *panels = NULL; /* float rows: each thread's panel dequantized */
  if (float_rows) {
    panels = malloc(sizeof(float) * (size_t)(K * NR) * (size_t)threads);
    if (!panels) {
      free(buf);
      free(xb);
      free(wide);
      return fail(frame, "paged_jax linear: out of memory");
    }
  }
  LinearJob jobs[MAX_THREADS];
  for (int64_t t = 0; t < threads; ++t)
    jobs[t] = (LinearJob){.x = (const float *)x->data, .w = weight, .scale = scale, .mins = mn,
                          .xsum = xs, .xq = xq, .dx = dx, .xc = xc, .y = (float *)y->data,
                          .M = M, .K = K, .N = N, .B = B, .first = P * t / threads,
                          .last = P * (t + 1) / threads, .grouped = grouped, .xb = xb,
                          .high = hi, .hb = hb, .half = half, .offset = offset,
                          .wide = wide ? wide + 2 * blocks * NR * t : NULL,
                          .panel = panels ? panels + K * NR * t : NULL};
  run_jobs(frame, jobs, sizeof(LinearJob), threads, run_linear);
  free(buf);
  free(xb);
  free(wide);
  free(panels);
  return NULL;
}

/* Grouped products (a mixture of experts' rows, sorted by expert):
 *   x        f32[M, K]            rows sorted by group: group g's are the n_g rows after
 *                                 the groups before it
 *   w        f32, bf16 or s8[W, P, K, NR]  W weights packed as above (f32 ones, bf16 ones
 *                                 in pairs of rows, int8 ones in quads of rows), or
 *            u8[W, P, K / 2, NR]  4-bit ones in octets of rows
 *   scales   f32[W, P, K / G, NR] int8 and 4-bit weights only: each group of G rows'
 *                                 column scales (G a multiple of 4; of 8 for 4-bit ones),
 *                                 packed as f32 weights
 *   mins     f32[W, P, K / G, NR] 4-bit weights only: each group's minimums, so
 *            (4-bit weights as PagedJaxLinear takes them: scales and mins perhaps f16, the
 *            mins absent with an offset, then perhaps high u8[W, P, K hb / 8, NR])
 *   sizes    s32[G]               n_g, each >= 0, their sum at most M
 *   params   s32[2] or s32[4]     {the weight of group 0 (group g's is that plus g; all in
 *                                 [0, W)), at most this many threads, and (4-bit weights)
 *                                 the offset and 1 for float rows (int8 and 4-bit
 *                                 weights), else 0}
 * Result: y f32[M, N]: group g's rows times its weight, each row as PagedJaxLinear
 * computes it alone (the same sums in the same order; int8 and 4-bit weights: the rows
 * quantized in blocks of G); the rows past the groups are 0. Each thread takes the same run of
 * panels of every group's weight in turn, so a weight no row chose is never read. */
typedef struct {
  LinearJob base;        /* x, y, xb, xq, dx, xc of row 0; w, scale of weight 0; panels */
  const int32_t *sizes;  /* the groups' rows */
  int64_t groups, stride, scale_stride; /* a weight's 4-byte lanes (bytes: int8); scales' */
  int half, q; /* q: 1 int8 weights, 2 4-bit ones */
  int64_t scale_bytes, high_stride; /* a scale's bytes (4, or 2: f16); a weight's high bits */
} GroupedJob;

static void *run_grouped(void *arg) {
  GroupedJob *g = (GroupedJob *)arg;
  LinearJob j = g->base;
  const int64_t K = j.K, N = j.N, blocks = g->q ? (K + j.B - 1) / j.B : 0;
  int64_t row = 0;
  for (int64_t e = 0; e < g->groups; ++e) {
    const int64_t n = g->sizes[e];
    if (n > 0) {
      j.M = n;
      j.x = g->base.x ? g->base.x + row * K : NULL;
      j.xb = g->base.xb ? g->base.xb + row * (K / 2) : NULL;
      j.y = g->base.y + row * N;
      if (g->q) {
        j.xq = g->base.xq + row * K;
        j.dx = g->base.dx + row * blocks;
        j.w = (const int8_t *)g->base.w + e * g->stride;
        const int64_t at = e * g->scale_stride * g->scale_bytes; /* (bytes: f32 or f16) */
        j.scale = (const float *)((const char *)g->base.scale + at);
        if (g->q == 1 && j.panel) /* float rows: x as it is, each panel dequantized */
          run_rows_dequantized(&j);
        else if (g->q == 1) {
          j.xc = g->base.xc + row * blocks;
          run_rows_q(&j, 2);
        } else {
          j.mins = g->base.mins ? (const float *)((const char *)g->base.mins + at) : NULL;
          j.high = g->base.high ? g->base.high + e * g->high_stride : NULL;
          if (j.panel) /* float rows: x as it is, each panel dequantized */
            run_rows_dequantized(&j);
          else {
            j.xsum = g->base.xsum + row * blocks;
            run_rows_q(&j, 0);
          }
        }
      } else {
        j.w = (const float *)g->base.w + e * g->stride;
        run_rows(&j, g->half);
      }
    }
    row += n;
  }
  return NULL;
}

XLA_FFI_Error *PagedJaxGroupedLinear(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  const int64_t nargs = frame->args.size;
  if (nargs < 4 || nargs > 7 || frame->rets.size != 1)
    return fail(frame, "paged_jax grouped linear: expected x, w, (scales, (mins,) (high,)) "
                       "sizes, params and 1 result");
  const XLA_FFI_Buffer *x = frame->args.args[0], *w = frame->args.args[1],
                       *scales = nargs >= 5 ? frame->args.args[2] : NULL, *mins = NULL,
                       *high = NULL, *sizes = frame->args.args[nargs - 2],
                       *params = frame->args.args[nargs - 1], *y = frame->rets.rets[0];
  for (int64_t a = 3; a < nargs - 2; ++a) { /* u8: 4-bit weights' high bits; else mins */
    const XLA_FFI_Buffer *o = frame->args.args[a];
    if (o->dtype == XLA_FFI_DataType_U8 && !high)
      high = o;
    else if (!mins && !high)
      mins = o;
    else
      return fail(frame, "paged_jax grouped linear: expected scales, then mins, then high bits");
  }
  const int half = w->dtype == XLA_FFI_DataType_BF16;
  const int q = w->dtype == XLA_FFI_DataType_S8 ? 1 : w->dtype == XLA_FFI_DataType_U8 ? 2 : 0;
  const int np = params->rank == 1 ? (int)params->dims[0] : 0;
  if (x->rank != 2 || w->rank != 4 || sizes->rank != 1 || params->rank != 1 || y->rank != 2 ||
      x->dtype != XLA_FFI_DataType_F32 || y->dtype != XLA_FFI_DataType_F32 ||
      (w->dtype != XLA_FFI_DataType_F32 && !half && !q) || sizes->dtype != XLA_FFI_DataType_S32 ||
      params->dtype != XLA_FFI_DataType_S32 || (np != 2 && np != 4) ||
      (q != 0) != (scales != NULL) || (q != 2 && (mins || high)))
    return fail(frame, "paged_jax grouped linear: expected f32 x[M,K], f32 or bf16 "
                       "w[W,P,K,NR] (s8 with f32 scales[W,P,K/G,NR], u8 w[W,P,K/2,NR] with "
                       "scales, perhaps mins and high bits), s32 sizes[G], s32 params[2] or "
                       "params[4], f32 y[M,N]");
  const int64_t W = w->dims[0], P = w->dims[1], K = x->dims[1], M = x->dims[0];
  const int64_t N = y->dims[1], G = sizes->dims[0];
  if (w->dims[2] * (q == 2 ? 2 : 1) != K || w->dims[3] != NR || y->dims[0] != M ||
      N > P * NR || N <= P * NR - NR || (half && K % 2) || (q && K % (q == 2 ? 8 : 4)))
    return fail(frame, "paged_jax grouped linear: operand shapes disagree (w's panels must be "
                       "this build's panel width and cover N; bf16 weights need K even, int8 "
                       "ones K a multiple of 4, 4-bit ones of 8)");
  int64_t B = 0; /* int8 and 4-bit: the rows of a scale's group */
  if (q) {
    const int64_t *sd = scales->dims;
    const int f16 = q == 2 && scales->dtype == XLA_FFI_DataType_F16;
    int ok = scales->rank == 4 && (scales->dtype == XLA_FFI_DataType_F32 || f16) &&
             sd[0] == W && sd[1] == P && sd[3] == NR && sd[2] > 0 && K % sd[2] == 0 &&
             (K / sd[2]) % (q == 2 ? 8 : 4) == 0;
    if (mins)
      ok = ok && mins->rank == 4 && mins->dtype == scales->dtype && mins->dims[0] == W &&
           mins->dims[1] == P && mins->dims[2] == sd[2] && mins->dims[3] == NR;
    if (!ok)
      return fail(frame, "paged_jax grouped linear: expected f32 scales [W, P, K / G, NR] with "
                         "s8 weights (G a multiple of 4), and f32 or f16 ones (mins alike) "
                         "with u8 ones (of 8)");
    B = K / sd[2];
  }
  int hb = 0; /* 4-bit weights' high bits: [W, P, K hb / 8, NR] */
  if (high) {
    hb = (int)(high->dims[2] * 8 / K);
    if (high->rank != 4 || high->dims[0] != W || high->dims[1] != P || high->dims[3] != NR ||
        (hb != 1 && hb != 2) || high->dims[2] * 8 != K * hb || K % (16 / hb))
      return fail(frame, "paged_jax grouped linear: expected u8 high bits [W, P, K hb / 8, NR], "
                         "hb 1 (K a multiple of 32) or 2 (of 16)");
  }
  const int32_t *p = (const int32_t *)params->data, *n = (const int32_t *)sizes->data;
  if (p[0] < 0 || p[0] + G > W)
    return fail(frame, "paged_jax grouped linear: the groups' weights are out of range");
  const int offset = np == 4 ? p[2] : 0, float_rows = np == 4 && p[3] != 0;
  if ((offset && (q != 2 || mins)) || (float_rows && !q))
    return fail(frame, "paged_jax grouped linear: an offset needs 4-bit weights without mins, "
                       "float rows int8 or 4-bit weights");
  int64_t rows = 0;
  for (int64_t e = 0; e < G; ++e) {
    if (n[e] < 0) return fail(frame, "paged_jax grouped linear: a group of negative size");
    rows += n[e];
  }
  if (rows > M) return fail(frame, "paged_jax grouped linear: the groups hold more rows than x");
  memset((float *)y->data + rows * N, 0, sizeof(float) * (size_t)((M - rows) * N));
  if (rows == 0 || N == 0) return NULL;
  if (K == 0) {
    memset(y->data, 0, sizeof(float) * (size_t)(rows * N));
    return NULL;
  }
  uint32_t *xb = NULL;
  if (half) {
    xb = malloc(sizeof(uint32_t) * (size_t)(rows * (K / 2)));
    if (!xb) return fail(frame, "paged_jax grouped linear: out of memory");
    round_rows_bf16((const float *)x->data, rows, K, xb);
  }
  /* int8 and 4-bit weights: the rows quantized, xq [rows, K], dx and xc (int8) or xs
   * (4-bit) [rows, blocks] */
  void *buf = NULL;
  int8_t *xq = NULL;
  float *dx = NULL, *xs = NULL;
  int32_t *xc = NULL;
  const int64_t blocks = q ? K / B : 0;
  if (q && !float_rows) {
    const size_t per = (size_t)(rows * blocks);
    buf = malloc(sizeof(float) * per * 2 + (size_t)(rows * K));
    if (!buf) return fail(frame, "paged_jax grouped linear: out of memory");
    dx = (float *)buf;
    if (q == 1)
      xc = (int32_t *)(dx + per);
    else
      xs = dx + per;
    xq = (int8_t *)(dx + 2 * per);
    quantize_rows((const float *)x->data, rows, K, B, xq, dx, xc, xs, NULL);
  }
  /* one weight: 4-byte lanes (f32, bf16 pairs) or bytes (int8, 4-bit) */
  const int64_t stride = q ? P * (q == 2 ? K / 2 : K) * NR : P * (half ? K / 2 : K) * NR;
  const int64_t scale_stride = q ? P * blocks * NR : 0;
  const int64_t scale_bytes = scales && scales->dtype == XLA_FFI_DataType_F16 ? 2 : 4;
  const int64_t high_stride = high ? P * (K * hb / 8) * NR : 0;
  const int64_t threads = clamp_threads(p[1], rows * K * P * NR / MIN_MACS_PER_THREAD, P);
  /* 4-bit weights with f16 scales or without mins: each thread's panel's scales widened;
   * float rows: each thread's panel dequantized */
  const int wide_needed = q == 2 && (scale_bytes == 2 || !mins);
  float *wide = wide_needed ? malloc(sizeof(float) * 2 * (size_t)(blocks * NR * threads)) : NULL;
  float *panels = float_rows ? malloc(sizeof(float) * (size_t)(K * NR * threads)) : NULL;
  if ((wide_needed && !wide) || (float_rows && !panels)) {
    free(xb);
    free(buf);
    free(wide);
    free(panels);
    return fail(frame, "paged_jax grouped linear: out of memory");
  }
  const int64_t first_at = p[0] * scale_stride * scale_bytes; /* bytes */
  GroupedJob jobs[MAX_THREADS];
  for (int64_t t = 0; t < threads; ++t) {
    LinearJob base = {
        .x = (half || q) && !float_rows ? NULL : (const float *)x->data,
        .w = q ? (const void *)((const int8_t *)w->data + p[0] * stride)
               : (const void *)((const float *)w->data + p[0] * stride),
        .scale = q ? (const float *)((const char *)scales->data + first_at) : NULL,
        .mins = mins ? (const float *)((const char *)mins->data + first_at) : NULL,
        .y = (float *)y->data, .K = K, .N = N, .B = B, .grouped = q == 1, .xq = xq, .dx = dx,
        .xc = xc, .xsum = xs, .first = P * t / threads, .last = P * (t + 1) / threads, .xb = xb,
        .high = high ? (const uint8_t *)high->data + p[0] * high_stride : NULL, .hb = hb,
        .half = scale_bytes == 2, .offset = offset,
        .wide = wide ? wide + 2 * blocks * NR * t : NULL,
        .panel = panels ? panels + K * NR * t : NULL};
    jobs[t] = (GroupedJob){.base = base, .sizes = n, .groups = G, .stride = stride,
                           .scale_stride = scale_stride, .half = half, .q = q,
                           .scale_bytes = scale_bytes, .high_stride = high_stride};
  }
  run_jobs(frame, jobs, sizeof(GroupedJob), threads, run_grouped);
  free(xb);
  free(buf);
  free(wide);
  free(panels);
  return NULL;
}
