/* Dot products of bf16 weight rows with a few activation rows (bf16 or fp32), the rounding of a
 * model's dtype, rows of either dtype read and written as fp32 (vectors, or one element), and the MoE
 * kernels' pick lookup: what the kernels of moe.c, moe_amx.c, project.c, mhc.c, route.c and feed.c share. */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* A pick's expert: the group its row falls in (ends: where each group's padded rows end); -1 for a
 * pick that is not this rank's. */
static inline int64_t expert_of(int64_t place, const int32_t *ends, int64_t experts, uint8_t keep) {
  if (!keep) return -1;
  for (int64_t g = 0; g < experts; g++)
    if (place < ends[g]) return g;
  return -1;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch rounds */
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  /* NaN stays NaN */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float f;
  __builtin_memcpy(&f, &bits, 4);
  return f;
}

/* base[i], fp32 (else bf16 bits), as fp32 */
static inline float load_at(const void *base, int64_t i, int fp32) {
  return fp32 ? ((const float *)base)[i] : from_bf16(((const uint16_t *)base)[i]);
}

enum { BLOCK = 8 }; /* the most rows that share each load of a weight */
enum { DOT_ROWS = VECTOR_REGISTERS >= 32 ? BLOCK : 4 }; /* the most rows whose sums dots_n keeps at once */
/* How far ahead of its loads a stream of weight rows asks for each of their lines, non-temporal: the
 * hardware's prefetchers stop at every 4 KB page, this does not (`small`'s decode projections at one token,
 * 12 layers in a loop: 416..448 us a layer against 534..564), and the weights, read once a step, do not
 * evict from the caches what the step reads again (its activations, the KV rows, the Python around the
 * calls). The projections of a decode step, weights cycling through more than the L3, on a machine whose
 * memory torch.sum reads at ~74 GB/s: 53 GB/s with every other line asked for 4 KB ahead into L2, 70..80
 * with every line 16 KB ahead non-temporal (at ~44 GB/s: 38 against 44..48). A whole c=1 decode step of
 * `small` (fp32, ~80 streams of 0.1..2 MB, each of whose first PREFETCH_BYTES go unasked), the distance
 * alternated by blocks of 4 steps in one process, paired medians against 16 KB: 8 KB -24..-60 us a step
 * (1.85..2.2 ms), 12 KB -25, 4 KB +66, 32 KB +8; 6 and 10 KB within noise of 8. */
enum { PREFETCH_BYTES = 8192 };

/* The first n of 32 words' mask */
static inline mmask32 first_words(int64_t n) { return n >= 32 ? 0xffffffffu : (mmask32)((1u << n) - 1); }

/* out[j] = sum over n bf16 pairs rows[j][i] * w[i] in fp32 for j < N (n even), w read once for all:
 * N independent sums (a constant where it is inlined, so that they stay in registers). */
static inline __attribute__((always_inline)) void dots_n(const uint16_t *w, const uint16_t *const *rows, const int N,
                                                         int64_t n, float *out) {
  m512 acc[BLOCK];
  for (int j = 0; j < N; j++) acc[j] = mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 32) {
    const mmask32 m = first_words(n - i);
    _mm_prefetch((const char *)(w + i) + PREFETCH_BYTES, _MM_HINT_NTA);
    const m512i wv = mm512_maskz_loadu_epi16(m, w + i);
    for (int j = 0; j < N; j++) acc[j] = mm512_dpbf16_ps(acc[j], mm512_maskz_loadu_epi16(m, rows[j] + i), wv);
  }
  for (int j = 0; j < N; j++) out[j] = mm512_reduce_add_ps(acc[j]);
}

/* An fp32 row as dots_n_fp32 and dot_1_fp32 read it: in `product order`. They widen 32 bf16 weights at
 * a time into two vectors of fp32 by interleaving them with zeros (an instruction each), which takes the
 * first 4 words of each 128-bit lane into the first vector and the last 4 into the second; the row's
 * elements lie in the same order, each block of 32 as [0..3 8..11 16..19 24..27 | 4..7 12..15 20..23
 * 28..31], zeros from n on to the block's end. A widening and a shift for every 16 weights (the plain
 * order's) made a one-token product bound by that work on AVX2, not by the memory: 9.6 against 20.9
 * GB/s from the cache on one Zen 1 core, 13.1 against 18.2 from memory on two. */
enum { ORDER_BLOCK = 32 };

