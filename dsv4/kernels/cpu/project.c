/* The attention's projections of a decode step's few tokens (up to BLOCK; dsv4/kernels/cpu_project.py)
 * (AVX512-BF16 or AVX2, simd.h), for a bf16 model or an fp32 one whose weights hold bf16 values (read from bf16
 * copies, widened exactly as they are read): the weights read once, where they lie, against every
 * token (dots.h), with the rounding of the model's dtype where the torch code rounds.
 *
 * decode_project: dsv4.model.attention.project_inputs. The layer input times w_input (wq_a | wkv |
 * the rest), the low-rank query's norm, its product with wq_b, each head's norm and RoPE, and the raw
 * row's norm and RoPE.
 * decode_exit: dsv4.model.attention.attention_exit. The inverse RoPE of the attention's output (in
 * place), its grouped low-rank projection (wo_a) and wo_b.
 * norm_rope: for the rows of a prefill's tokens, after (or before) torch's products, the same norms and
 * RoPE (or the exit's inverse RoPE) in place.
 * decode_index_queries: dsv4.model.attention.index_queries' queries. The low-rank query times the
 * indexer's wq_b, each head's RoPE.
 * decode_logits: the LM head of a few rows (dsv4.model.model.PagedModel's last product), fp32 logits of
 * the model's dtype's values.
 * compressor_store: the rows of the windows a batch completes (dsv4.model.compressor.PagedCompressor.store):
 * each window's slots pooled (a softmax over them per channel), rounded into the model's dtype, normed,
 * rotated and packed into the cache's format where it lies.
 *
 * Each phase's rows are split over torch's OpenMP team (see attention.c), a barrier between phases. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "dots.h"
#include "simd.h"

/* decode_project's p[]: tokens, hidden size, w_input's rows, q_lora_rank, head_dim, heads, RoPE dims,
 * whether the activations are fp32 (else bf16) */
enum { J_TOKENS, J_HIDDEN, J_WIDTH, J_Q_RANK, J_DIM, J_HEADS, J_ROPE, J_FP32, J_COUNT };
/* decode_exit's p[]: tokens, heads, head_dim, groups, o_lora_rank, hidden size, RoPE dims, fp32 */
enum { X_TOKENS, X_HEADS, X_DIM, X_GROUPS, X_O_RANK, X_HIDDEN, X_ROPE, X_FP32, X_COUNT };
/* norm_rope's p[]: tokens, rows per token, their dims, RoPE dims, fp32, whether to norm them (else only
 * rotate), whether to rotate backwards */
enum { N_TOKENS, N_HEADS, N_DIM, N_ROPE, N_FP32, N_NORM, N_INVERSE, N_COUNT };
/* decode_index_queries' p[]: tokens, q_lora_rank, the indexer's heads, its head_dim, RoPE dims, fp32 */
enum { I_TOKENS, I_Q_RANK, I_HEADS, I_DIM, I_ROPE, I_FP32, I_COUNT };
/* decode_logits' p[]: rows, the hidden size, the vocabulary, fp32 */
enum { H_ROWS, H_HIDDEN, H_VOCAB, H_FP32, H_COUNT };
/* compressor_store's p[]: windows, slots a window pools, the slots' kv (and score) width, the rows' dims,
 * ratio, whether the slots overlap (CSA: slots 0 .. ratio - 1 take the first `dims` channels, the rest the
 * last), RoPE dims, fp32 (else bf16: the model's dtype), the cache's format (STORE_*), its page and row
 * strides (bytes) */
enum { S_WINDOWS, S_SPAN, S_WIDTH, S_DIMS, S_RATIO, S_OVERLAP, S_ROPE, S_FP32, S_FORMAT, S_PAGE, S_ROW, S_COUNT };
/* rows of fp32 or bf16 values; STORE_FP8: index-key rows, e4m3 values and a float32 power-of-two scale
 * (dsv4/kernels/rows.py) */
enum { STORE_FP32, STORE_BF16, STORE_FP8 };
enum { FP8_MAX = 448 };

/* v rounded into the model's dtype and stored at base[i] */
static inline void store_at(void *base, int64_t i, int fp32, float v) {
  if (fp32)
    ((float *)base)[i] = v;
  else
    ((uint16_t *)base)[i] = to_bf16(v);
}

