/* Paged attention for CPUs, called by XLA through its FFI (the C API in
 * jaxlib/include/xla/ffi/api/c_api.h); built and registered by __init__.py. Two entry
 * points: PagedJaxDecodeAttention (one query token per sequence, below) and
 * PagedJaxRaggedAttention (any number per sequence, at the end of the file: up to
 * ITEM_TOKENS consecutive query tokens of a sequence make an item, which reads each
 * block of keys once for all of them, each token masking the keys past its position;
 * a token's result is bitwise its decode row's).
 *
 * Decode operands (row-major):
 *   q        [B, H, D]      f32 or bf16, one query token per sequence
 *   kv_pages [N, P, 2K, D]  f32 or bf16; a token's row 2k is KV head k's key, 2k + 1 its value
 *   kv_lens  i32[B]         sequence b's query sits at position kv_lens[b] - 1
 *   tables   i32[B, M]      sequence b's pages, in order
 *   params   f32[4]         {sm_scale, sliding window (0: none), soft cap (0: none), threads}
 *            or f32[4 + H]  the same, then each query head's sink: a logit (on the scale of
 *                           sm_scale * q.k) in the softmax's sum whose value is 0 (GPT-OSS)
 * Result: o [B, H, D] in q's dtype.
 *
 * Sequence b attends to its keys [max(0, kv_lens[b] - window), kv_lens[b]), clipped to
 * the M * P slots its table holds; a row with kv_lens[b] <= 0 is padding (output 0). A
 * page id outside [0, N) reads page 0, the null page. Keys past kv_lens[b] are never
 * read, so stale or unwritten slots cannot leak in (not even as NaN).
 *
 * The work, per sequence, with an online softmax per query head in f32 (the running max,
 * the sum of exponentials and the weighted values, rescaled when the max grows):
 *   - run_blocked (x86 CPUs with AVX2 or AVX-512, D a multiple of LANES, the f32 lanes of
 *     one register: 8 or 16): BLOCK = LANES tokens at a time, in two passes. The first
 *     reads the block's rows in memory order and keeps per query head and token a vector
 *     of partial sums of the score (with AVX512-BF16, bf16 q and keys multiply in pairs
 *     without conversion); one transposing reduction per head gives the block's scores,
 *     the running max moves once per block and the block's exponentials are one vector.
 *     The second pass adds the weighted values from rows now in cache, with the sums of
 *     up to four query heads in registers; bf16 values are read 2 * LANES at a time as
 *     even and odd halves, which is why those sums are kept in a permuted order until
 *     the end. The rows two blocks ahead (perhaps the next sequence's) are prefetched
 *     into L2 during the first pass, the next block's keys into L1 during the first and
 *     its values during the second.
 *   - run_rows (any D, any CPU): token by token, one exponential each.
 * A token's K and V rows for all heads are adjacent (2K * D elements), so both read every
 * page front to back; the rows ahead are prefetched, since a page boundary jumps to an
 * unrelated address. Sequences (ragged: items) are split over `threads` threads in
 * contiguous runs of about equal work; the calling thread computes the first run and
 * hands the others to XLA's thread pool (run_jobs). Each sequence is computed alone and
 * in a fixed order, so its result does not depend on the rest of the batch or on the
 * thread count.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define PREFETCH_TOKENS 4 /* how far ahead run_rows fetches the next tokens' rows */
#define MAX_GROUP 64                     /* query heads per KV head */
#define MAX_ITEM 16                      /* query tokens of one ragged item */
#define MIN_ELEMENTS_PER_THREAD (1 << 18) /* a thread only for at least this much K/V */

typedef struct {
  const void *q, *kv;
  void *out;
  const int32_t *lens, *tables;
  /* Ragged calls: item b is nq[b] query tokens of one sequence at consecutive positions,
   * rows tok[b] .. of q and o, read with table row seq[b]; lens[b] is the last one's
   * length. NULL (decode): item b is row b alone, with its own table row. */
  const int32_t *seq, *tok, *nq;
  int64_t H, D, N, P, K, M, window, first, last; /* items [first, last) */
  float scale, cap;
  const float *sinks; /* per query head, a logit of a key with value 0 (NULL: none) */
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

#if defined(__AVX512F__) || defined(__AVX2__) /* the blocked path: x86 with AVX2 or more */
#define HAVE_BLOCKED 1
/* The blocked path: vectors of LANES f32 lanes (vec.h), one machine register each: 16
 * with AVX-512, 8 with AVX2. BLOCK tokens (one a lane) share a softmax step. */
#include "vec.h"
#define BLOCK LANES
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));

