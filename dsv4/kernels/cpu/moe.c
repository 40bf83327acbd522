/* The MoE of a decode step's tokens (up to cpu_moe.KERNEL_TOKENS) on AVX512-BF16
 * (dsv4/kernels/cpu_moe.py), for a bf16 model: every routed pick and every token's shared expert
 * read their weights where they lie, as dot
 * products of bf16 pairs summed in fp32 (vdpbf16ps: exact products, the sums of fp32 arithmetic in
 * another order), rounded into bf16 where the grouped matmuls round (dsv4.model.moe.grouped): the
 * gate and up projections, the SwiGLU's silu and product, each expert's down projection; the picks'
 * weighted sum and the shared expert's add in fp32.
 *
 * Two passes over every thread of torch's OpenMP team (the library shares torch's libgomp: see
 * attention.c): the gate/up rows of every expert (and of the shared expert), each row against all of
 * the expert's picks, then every output row against all the picks. Every weight is read once, at the
 * memory's pace (which the compiled torch code of the same sums, a fused loop with the expert's rows
 * indexed, did not reach), and BLOCK rows at a time share each load of it. */

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

enum { BLOCK = 8, ROWS_A_CHUNK = 16 };

/* out[j] = sum over n bf16 pairs rows[j][i] * w[i] in fp32 for j < N (n even), w read once for all:
 * N independent sums (a constant where it is inlined, so that they stay in registers). */
