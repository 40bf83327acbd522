/* The MoE of a decode step's tokens (up to cpu_moe.KERNEL_TOKENS), AVX512-BF16 or AVX2
 * (simd.h; dsv4/kernels/cpu_moe.py), for a bf16 model, or an fp32 one whose weights hold bf16 values: every
 * routed pick and every token's shared expert read their (bf16) weights where they lie. In bf16, as dot
 * products of bf16 pairs summed in fp32 (vdpbf16ps: exact products, the sums of fp32 arithmetic in
 * another order), rounded into bf16 where the grouped matmuls round (dsv4.model.moe.grouped): the
 * gate and up projections, the SwiGLU's silu and product, each expert's down projection; the picks'
 * weighted sum and the shared expert's add in fp32. In fp32, the weights widened as they are read
 * (exactly) into fp32 FMAs with the fp32 activations: half the bytes of the fp32 weights, the same math.
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

#include "dots.h"
#include "moe.h"
#include "simd.h"

/* p[]: tokens, picks, local experts, hidden size, an expert's width, the shared expert's (0: none),
 * whether the activations are fp32 (else bf16) */
enum { M_TOKENS, M_PICKS, M_EXPERTS, M_HIDDEN, M_INTER, M_SHARED, M_FP32, M_COUNT };

/* Hidden units: 0..picks-1 the picks', then each token's shared expert's. Each expert's weight rows
 * are read once for all of its picks (`dispatch` sorts them by expert, this rank's first). x and the
 * hidden units are bf16, or fp32 (p[M_FP32]); the weights bf16. */
int moe_few(const void *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
            const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
            const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads) {
  const int64_t n_tok = p[M_TOKENS], n_pick = p[M_PICKS], n_exp = p[M_EXPERTS], hidden_n = p[M_HIDDEN], inter = p[M_INTER], shared = p[M_SHARED];
  const int fp32 = (int)p[M_FP32];
  const int64_t size = fp32 ? 4 : 2; /* bytes of an activation */
  /* fp32 rows (x's and the hidden units') are read in product order (dots.h), the hidden units written in it */
  const int64_t width = fp32 ? ordered_length(inter > shared ? inter : shared) : inter > shared ? inter : shared;
  const int64_t units = n_pick + (shared ? n_tok : 0), x_row = fp32 ? ordered_length(hidden_n) : hidden_n;
  /* the experts with picks, then the shared expert: `active` of them, source s's rows from row_start[s] on
   * in the rows of them all */
  int64_t *first = malloc(sizeof(int64_t) * (4 * n_exp + 3)), *last = first ? first + n_exp : NULL;
  int64_t *sources = last ? last + n_exp : NULL, *row_start = sources ? sources + n_exp + 1 : NULL;
  char *hidden = calloc((size_t)((units ? units : 1) * width), size); /* (zeros past a row's end: product order's) */
  float *ordered_x = fp32 ? ordered_copy(x, n_tok, hidden_n) : NULL;
  if (!first || !hidden || (fp32 && !ordered_x)) {
    free(first), free(hidden), free(ordered_x);
    return 1;
  }
  const char *rows_x = fp32 ? (const char *)ordered_x : (const char *)x;
  for (int64_t g = 0; g < n_exp; g++) first[g] = last[g] = 0;
  for (int64_t k = n_pick - 1; k >= 0; k--) { /* each expert's picks: one run of the sorted picks */
    const int64_t g = expert_of(places[k], ends, n_exp, keep[k]);
    if (g < 0) continue;
    if (last[g] == 0) last[g] = k + 1;
    first[g] = k;
  }
  int64_t active = 0;
  row_start[0] = 0;
  for (int64_t g = 0; g <= n_exp; g++)
    if (g < n_exp ? last[g] > first[g] : shared > 0) {
      sources[active] = g;
      row_start[active + 1] = row_start[active] + (g < n_exp ? inter : shared);
      active++;
    }
#pragma omp parallel num_threads(threads)
  {
    /* gate and up rows of each hidden unit: h = as_model(as_model(silu(min(gate, limit))) * clamp(up));
     * the active experts' rows one after another, each thread a contiguous share of them (so that its
     * reads are a few long runs, which its prefetches follow) */
    int64_t s = 0;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < row_start[active]; item++) {
      while (item >= row_start[s + 1]) s++;
      const int64_t source = sources[s], is_shared = source == n_exp, i = item - row_start[s];
      const int64_t width_u = is_shared ? shared : inter;
      const uint16_t *w = is_shared ? shared_w13 : w13 + source * 2 * inter * hidden_n;
      const int64_t begin = is_shared ? 0 : first[source], end = is_shared ? n_tok : last[source];
      for (int64_t k = begin; k < end; k += BLOCK) {
        const int count = end - k < BLOCK ? (int)(end - k) : BLOCK;
        const void *rows[BLOCK];
        float gates[BLOCK], ups[BLOCK];
        for (int j = 0; j < count; j++) rows[j] = rows_x + (is_shared ? k + j : tokens[k + j]) * x_row * size;
        dots(w + i * hidden_n, rows, count, hidden_n, fp32, gates);
        dots(w + (width_u + i) * hidden_n, rows, count, hidden_n, fp32, ups);
        for (int j = 0; j < count; j++) {
          const float gate = fminf(as_model(gates[j], fp32), limit);
          const float up = fminf(fmaxf(as_model(ups[j], fp32), -limit), limit);
          const float unit = as_model(gate / (1.0f + expf(-gate)), fp32) * up;
          const int64_t row = ((is_shared ? n_pick : 0) + k + j) * width;
          if (fp32)
            ((float *)hidden)[row + ordered_index(i)] = unit;
          else
            ((uint16_t *)hidden)[row + i] = to_bf16(unit);
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
          const void *rows[BLOCK];
          float downs[BLOCK];
          for (int j = 0; j < count; j++) rows[j] = hidden + (k + j) * width * size;
          dots(w2 + (g * hidden_n + o) * inter, rows, count, inter, fp32, downs);
          for (int j = 0; j < count; j++) out[tokens[k + j] * hidden_n + o] += as_model(downs[j], fp32) * scale[k + j];
        }
      for (int64_t t = 0; shared && t < n_tok; t += BLOCK) {
        const int count = n_tok - t < BLOCK ? (int)(n_tok - t) : BLOCK;
        const void *rows[BLOCK];
        float downs[BLOCK];
        for (int j = 0; j < count; j++) rows[j] = hidden + (n_pick + t + j) * width * size;
        dots(shared_w2 + o * shared, rows, count, shared, fp32, downs);
        for (int j = 0; j < count; j++) out[(t + j) * hidden_n + o] += as_model(downs[j], fp32);
      }
    }
  }
  free(first), free(hidden), free(ordered_x);
  return 0;
}
