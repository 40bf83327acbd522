/* The MoE's routing and sort for a decode step's tokens (dsv4/kernels/cpu_moe.py's `route`, and
 * `routed`: then the MoE kernel, in the same call): dsv4.model.moe.dispatch without its padded rows
 * (the C kernels read x where it lies), instead of a compiled package's call (~90 us a layer of
 * `small`, most of it the package's own overhead).
 *
 * Each token's scores s = score_fn(x . gate[e]) in fp32 for every expert e (every rank routes every
 * token alike); its picks: hash layers tid2eid[token id], learned layers the top k of s + bias (the
 * larger first, the lower expert first among equals); their weights s, normalised to sum 1, times the
 * scaling factor. The (token, pick) pairs are then sorted stably by this rank's expert, as dispatch's
 * argsort sorts them (other ranks' picks last), and laid out as dispatch lays out its rows. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "dots.h"
#include "moe.h"
#include "simd.h"

/* p[]: tokens, hidden size, all experts, k, this rank's first expert, its experts, whether x is fp32
 * (else bf16), whether the layer routes by token id, the score function (SCORE_*), whether the picks'
 * weights are normalised, the rows of a group (dsv4.model.moe.GROUP_ROWS) */
enum { R_TOKENS, R_HIDDEN, R_EXPERTS, R_TOP_K, R_FIRST, R_LOCAL, R_FP32, R_HASHED, R_SCORE, R_NORM, R_GROUP, R_COUNT };
enum { SCORE_SQRTSOFTPLUS, SCORE_SIGMOID, SCORE_SOFTMAX };
enum { MAX_TOP_K = 64 };

/* x (fp32, or bf16 bits) . gate row (fp32) */
static float gate_logit(const void *x, const float *gate, int64_t n, int fp32) {
  m512 acc = mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const mmask16 m = first_lanes(n - i);
    acc = mm512_fmadd_ps(load_row(x, i, !fp32, m), mm512_maskz_loadu_ps(m, gate + i), acc);
  }
  return mm512_reduce_add_ps(acc);
}

/* The row's scores in place: torch's softplus (the logit itself above 20) then its square root, the
 * sigmoid, or the softmax over the experts */
static void score(float *row, int64_t experts, int function) {
  if (function == SCORE_SOFTMAX) {
    float peak = -INFINITY, sum = 0.0f;
    for (int64_t e = 0; e < experts; e++) peak = fmaxf(peak, row[e]);
    for (int64_t e = 0; e < experts; e++) sum += row[e] = expf(row[e] - peak);
    for (int64_t e = 0; e < experts; e++) row[e] /= sum;
    return;
  }
  for (int64_t e = 0; e < experts; e++)
    row[e] = function == SCORE_SIGMOID ? 1.0f / (1.0f + expf(-row[e]))
                                       : sqrtf(row[e] > 20.0f ? row[e] : log1pf(expf(row[e])));
}

/* x [T, hidden], gate [experts, hidden] fp32, bias [experts] fp32 or tid2eid [vocab, k] int64, token
 * ids [T] -> places, tokens [T * k] int64, ends [local] int32, scale [T * k] fp32, keep [T * k] as
 * dsv4.model.moe.dispatch returns them */