static inline __attribute__((always_inline)) void dots_n(const uint16_t *w, const uint16_t *const *rows, const int N,
                                                         int64_t n, float *out) {
  __m512 acc[BLOCK];
  for (int j = 0; j < N; j++) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 32) {
    const __mmask32 m = n - i >= 32 ? 0xffffffffu : (__mmask32)((1u << (n - i)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i);
    for (int j = 0; j < N; j++) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_maskz_loadu_epi16(m, rows[j] + i), wv);
  }
  for (int j = 0; j < N; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

/* dots_n over count <= BLOCK rows: the latency of one vdpbf16ps is several of its issue slots, so the
 * more sums in flight the better */
static inline void dots_bf16(const uint16_t *w, const uint16_t *const *rows, int count, int64_t n, float *out) {
  int j = 0;
  if (count == BLOCK) dots_n(w, rows, BLOCK, n, out), j = BLOCK;
  if (count - j >= 4) dots_n(w, rows + j, 4, n, out + j), j += 4;
  if (count - j >= 2) dots_n(w, rows + j, 2, n, out + j), j += 2;
  if (count - j >= 1) dots_n(w, rows + j, 1, n, out + j);
}

/* A pick's expert: the group its row falls in (ends: where each group's padded rows end); -1 for a
 * pick that is not this rank's. */
static inline int64_t expert_of(int64_t place, const int32_t *ends, int64_t experts, uint8_t keep) {
  if (!keep) return -1;
  for (int64_t g = 0; g < experts; g++)
    if (place < ends[g]) return g;
  return -1;
}

/* Hidden units: 0..picks-1 the picks', then each token's shared expert's. Each expert's weight rows
 * are read once for all of its picks (`dispatch` sorts them by expert, this rank's first). */
int moe_few(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
            const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
            const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads) {
  const int64_t n_tok = p[M_TOKENS], n_pick = p[M_PICKS], n_exp = p[M_EXPERTS], hidden_n = p[M_HIDDEN], inter = p[M_INTER], shared = p[M_SHARED];
  const int64_t width = inter > shared ? inter : shared, units = n_pick + (shared ? n_tok : 0);
  const int64_t sources = n_exp + (shared ? 1 : 0); /* the experts, then the shared expert */
  const int64_t chunks = (width + ROWS_A_CHUNK - 1) / ROWS_A_CHUNK;
  int64_t *first = malloc(sizeof(int64_t) * (2 * n_exp + 1)), *last = first ? first + n_exp : NULL;
  uint16_t *hidden = malloc(sizeof(uint16_t) * (units ? units : 1) * width);
  if (!first || !hidden) {
    free(first);
    free(hidden);
    return 1;
  }
  for (int64_t g = 0; g < n_exp; g++) first[g] = last[g] = 0;
  for (int64_t k = n_pick - 1; k >= 0; k--) { /* each expert's picks: one run of the sorted picks */
    const int64_t g = expert_of(places[k], ends, n_exp, keep[k]);
    if (g < 0) continue;
    if (last[g] == 0) last[g] = k + 1;
    first[g] = k;
  }
#pragma omp parallel num_threads(threads)
  {
    /* gate and up rows of each hidden unit: h = bf16(bf16(silu(min(gate, limit))) * clamp(up)); an
     * expert's rows in chunks, taken as threads come free (the experts' picks differ in number) */
#pragma omp for schedule(dynamic, 1)
    for (int64_t c = 0; c < chunks * sources; c++) {
      const int64_t source = c / chunks, is_shared = source == n_exp;
      const int64_t width_u = is_shared ? shared : inter;
      const uint16_t *w = is_shared ? shared_w13 : w13 + source * 2 * inter * hidden_n;
      const int64_t begin = is_shared ? 0 : first[source], end = is_shared ? n_tok : last[source];
      for (int64_t i = c % chunks * ROWS_A_CHUNK; i < width_u && i < (c % chunks + 1) * ROWS_A_CHUNK; i++)
        for (int64_t k = begin; k < end; k += BLOCK) {
          const int count = end - k < BLOCK ? (int)(end - k) : BLOCK;
          const uint16_t *rows[BLOCK];
          float gates[BLOCK], ups[BLOCK];
          for (int j = 0; j < count; j++) rows[j] = x + (is_shared ? k + j : tokens[k + j]) * hidden_n;
          dots_bf16(w + i * hidden_n, rows, count, hidden_n, gates);
          dots_bf16(w + (width_u + i) * hidden_n, rows, count, hidden_n, ups);
          for (int j = 0; j < count; j++) {
            const float gate = fminf(from_bf16(to_bf16(gates[j])), limit);
            const float up = fminf(fmaxf(from_bf16(to_bf16(ups[j])), -limit), limit);
            const float silu = from_bf16(to_bf16(gate / (1.0f + expf(-gate))));
            hidden[((is_shared ? n_pick : 0) + k + j) * width + i] = to_bf16(silu * up);
          }
        }
    }
    /* (the implied barrier: every hidden unit is set) each output row o of every token: the picks in
     * expert order, as the grouped path adds them, then the shared expert */
#pragma omp for schedule(static)
    for (int64_t o = 0; o < hidden_n; o++) {
      for (int64_t t = 0; t < n_tok; t++) out[t * hidden_n + o] = 0.0f;
      for (int64_t g = 0; g < n_exp; g++)
        for (int64_t k = first[g]; k < last[g]; k += BLOCK) {
          const int count = last[g] - k < BLOCK ? (int)(last[g] - k) : BLOCK;
          const uint16_t *rows[BLOCK];
          float downs[BLOCK];
          for (int j = 0; j < count; j++) rows[j] = hidden + (k + j) * width;
          dots_bf16(w2 + (g * hidden_n + o) * inter, rows, count, inter, downs);
          for (int j = 0; j < count; j++) out[tokens[k + j] * hidden_n + o] += from_bf16(to_bf16(downs[j])) * scale[k + j];
        }
      for (int64_t t = 0; shared && t < n_tok; t += BLOCK) {
        const int count = n_tok - t < BLOCK ? (int)(n_tok - t) : BLOCK;
        const uint16_t *rows[BLOCK];
        float downs[BLOCK];
        for (int j = 0; j < count; j++) rows[j] = hidden + (n_pick + t + j) * width;
        dots_bf16(shared_w2 + o * shared, rows, count, shared, downs);
        for (int j = 0; j < count; j++) out[(t + j) * hidden_n + o] += from_bf16(to_bf16(downs[j]));
      }
    }
  }
  free(first);
  free(hidden);
  return 0;
}
