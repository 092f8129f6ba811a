/* The sampler's work for CPUs, called by XLA through its FFI; built with decode.c and
 * linear.c into one library by __init__.py. Two entry points:
 *
 * PagedJaxGreedyRows: operands x f32[R, V] (a step's logits), params i32[1] {at most this
 * many threads}; results token i32[R], lse f32[R]. For each row:
 *   token = the first index of the row's maximum (of its first NaN, if it holds one), as
 *           jnp.argmax gives it;
 *   lse   = log(sum of exp(x - m)) + m with m the row's maximum, as jax.nn.logsumexp
 *           gives it: NaN for a row with a NaN, +inf for one with +inf, -inf for a row
 *           of -inf.
 * Two passes over the row: its maximum (vectors of LANES), then the sum of exponentials
 * (vec.h's exp_nonpositive, within 1 ulp of exp) and the first index holding the maximum.
 * Why: XLA:CPU's logsumexp and argmax of SmolLM2's 32 x 49,152 logits took 0.8-1.0 ms,
 * most of it in the exponentials, against a 35 ms decode step.
 *
 * PagedJaxSampleRows: operands x f32[R, V], temperature f32[R], top_k i32[R], top_p
 * f32[R], min_p f32[R], u f32[R, J] (one uniform in [0, 1) per sample), params i32[1]
 * {threads}; results token i32[R, J], lse f32[R] (as above). The definition is
 * paged_jax/engine/sampling.py's sample_rows; per row:
 *   - temperature 0, or a row whose maximum is not finite (a NaN, +inf, every logit
 *     -inf), or whose maximum divided by the temperature is not: every column the argmax;
 *   - otherwise s = x / temperature and weights exp(s - max s). A row without top-k,
 *     top-p or min-p draws in vocabulary order: the first index whose running sum of
 *     weights exceeds u times their total. A restricted row keeps a prefix of its tokens
 *     in descending order of s (ties: the lower index first): rank < top_k (when > 0),
 *     weight before the token < top_p times the total, weight >= min_p times the
 *     largest (the first token always), and draws the same way among the kept tokens,
 *     in vocabulary order.
 * Nothing sorts the vocabulary. A pass over the row keeps each block of BLOCK logits'
 * maximum and sum of exponentials; a restricted row then gathers the tokens with
 * s >= c, trying lower bounds c until one provably holds the kept prefix (at least top_k
 * tokens, enough weight for top-p with a margin of 1e-4 for rounding, or c below min_p's
 * bound), reading only the blocks whose maximum reaches c, and sorts what it gathered
 * (a radix sort on the bits of s, stable, so ties keep their index order) to find the
 * kept prefix; the draw then walks the gathered tokens in index order. SmolLM2's
 * peaked rows gather tens of tokens, flat ones at temperature 1 a few thousand.
 *
 * Rows are split over threads in contiguous runs, the calling thread computing the first
 * and XLA's thread pool the others; a row's result does not depend on the others.
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

#define BLOCK 256 /* logits a block keeps a maximum and sums for */

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

static inline int64_t num_blocks(int64_t V) { return (V + BLOCK - 1) / BLOCK; }

/* A row's blocks of BLOCK logits: each one's maximum and sums of exponentials. */
typedef struct {
  float *bmax; /* [blocks] the block's largest logit */
  double *raw; /* [blocks] sum of exp(x - bmax) */
  double *w;   /* [blocks] sum of exp((x - bmax) / t) (sampled rows) */
} Blocks;

static int blocks_alloc(Blocks *k, int64_t V) {
  const int64_t blocks = num_blocks(V);
  k->bmax = malloc(blocks * sizeof *k->bmax);
  k->raw = malloc(blocks * sizeof *k->raw);
  k->w = malloc(blocks * sizeof *k->w);
  return k->bmax && k->raw && k->w;
}

static void blocks_free(Blocks *k) {
  free(k->bmax);
  free(k->raw);
  free(k->w);
}

