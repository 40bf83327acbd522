/* The mHC mix between two sublayers (dsv4.model.mhc.mix, dsv4/kernels/cpu_mhc.py) for fp32 or bf16
 * streams, one token at a time in fp32, rounded into the streams' dtype where mix rounds: the last
 * sublayer's output written into the streams (`expand`), the mixing weights from the RMS-normalised
 * streams (pre and post gates, the Sinkhorn-normalised comb), the next sublayer's input collapsed from
 * the streams and RMS-normed. Compiled torch code spends most of this piece's time in ~40 one-threaded
 * loops over the 4x4 Sinkhorn matrices and in separate passes over the streams; here a token's streams
 * are read once and stay in cache for every step, and the Sinkhorns of four tokens run as vector code
 * at once (for n = 4, the model's; scalar code for other n).
 *
 * Tokens are split over torch's OpenMP team (see attention.c) in groups of GROUP, which share each load
 * of the mixing projection `fn` (it is read from the cache once per group rather than once per token);
 * with fewer groups than threads, the team splits each step instead (mhc_mix). */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "dots.h"
#include "simd.h"

/* p[]: tokens, streams per token (n), hidden size, Sinkhorn iterations, whether the streams are bf16 */
enum { M_TOKENS, M_STREAMS, M_HIDDEN, M_ITERS, M_BF16, M_COUNT };
enum { GROUP = 4, MIX_BLOCK = 4, MAX_STREAMS = 8, MAX_MIXES = (2 + MAX_STREAMS) * MAX_STREAMS };

static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/* sinkhorn for n = 4 (the model's) over GROUP tokens' matrices at once (independent chains of divisions
 * in flight), each in one register (lane 4i + j: row i, column j): each row a 128-bit lane, each column
 * the same place in the four. The sums are added in pairs rather than in order, and exp is
 * exp_nonpositive's (within 2 ulp of expf). */
static void sinkhorn4(float *const c[GROUP], int iters, float eps) {
  const m512 e = mm512_set1_ps(eps);
  m512 v[GROUP], tmp;
#define ROW_SUMS(x) (tmp = mm512_add_ps(x, mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1))), \
                     mm512_add_ps(tmp, mm512_permute_ps(tmp, _MM_SHUFFLE(1, 0, 3, 2))))
#define COLUMN_SUMS(x) (tmp = mm512_add_ps(x, mm512_shuffle_f32x4(x, x, _MM_SHUFFLE(2, 3, 0, 1))), \
                        mm512_add_ps(tmp, mm512_shuffle_f32x4(tmp, tmp, _MM_SHUFFLE(1, 0, 3, 2))))
  for (int t = 0; t < GROUP; t++) {
    v[t] = mm512_loadu_ps(c[t]);
    m512 peak = mm512_max_ps(v[t], mm512_permute_ps(v[t], _MM_SHUFFLE(2, 3, 0, 1)));
    peak = mm512_max_ps(peak, mm512_permute_ps(peak, _MM_SHUFFLE(1, 0, 3, 2)));
    v[t] = exp_nonpositive(mm512_sub_ps(v[t], peak));
    v[t] = mm512_add_ps(mm512_div_ps(v[t], ROW_SUMS(v[t])), e);
  }
  for (int pass = 0; pass < iters; pass++)
    for (int t = 0; t < GROUP; t++) {
      if (pass > 0) v[t] = mm512_div_ps(v[t], mm512_add_ps(ROW_SUMS(v[t]), e));
      v[t] = mm512_div_ps(v[t], mm512_add_ps(COLUMN_SUMS(v[t]), e));
    }
#undef ROW_SUMS
#undef COLUMN_SUMS
  for (int t = 0; t < GROUP; t++) mm512_storeu_ps(c[t], v[t]);
}

/* Row softmax (+eps), then alternating column / row normalisation (`iters` column passes), in place:
 * mhc._sinkhorn */
static void sinkhorn(float *c, int n, int iters, float eps) {
  for (int i = 0; i < n; i++) {
    float peak = c[i * n], sum = 0.0f;
    for (int j = 1; j < n; j++) peak = fmaxf(peak, c[i * n + j]);
    for (int j = 0; j < n; j++) sum += c[i * n + j] = expf(c[i * n + j] - peak);
    for (int j = 0; j < n; j++) c[i * n + j] = c[i * n + j] / sum + eps;
  }
  for (int pass = 0; pass < iters; pass++) {
    if (pass > 0)
      for (int i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int j = 0; j < n; j++) sum += c[i * n + j];
        for (int j = 0; j < n; j++) c[i * n + j] /= sum + eps;
      }
    for (int j = 0; j < n; j++) {
      float sum = 0.0f;
      for (int i = 0; i < n; i++) sum += c[i * n + j];
      for (int i = 0; i < n; i++) c[i * n + j] /= sum + eps;
    }
  }
}