/* out[t][g * count + j] = as_model(rows[t][g * n .. (g + 1) * n) . w[g][j]) for each of `groups` weights
 * [count, n] (one after another in w), the rows j of every group split over the team at once (no
 * barrier between groups). fp32 rows are read from this thread's copies of them in product order, made
 * here into `ordered` (ordered_floats(tokens * groups, n) of them; NULL for bf16 rows, read where they lie). */
static void products(const uint16_t *w, int64_t groups, int64_t count, int64_t n, const void *rows_base,
                     int64_t tokens, int64_t row_stride, int fp32, float *ordered, void *out) {
  const int64_t size = fp32 ? 4 : 2, length = ordered_length(n);
  for (int64_t r = 0; fp32 && r < tokens * groups; r++)
    product_order((const float *)rows_base + r / groups * row_stride + r % groups * n, n, ordered + r * length);
#pragma omp for schedule(static)
  for (int64_t item = 0; item < groups * count; item++) {
    const int64_t g = item / count;
    const void *rows[BLOCK];
    float sums[BLOCK];
    for (int64_t t = 0; t < tokens; t++)
      rows[t] = fp32 ? (const void *)(ordered + (t * groups + g) * length)
                     : (const void *)((const char *)rows_base + (t * row_stride + g * n) * size);
    dots(w + item * n, rows, (int)tokens, n, fp32, sums);
    for (int64_t t = 0; t < tokens; t++) store_at(out, t * groups * count + item, fp32, sums[t]);
  }
}

/* The floats of `rows` rows of n in product order */
static inline int64_t ordered_floats(int64_t rows, int64_t n) { return rows * ordered_length(n); }

/* For an fp32 kernel (`fp32`) of `threads` threads, scratch for each thread's products' rows in product
 * order, `floats` a thread; NULL for bf16 (and where it could not be had: the caller fails) */
static float *ordered_scratch(int fp32, int threads, int64_t floats) {
  return fp32 ? malloc(sizeof(float) * (size_t)(threads * floats)) : NULL;
}

/* Thread t's part of ordered_scratch's (NULL for bf16) */
static inline float *ordered_part(float *scratch, int64_t floats) {
  return scratch ? scratch + omp_get_thread_num() * floats : NULL;
}

static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* row[0..n) (the model's dtype) RMS-normed in fp32 (times weight, unless NULL), rounded into the dtype,
 * then its last `rope` dims rotated in interleaved pairs by the tables cos2, sin2 (backwards with
 * `inverse`), rounded again: rms_norm then ops.rotate_, in place. With norm 0 it only rotates. */
static void norm_and_rotate(void *row, int64_t n, int fp32, int norm, const float *weight, float eps,
                            const float *cos2, const float *sin2, int64_t rope, int inverse) {
  float v[n];
  const int64_t start = norm ? 0 : n - rope; /* (only the rotated dims change) */
  for (int64_t i = start; i < n; i += 16) {
    const mmask16 m = first_lanes(n - i);
    mm512_mask_storeu_ps(v + i, m, load_row(row, i, !fp32, m));
  }
  if (norm) {
    const m512 r = mm512_set1_ps(1.0f / sqrtf(sum_squares(v, n) / (float)n + eps));
    for (int64_t i = 0; i < n; i += 16) {
      const mmask16 m = first_lanes(n - i);
      m512 x = mm512_mul_ps(mm512_maskz_loadu_ps(m, v + i), r);
      if (weight) x = mm512_mul_ps(x, mm512_maskz_loadu_ps(m, weight + i));
      mm512_mask_storeu_ps(v + i, m, round_row(x, !fp32));
    }
  }
  const m512 sign = mm512_set1_ps(inverse ? -1.0f : 1.0f);
  float *tail = v + n - rope;
  for (int64_t i = 0; i < rope; i += 16) { /* (i even: each pair of dims in two neighbouring lanes) */
    const mmask16 m = first_lanes(rope - i);
    const m512 x = mm512_maskz_loadu_ps(m, tail + i);
    const m512 swapped = mm512_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1));
    const m512 turned = mm512_mul_ps(swapped, mm512_maskz_loadu_ps(m, sin2 + i));
    mm512_mask_storeu_ps(tail + i, m, mm512_add_ps(mm512_mul_ps(x, mm512_maskz_loadu_ps(m, cos2 + i)),
                                                     mm512_mul_ps(sign, turned)));
  }
  for (int64_t i = start; i < n; i += 16) {
    const mmask16 m = first_lanes(n - i);
    store_row(row, i, !fp32, m, mm512_maskz_loadu_ps(m, v + i));
  }
}