static inline vf load_bf16(const uint16_t *p) {
  vh h;
  memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

static inline vf load_row(const void *base, int bf16, size_t at) {
  return bf16 ? load_bf16((const uint16_t *)base + at) : load_f32((const float *)base + at);
}

/* Lane t of the result: the sum of a[t]'s lanes, for LANES vectors a. A transposing
 * reduction: each step adds two vectors' lanes in pairs and packs the two halves into one
 * vector (16 lanes: 30 shuffles and 15 adds for 16 sums). */
#if LANES == 16
#define PAIRS_8A 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define PAIRS_8B 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define PAIRS_4A 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27
#define PAIRS_4B 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31
#define PAIRS_2A 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29
#define PAIRS_2B 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31
#define PAIRS_1A 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define PAIRS_1B 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#else
#define PAIRS_4A 0, 1, 2, 3, 8, 9, 10, 11
#define PAIRS_4B 4, 5, 6, 7, 12, 13, 14, 15
#define PAIRS_2A 0, 1, 4, 5, 8, 9, 12, 13
#define PAIRS_2B 2, 3, 6, 7, 10, 11, 14, 15
#define PAIRS_1A 0, 2, 4, 6, 8, 10, 12, 14
#define PAIRS_1B 1, 3, 5, 7, 9, 11, 13, 15
#endif


#define FOLD(a, b, n) (SHUFFLE(a, b, PAIRS_##n##A) + SHUFFLE(a, b, PAIRS_##n##B))
static inline vf sum_lanes(const vf *a) {
  vf y[4], z[2];
#if LANES == 16
  vf x[8];
  for (int i = 0; i < 8; ++i) x[i] = FOLD(a[2 * i], a[2 * i + 1], 8);
#else
  const vf *x = a;
#endif
  for (int i = 0; i < 4; ++i) y[i] = FOLD(x[2 * i], x[2 * i + 1], 4);
  for (int i = 0; i < 2; ++i) z[i] = FOLD(y[2 * i], y[2 * i + 1], 2);
  return FOLD(z[0], z[1], 1);
}


#endif

static inline int64_t item_tokens(const Job *j, int64_t b) { return j->nq ? j->nq[b] : 1; }

static inline int64_t item_row(const Job *j, int64_t b) { return j->tok ? j->tok[b] : b; }

/* Token i of item b attends to keys [.., token_len): its position + 1, clipped to the M * P
 * slots its table holds; 0 for no keys. */
static inline int64_t token_len(const Job *j, int64_t b, int64_t i) {
  int64_t len = (int64_t)j->lens[b] - (item_tokens(j, b) - 1 - i), slots = j->M * j->P;
  return len <= 0 ? 0 : (len < slots ? len : slots);
}

/* Item b reads keys [.., clipped_len): its last token's. */
static inline int64_t clipped_len(const Job *j, int64_t b) {
  return token_len(j, b, item_tokens(j, b) - 1);
}

/* The first key a token of length len attends to (its window's start). */
static inline int64_t first_token(const Job *j, int64_t len) {
  return (j->window > 0 && len > j->window) ? len - j->window : 0;
}

/* The id of the page holding token c of row b's sequence (the null page for a bad id). */
static inline int64_t page_of(const Job *j, int64_t b, int64_t c) {
  const int64_t s = j->seq ? j->seq[b] : b;
  int64_t page = j->tables[s * j->M + c / j->P];
  return (page < 0 || page >= j->N) ? 0 : page;
}

/* Token c of sequence b's first row in kv_pages (its KV head 0 key); head k's key is
 * row + 2k, its value row + 2k + 1. */
static inline int64_t token_row(const Job *j, int64_t b, int64_t c) {
  return (page_of(j, b, c) * j->P + c % j->P) * 2 * j->K;
}

/* Fetches `count` rows from `row` on into the cache ahead of their use: into L1, or only
 * into L2 when `l2` (a constant at every call, so the branch compiles away). */
static inline __attribute__((always_inline)) void prefetch_rows(const Job *j, int64_t D,
                                                                int64_t row, int64_t count,
                                                                int l2) {
  const size_t bytes = (size_t)D * (j->kv16 ? 2 : 4);
  const char *at = (const char *)j->kv + (size_t)row * bytes;
  for (size_t o = 0; o < (size_t)count * bytes; o += 64) {
    if (l2)
      __builtin_prefetch(at + o, 0, 2);
    else
      __builtin_prefetch(at + o, 0, 3);
  }
}

/* Item b's starting state, per head of its tokens (token i's head h at i * H + h): q
 * scaled to f32 in qf [nq * H, D], acc zero, the running max -inf and sum 0; with sinks,
 * the max the head's sink and the sum 1 (the sink as a key whose value is 0). */
static void start_row(const Job *j, int64_t b, float *qf, float *acc, float *mx, float *sum,
                      float *tmp) {
  const int64_t H = j->H, D = j->D, hq = item_tokens(j, b) * H, q0 = item_row(j, b) * H;
  memset(acc, 0, sizeof(float) * (size_t)(hq * D));
  for (int64_t h = 0; h < hq; ++h) {
    const float *r = row_f32(j->q, j->q16, q0 + h, D, tmp);
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = r[d] * j->scale;
    mx[h] = j->sinks ? j->sinks[h % H] : -INFINITY;
    sum[h] = j->sinks ? 1.0f : 0.0f;
  }
}

/* Divides each head's weighted values by its sum of exponentials (0 for a head with no
 * keys) and writes item b's output rows in q's dtype. */
static void finish_row(const Job *j, int64_t b, float *acc, const float *sum) {
  const int64_t D = j->D, hq = item_tokens(j, b) * j->H, o0 = item_row(j, b) * j->H * D;
  for (int64_t h = 0; h < hq; ++h) {
    const float inv = sum[h] > 0.0f ? 1.0f / sum[h] : 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[h * D + d] *= inv;
  }
  if (j->q16) {
    uint16_t *o = (uint16_t *)j->out + o0;
    for (int64_t i = 0; i < hq * D; ++i) o[i] = f32_to_bf16(acc[i]);
  } else {
    memcpy((float *)j->out + o0, acc, sizeof(float) * (size_t)(hq * D));
  }
}

static void *run_rows(void *arg) {
  Job *j = (Job *)arg;
  const int64_t H = j->H, D = j->D, K = j->K, G = H / K;
  /* q scaled to f32, the running sums per query head, a bf16 conversion row */
  float *buf = (float *)malloc(sizeof(float) * (size_t)(2 * H * D + D + 2 * H));
  if (!buf) return NULL; /* j->ok stays 0 */
  float *qf = buf, *acc = qf + H * D, *tmp = acc + H * D, *mx = tmp + D, *sum = mx + H;
  float score[MAX_GROUP];

  for (int64_t b = j->first; b < j->last; ++b) {
    const int64_t len = clipped_len(j, b);
    const int64_t start = first_token(j, len);
    start_row(j, b, qf, acc, mx, sum, tmp);
    for (int64_t c = start; c < len; ++c) {
      if (c + PREFETCH_TOKENS < len)
        prefetch_rows(j, D, token_row(j, b, c + PREFETCH_TOKENS), 2 * K, 0);
      const int64_t row0 = token_row(j, b, c);
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
    finish_row(j, b, acc, sum);
  }
  free(buf);
  j->ok = 1;
  return NULL;
}

#if HAVE_BLOCKED
/* The first key of item b's first block: its first token's window start, rounded down to
 * a multiple of BLOCK (blocks lie at the same keys for every token). */
static inline int64_t item_start(const Job *j, int64_t b) {
  return first_token(j, token_len(j, b, 0)) / BLOCK * BLOCK;
}

/* The weighted values of KV head k for query heads [h0, h0 + ng), of the block's tokens
 * [t0, n): the running sums of up to four heads stay in registers while the block's value
 * rows (in cache since the first pass) are added in, LANES at a time. */
static inline __attribute__((always_inline)) void add_values(
    const Job *j, const int64_t D, float *acc, const float *w, const int64_t *row, int64_t t0,
    int64_t n, int64_t k, int64_t h0, const int ng) {
  if (j->kv16 && D % (2 * LANES) == 0) { /* 2 LANES values a load: even ones first */
    for (int64_t c = 0; c < D; c += 2 * LANES) {
      vf e[4], o[4];
      for (int i = 0; i < ng; ++i) {
        e[i] = load_f32(acc + (h0 + i) * D + c);
        o[i] = load_f32(acc + (h0 + i) * D + c + LANES);
      }
      for (int64_t t = t0; t < n; ++t) {
        vu u;
        memcpy(&u, (const uint16_t *)j->kv + (size_t)(row[t] + 2 * k + 1) * D + c, sizeof u);
        const vf even = (vf)(u << 16), odd = (vf)(u & 0xffff0000u);
        for (int i = 0; i < ng; ++i) {
          e[i] += w[(h0 + i) * BLOCK + t] * even;
          o[i] += w[(h0 + i) * BLOCK + t] * odd;
        }
      }
      for (int i = 0; i < ng; ++i) {
        memcpy(acc + (h0 + i) * D + c, &e[i], sizeof e[i]);
        memcpy(acc + (h0 + i) * D + c + LANES, &o[i], sizeof o[i]);
      }
    }
    return;
  }
  for (int64_t c = 0; c < D; c += LANES) {
    vf a[4];
    for (int i = 0; i < ng; ++i) a[i] = load_f32(acc + (h0 + i) * D + c);
    for (int64_t t = t0; t < n; ++t) {
      const vf v = load_row(j->kv, j->kv16, (size_t)(row[t] + 2 * k + 1) * D + c);
      for (int i = 0; i < ng; ++i) a[i] += w[(h0 + i) * BLOCK + t] * v;
    }
    for (int i = 0; i < ng; ++i) memcpy(acc + (h0 + i) * D + c, &a[i], sizeof a[i]);
  }
}

/* A block of the thread's work: tokens [c, c + BLOCK) of sequence b, or b == last past
 * its end. run_blocked keeps one two blocks ahead of the block it computes, across
 * sequences, and fetches that block's rows into L2. */
typedef struct {
  int64_t b, c;
} Cursor;

/* Moves `at` forward by `step` tokens, on to the next sequence with keys when it passes
 * the end of its own (step 0 only skips sequences without keys). */
static inline void cursor_advance(const Job *j, Cursor *at, int64_t step) {
  at->c += step;
  while (at->b < j->last && at->c >= clipped_len(j, at->b))
    if (++at->b < j->last) at->c = item_start(j, at->b);
}

/* The blocked path, for D a multiple of LANES (see the top of the file); the same result as
 * run_rows up to rounding. An item of several query tokens (ragged calls) reads each
 * block of keys once for all of them: token i's heads are heads i * H .. of the item, and
 * keys outside token i's own range [first_token, token_len) get weight 0 (at the item's
 * end, where the later tokens' keys lie, and at its start with a window). Blocks lie at
 * multiples of BLOCK keys, whatever the item, the keys of a first partial block before
 * its first token's window neither read nor weighted: a token's result is bitwise that
 * of the token alone (a decode row). `multi` (a constant where it is inlined): items may
 * have several tokens;
 * 0 compiles the decode path without the checks those need (6% faster at 64 x 1k f32).
 * `Dc` (a constant too): the head size D, or 0 to read it from the job. */
static inline __attribute__((always_inline)) void *blocked(Job *j, const int multi,
                                                           const int64_t Dc) {
  const int64_t H = j->H, D = Dc ? Dc : j->D, K = j->K, G = H / K;
  int64_t most = 1; /* the most tokens of any of this job's items */
  for (int64_t b = j->first; multi && b < j->last; ++b)
    most = item_tokens(j, b) > most ? item_tokens(j, b) : most;
  const int64_t HQ = most * H;
  /* partial scores [HQ][BLOCK] (vectors), q scaled to f32 [HQ][D], the running sums
   * [HQ][D], weights [HQ][BLOCK], a converted key row [D], max and sum [HQ] */
  const size_t floats =
      (size_t)(HQ * BLOCK * LANES + 2 * HQ * D + HQ * BLOCK + D + 2 * HQ);
  float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
  if (!buf) return NULL; /* j->ok stays 0 */
  vf *part = (vf *)buf;
  float *qf = buf + HQ * BLOCK * LANES, *acc = qf + HQ * D, *w = acc + HQ * D,
        *tmp = w + HQ * BLOCK, *mx = tmp + D, *sum = mx + HQ;

#if defined(__AVX512BF16__)
  const int dp = j->q16 && j->kv16 && D % 32 == 0;
#else
  const int dp = 0;
#endif
  Cursor far = {j->first, j->first < j->last ? item_start(j, j->first) : 0};
  cursor_advance(j, &far, 0);
  cursor_advance(j, &far, BLOCK);
  cursor_advance(j, &far, BLOCK);
  for (int64_t b = j->first; b < j->last; ++b) {
    const int64_t nq = multi ? item_tokens(j, b) : 1, len = clipped_len(j, b),
                  start = item_start(j, b);
    int64_t tl[MAX_ITEM], lo[MAX_ITEM]; /* token i's keys: [lo[i], tl[i]) */
    for (int64_t i = 0; i < nq; ++i) {
      tl[i] = token_len(j, b, i);
      lo[i] = first_token(j, tl[i]);
    }
#if defined(__AVX512BF16__)
    const uint16_t *qh = (const uint16_t *)j->q + item_row(j, b) * H * D; /* q as it came */
#endif
    start_row(j, b, qf, acc, mx, sum, tmp);
    int64_t row[BLOCK], next[BLOCK]; /* token_row of this block's tokens, of the next's */
    for (int64_t t = 0; t < BLOCK && start + t < len; ++t) row[t] = token_row(j, b, start + t);
    for (int64_t c0 = start; c0 < len; c0 += BLOCK) {
      const int64_t n = len - c0 < BLOCK ? len - c0 : BLOCK;
      /* The item's tokens with keys in this block: [i0, i1) (tl and lo grow with i). */
      int64_t i0 = 0, i1 = nq;
      while (multi && i0 < nq && tl[i0] <= c0) ++i0;
      while (multi && i1 > i0 && lo[i1 - 1] >= c0 + n) --i1;
      /* keys before t_first (the earliest window's start) are not read */
      const int64_t t_first = lo[i0] > c0 ? lo[i0] - c0 : 0;
      /* Prefetching, in two steps (measured on a 2-core AMD EPYC, Zen 5).
       * 1. The block two ahead, at `far` (in a later sequence near the end of this one),
       *    goes to L2 during the first pass, a key and its value together: 48.5 -> 40 ms
       *    at 64 x 4k bf16, and 4% off SmolLM2's 30 layers at 32 x 170 tokens, where the
       *    far block is often the next sequence's. Its rows are looked up where they are
       *    fetched: looking them up once per block beforehand measured 6% slower.
       * 2. The next block's keys go to L1 during the first pass and its values during
       *    the second. All of its rows at once stalled the first pass on the memory
       *    system and left it idle in the second (61 ms against 51). */
      const int64_t after = len - (c0 + BLOCK), n2 = after < 0 ? 0 : after < BLOCK ? after : BLOCK;
      for (int64_t t = 0; t < n2; ++t) next[t] = token_row(j, b, c0 + BLOCK + t);
      const int64_t left = far.b < j->last ? clipped_len(j, far.b) - far.c : 0,
                    n3 = left < BLOCK ? left : BLOCK;
      for (int64_t t = 0; t < BLOCK; ++t) { /* pass 1: partial scores, rows in order */
        for (int64_t k = 0; k < K; ++k) {
          if (t < n3) prefetch_rows(j, D, token_row(j, far.b, far.c + t) + 2 * k, 2, 1);
          if (t < n2) prefetch_rows(j, D, next[t] + 2 * k, 1, 0);
          if (t >= n || t < t_first) {
            for (int64_t i = i0; i < i1; ++i)
              for (int64_t h = i * H + k * G; h < i * H + (k + 1) * G; ++h)
                part[h * BLOCK + t] = (vf){};
            continue;
          }
#if defined(__AVX512BF16__)
          if (dp) { /* bf16 q and K: products of pairs summed in f32, 32 elements an op */
            const uint16_t *key = (const uint16_t *)j->kv + (size_t)(row[t] + 2 * k) * D;
            for (int64_t i = i0; i < i1; ++i)
              for (int64_t h = i * H + k * G; h < i * H + (k + 1) * G; ++h) {
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < D; c += 32)
                  a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(qh + h * D + c),
                                       (__m512bh)_mm512_loadu_si512(key + c));
                memcpy(&part[h * BLOCK + t], &a, sizeof a);
              }
            continue;
          }
#endif
          const float *key = row_f32(j->kv, j->kv16, row[t] + 2 * k, D, tmp);
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t h = i * H + k * G; h < i * H + (k + 1) * G; ++h) {
              vf a = load_f32(qf + h * D) * load_f32(key);
              for (int64_t c = LANES; c < D; c += LANES)
                a += load_f32(qf + h * D + c) * load_f32(key + c);
              part[h * BLOCK + t] = a;
            }
        }
      }
      for (int64_t i = i0; i < i1; ++i) { /* the block's scores and weights, per head */
        /* the block's keys in token i's range: lanes [t_lo, t_hi) */
        const int64_t t_lo = lo[i] > c0 ? lo[i] - c0 : 0,
                      t_hi = multi && tl[i] - c0 < n ? tl[i] - c0 : n;
        vi lane;
        for (int t = 0; t < LANES; ++t) lane[t] = t;
        const vi keep = (lane >= (int32_t)t_lo) & (lane < (int32_t)t_hi);
        const vf none = (vf){} - INFINITY;
        for (int64_t h = i * H; h < (i + 1) * H; ++h) {
          vf s = sum_lanes(part + h * BLOCK);
          if (dp) s *= j->scale;
          if (j->cap > 0.0f)
            for (int64_t t = t_lo; t < t_hi; ++t) s[t] = j->cap * tanhf(s[t] / j->cap);
          s = (vf)(((vi)s & keep) | ((vi)none & ~keep));
          const float top = max_lanes(s);
          if (top > mx[h]) { /* a new running max: rescale what was summed so far */
            const float r = expf(mx[h] - top);
            sum[h] *= r;
            for (int64_t c = 0; c < D; c += LANES) {
              const vf a = load_f32(acc + h * D + c) * r;
              memcpy(acc + h * D + c, &a, sizeof a);
            }
            mx[h] = top;
          }
          const vf p = exp_nonpositive(s - mx[h]);
          sum[h] += add_lanes(p);
          memcpy(w + h * BLOCK, &p, sizeof p);
        }
      }
      for (int64_t k = 0; k < K; ++k) { /* pass 2: weighted values, rows now in cache */
        for (int64_t t = 0; t < n2; ++t) prefetch_rows(j, D, next[t] + 2 * k + 1, 1, 0);
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t h0 = i * H + k * G; h0 < i * H + (k + 1) * G; h0 += 4) {
            switch (i * H + (k + 1) * G - h0) {
              case 1: add_values(j, D, acc, w, row, t_first, n, k, h0, 1); break;
              case 2: add_values(j, D, acc, w, row, t_first, n, k, h0, 2); break;
              case 3: add_values(j, D, acc, w, row, t_first, n, k, h0, 3); break;
              default: add_values(j, D, acc, w, row, t_first, n, k, h0, 4); break;
            }
          }
      }
      memcpy(row, next, sizeof(int64_t) * (size_t)n2);
      cursor_advance(j, &far, BLOCK);
    }
    if (j->kv16 && D % (2 * LANES) == 0) /* back to d order (see add_values) */
      for (int64_t h = 0; h < nq * H; ++h)
        for (int64_t c = 0; c < D; c += 2 * LANES) {
          float *a = acc + h * D + c;
          for (int d = 0; d < 2 * LANES; ++d) tmp[d] = a[(d & 1) * LANES + d / 2];
          memcpy(a, tmp, 2 * LANES * sizeof(float));
        }
    finish_row(j, b, acc, sum);
  }
  free(buf);
  j->ok = 1;
  return NULL;
}