/* One pass over a row, block by block (each block read again while it is in cache): the
 * block's maximum, the sum of exp(x - its maximum) and, for inv_t other than 0 and 1, of
 * exp((x - its maximum) * inv_t) (else w = raw). Returns the row's maximum, or a NaN or
 * +inf as soon as a block holds one (the caller then takes the greedy answer). Greedy and
 * sampled rows sum the same way, so a row's log-sum-exp has the same bits in both. */
static float block_pass(const float *x, int64_t V, float inv_t, Blocks *k) {
  const int64_t blocks = num_blocks(V);
  const int scaled = inv_t != 0.0f && inv_t != 1.0f;
  float m = -INFINITY;
  for (int64_t b = 0; b < blocks; ++b) {
    const float *xb = x + b * BLOCK;
    const int64_t n = b * BLOCK + BLOCK < V ? BLOCK : V - b * BLOCK;
    const float bm = row_max(xb, n);
    if (!(bm < INFINITY)) return bm;
    k->bmax[b] = bm;
    if (bm > m) m = bm;
    float sr = 0.0f, sw = 0.0f;
    if (bm > -INFINITY) {
      int64_t v = 0;
#if HAVE_LANES
      vf ar = (vf){}, aw = (vf){};
      for (; v + LANES <= n; v += LANES) {
        const vf d = load_f32(xb + v) - bm;
        ar += exp_nonpositive(d);
        if (scaled) aw += exp_nonpositive(d * inv_t);
      }
      sr = add_lanes(ar);
      sw = add_lanes(aw);
#endif
      for (; v < n; ++v) {
        sr += expf(xb[v] - bm);
        if (scaled) sw += expf((xb[v] - bm) * inv_t);
      }
    }
    k->raw[b] = sr;
    k->w[b] = scaled ? sw : sr;
  }
  return m;
}

/* log(sum of exp(x - m)) + m from the blocks' sums (m: the row's finite maximum). */
static float row_lse(const Blocks *k, int64_t V, float m) {
  const int64_t blocks = num_blocks(V);
  double sum = 0.0;
  for (int64_t b = 0; b < blocks; ++b)
    if (k->bmax[b] > -INFINITY) sum += k->raw[b] * exp((double)(k->bmax[b] - m));
  return (float)(log(sum) + m);
}

/* The first index holding the row's maximum m. */
static int32_t first_max(const float *x, int64_t V, float m) {
  int64_t at = 0;
  while (at < V - 1 && x[at] != m) ++at;
  return (int32_t)at;
}

/* One row's argmax and log-sum-exp (the greedy rows). */
static void greedy_row(const float *x, int64_t V, int32_t *token, float *lse, Blocks *k) {
  float m = block_pass(x, V, 0.0f, k);
  const int finite = isfinite(m);
  if (!finite) m = row_max(x, V); /* a NaN after a +inf wins */
  if (m != m) { /* the first NaN; the sum is NaN */
    int64_t at = 0;
    while (at < V && x[at] == x[at]) ++at;
    *token = (int32_t)at;
    *lse = NAN;
    return;
  }
  *token = first_max(x, V, m);
  /* +inf: +inf; a row of -inf: -inf (the sum's log of 0) */
  *lse = finite ? row_lse(k, V, m) : m;
}

typedef struct {
  const float *x;
  int32_t *token;
  float *lse;
  int64_t V, first, last; /* rows [first, last) */
  int failed;             /* out of memory */
} RowsJob;

static void *run_rows_greedy(void *arg) {
  RowsJob *j = (RowsJob *)arg;
  Blocks k;
  if (!blocks_alloc(&k, j->V)) j->failed = 1;
  for (int64_t r = j->first; r < j->last && !j->failed; ++r)
    greedy_row(j->x + r * j->V, j->V, j->token + r, j->lse + r, &k);
  blocks_free(&k);
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
  for (int64_t t = 0; t < threads; ++t)
    if (jobs[t].failed) return fail(frame, "paged_jax greedy rows: out of memory");
  return NULL;
}

/* ---- PagedJaxSampleRows ---------------------------------------------------------- */

