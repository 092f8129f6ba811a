/* Vectors of f32 lanes for the CPU kernels, in GCC/clang vector extensions: LANES = 16
 * with AVX-512, 8 with AVX2 (one machine register each). For x86 builds with AVX2 or
 * more (__AVX2__ or __AVX512F__) only; decode.c and sample.c have plain C paths besides. */
#ifndef PAGED_JAX_VEC_H
#define PAGED_JAX_VEC_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

static inline vf load_f32(const float *p) {
  vf v;
  memcpy(&v, p, sizeof v);
  return v;
}

#if LANES == 16
#define SWAP_8 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7
#define SWAP_4 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11
#define SWAP_2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#define SWAP_1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#else
#define SWAP_4 4, 5, 6, 7, 0, 1, 2, 3
#define SWAP_2 2, 3, 0, 1, 6, 7, 4, 5
#define SWAP_1 1, 0, 3, 2, 5, 4, 7, 6
#endif

/* Lane-wise max (a's lane where b's is not larger, NaN included). */
static inline vf vmax(vf a, vf b) {
  const vi m = b > a;
  return (vf)(((vi)b & m) | ((vi)a & ~m));
}

/* The largest of a vector's lanes and their sum, each by a butterfly of shuffles: a
 * block's max and sum of exponentials in 4 steps instead of a chain of 15 (64 x 4k bf16:
 * 43 -> 41 ms, 29 -> 27 with cached pages). */
static inline float max_lanes(vf x) {
#if LANES == 16
  x = vmax(x, SHUFFLE(x, x, SWAP_8));
#endif
  x = vmax(x, SHUFFLE(x, x, SWAP_4));
  x = vmax(x, SHUFFLE(x, x, SWAP_2));
  x = vmax(x, SHUFFLE(x, x, SWAP_1));
  return x[0];
}

static inline float add_lanes(vf x) {
#if LANES == 16
  x += SHUFFLE(x, x, SWAP_8);
#endif
  x += SHUFFLE(x, x, SWAP_4);
  x += SHUFFLE(x, x, SWAP_2);
  x += SHUFFLE(x, x, SWAP_1);
  return x[0];
}

/* exp(x) lane by lane for x <= 0 (the softmax's exponents): within 1 ulp of exp on
 * [-87, 0] (every float there checked, built with this file's flags), 0 below and for
 * -inf; NaN stays NaN. 2^n e^y with n = round(x / ln 2) (adding and removing 1.5 * 2^23
 * rounds to nearest), y = x - n ln 2 in two parts (Cody-Waite), e^y by its Taylor series
 * to degree 7 (|y| <= 0.35: the next term is below 6e-9). */
static inline vf exp_nonpositive(vf x) {
  const vi small = x < -87.0f;
  x = (vf)(((vi)x & ~small) | ((vi)((vf){} - 87.0f) & small));
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf y = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  vf p = y * (1.0f / 5040.0f) + 1.0f / 720.0f;
  p = p * y + 1.0f / 120.0f;
  p = p * y + 1.0f / 24.0f;
  p = p * y + 1.0f / 6.0f;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const vf scale = (vf)((vu)(__builtin_convertvector(n, vi) + 127) << 23); /* 2^n */
  return (vf)((vi)(p * scale) & ~small);
}

#endif