/* The entry points, with the common head sizes compiled in so that every loop over D
 * unrolls (64 x 4k bf16, D = 128, on a 2-core AMD EPYC, Zen 5: 35 -> 33 ms; 24 -> 23 ms
 * with the pages in cache); other sizes take D at run time. */
static inline __attribute__((always_inline)) void *blocked_sized(Job *j, const int multi) {
  if (j->D == 128) return blocked(j, multi, 128);
  if (j->D == 64) return blocked(j, multi, 64);
  return blocked(j, multi, 0);
}

static void *run_blocked(void *arg) { return blocked_sized((Job *)arg, 0); }

static void *run_blocked_items(void *arg) { return blocked_sized((Job *)arg, 1); }

#endif

static int is_i32_vector(const XLA_FFI_Buffer *x, int64_t n) {
  return x->rank == 1 && x->dtype == XLA_FFI_DataType_S32 && x->dims[0] == n;
}

static int is_float(const XLA_FFI_Buffer *x) {
  return x->dtype == XLA_FFI_DataType_F32 || x->dtype == XLA_FFI_DataType_BF16;
}

/* Item b's work: the keys it reads times its query tokens. */
static inline int64_t item_work(const Job *j, int64_t b) {
  return clipped_len(j, b) * item_tokens(j, b);
}

