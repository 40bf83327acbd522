/* decode_attention: the CPU path's attention of decode tokens, AVX512-BF16 or AVX2 (simd.h)
 * (dsv4/kernels/cpu_attention.py; prefill chunks' attention: band_amx.c, band_dots.c). Where the
 * operands hold bf16 values, every product q[d] * k[d] is exact in fp32: those dot products run as
 * vdpbf16ps (pairs of bf16 products summed into fp32 lanes), the same sums as fp32 arithmetic in
 * another order, at twice the fp32 rate of the FMA units on AVX512-BF16. Softmaxes and value products are fp32.
 *
 * The whole attention of decode tokens, one query each, over their rings and
 * compressed rows, read where they lie in the pools; bf16 or fp32 (then the logits are FMAs): the 16
 * heads of a query interleaved in one register per pair of dims (per dim in fp32), each key's pairs
 * broadcast against them (a key's logits for 16 heads in one register, no horizontal sums), the
 * softmax over the keys a token may see (the others are never read: rows that do not exist may hold
 * anything), and the value products in fp32. Each thread takes whole tokens; with fewer tokens than
 * threads, the team shares each token instead (key ranges, then every n-th chunk of dims).
 *
 * The work is split over OpenMP threads: loaded into a process that runs torch, the library shares
 * torch's libgomp (the same soname) and so its thread team; threads of its own would compete for the
 * cores with torch's workers, which spin a while after each parallel op (a call took twice as long). */

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

/* p[]: the shapes, whether the tensors are fp32 (else bf16), then the pools' strides in bytes (q and out
 * are contiguous [B][H][D]). */
enum { D_B, D_H, D_D, D_W, D_C, D_FP32, D_SLOT, D_RING_ROW, D_PAGE, D_PAGE_ROW, D_COUNT };

#define INLINE static inline __attribute__((always_inline))

/* 16 elements of a row from `at` (first `n` of them) as fp32. */
INLINE m512 load16(const void *at, int64_t n, const int fp32) {
  const mmask16 m = first_lanes(n > 0 ? n : 0);
  if (fp32) return mm512_maskz_loadu_ps(m, at);
  return mm512_castsi512_ps(mm512_slli_epi32(mm512_cvtepu16_epi32(mm256_maskz_loadu_epi16(m, at)), 16));
}

/* Heads h0 .. h0 + 16 of q [H][D] interleaved: packed[step] holds that word of each head (a pair of
 * bf16 dims, or one fp32 dim); `steps` words a row. */
INLINE void pack_heads(const void *q, int64_t h0, int64_t heads, int64_t D, int64_t steps, uint32_t *packed,
                       const int fp32) {
  const m512i at_head = mm512_mullo_epi32(mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             mm512_set1_epi32((int)steps));
  const uint32_t *words = (const uint32_t *)((const char *)q + h0 * D * (fp32 ? 4 : 2));
  for (int64_t d = 0; d < steps; d++)
    mm512_store_si512((void *)(packed + d * 16), mm512_mask_i32gather_epi32(mm512_setzero_si512(), first_lanes(heads),
                                                                               at_head, (const void *)(words + d), 4));
}

INLINE m512 word_product(m512 acc, m512i heads_word, m512i word, const int fp32) {
  return fp32 ? mm512_fmadd_ps(mm512_castsi512_ps(heads_word), mm512_castsi512_ps(word), acc)
              : mm512_dpbf16_ps(acc, heads_word, word);
}

/* Keys whose logits key_logits sums at once (a sum each, the heads' word and a key's word besides in
 * registers) and, in weighted_values, the vectors of 16 dims of a chunk (each of 4 heads' sums) */
enum { LOGIT_KEYS = VECTOR_REGISTERS >= 32 ? 8 : 4, VALUE_VECTORS = VECTOR_REGISTERS >= 32 ? 4 : 1 };
enum { VALUE_AHEAD = 8 }; /* how many keys ahead weighted_values asks for a key's line */

/* logits[k] (the 16 heads' scaled logits, one register) for the keys first .. last: LOGIT_KEYS keys at a
 * time, each key's words broadcast against the heads'. */