int moe_route(const void *x, const float *gate, const void *route, const int64_t *token_ids, int64_t *places,
              int64_t *tokens, int32_t *ends, float *scale, uint8_t *keep, const int64_t *p, float scaling,
              int threads) {
  const int64_t n_tok = p[R_TOKENS], hidden = p[R_HIDDEN], experts = p[R_EXPERTS], k = p[R_TOP_K];
  const int64_t first = p[R_FIRST], local = p[R_LOCAL], group = p[R_GROUP];
  const int fp32 = (int)p[R_FP32], hashed = (int)p[R_HASHED], function = (int)p[R_SCORE], norm = (int)p[R_NORM];
  const int64_t size = fp32 ? 4 : 2, picks = n_tok * k;
  if (k > MAX_TOP_K || k > experts) return 2;
  float *scores = malloc(sizeof(float) * n_tok * experts + sizeof(float) * picks);
  int64_t *chosen = malloc(sizeof(int64_t) * (picks + 2 * (local + 1)));
  if (!scores || !chosen) {
    free(scores);
    free(chosen);
    return 1;
  }
  float *weights = scores + n_tok * experts;
  int64_t *count = chosen + picks, *start = count + local + 1; /* by key: this rank's experts, then "other" */
  /* (a team only where the products are worth it: a parallel region costs a few us) */
#pragma omp parallel for num_threads(threads) schedule(static) if (n_tok * experts * hidden >= (1 << 18))
  for (int64_t item = 0; item < n_tok * experts; item++)
    scores[item] = gate_logit((const char *)x + item / experts * hidden * size, gate + item % experts * hidden,
                              hidden, fp32);
  for (int64_t t = 0; t < n_tok; t++) {
    float *row = scores + t * experts;
    int64_t *mine = chosen + t * k;
    score(row, experts, function);
    if (hashed) {
      for (int64_t j = 0; j < k; j++) mine[j] = ((const int64_t *)route)[token_ids[t] * k + j];
    } else { /* k passes of a selection: the best not yet taken, by s + bias */
      const float *bias = (const float *)route;
      for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < experts; e++) {
          int taken = 0;
          for (int64_t i = 0; i < j; i++) taken |= mine[i] == e;
          if (!taken && (best < 0 || row[e] + bias[e] > row[best] + bias[best])) best = e;
        }
        mine[j] = best;
      }
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) sum += weights[t * k + j] = row[mine[j]];
    for (int64_t j = 0; j < k; j++)
      weights[t * k + j] = (norm ? weights[t * k + j] / sum : weights[t * k + j]) * scaling;
  }
  /* the stable sort: a count of each key, then every pick at its key's next place */
  for (int64_t g = 0; g <= local; g++) count[g] = 0;
  for (int64_t i = 0; i < picks; i++) {
    const int64_t g = chosen[i] - first;
    count[g >= 0 && g < local ? g : local]++;
  }
  int64_t sorted = 0, padded = 0; /* where each key's picks start among the sorted picks, and among the rows */
  for (int64_t g = 0; g <= local; g++) {
    start[g] = sorted;
    sorted += count[g];
    if (g < local) {
      ends[g] = (int32_t)(padded + (count[g] + group - 1) / group * group);
      padded = ends[g];
    }
  }
  int64_t *next = count; /* reused: each key's next place */
  for (int64_t g = 0; g <= local; g++) next[g] = start[g];
  for (int64_t i = 0; i < picks; i++) {
    const int64_t g0 = chosen[i] - first, g = g0 >= 0 && g0 < local ? g0 : local;
    const int64_t rank = next[g]++;
    const int64_t row_start = g == 0 ? 0 : g < local ? ends[g - 1] : padded; /* the key's first row */
    places[rank] = row_start + rank - start[g];
    tokens[rank] = i / k;
    scale[rank] = weights[i];
    keep[rank] = g < local;
  }
  free(scores);
  free(chosen);
  return 0;
}

/* moe_route, then moe_few (or moe_tiles, `tiles`) over its picks: the MoE of a decode step's tokens in
 * one call. rp[]: moe_route's p[]; mp[]: the MoE kernel's (its picks T * k). */
int moe_routed(const void *x, const float *gate, const void *route, const int64_t *token_ids, const uint16_t *w13,
               const uint16_t *w2, const uint16_t *shared_w13, const uint16_t *shared_w2, float *out,
               const int64_t *rp, const int64_t *mp, float scaling, float limit, int tiles, int threads) {
  const int64_t picks = rp[R_TOKENS] * rp[R_TOP_K], local = rp[R_LOCAL];
  /* the picks' places, tokens, ends, scale and keep, in one allocation */
  char *scratch = malloc(sizeof(int64_t) * 2 * picks + sizeof(int32_t) * local + (sizeof(float) + 1) * picks + 8);
  if (!scratch) return 1;
  int64_t *places = (int64_t *)scratch, *tokens = places + picks;
  float *scale = (float *)(tokens + picks);
  int32_t *ends = (int32_t *)(scale + picks);
  uint8_t *keep = (uint8_t *)(ends + local);
  int status = moe_route(x, gate, route, token_ids, places, tokens, ends, scale, keep, rp, scaling, threads);
  if (status == 0)
    status = tiles ? moe_tiles(x, w13, w2, shared_w13, shared_w2, tokens, places, ends, keep, scale, out, mp, limit, threads)
                   : moe_few(x, w13, w2, shared_w13, shared_w2, tokens, places, ends, keep, scale, out, mp, limit, threads);
  free(scratch);
  return status;
}