/* A token's new streams (new stream j = post_j * output + sum_i comb[i][j] * stream i, stored in the
 * streams' dtype), and as read back, RMS-normalised over all n * H, into `normed` [n * H] (as
 * stream_mixes rounds: normalised first) */
static inline __attribute__((always_inline)) void expand(const void *streams, const void *output, const float *post, const float *comb, void *streams_out,
                   float *normed, int64_t token, int64_t n, int64_t hidden, int bf16, float norm_eps) {
  const int64_t width = n * hidden;
  const float *token_post = post + token * n, *token_comb = comb + token * n * n;
  for (int64_t h = 0; h < hidden; h += 16) {
    const mmask16 m = first_lanes(hidden - h);
    m512 old[MAX_STREAMS];
    for (int64_t i = 0; i < n; i++) old[i] = load_row(streams, (token * n + i) * hidden + h, bf16, m);
    const m512 out = load_row(output, token * hidden + h, bf16, m);
    for (int64_t j = 0; j < n; j++) {
      m512 mixed = mm512_mul_ps(mm512_set1_ps(token_comb[j]), old[0]);
      for (int64_t i = 1; i < n; i++) mixed = mm512_add_ps(mixed, mm512_mul_ps(mm512_set1_ps(token_comb[i * n + j]), old[i]));
      const m512 v = mm512_add_ps(mm512_mul_ps(mm512_set1_ps(token_post[j]), out), mixed);
      mm512_mask_storeu_ps(normed + j * hidden + h, m, store_row(streams_out, (token * n + j) * hidden + h, bf16, m, v));
    }
  }
  const m512 r = mm512_set1_ps(1.0f / sqrtf(sum_squares(normed, width) / (float)width + norm_eps));
  for (int64_t i = 0; i < width; i += 16) {
    const mmask16 m = first_lanes(width - i);
    mm512_mask_storeu_ps(normed + i, m, mm512_mul_ps(mm512_maskz_loadu_ps(m, normed + i), r));
  }
}

/* Sums a loop over the rows of mix_block keeps in registers, beside the rows it holds */
enum { MIX_SUMS = VECTOR_REGISTERS >= 32 ? 16 : 4 };

/* sums[b][t] = weights[b] . x_rows[t] for B mixes and N tokens (constants where inlined, B * N <= MIX_SUMS):
 * the fewer of the two kinds of row held, each vector of the other loaded as it is used */
static inline __attribute__((always_inline)) void mix_sums(const float *const *weights, const float *const *x_rows,
                                                           const int B, const int N, int64_t width,
                                                           float (*sums)[GROUP]) {
  m512 acc[MIX_BLOCK][GROUP];
  for (int b = 0; b < B; b++)
    for (int t = 0; t < N; t++) acc[b][t] = mm512_setzero_ps();
  for (int64_t i = 0; i < width; i += 16) {
    const mmask16 m = first_lanes(width - i);
    if (N <= B) {
      m512 x[GROUP];
      for (int t = 0; t < N; t++) x[t] = mm512_maskz_loadu_ps(m, x_rows[t] + i);
      for (int b = 0; b < B; b++) {
        const m512 w = mm512_maskz_loadu_ps(m, weights[b] + i);
        for (int t = 0; t < N; t++) acc[b][t] = mm512_fmadd_ps(w, x[t], acc[b][t]);
      }
    } else {
      m512 w[MIX_BLOCK];
      for (int b = 0; b < B; b++) w[b] = mm512_maskz_loadu_ps(m, weights[b] + i);
      for (int t = 0; t < N; t++) {
        const m512 x = mm512_maskz_loadu_ps(m, x_rows[t] + i);
        for (int b = 0; b < B; b++) acc[b][t] = mm512_fmadd_ps(w[b], x, acc[b][t]);
      }
    }
  }
  for (int b = 0; b < B; b++)
    for (int t = 0; t < N; t++) sums[b][t] = mm512_reduce_add_ps(acc[b][t]);
}