/* Splits items [0, B) over the threads in contiguous runs of about equal work and runs
 * them; `base` holds everything else. */
static XLA_FFI_Error *run_split(XLA_FFI_CallFrame *frame, const Job *base, int64_t B,
                                int64_t asked, const char *oom) {
  int64_t tokens = 0;
  for (int64_t b = 0; b < B; ++b) tokens += item_work(base, b);
  const int64_t threads =
      clamp_threads(asked, tokens * 2 * base->K * base->D / MIN_ELEMENTS_PER_THREAD, B);
#if HAVE_BLOCKED
  void *(*run)(void *) =
      base->D % LANES != 0 ? run_rows : base->nq ? run_blocked_items : run_blocked;
#else
  void *(*run)(void *) = run_rows;
#endif
  Job jobs[MAX_THREADS];
  int64_t b = 0, done = 0;
  for (int64_t t = 0; t < threads; ++t) { /* contiguous runs of about tokens / threads */
    jobs[t] = *base;
    jobs[t].first = b;
    const int64_t target = tokens * (t + 1) / threads;
    while (b < B && (done < target || t == threads - 1)) done += item_work(base, b++);
    jobs[t].last = b;
  }
  run_jobs(frame, jobs, sizeof(Job), threads, run);
  int ok = 1;
  for (int64_t t = 0; t < threads; ++t) ok &= jobs[t].ok;
  return ok ? NULL : fail(frame, oom);
}