INLINE void key_logits(const uint32_t *packed, const void **seen, int64_t first, int64_t last, int64_t steps,
                       float scale, float *logits, const int fp32) {
  int64_t k = first;
  for (; k + LOGIT_KEYS <= last; k += LOGIT_KEYS) {
    m512 acc[LOGIT_KEYS];
    const uint32_t *key[LOGIT_KEYS];
    for (int i = 0; i < LOGIT_KEYS; i++) acc[i] = mm512_setzero_ps(), key[i] = (const uint32_t *)seen[k + i];
    /* the next keys' rows asked for a line at a time as these are read (each a different page) */
    const char *next[LOGIT_KEYS];
    for (int i = 0; i < LOGIT_KEYS; i++)
      next[i] = k + LOGIT_KEYS + i < last ? (const char *)seen[k + LOGIT_KEYS + i] : (const char *)key[i];
    for (int64_t d = 0; d < steps; d++) {
      if (d % 16 == 0)
        for (int i = 0; i < LOGIT_KEYS; i++) _mm_prefetch(next[i] + d * 4, _MM_HINT_T0);
      const m512i heads_word = mm512_load_si512((const void *)(packed + d * 16));
#pragma GCC unroll 8
      for (int i = 0; i < LOGIT_KEYS; i++)
        acc[i] = word_product(acc[i], heads_word, mm512_set1_epi32((int)key[i][d]), fp32);
    }
    for (int i = 0; i < LOGIT_KEYS; i++)
      mm512_store_ps(logits + (k + i) * 16, mm512_mul_ps(acc[i], mm512_set1_ps(scale)));
  }
  for (; k < last; k++) {
    m512 acc = mm512_setzero_ps();
    const uint32_t *key = (const uint32_t *)seen[k];
    for (int64_t d = 0; d < steps; d++)
      acc = word_product(acc, mm512_load_si512((const void *)(packed + d * 16)), mm512_set1_epi32((int)key[d]), fp32);
    mm512_store_ps(logits + k * 16, mm512_mul_ps(acc, mm512_set1_ps(scale)));
  }
}

static inline m512 logits_peak(const float *logits, int64_t count, m512 peak) {
  for (int64_t k = 0; k < count; k++) peak = mm512_max_ps(peak, mm512_load_ps(logits + k * 16));
  return peak;
}

/* The keys first .. last's logits replaced by their weights exp(logit - peak); returns their sum. */
static inline m512 key_weights(float *logits, int64_t first, int64_t last, m512 peak) {
  m512 sum = mm512_setzero_ps();
  for (int64_t k = first; k < last; k++) {
    const m512 weight = exp_nonpositive(mm512_sub_ps(mm512_load_ps(logits + k * 16), peak));
    mm512_store_ps(logits + k * 16, weight);
    sum = mm512_add_ps(sum, weight);
  }
  return sum;
}

/* out's rows of heads h0 .. h0 + heads, in the chunks of CHUNK dims first_chunk, first_chunk + stride, ...:
 * the weighted sum over the keys (weights[k]: one register of the 16 heads') times inverse[head], in
 * fp32, 4 heads x CHUNK dims in registers. */