/* mix_sums of MIX_BLOCK mixes and N tokens (a constant where inlined), in runs of as many mixes as fit */
static inline __attribute__((always_inline)) void mix_runs(const float *const *weights, const float *const *x_rows,
                                                           const int N, int64_t width, float (*sums)[GROUP]) {
  const int B = MIX_SUMS / N < MIX_BLOCK ? MIX_SUMS / N : MIX_BLOCK;
  for (int b0 = 0; b0 < MIX_BLOCK; b0 += B) mix_sums(weights + b0, x_rows, B, N, width, sums + b0);
}

/* Mixes k0 .. k0 + MIX_BLOCK - 1's logits (base + scale * fn @ normed) of `count` <= GROUP tokens (`rows`:
 * their normed streams) into logits[t][k]: one token's or two tokens' sums alone, three's or four's as four
 * (a short group repeats its last token and a short block its last mix, whose sums are dropped), every
 * sum of a run in registers, each load shared by the run's sums */
static inline __attribute__((always_inline)) void mix_block(const float *fn, const float *base, const float *scale, const float *const *rows, int64_t count,
                      int k0, int mixes, int64_t width, float (*logits)[MAX_MIXES]) {
  const float *weights[MIX_BLOCK], *x_rows[GROUP];
  for (int b = 0; b < MIX_BLOCK; b++) weights[b] = fn + (int64_t)(k0 + b < mixes ? k0 + b : mixes - 1) * width;
  for (int t = 0; t < GROUP; t++) x_rows[t] = rows[t < count ? t : count - 1];
  float sums[MIX_BLOCK][GROUP];
  if (count == 1) mix_runs(weights, x_rows, 1, width, sums);
  else if (count == 2) mix_runs(weights, x_rows, 2, width, sums);
  else mix_runs(weights, x_rows, GROUP, width, sums);
  for (int b = 0; b < MIX_BLOCK && k0 + b < mixes; b++)
    for (int64_t t = 0; t < count; t++) logits[t][k0 + b] = base[k0 + b] + sums[b][t] * scale[k0 + b];
}

/* A group's `count` tokens from their mixes' logits: the gates, the Sinkhorn-normalised comb, and the
 * collapse x = sum_i pre_i * stream i (of the new streams as stored), RMS-normed; `scratch` [count][H] */
static inline __attribute__((always_inline)) void finish_group(float (*logits)[MAX_MIXES], int64_t first, int64_t count, const void *streams_out,
                         const float *norm, void *x_out, float *post_out, float *comb_out, float *scratch, int64_t n,
                         int64_t hidden, int iters, int bf16, float hc_eps, float norm_eps) {
  if (n == 4) { /* (a short group's spare matrices: its last token's, computed twice, stored once) */
    float *combs[GROUP];
    for (int t = 0; t < GROUP; t++) combs[t] = logits[t < count ? t : count - 1] + 2 * n;
    sinkhorn4(combs, iters, hc_eps);
  }
  for (int64_t t = 0; t < count; t++) {
    const int64_t token = first + t;
    float pre[MAX_STREAMS];
    for (int64_t i = 0; i < n; i++) {
      pre[i] = sigmoid(logits[t][i]) + hc_eps;
      post_out[token * n + i] = sigmoid(logits[t][n + i]) * 2.0f;
    }
    if (n != 4) sinkhorn(logits[t] + 2 * n, (int)n, iters, hc_eps);
    for (int64_t k = 0; k < n * n; k++) comb_out[token * n * n + k] = logits[t][2 * n + k];
    float *x = scratch + t * hidden; /* x as rounded into the streams' dtype */
    for (int64_t h = 0; h < hidden; h += 16) {
      const mmask16 m = first_lanes(hidden - h);
      m512 sum = mm512_mul_ps(mm512_set1_ps(pre[0]), load_row(streams_out, token * n * hidden + h, bf16, m));
      for (int64_t i = 1; i < n; i++)
        sum = mm512_add_ps(sum, mm512_mul_ps(mm512_set1_ps(pre[i]), load_row(streams_out, (token * n + i) * hidden + h, bf16, m)));
      mm512_mask_storeu_ps(x + h, m, round_row(sum, bf16));
    }
    const m512 r = mm512_set1_ps(1.0f / sqrtf(sum_squares(x, hidden) / (float)hidden + norm_eps));
    for (int64_t h = 0; h < hidden; h += 16) {
      const mmask16 m = first_lanes(hidden - h);
      const m512 v = mm512_mul_ps(mm512_mul_ps(mm512_maskz_loadu_ps(m, x + h), r), mm512_maskz_loadu_ps(m, norm + h));
      store_row(x_out, token * hidden + h, bf16, m, v);
    }
  }
}