/* rows [T, heads, dim] (the model's dtype) in place: norm_and_rotate of each, with weight [dim] (or
 * NULL) and token t's tables cos2[t], sin2[t] [rope]: the queries' and raw rows' norms and RoPE of a
 * prefill's tokens, after their products (dsv4.model.attention.project_inputs), or the attention
 * output's inverse RoPE before its products (attention_exit) */
int norm_rope(void *rows, const float *weight, const float *cos2, const float *sin2, const int64_t *p, float eps,
              int threads) {
  const int64_t tokens = p[N_TOKENS], heads = p[N_HEADS], dim = p[N_DIM], rope = p[N_ROPE];
  const int fp32 = (int)p[N_FP32], norm = (int)p[N_NORM], inverse = (int)p[N_INVERSE];
  const int64_t size = fp32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < tokens * heads; item++)
    norm_and_rotate((char *)rows + item * dim * size, dim, fp32, norm, weight, eps, cos2 + item / heads * rope,
                    sin2 + item / heads * rope, rope, inverse);
  return 0;
}

/* x [T, hidden], w_input [width, hidden], q_norm [q_rank], wq_b [heads * dim, q_rank], kv_norm [dim],
 * cos2 and sin2 [T, rope] -> q [T, heads, dim], kv [T, dim], qr [T, q_rank], projected [T, width]
 * (activations in the model's dtype, weights bf16, norms and tables fp32) */
int decode_project(const void *x, const uint16_t *w_input, const float *q_norm, const uint16_t *wq_b,
                   const float *kv_norm, const float *cos2, const float *sin2, void *q, void *kv, void *qr,
                   void *projected, const int64_t *p, float eps, int threads) {
  const int64_t tokens = p[J_TOKENS], hidden = p[J_HIDDEN], width = p[J_WIDTH], q_rank = p[J_Q_RANK];
  const int64_t dim = p[J_DIM], heads = p[J_HEADS], rope = p[J_ROPE];
  const int fp32 = (int)p[J_FP32];
  const int64_t size = fp32 ? 4 : 2;
  if (tokens > BLOCK) return 2;
  const int64_t floats = max64(ordered_floats(tokens, hidden), ordered_floats(tokens, q_rank));
  float *ordered = ordered_scratch(fp32, threads, floats);
  if (fp32 && !ordered) return 1;
#pragma omp parallel num_threads(threads)
  {
    float *mine = ordered_part(ordered, floats);
    products(w_input, 1, width, hidden, x, tokens, hidden, fp32, mine, projected);
#pragma omp single
    for (int64_t t = 0; t < tokens; t++) { /* the low-rank query's norm: no rotation */
      char *row = (char *)qr + t * q_rank * size;
      for (int64_t i = 0; i < q_rank; i++) store_at(row, i, fp32, load_at(projected, t * width + i, fp32));
      norm_and_rotate(row, q_rank, fp32, 1, q_norm, eps, cos2, sin2, 0, 0);
    }
    products(wq_b, 1, heads * dim, q_rank, qr, tokens, q_rank, fp32, mine, q);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < tokens * (heads + 1); item++) {
      const int64_t t = item / (heads + 1), h = item % (heads + 1);
      if (h < heads) {
        norm_and_rotate((char *)q + (t * heads + h) * dim * size, dim, fp32, 1, NULL, eps, cos2 + t * rope,
                        sin2 + t * rope, rope, 0);
      } else { /* the raw row */
        char *row = (char *)kv + t * dim * size;
        for (int64_t i = 0; i < dim; i++) store_at(row, i, fp32, load_at(projected, t * width + q_rank + i, fp32));
        norm_and_rotate(row, dim, fp32, 1, kv_norm, eps, cos2 + t * rope, sin2 + t * rope, rope, 0);
      }
    }
  }
  free(ordered);
  return 0;
}

/* out [T, heads, dim] (rotated back in place), cos2 and sin2 [T, rope], wo_a [groups, o_rank, heads /
 * groups * dim], wo_b [hidden, groups * o_rank] -> result [T, hidden] */