/* Checks q [B, H, D], kv [N, P, 2K, D], tables [S, M], params f32[4] or f32[4 + H] (the
 * heads' sinks after the four) and o (as q) and fills `j` from them; an error message,
 * or NULL. */
static const char *common_operands(const XLA_FFI_Buffer *q, const XLA_FFI_Buffer *kv,
                                   const XLA_FFI_Buffer *tables, const XLA_FFI_Buffer *params,
                                   const XLA_FFI_Buffer *out, Job *j) {
  if (q->rank != 3 || kv->rank != 4 || tables->rank != 2 || params->rank != 1 || out->rank != 3)
    return "paged_jax attention: expected q[T,H,D], kv_pages[N,P,2K,D], tables[S,M], "
           "params[4] and o[T,H,D]";
  const int64_t H = q->dims[1], D = q->dims[2], K = kv->dims[2] / 2;
  if (!is_float(q) || !is_float(kv) || out->dtype != q->dtype ||
      tables->dtype != XLA_FFI_DataType_S32 || params->dtype != XLA_FFI_DataType_F32 ||
      (params->dims[0] != 4 && params->dims[0] != 4 + H))
    return "paged_jax attention: expected f32/bf16 q and kv_pages, i32 tables, f32[4] "
           "or f32[4 + H] params, o in q's dtype";
  if (kv->dims[3] != D || kv->dims[2] % 2 || K == 0 || H % K || H / K > MAX_GROUP ||
      out->dims[0] != q->dims[0] || out->dims[1] != H || out->dims[2] != D)
    return "paged_jax attention: operand shapes disagree (or > 64 query heads per KV head)";
  const float *p = (const float *)params->data;
  *j = (Job){
      .q = q->data, .kv = kv->data, .out = out->data, .tables = (const int32_t *)tables->data,
      .H = H, .D = D, .N = kv->dims[0], .P = kv->dims[1], .K = K, .M = tables->dims[1],
      .window = (int64_t)p[1], .scale = p[0], .cap = p[2],
      .sinks = params->dims[0] == 4 + H ? p + 4 : NULL,
      .q16 = q->dtype == XLA_FFI_DataType_BF16, .kv16 = kv->dtype == XLA_FFI_DataType_BF16,
  };
  return NULL;
}