#define INSERTION_SORT_MAX 32

typedef struct {
  const float *x, *temperature, *top_p, *min_p, *u;
  const int32_t *top_k;
  int32_t *token;
  float *lse;
  int64_t V, J, first, last; /* rows [first, last) */
  int failed;                /* out of memory */
} SampleJob;

/* A thread's working memory: per block of the row, and per gathered token (grown on
 * demand). */
typedef struct {
  Blocks k;
  int32_t *idx, *pos, *pos2;
  float *e;           /* [gathered] exp(s - max s) of each gathered token */
  uint32_t *key, *key2;
  int64_t cap;
} Scratch;

static int grow(Scratch *w, int64_t n) {
  if (n <= w->cap) return 1;
  int64_t cap = w->cap ? w->cap : 1024;
  while (cap < n) cap *= 2;
#define GROW(field)                                      \
  do {                                                   \
    void *p = realloc(w->field, cap * sizeof *w->field); \
    if (!p) return 0;                                    \
    w->field = p;                                        \
  } while (0)
  GROW(idx);
  GROW(pos);
  GROW(pos2);
  GROW(e);
  GROW(key);
  GROW(key2);
#undef GROW
  w->cap = cap;
  return 1;
}

static void scratch_free(Scratch *w) {
  blocks_free(&w->k);
  free(w->idx);
  free(w->pos);
  free(w->pos2);
  free(w->e);
  free(w->key);
  free(w->key2);
}

/* An unsigned key whose ascending order is s's descending order (-0 as +0). */
static inline uint32_t descending_key(float s) {
  uint32_t b;
  if (s == 0.0f) s = 0.0f;
  memcpy(&b, &s, sizeof b);
  b = (b >> 31) ? ~b : (b | 0x80000000u);
  return ~b;
}

/* Sorts pos[0 .. n) by key, stably (equal keys keep their order); key2/pos2 are room of
 * the same size. Returns the array holding the sorted positions. */
static int32_t *sort_positions(uint32_t *key, int32_t *pos, uint32_t *key2, int32_t *pos2,
                               int64_t n) {
  if (n <= INSERTION_SORT_MAX) {
    for (int64_t i = 1; i < n; ++i) {
      const uint32_t k = key[i];
      const int32_t p = pos[i];
      int64_t j = i;
      for (; j > 0 && key[j - 1] > k; --j) {
        key[j] = key[j - 1];
        pos[j] = pos[j - 1];
      }
      key[j] = k;
      pos[j] = p;
    }
    return pos;
  }
  int64_t count[4][256];
  memset(count, 0, sizeof count);
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < 4; ++d) ++count[d][(key[i] >> (8 * d)) & 255];
  for (int d = 0; d < 4; ++d) { /* least significant byte first: stable passes */
    const int shift = 8 * d;
    if (count[d][(key[0] >> shift) & 255] == n) continue; /* every key has this byte */
    int64_t at = 0;
    for (int b = 0; b < 256; ++b) {
      const int64_t c = count[d][b];
      count[d][b] = at;
      at += c;
    }
    for (int64_t i = 0; i < n; ++i) {
      const int64_t to = count[d][(key[i] >> shift) & 255]++;
      key2[to] = key[i];
      pos2[to] = pos[i];
    }
    uint32_t *tk = key;
    key = key2;
    key2 = tk;
    int32_t *tp = pos;
    pos = pos2;
    pos2 = tp;
  }
  return pos;
}

#if HAVE_LANES
/* Whether any lane of a comparison's result is set. */
static inline int any_lane(vi m) {
#if LANES == 16
  m |= SHUFFLE(m, m, SWAP_8);
#endif
  m |= SHUFFLE(m, m, SWAP_4);
  m |= SHUFFLE(m, m, SWAP_2);
  m |= SHUFFLE(m, m, SWAP_1);
  return m[0] != 0;
}
#endif