INLINE void weighted_values(const void **seen, int64_t count, const float *weights, const float *inverse, void *out,
                            int64_t h0, int64_t heads, int64_t D, int64_t first_chunk, int64_t stride, const int fp32) {
  enum { CHUNK = 16 * VALUE_VECTORS };
  const int64_t size = fp32 ? 4 : 2;
  for (int64_t h = 0; h < heads; h += 4) {
    const int64_t hs = heads - h < 4 ? heads - h : 4;
    for (int64_t d0 = first_chunk * CHUNK; d0 < D; d0 += stride * CHUNK) {
      m512 acc[4][VALUE_VECTORS];
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < VALUE_VECTORS; j++) acc[i][j] = mm512_setzero_ps();
      const int64_t left = D - d0;
      for (int64_t k = 0; k < count; k++) {
        const char *v = (const char *)seen[k] + d0 * size;
        /* (a line of each key a pass: rows scattered over pages, which the hardware's prefetchers miss) */
        if (k + VALUE_AHEAD < count) _mm_prefetch((const char *)seen[k + VALUE_AHEAD] + d0 * size, _MM_HINT_T0);
        m512 values[VALUE_VECTORS];
        for (int j = 0; j < VALUE_VECTORS; j++) values[j] = load16(v + 16 * j * size, left - 16 * j, fp32);
        const float *w = weights + k * 16 + h;
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
          const m512 wi = mm512_set1_ps(w[i]);
          for (int j = 0; j < VALUE_VECTORS; j++) acc[i][j] = mm512_fmadd_ps(wi, values[j], acc[i][j]);
        }
      }
      /* (constant bounds, the conditions inside: acc stays in registers, not spilled at every key) */
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
        for (int j = 0; j < VALUE_VECTORS; j++) {
          if (i >= hs || 16 * j >= left) continue;
          const m512 result = mm512_mul_ps(acc[i][j], mm512_set1_ps(inverse[h + i]));
          const int64_t at = (h0 + h + i) * D + d0 + 16 * j;
          if (fp32) mm512_mask_storeu_ps((float *)out + at, first_lanes(left - 16 * j), result);
          else mm256_mask_storeu_epi16((uint16_t *)out + at, first_lanes(left - 16 * j), mm512_cvtneps_pbh(result));
        }
    }
  }
}

/* One token: q [H][D] over the keys `seen[0 .. count)` (pointers to rows of D) -> out [H][D], all bf16
 * bits or (`fp32`) fp32, with or without the team: alone (team_size 1), or on every thread of the
 * team at once (each computes a share of the keys' logits and weights, then every team_size-th chunk
 * of the values; `logits` and `partial` (16 floats a thread) shared, a barrier between the phases).
 * `logits` (count * 16) holds one register of 16 heads' logits, then weights, per key; `packed`
 * (D * 16 words) a head group's query. Inlined into one copy per element type. */
INLINE void decode_token(const void *q, const void **seen, int64_t count, const float *sink, void *out,
                         const int64_t *p, float scale, float *logits, uint32_t *packed, float *partial, int team_size,
                         const int fp32) {
  const int64_t H = p[D_H], D = p[D_D], steps = fp32 ? D : D / 2, t = team_size > 1 ? omp_get_thread_num() : 0;
  const int64_t first = count * t / team_size, last = count * (t + 1) / team_size;
  for (int64_t h0 = 0; h0 < H; h0 += 16) {
    const int64_t heads = H - h0 < 16 ? H - h0 : 16;
    pack_heads(q, h0, heads, D, steps, packed, fp32);
    key_logits(packed, seen, first, last, steps, scale, logits, fp32);
    if (team_size > 1) {
#pragma omp barrier
    }
    const m512 sinks = mm512_maskz_loadu_ps(first_lanes(heads), sink + h0);
    const m512 peak = logits_peak(logits, count, sinks);
    if (team_size > 1) {
#pragma omp barrier
    }
    mm512_storeu_ps(partial + t * 16, key_weights(logits, first, last, peak));
    if (team_size > 1) {
#pragma omp barrier
    }
    m512 denominator = exp_nonpositive(mm512_sub_ps(sinks, peak));
    for (int i = 0; i < team_size; i++) denominator = mm512_add_ps(denominator, mm512_loadu_ps(partial + i * 16));
    float inverse[16];
    mm512_storeu_ps(inverse, mm512_div_ps(mm512_set1_ps(1.0f), denominator));
    weighted_values(seen, count, logits, inverse, out, h0, heads, D, t, team_size, fp32);
    if (team_size > 1) { /* (the next head group rewrites the shared logits) */
#pragma omp barrier
    }
  }
}

static void decode_token_bf16(const void *q, const void **seen, int64_t count, const float *sink, void *out,
                              const int64_t *p, float scale, float *logits, uint32_t *packed, float *partial,
                              int team_size) {
  decode_token(q, seen, count, sink, out, p, scale, logits, packed, partial, team_size, 0);
}

