/* The MoE of a decode step's few tokens on AVX512-BF16 (dsv4/kernels/cpu_moe.py), for a bf16 model:
 * every routed pick and every token's shared expert read their weights where they lie, as dot
 * products of bf16 pairs summed in fp32 (vdpbf16ps: exact products, the sums of fp32 arithmetic in
 * another order), rounded into bf16 where the grouped matmuls round (dsv4.model.moe.grouped): the
 * gate and up projections, the SwiGLU's silu and product, each expert's down projection; the picks'
 * weighted sum and the shared expert's add in fp32.
 *
 * Two passes over every thread of torch's OpenMP team (the library shares torch's libgomp: see
 * attention.c): the gate/up rows of every (pick, hidden unit) split evenly, then every (token, output
 * row); the weights are read once, at the memory's pace, which the compiled torch code of the same
 * sums (a fused loop with the expert's rows indexed) did not reach. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* p[]: tokens, picks, local experts, hidden size, an expert's width, the shared expert's (0: none) */
enum { M_TOKENS, M_PICKS, M_EXPERTS, M_HIDDEN, M_INTER, M_SHARED, M_COUNT };

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

/* sum over n bf16 pairs a[i] * b[i] in fp32 (n even) */
static inline float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + i), (__m512bh)_mm512_loadu_si512(b + i));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + i + 32), (__m512bh)_mm512_loadu_si512(b + i + 32));
  }
  for (; i < n; i += 32) {
    __mmask32 m = n - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (n - i)) - 1);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(m, a + i),
                            (__m512bh)_mm512_maskz_loadu_epi16(m, b + i));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* A pick's expert: the group its row falls in (ends: where each group's padded rows end); -1 for a
 * pick that is not this rank's. */
static inline int64_t expert_of(int64_t place, const int32_t *ends, int64_t experts, uint8_t keep) {
  if (!keep) return -1;
  for (int64_t g = 0; g < experts; g++)
    if (place < ends[g]) return g;
  return -1;
}

/* Hidden units: 0..picks-1 the picks', then each token's shared expert's. */
int moe_few(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
            const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
            const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads) {
  const int64_t n_tok = p[M_TOKENS], n_pick = p[M_PICKS], n_exp = p[M_EXPERTS], hidden_n = p[M_HIDDEN], inter = p[M_INTER], shared = p[M_SHARED];
  const int64_t width = inter > shared ? inter : shared, shared_units = shared ? n_tok : 0, units = n_pick + shared_units;
  int64_t *expert = malloc(sizeof(int64_t) * (n_pick ? n_pick : 1));
  uint16_t *hidden = malloc(sizeof(uint16_t) * (units ? units : 1) * width);
  if (!expert || !hidden) {
    free(expert);
    free(hidden);
    return 1;
  }
  for (int64_t k = 0; k < n_pick; k++) expert[k] = expert_of(places[k], ends, n_exp, keep[k]);
  const int64_t routed_rows = n_pick * inter, all_rows = routed_rows + shared_units * shared;
#pragma omp parallel num_threads(threads)
  {
    /* gate and up rows of one hidden unit each: h = bf16(bf16(silu(min(gate, limit))) * clamp(up)) */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < all_rows; r++) {
      int64_t unit, i, width_u, token;
      const uint16_t *w;
      if (r < routed_rows) {
        unit = r / inter, i = r % inter, width_u = inter, token = tokens[unit];
        if (expert[unit] < 0) continue;
        w = w13 + expert[unit] * 2 * inter * hidden_n;
      } else {
        int64_t s = r - routed_rows;
        unit = n_pick + s / shared, i = s % shared, width_u = shared, token = s / shared;
        w = shared_w13;
      }
      const uint16_t *row = x + token * hidden_n;
      float gate = from_bf16(to_bf16(dot_bf16(row, w + i * hidden_n, hidden_n)));
      float up = from_bf16(to_bf16(dot_bf16(row, w + (width_u + i) * hidden_n, hidden_n)));
      gate = fminf(gate, limit);
      up = fminf(fmaxf(up, -limit), limit);
      float silu = from_bf16(to_bf16(gate / (1.0f + expf(-gate))));
      hidden[unit * width + i] = to_bf16(silu * up);
    }
    /* (the implied barrier: every hidden unit is set) each output row of each token */
#pragma omp for schedule(static)
    for (int64_t r = 0; r < n_tok * hidden_n; r++) {
      int64_t t = r / hidden_n, o = r % hidden_n;
      float sum = 0.0f;
      for (int64_t k = 0; k < n_pick; k++) {  /* the picks in expert order, as the grouped path adds them */
        if (tokens[k] != t || expert[k] < 0) continue;
        float down = from_bf16(to_bf16(dot_bf16(hidden + k * width, w2 + (expert[k] * hidden_n + o) * inter, inter)));
        sum += down * scale[k];
      }
      if (shared) sum += from_bf16(to_bf16(dot_bf16(hidden + (n_pick + t) * width, shared_w2 + o * shared, shared)));
      out[r] = sum;
    }
  }
  free(expert);
  free(hidden);
  return 0;
}