/* The floats of a row of n in product order */
static inline int64_t ordered_length(int64_t n) { return round_up(n, ORDER_BLOCK); }

/* Where element i of a row lies in product order */
static inline int64_t ordered_index(int64_t i) {
  const int64_t j = i % ORDER_BLOCK;
  return i - j + (j & 4 ? 16 : 0) + j / 8 * 4 + j % 4;
}

/* row[0..n) -> out[0..ordered_length(n)) in product order */
static inline void product_order(const float *row, int64_t n, float *out) {
  for (int64_t i = 0; i < n; i += ORDER_BLOCK) {
    const m512 a = mm512_maskz_loadu_ps(first_lanes(n - i), row + i);
    const m512 b = mm512_maskz_loadu_ps(n - i > 16 ? first_lanes(n - i - 16) : 0, row + i + 16);
    mm512_storeu_ps(out + i, mm512_shuffle_f32x4(a, b, 0x88));      /* 128-bit lanes 0, 2 of a, then of b */
    mm512_storeu_ps(out + i + 16, mm512_shuffle_f32x4(a, b, 0xdd)); /* lanes 1, 3 */
  }
}

/* rows [count, n] copied into product order, ordered_length(n) floats a row (malloc'd: the caller frees
 * it); NULL where the memory could not be had */
static inline float *ordered_copy(const float *rows, int64_t count, int64_t n) {
  float *out = malloc(sizeof(float) * (size_t)(count * ordered_length(n)));
  for (int64_t r = 0; out && r < count; r++) product_order(rows + r * n, n, out + r * ordered_length(n));
  return out;
}

/* The weights w[i..i+32) (m's of them, the rest 0) widened exactly into fp32, in product order */
static inline __attribute__((always_inline)) void widen_ordered(const uint16_t *w, int64_t i, mmask32 m,
                                                                 m512 *first, m512 *second) {
  const m512i words = mm512_maskz_loadu_epi16(m, w + i), zero = mm512_setzero_si512();
  *first = mm512_castsi512_ps(mm512_unpacklo_epi16(zero, words));
  *second = mm512_castsi512_ps(mm512_unpackhi_epi16(zero, words));
}

/* dots_n with fp32 rows in product order: each 32 weights widened once for all N rows' FMAs */
static inline __attribute__((always_inline)) void dots_n_fp32(const uint16_t *w, const float *const *rows, const int N,
                                                              int64_t n, float *out) {
  m512 acc[BLOCK];
  for (int j = 0; j < N; j++) acc[j] = mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += ORDER_BLOCK) {
    _mm_prefetch((const char *)(w + i) + PREFETCH_BYTES, _MM_HINT_NTA);
    m512 first, second;
    widen_ordered(w, i, first_words(n - i), &first, &second);
    for (int j = 0; j < N; j++) {
      acc[j] = mm512_fmadd_ps(first, mm512_loadu_ps(rows[j] + i), acc[j]);
      acc[j] = mm512_fmadd_ps(second, mm512_loadu_ps(rows[j] + i + 16), acc[j]);
    }
  }
  for (int j = 0; j < N; j++) out[j] = mm512_reduce_add_ps(acc[j]);
}

/* dots_n and dots_n_fp32 of one row, in four sums of every fourth vector: one sum alone waits out the
 * latency of each FMA (a one-token decode step's products were bound by it, not by the memory) */
static inline float dot_1(const uint16_t *w, const uint16_t *row, int64_t n) {
  m512 acc[4] = {mm512_setzero_ps(), mm512_setzero_ps(), mm512_setzero_ps(), mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    for (int c = 0; c < 4; c++) _mm_prefetch((const char *)(w + i + 32 * c) + PREFETCH_BYTES, _MM_HINT_NTA);
    for (int c = 0; c < 4; c++)
      acc[c] = mm512_dpbf16_ps(acc[c], mm512_loadu_epi16(row + i + 32 * c),
                                mm512_loadu_epi16(w + i + 32 * c));
  }
  for (; i < n; i += 32) {
    const mmask32 m = first_words(n - i);
    acc[0] = mm512_dpbf16_ps(acc[0], mm512_maskz_loadu_epi16(m, row + i),
                              mm512_maskz_loadu_epi16(m, w + i));
  }
  return mm512_reduce_add_ps(mm512_add_ps(mm512_add_ps(acc[0], acc[1]), mm512_add_ps(acc[2], acc[3])));
}