/* streams [T, n, H] and output [T, H] (the streams' dtype), post [T, n] and comb [T, n, n] fp32; the
 * sublayer's fn [(2 + n) * n, n * H], base and scale [(2 + n) * n], norm [H], all fp32 -> new streams,
 * the sublayer's normed input x [T, H] (the streams' dtype), its post and comb (fp32).
 * With at least as many groups of GROUP tokens as threads, each thread takes whole groups, every step of
 * a group while its streams are in cache. With fewer (a decode step of a few tokens), the team takes the
 * steps in turn, the mixes' logits split by blocks of mixes: one thread alone read all of fn (196 KB a
 * mix of `small`) at one core's pace, ~9 of a c=1 mix's ~12 us. Both compute every value alike. */
int mhc_mix(const void *streams, const void *output, const float *post, const float *comb, const float *fn,
            const float *base, const float *scale, const float *norm, void *streams_out, void *x_out,
            float *post_out, float *comb_out, const int64_t *p, float hc_eps, float norm_eps, int threads) {
  const int64_t tokens = p[M_TOKENS], n = p[M_STREAMS], hidden = p[M_HIDDEN], width = n * hidden;
  const int iters = (int)p[M_ITERS], bf16 = (int)p[M_BF16], mixes = (int)((2 + n) * n);
  const int64_t groups = (tokens + GROUP - 1) / GROUP, blocks = (mixes + MIX_BLOCK - 1) / MIX_BLOCK;
  if (n > MAX_STREAMS) return 2;
  if (threads < 1) threads = 1;
  const int split = groups < threads;
  /* grouped: each thread's [GROUP][n * H] normed streams and logits; split: every token's */
  const int64_t rows = split ? tokens : (int64_t)threads * GROUP;
  float *normed = malloc(sizeof(float) * rows * width);
  float (*logits)[MAX_MIXES] = malloc(sizeof(float) * rows * MAX_MIXES);
  if (!normed || !logits) {
    free(normed), free(logits);
    return 1;
  }
  if (split) {
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
      for (int64_t token = 0; token < tokens; token++)
        expand(streams, output, post, comb, streams_out, normed + token * width, token, n, hidden, bf16, norm_eps);
#pragma omp for schedule(static)
      for (int64_t item = 0; item < groups * blocks; item++) {
        const int64_t g = item / blocks, first = g * GROUP, count = tokens - first < GROUP ? tokens - first : GROUP;
        const float *group_rows[GROUP];
        for (int64_t t = 0; t < count; t++) group_rows[t] = normed + (first + t) * width;
        mix_block(fn, base, scale, group_rows, count, (int)(item % blocks * MIX_BLOCK), mixes, width, logits + first);
      }
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * GROUP, count = tokens - first < GROUP ? tokens - first : GROUP;
        finish_group(logits + first, first, count, streams_out, norm, x_out, post_out, comb_out,
                     normed + first * width, n, hidden, iters, bf16, hc_eps, norm_eps);
      }
    }
  } else {
#pragma omp parallel num_threads(threads)
    {
      float *mine = normed + (int64_t)omp_get_thread_num() * GROUP * width;
      float (*my_logits)[MAX_MIXES] = logits + omp_get_thread_num() * GROUP;
#pragma omp for schedule(static)
      for (int64_t g = 0; g < groups; g++) {
        const int64_t first = g * GROUP, count = tokens - first < GROUP ? tokens - first : GROUP;
        const float *group_rows[GROUP];
        for (int64_t t = 0; t < count; t++) {
          expand(streams, output, post, comb, streams_out, mine + t * width, first + t, n, hidden, bf16, norm_eps);
          group_rows[t] = mine + t * width;
        }
        for (int k0 = 0; k0 < mixes; k0 += MIX_BLOCK)
          mix_block(fn, base, scale, group_rows, count, k0, mixes, width, my_logits);
        finish_group(my_logits, first, count, streams_out, norm, x_out, post_out, comb_out, mine, n, hidden, iters,
                     bf16, hc_eps, norm_eps);
      }
    }
  }
  free(normed);
  free(logits);
  return 0;
}