/* Decode: operands q, kv_pages, kv_lens i32[B], tables i32[B, M], params (see the top). */
XLA_FFI_Error *PagedJaxDecodeAttention(XLA_FFI_CallFrame *frame) {
  /* XLA first asks which FFI version the handler speaks. */
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 5 || frame->rets.size != 1)
    return fail(frame, "paged_jax decode: expected 5 operands and 1 result");
  const XLA_FFI_Buffer *q = frame->args.args[0], *lens = frame->args.args[2],
                       *tables = frame->args.args[3], *params = frame->args.args[4];
  Job base;
  const char *why = common_operands(q, frame->args.args[1], tables, params,
                                    frame->rets.rets[0], &base);
  if (why) return fail(frame, why);
  const int64_t B = q->dims[0];
  if (!is_i32_vector(lens, B) || tables->dims[0] != B)
    return fail(frame, "paged_jax decode: expected kv_lens i32[B] and tables[B, M]");
  base.lens = (const int32_t *)lens->data;
  return run_split(frame, &base, B, (int64_t)((const float *)params->data)[3],
                   "paged_jax decode: out of memory");
}

/* Ragged steps: operands q [T, H, D], kv_pages, kv_lens i32[S], tables i32[S, M],
 * cu_q_lens i32[S + 1], num_seqs i32[1], params. Sequence s < num_seqs owns query rows
 * [cu_q_lens[s], cu_q_lens[s + 1]), the last kv_lens[s] - q_len .. kv_lens[s] - 1
 * positions of its keys, and row t attends causally to its sequence's keys up to its
 * own position. The rows go in items of up to ITEM_TOKENS consecutive ones of a
 * sequence, which read each block of keys once (run_blocked); run_rows takes them one at
 * a time. Rows no sequence owns are padding (output 0). Offsets are clamped to [0, T]
 * and to the end of the previous sequence's rows, so bad ones cannot read outside q or
 * give a row two owners.
 *
 * ITEM_TOKENS: SmolLM2's shapes (9/3 heads, D 64, f32), one 2048-token prompt: 39.5 ms
 * a layer with 4, 35.3 with 8, 35.8 with 16, against 59-64 token by token and 272-311
 * for XLA's ragged path; 32 sequences x 9 new tokens at 105: 0.65-0.7 against 1.1-1.2. */