/* Appends token v (s = x[v] / t, weight e) to the gathered set. */
static inline void keep(Scratch *w, int64_t *n, int64_t v, float s, float e, double *sum) {
  w->idx[*n] = (int32_t)v;
  w->e[*n] = e;
  w->key[*n] = descending_key(s);
  w->pos[*n] = (int32_t)*n;
  *sum += e;
  ++*n;
}

/* Gathers the tokens with x / t >= c (in index order), their weights exp(s - smax) and
 * descending keys, reading only blocks whose maximum reaches c. Returns how many, or -1
 * when out of memory; *mass: their summed weight. */
static int64_t gather(const float *x, int64_t V, float t, float smax, double c, Scratch *w,
                      double *mass) {
  const int64_t blocks = num_blocks(V);
  /* The least float f with f >= c, so that s >= f exactly when s >= c. */
  float cf = (float)c;
  if ((double)cf < c) cf = nextafterf(cf, INFINITY);
  int64_t n = 0;
  double sum = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (!(w->k.bmax[b] / t >= cf)) continue;
    const int64_t end = b * BLOCK + BLOCK < V ? b * BLOCK + BLOCK : V;
    if (!grow(w, n + (end - b * BLOCK))) return -1;
    int64_t v = b * BLOCK;
#if HAVE_LANES
    for (; v + LANES <= end; v += LANES) {
      const vf s = load_f32(x + v) / t;
      const vi in = s >= cf;
      if (!any_lane(in)) continue;
      const vf e = exp_nonpositive(s - smax);
      for (int i = 0; i < LANES; ++i)
        if (in[i]) keep(w, &n, v + i, s[i], e[i], &sum);
    }
#endif
    for (; v < end; ++v) {
      const float s = x[v] / t;
      if (s >= cf) keep(w, &n, v, s, expf(s - smax), &sum);
    }
  }
  *mass = sum;
  return n;
}