static inline float dot_1_fp32(const uint16_t *w, const float *row, int64_t n) {
  m512 acc[4] = {mm512_setzero_ps(), mm512_setzero_ps(), mm512_setzero_ps(), mm512_setzero_ps()};
  int64_t i = 0;
  for (; i + 2 * ORDER_BLOCK <= n; i += 2 * ORDER_BLOCK) {
    _mm_prefetch((const char *)(w + i) + PREFETCH_BYTES, _MM_HINT_NTA);
    _mm_prefetch((const char *)(w + i + ORDER_BLOCK) + PREFETCH_BYTES, _MM_HINT_NTA);
    for (int c = 0; c < 2; c++) {
      m512 first, second;
      widen_ordered(w, i + ORDER_BLOCK * c, 0xffffffffu, &first, &second);
      acc[2 * c] = mm512_fmadd_ps(first, mm512_loadu_ps(row + i + ORDER_BLOCK * c), acc[2 * c]);
      acc[2 * c + 1] = mm512_fmadd_ps(second, mm512_loadu_ps(row + i + ORDER_BLOCK * c + 16), acc[2 * c + 1]);
    }
  }
  for (; i < n; i += ORDER_BLOCK) {
    m512 first, second;
    widen_ordered(w, i, first_words(n - i), &first, &second);
    acc[0] = mm512_fmadd_ps(first, mm512_loadu_ps(row + i), acc[0]);
    acc[1] = mm512_fmadd_ps(second, mm512_loadu_ps(row + i + 16), acc[1]);
  }
  return mm512_reduce_add_ps(mm512_add_ps(mm512_add_ps(acc[0], acc[1]), mm512_add_ps(acc[2], acc[3])));
}

/* dots_n (or dots_n_fp32, `fp32`: the rows in product order) over count <= BLOCK rows, in runs of a
 * constant number of them (so that their sums stay in registers): the latency of one vdpbf16ps or FMA is
 * several of its issue slots, so the more sums in flight the better */
static inline void dots(const uint16_t *w, const void *const *rows, int count, int64_t n, int fp32, float *out) {
  if (count == 1) {
    out[0] = fp32 ? dot_1_fp32(w, (const float *)rows[0], n) : dot_1(w, (const uint16_t *)rows[0], n);
    return;
  }
#define RUN(N) (fp32 ? dots_n_fp32(w, (const float *const *)rows + j, N, n, out + j) \
                     : dots_n(w, (const uint16_t *const *)rows + j, N, n, out + j))
  for (int j = 0, run; j < count; j += run) {
    run = count - j == DOT_ROWS ? DOT_ROWS : count - j >= 4 ? 4 : count - j >= 2 ? 2 : 1;
    if (run == DOT_ROWS) RUN(DOT_ROWS);
    else if (run == 4) RUN(4);
    else if (run == 2) RUN(2);
    else RUN(1);
  }
#undef RUN
}

/* v as the model's dtype holds it: rounded into bf16, or fp32 as it is */
static inline float as_model(float v, int fp32) { return fp32 ? v : from_bf16(to_bf16(v)); }

/* m's lanes of base[i..i+16), bf16 (else fp32) values, as fp32 */
static inline m512 load_row(const void *base, int64_t i, int bf16, mmask16 m) {
  if (bf16)
    return mm512_castsi512_ps(
        mm512_slli_epi32(mm512_cvtepu16_epi32(mm256_maskz_loadu_epi16(m, (const uint16_t *)base + i)), 16));
  return mm512_maskz_loadu_ps(m, (const float *)base + i);
}

/* v rounded into the model's dtype (to nearest even, as torch rounds), stored, and returned as read back */
static inline m512 store_row(void *base, int64_t i, int bf16, mmask16 m, m512 v) {
  if (!bf16) {
    mm512_mask_storeu_ps((float *)base + i, m, v);
    return v;
  }
  const __m256i h = mm512_cvtneps_pbh(v);
  mm256_mask_storeu_epi16((uint16_t *)base + i, m, h);
  return mm512_castsi512_ps(mm512_slli_epi32(mm512_cvtepu16_epi32(h), 16));
}

/* v as the model's dtype holds it (bf16: rounded, else as it is) */
static inline m512 round_row(m512 v, int bf16) {
  return bf16 ? mm512_castsi512_ps(mm512_slli_epi32(mm512_cvtepu16_epi32(mm512_cvtneps_pbh(v)), 16)) : v;
}