#define ITEM_TOKENS 8
_Static_assert(ITEM_TOKENS <= MAX_ITEM, "an item's tokens must fit run_blocked's arrays");
XLA_FFI_Error *PagedJaxRaggedAttention(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 7 || frame->rets.size != 1)
    return fail(frame, "paged_jax ragged: expected 7 operands and 1 result");
  const XLA_FFI_Buffer *q = frame->args.args[0], *lens = frame->args.args[2],
                       *tables = frame->args.args[3], *cu = frame->args.args[4],
                       *num = frame->args.args[5], *params = frame->args.args[6];
  Job base;
  const char *why = common_operands(q, frame->args.args[1], tables, params,
                                    frame->rets.rets[0], &base);
  if (why) return fail(frame, why);
  const int64_t T = q->dims[0], S = tables->dims[0];
  if (!is_i32_vector(lens, S) || !is_i32_vector(cu, S + 1) || !is_i32_vector(num, 1))
    return fail(frame, "paged_jax ragged: expected kv_lens i32[S], cu_q_lens i32[S + 1] and "
                       "num_seqs i32[1] with tables[S, M]");
#if HAVE_BLOCKED
  const int64_t per_item = base.D % LANES == 0 ? ITEM_TOKENS : 1;
#else
  const int64_t per_item = 1;