/* One sampled row (temperature t > 0). Returns 0 when out of memory. */
static int sample_row(const float *x, int64_t V, float t, int32_t top_k, float top_p,
                      float min_p, const float *u, int64_t J, int32_t *token, float *lse,
                      Scratch *w) {
  const int64_t blocks = num_blocks(V);
  const float inv_t = 1.0f / t;
  const float m = block_pass(x, V, inv_t, &w->k);
  const float smax = m / t;
  if (!isfinite(m) || !isfinite(smax) || !isfinite(inv_t)) {
    int32_t tok; /* a NaN, +inf or nothing to weigh: the greedy row's answer */
    greedy_row(x, V, &tok, lse, &w->k);
    for (int64_t j = 0; j < J; ++j) token[j] = tok;
    return 1;
  }
  *lse = row_lse(&w->k, V, m);
  double *const weight = w->k.w; /* each block's weight, rescaled to the row's maximum */
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    const float bm = w->k.bmax[b];
    weight[b] = bm == -INFINITY ? 0.0 : weight[b] * exp((double)(bm - m) * inv_t);
    total += weight[b];
  }

  if (min_p > 1.0f) min_p = 1.0f; /* keeps the top token(s), as min_p 1 does */
  const int restricted = top_k > 0 || top_p < 1.0f || min_p > 0.0f;
  if (!restricted) { /* vocabulary order: the block, then the token within it */
    for (int64_t j = 0; j < J; ++j) {
      const double target = (double)u[j] * total;
      double run = 0.0;
      int64_t b = 0;
      while (b < blocks - 1 && run + weight[b] <= target) run += weight[b++];
      int64_t pick = -1, last = -1;
      const int64_t end = b * BLOCK + BLOCK < V ? b * BLOCK + BLOCK : V;
      for (int64_t v = b * BLOCK; v < end; ++v) {
        const float e = expf(x[v] / t - smax);
        if (e > 0.0f) {
          last = v;
          run += e;
          if (run > target) {
            pick = v;
            break;
          }
        }
      }
      token[j] = (int32_t)(pick >= 0 ? pick : last >= 0 ? last : first_max(x, V, m));
    }
    return 1;
  }

  /* Restricted: gather the tokens with s >= c for lower and lower c until the gathered
   * set provably holds the kept prefix, sort it to find that prefix, then walk the kept
   * tokens in index order. */
  static const double reach[] = {3.0, 6.0, 10.0, 16.0, 24.0, 40.0, INFINITY}; /* smax - c */
  const double min_p_bound = min_p > 0.0f ? smax + log((double)min_p) - 1e-3 : -INFINITY;
  int64_t n = 0;
  for (size_t i = 0; i < sizeof reach / sizeof *reach; ++i) {
    double c = smax - reach[i];
    int sure = c == -INFINITY;
    if (min_p > 0.0f && min_p_bound >= c) { /* kept tokens have weight >= min_p */
      c = min_p_bound;
      sure = 1;
    }
    double mass;
    n = gather(x, V, t, smax, c, w, &mass);
    if (n < 0) return 0;
    sure |= top_k > 0 && n >= top_k;
    sure |= top_p < 1.0f && mass >= (double)top_p * total * (1.0 + 1e-4);
    if (sure) break;
  }
  if (n == 0) { /* nothing gathered (a min_p above 1 the caller let through): the top token */
    const int32_t tok = (int32_t)first_max(x, V, m);
    for (int64_t j = 0; j < J; ++j) token[j] = tok;
    return 1;
  }
  const int32_t *order = sort_positions(w->key, w->pos, w->key2, w->pos2, n);
  /* The kept prefix: each rule keeps a prefix, so stop at the first token one refuses. */
  const double top_p_mass = (double)top_p * total;
  const float e0 = w->e[order[0]];
  double kept = 0.0;
  int64_t count = 0;
  for (; count < n; ++count) {
    const float e = w->e[order[count]];
    if (count > 0 && ((top_k > 0 && count >= top_k) || (top_p < 1.0f && !(kept < top_p_mass)) ||
                      !(e >= min_p * e0)))
      break;
    kept += e;
  }
  /* The draw walks the kept tokens in index order, which the gathered tokens are in.
   * Their weights are summed per chunk of BLOCK gathered tokens (a scatter from the sorted
   * order, into the row's block sums' room: those are spent), and only the chunk the draw
   * falls in is walked token by token. There a token is kept when its key is below the
   * cut's, or equal to it at or before the cut's position (the sort is stable: equal keys
   * keep their index order); s = x / t again gives gather's bits. */
  const int64_t chunks = (n + BLOCK - 1) / BLOCK;
  double *const chunk = w->k.raw;
  for (int64_t c = 0; c < chunks; ++c) chunk[c] = 0.0;
  for (int64_t i = 0; i < count; ++i) chunk[order[i] / BLOCK] += w->e[order[i]];
  const int32_t cut = order[count - 1];
  const uint32_t cut_key = descending_key(x[w->idx[cut]] / t);
  for (int64_t j = 0; j < J; ++j) {
    const double target = (double)u[j] * kept;
    /* the chunk where the running sum passes the target; where rounding leaves it short
     * to the end, the last chunk holding kept weight */
    int64_t c = -1, last_c = 0;
    double run = 0.0, before = 0.0, last_before = 0.0;
    for (int64_t k = 0; k < chunks; ++k) {
      if (chunk[k] > 0.0) {
        last_c = k;
        last_before = run;
        if (run + chunk[k] > target) {
          c = k;
          before = run;
          break;
        }
      }
      run += chunk[k];
    }
    if (c < 0) {
      c = last_c;
      before = last_before;
    }
    int64_t pick = -1, last = order[0]; /* (the top token: weight 1) */
    const int64_t end = c * BLOCK + BLOCK < n ? c * BLOCK + BLOCK : n;
    for (int64_t i = c * BLOCK; i < end; ++i) {
      const uint32_t key = descending_key(x[w->idx[i]] / t);
      if (key > cut_key || (key == cut_key && i > cut) || !(w->e[i] > 0.0f)) continue;
      last = i; /* the last kept token of positive weight so far */
      before += w->e[i];
      if (before > target) {
        pick = i;
        break;
      }
    }
    token[j] = w->idx[pick >= 0 ? pick : last];
  }
  return 1;
}