static void decode_token_fp32(const void *q, const void **seen, int64_t count, const float *sink, void *out,
                              const int64_t *p, float scale, float *logits, uint32_t *packed, float *partial,
                              int team_size) {
  decode_token(q, seen, count, sink, out, p, scale, logits, packed, partial, team_size, 1);
}

/* Token b's keys: its ring rows r <= at[b], then its compressed rows that exist and that it attends to. */
static int64_t seen_rows(const void **seen, int64_t b, const uint8_t *window, const int64_t *slots, const int64_t *at,
                         const uint8_t *comp_pool, const int64_t *pages, const int64_t *page_rows,
                         const uint8_t *exists, const uint8_t *allowed, const int64_t *p) {
  int64_t count = 0;
  for (int64_t r = 0; r < p[D_W] && r <= at[b]; r++) seen[count++] = window + slots[b] * p[D_SLOT] + r * p[D_RING_ROW];
  for (int64_t c = b * p[D_C]; c < (b + 1) * p[D_C]; c++)
    if (exists[c] && allowed[c]) seen[count++] = comp_pool + pages[c] * p[D_PAGE] + page_rows[c] * p[D_PAGE_ROW];
  return count;
}

/* q [B][H][D], each token's ring in the window pool (slot slots[b]; position p at row p % W, rows
 * r <= at[b] seen) and its compressed rows in the compressed pool (row c at page pages[b][c], row
 * page_rows[b][c]; seen where exists and allowed [B][C]), the pools' rows of D like q (bf16 bits or
 * fp32); sink [H] fp32 -> out [B][H][D] like q. comp_pool NULL when C == 0. With at least as many
 * tokens as threads, each thread takes whole tokens; with fewer, the whole team takes each token in
 * turn. Returns 0, or -1 where scratch memory could not be had. */
int decode_attention(const void *q, const uint8_t *window, const int64_t *slots, const int64_t *at,
                     const float *sink, const uint8_t *comp_pool, const int64_t *pages, const int64_t *page_rows,
                     const uint8_t *exists, const uint8_t *allowed, void *out, const int64_t *p, float scale,
                     int threads) {
  const int64_t B = p[D_B], H = p[D_H], D = p[D_D], keys = p[D_W] + p[D_C], size = p[D_FP32] ? 4 : 2;
  void (*token)(const void *, const void **, int64_t, const float *, void *, const int64_t *, float, float *,
                uint32_t *, float *, int) = p[D_FP32] ? decode_token_fp32 : decode_token_bf16;
  if (threads < 1) threads = 1;
  /* Every thread's scratch, and the team's shared logits and partial sums, before the threads start:
   * a thread that lacked its own could not take part in the team's barriers. */
  const void **seen = malloc((size_t)(threads * keys) * sizeof *seen);
  float *logits = aligned_alloc(64, (size_t)(threads * (keys * 16 * 4 + 64)));
  uint32_t *packed = aligned_alloc(64, (size_t)(threads * D * 64));
  float *partial = aligned_alloc(64, (size_t)(threads * 64));
  if (!seen || !logits || !packed || !partial) {
    free(seen), free(logits), free(packed), free(partial);
    return -1;
  }
  const int team = B < threads;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const void **mine = seen + t * keys;
    uint32_t *my_packed = packed + t * D * 16;
    if (team) { /* every thread on each token: the logits buffer is thread 0's, shared */
      for (int64_t b = 0; b < B; b++) {
        const int64_t count = seen_rows(mine, b, window, slots, at, comp_pool, pages, page_rows, exists, allowed, p);
        token((const char *)q + b * H * D * size, mine, count, sink, (char *)out + b * H * D * size, p, scale, logits,
              my_packed, partial, (int)n);
      }
    } else {
      float *my_logits = logits + t * (keys * 16 + 16);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; b++) {
        const int64_t count = seen_rows(mine, b, window, slots, at, comp_pool, pages, page_rows, exists, allowed, p);
        token((const char *)q + b * H * D * size, mine, count, sink, (char *)out + b * H * D * size, p, scale,
              my_logits, my_packed, partial + t * 16, 1);
      }
    }
  }
  free(seen), free(logits), free(packed), free(partial);
  return 0;
}