int decode_exit(void *out, const float *cos2, const float *sin2, const uint16_t *wo_a, const uint16_t *wo_b,
                void *result, const int64_t *p, int threads) {
  const int64_t tokens = p[X_TOKENS], heads = p[X_HEADS], dim = p[X_DIM], groups = p[X_GROUPS];
  const int64_t o_rank = p[X_O_RANK], hidden = p[X_HIDDEN], rope = p[X_ROPE];
  const int fp32 = (int)p[X_FP32];
  const int64_t size = fp32 ? 4 : 2, span = heads / groups * dim;
  if (tokens > BLOCK) return 2;
  const int64_t floats = max64(ordered_floats(tokens * groups, span), ordered_floats(tokens, groups * o_rank));
  void *low = malloc(size * tokens * groups * o_rank);
  float *ordered = ordered_scratch(fp32, threads, floats);
  if (!low || (fp32 && !ordered)) {
    free(low), free(ordered);
    return 1;
  }
#pragma omp parallel num_threads(threads)
  {
    float *mine = ordered_part(ordered, floats);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < tokens * heads; item++)
      norm_and_rotate((char *)out + item * dim * size, dim, fp32, 0, NULL, 0.0f, cos2 + item / heads * rope,
                      sin2 + item / heads * rope, rope, 1);
    products(wo_a, groups, o_rank, span, out, tokens, heads * dim, fp32, mine, low);
    products(wo_b, 1, hidden, groups * o_rank, low, tokens, groups * o_rank, fp32, mine, result);
  }
  free(low), free(ordered);
  return 0;
}

/* qr [T, q_rank], wq_b [heads * dim, q_rank], cos2 and sin2 [T, rope] -> q [T, heads, dim]: each head's
 * product rounded into the model's dtype, then its last `rope` dims rotated (no norm) */
int decode_index_queries(const void *qr, const uint16_t *wq_b, const float *cos2, const float *sin2, void *q,
                         const int64_t *p, int threads) {
  const int64_t tokens = p[I_TOKENS], q_rank = p[I_Q_RANK], heads = p[I_HEADS], dim = p[I_DIM], rope = p[I_ROPE];
  const int fp32 = (int)p[I_FP32];
  const int64_t size = fp32 ? 4 : 2;
  if (tokens > BLOCK) return 2;
  const int64_t floats = ordered_floats(tokens, q_rank);
  float *ordered = ordered_scratch(fp32, threads, floats);
  if (fp32 && !ordered) return 1;
#pragma omp parallel num_threads(threads)
  {
    products(wq_b, 1, heads * dim, q_rank, qr, tokens, q_rank, fp32, ordered_part(ordered, floats), q);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < tokens * heads; item++)
      norm_and_rotate((char *)q + item * dim * size, dim, fp32, 0, NULL, 0.0f, cos2 + item / heads * rope,
                      sin2 + item / heads * rope, rope, 0);
  }
  free(ordered);
  return 0;
}

/* x [rows, hidden] (the model's dtype), head [vocab, hidden] -> logits [rows, vocab] fp32: each product
 * rounded into the model's dtype (F.linear's result), then widened (the logits' .float()) */
int decode_logits(const void *x, const uint16_t *head, float *logits, const int64_t *p, int threads) {
  const int64_t rows = p[H_ROWS], hidden = p[H_HIDDEN], vocab = p[H_VOCAB];
  const int fp32 = (int)p[H_FP32];
  if (rows > BLOCK) return 2;
  const int64_t length = ordered_length(hidden);
  float *ordered = fp32 ? ordered_copy(x, rows, hidden) : NULL; /* (the rows', shared) */
  if (fp32 && !ordered) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t v = 0; v < vocab; v++) {
    const void *at[BLOCK];
    float sums[BLOCK];
    for (int64_t t = 0; t < rows; t++)
      at[t] = fp32 ? (const void *)(ordered + t * length) : (const void *)((const uint16_t *)x + t * hidden);
    dots(head + v * hidden, at, (int)rows, hidden, fp32, sums);
    for (int64_t t = 0; t < rows; t++) logits[t * vocab + v] = as_model(sums[t], fp32);
  }
  free(ordered);
  return 0;
}

/* f (|f| <= 448, or NaN) as float8_e4m3fn bits, rounded to nearest even as torch converts */
static inline uint8_t to_e4m3(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  const uint8_t sign = (uint8_t)((bits >> 24) & 0x80);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7f;
  const int exponent = (int)(magnitude >> 23) - 127;
  if (exponent < -6) /* e4m3's subnormals (and zero): multiples of 2^-9, 2^-6 the first normal */
    return sign | (uint8_t)nearbyintf(fabsf(f) * 512.0f);
  const uint32_t mantissa = magnitude & 0x7fffffu;
  uint32_t top = (mantissa + 0x7ffffu + ((mantissa >> 20) & 1u)) >> 20; /* 3 bits, to nearest even */
  int biased = exponent + 7;
  if (top == 8) top = 0, biased++;
  return sign | (uint8_t)(biased << 3) | (uint8_t)top;
}