static void *run_rows_sample(void *arg) {
  SampleJob *j = (SampleJob *)arg;
  const int64_t V = j->V;
  Scratch w = {0};
  if (!blocks_alloc(&w.k, V)) j->failed = 1;
  for (int64_t r = j->first; r < j->last && !j->failed; ++r) {
    const float *x = j->x + r * V;
    int32_t *token = j->token + r * j->J;
    const float t = j->temperature[r];
    if (!(t > 0.0f)) { /* greedy */
      int32_t tok;
      greedy_row(x, V, &tok, j->lse + r, &w.k);
      for (int64_t c = 0; c < j->J; ++c) token[c] = tok;
    } else if (!sample_row(x, V, t, j->top_k[r], j->top_p[r], j->min_p[r], j->u + r * j->J,
                           j->J, token, j->lse + r, &w)) {
      j->failed = 1;
    }
  }
  scratch_free(&w);
  return NULL;
}

XLA_FFI_Error *PagedJaxSampleRows(XLA_FFI_CallFrame *frame) {
  if (ffi_metadata(frame)) return NULL;
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 7 || frame->rets.size != 2)
    return fail(frame, "paged_jax sample rows: expected 7 operands and 2 results");
  XLA_FFI_Buffer *const *a = (XLA_FFI_Buffer *const *)frame->args.args;
  const XLA_FFI_Buffer *x = a[0], *u = a[5], *params = a[6], *token = frame->rets.rets[0],
                       *lse = frame->rets.rets[1];
  int ok = x->rank == 2 && x->dtype == XLA_FFI_DataType_F32 && x->dims[1] >= 1 &&
           u->rank == 2 && u->dtype == XLA_FFI_DataType_F32 && u->dims[0] == x->dims[0] &&
           params->rank == 1 && params->dtype == XLA_FFI_DataType_S32 &&
           params->dims[0] == 1 && token->rank == 2 && token->dtype == XLA_FFI_DataType_S32 &&
           token->dims[0] == x->dims[0] && token->dims[1] == u->dims[1] && lse->rank == 1 &&
           lse->dtype == XLA_FFI_DataType_F32 && lse->dims[0] == x->dims[0];
  for (int i = 1; i < 5; ++i)
    ok = ok && a[i]->rank == 1 && a[i]->dims[0] == x->dims[0] &&
         a[i]->dtype == (i == 2 ? XLA_FFI_DataType_S32 : XLA_FFI_DataType_F32);
  if (!ok)
    return fail(frame, "paged_jax sample rows: expected f32 x[R,V] (V >= 1), f32 temperature, "
                       "i32 top_k, f32 top_p, f32 min_p [R], f32 u[R,J], i32[1] params, "
                       "i32 token[R,J] and f32 lse[R]");
  const int64_t R = x->dims[0], V = x->dims[1];
  const int64_t threads =
      clamp_threads(*(const int32_t *)params->data, R * V / MIN_ELEMENTS_PER_THREAD, R);
  SampleJob jobs[MAX_THREADS];
  for (int64_t t = 0; t < threads; ++t)
    jobs[t] = (SampleJob){.x = (const float *)x->data,
                          .temperature = (const float *)a[1]->data,
                          .top_k = (const int32_t *)a[2]->data,
                          .top_p = (const float *)a[3]->data,
                          .min_p = (const float *)a[4]->data,
                          .u = (const float *)u->data,
                          .token = (int32_t *)token->data,
                          .lse = (float *)lse->data,
                          .V = V,
                          .J = u->dims[1],
                          .first = R * t / threads,
                          .last = R * (t + 1) / threads};
  if (R > 0) run_jobs(frame, jobs, sizeof(SampleJob), threads, run_rows_sample);
  for (int64_t t = 0; t < threads; ++t)
    if (jobs[t].failed) return fail(frame, "paged_jax sample rows: out of memory");
  return NULL;
}