#endif
  /* at most T items: len, seq, first row and count of each */
  int32_t *items = (int32_t *)malloc(sizeof(int32_t) * (size_t)(4 * T + 1));
  if (!items) return fail(frame, "paged_jax ragged: out of memory");
  int32_t *item_len = items, *item_seq = items + T, *item_tok = items + 2 * T,
          *item_nq = items + 3 * T;
  const int32_t *kv_lens = (const int32_t *)lens->data, *offsets = (const int32_t *)cu->data;
  int64_t used = ((const int32_t *)num->data)[0];
  used = used < 0 ? 0 : used > S ? S : used;
  const size_t row_bytes = (size_t)(base.H * base.D) * (base.q16 ? 2 : 4);
  int64_t count = 0, end = 0; /* items so far; the rows owned so far end at `end` */
  for (int64_t s = 0; s < used; ++s) {
    int64_t a = offsets[s], e = offsets[s + 1];
    a = a < end ? end : a > T ? T : a;
    e = e < a ? a : e > T ? T : e;
    memset((char *)base.out + end * row_bytes, 0, (size_t)(a - end) * row_bytes);
    for (int64_t t = a; t < e; t += per_item) {
      const int64_t nq = e - t < per_item ? e - t : per_item;
      const int64_t len = (int64_t)kv_lens[s] - (e - a) + (t + nq - 1 - a) + 1;
      item_len[count] = (int32_t)(len < INT32_MIN ? INT32_MIN : len);
      item_seq[count] = (int32_t)s;
      item_tok[count] = (int32_t)t;
      item_nq[count++] = (int32_t)nq;
    }
    end = e;
  }
  memset((char *)base.out + end * row_bytes, 0, (size_t)(T - end) * row_bytes);
  base.lens = item_len;
  base.seq = item_seq;
  base.tok = item_tok;
  base.nq = item_nq;
  XLA_FFI_Error *err = run_split(frame, &base, count, (int64_t)((const float *)params->data)[3],
                                 "paged_jax ragged: out of memory");
  free(items);
  return err;
}

/* A buffer for the KV pool, left as XLA allocated it (no operands, one result of any
 * shape and dtype): __init__.py's uninitialized(). paged_jax then zeroes it lazily
 * (_hugepages.lazy_zeros), handing its whole pages back to the kernel, which maps zero
 * pages on first touch, instead of XLA writing zeros through every page of a pool that
 * a run may never fill (4 GiB: 2.8-6.6 s of the engine's start-up on a 2-core CPU). */
XLA_FFI_Error *PagedJaxUninitialized(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 0 || frame->rets.size != 1)
    return fail(frame, "paged_jax uninitialized: expected no operands and 1 result");
  return NULL;
}