/* windows [W, span, 2 * width] fp32 (each window's slots, kv | score, as the feed copies them out), the
 * rows' norm weight [dims], the RoPE tables cos2, sin2 [W, rope] fp32 at each window's position -> each
 * window's row packed into cache (uint8, strided) at pages[w], page_rows[w] */
int compressor_store(const float *windows, const float *norm, const float *cos2, const float *sin2, uint8_t *cache,
                     const int64_t *pages, const int64_t *page_rows, const int64_t *p, float eps, int threads) {
  const int64_t count = p[S_WINDOWS], span = p[S_SPAN], width = p[S_WIDTH], dims = p[S_DIMS], ratio = p[S_RATIO];
  const int64_t rope = p[S_ROPE], format = p[S_FORMAT];
  const int fp32 = (int)p[S_FP32], overlap = (int)p[S_OVERLAP];
  if (span > 1024) return 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t w = 0; w < count; w++) {
    const float *slots = windows + w * span * 2 * width;
    float weights[span][16];
    uint16_t row[dims * 2]; /* the row in the model's dtype (fp32: two words a value) */
    for (int64_t c = 0; c < dims; c += 16) { /* pooled = sum over slots of softmax(score) * kv, per channel */
      const mmask16 m = first_lanes(dims - c);
      m512 peak = mm512_set1_ps(-INFINITY);
      for (int64_t s = 0; s < span; s++) {
        const int64_t column = (overlap && s >= ratio ? dims : 0) + c;
        peak = mm512_max_ps(peak, mm512_mask_loadu_ps(mm512_set1_ps(-INFINITY), m, slots + s * 2 * width + width + column));
      }
      m512 sum = mm512_setzero_ps();
      for (int64_t s = 0; s < span; s++) {
        const int64_t column = (overlap && s >= ratio ? dims : 0) + c;
        const m512 score = mm512_mask_loadu_ps(mm512_set1_ps(-INFINITY), m, slots + s * 2 * width + width + column);
        const m512 e = exp_nonpositive(mm512_sub_ps(score, peak));
        mm512_storeu_ps(weights[s], e);
        sum = mm512_add_ps(sum, e);
      }
      m512 pooled = mm512_setzero_ps();
      for (int64_t s = 0; s < span; s++) {
        const int64_t column = (overlap && s >= ratio ? dims : 0) + c;
        const m512 weight = mm512_div_ps(mm512_loadu_ps(weights[s]), sum);
        pooled = mm512_add_ps(pooled, mm512_mul_ps(weight, mm512_maskz_loadu_ps(m, slots + s * 2 * width + column)));
      }
      store_row(row, c, !fp32, m, pooled);
    }
    norm_and_rotate(row, dims, fp32, 1, norm, eps, cos2 + w * rope, sin2 + w * rope, rope, 0);
    uint8_t *out = cache + pages[w] * p[S_PAGE] + page_rows[w] * p[S_ROW];
    if (format == STORE_FP8) {
      float amax = 0.0f;
      for (int64_t c = 0; c < dims; c++) amax = fmaxf(amax, fabsf(load_at(row, c, fp32)));
      int exponent;
      const float mantissa = frexpf(fmaxf(amax, 1e-4f) / (float)FP8_MAX, &exponent);
      exponent -= mantissa == 0.5f; /* an exact power of two needs no rounding up */
      for (int64_t c = 0; c < dims; c++) {
        const float scaled = ldexpf(load_at(row, c, fp32), -exponent);
        out[c] = to_e4m3(fminf(fmaxf(scaled, -(float)FP8_MAX), (float)FP8_MAX));
      }
      const float scale = ldexpf(1.0f, exponent);
      __builtin_memcpy(out + dims, &scale, 4);
    } else {
      for (int64_t c = 0; c < dims; c++) {
        const float v = load_at(row, c, fp32);
        if (format == STORE_FP32) __builtin_memcpy(out + 4 * c, &v, 4);
        else ((uint16_t *)out)[c] = to_bf16(v);
      }
    }
  }
  return 0;
}
