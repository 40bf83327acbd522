/* band_attention_dots: the whole sink attention of prefill chunks' query blocks over their bands of
 * raw rows and the compressed rows, for a bf16 model on a CPU without AMX tiles (AVX512-BF16, a Zen 4
 * or 5, or AVX2, simd.h; band_amx.c is the tiles' version, with the same arguments and results), and for
 * an fp32 model on any CPU the kernels run on (p[A_FP32]: its logits are fp32 FMAs, strips of 16 keys' dims, the
 * rest alike). Its oracle is dsv4.model.attention.banded_sink_attention.
 *
 * The queries and rows hold bf16 values, so the logits' products are exact as vdpbf16ps (bf16 pairs
 * summed into fp32 lanes): a block's keys are packed once into strips of 16 (`strips[strip][pair][key]`)
 * and each query row's pair, read in place, is broadcast against two strips (8 rows x 32 keys in 16
 * registers over the whole head dim; 4 rows x 16 keys on AVX2, whose registers hold a quarter of the bytes).
 * The softmax weights stay fp32, and the value products are fp32 FMAs over the block's rows converted to
 * fp32 once (an fp32 weight times a bf16 value is exact in fp32): 4 rows x 64 dims in 16 registers over
 * the columns (4 rows x 16 dims on AVX2). Every product is exact, so only the
 * order of the fp32 sums differs from fp32 arithmetic. Each work item is a block's range of up to
 * ITEM_ROWS (query, head) rows, over only the columns some of its queries attend to: its logits, its
 * softmax a row at a time, its value products divided by the rows' denominators and rounded to bf16.
 * Each thread takes a run of consecutive items (most share their block's packed rows) of an equal
 * share of the work. OpenMP threads share torch's team, as in attention.c. */

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "band.h"
#include "dots.h"

/* LOGIT_ROWS query rows' logits against LOGIT_STRIPS strips of keys, and VALUE_ROWS rows' value products over
 * up to VALUE_VECTORS vectors of dims, summed at once: as many sums as the registers hold (simd.h). Each
 * sum keeps its order at any blocking, so the results do not depend on it. */
enum { ITEM_ROWS = 64, STRIP = 16, VALUE_ROWS = 4 };
enum { LOGIT_ROWS = VECTOR_REGISTERS >= 32 ? 8 : 4, LOGIT_STRIPS = VECTOR_REGISTERS >= 32 ? 2 : 1,
       VALUE_VECTORS = VECTOR_REGISTERS >= 32 ? 4 : 1 };

#define INLINE static inline __attribute__((always_inline))

typedef struct {
  const int64_t *p;
  const char *q, *rows, *comp; /* bf16, or fp32 (`fp32`) */
  const uint8_t *raw_allowed, *comp_allowed;
  const float *sink;
  char *out;
  float scale;
  int64_t raw_cols, cols; /* raw_cols = round_up(K, STRIP), cols adds round_up(C, STRIP) */
  int fp32;
  int64_t size; /* bytes of an element */
} Shared;

typedef struct {
  uint32_t *strips;      /* [cols / STRIP][D / 2][STRIP]: the block's keys as bf16 pairs ([D][STRIP] fp32) */
  float *values;         /* [cols][D]: the same rows in fp32 */
  float *weights;        /* [ITEM_ROWS][cols]: logits, then softmax numerators */
  float *denom;          /* [ITEM_ROWS] */
  const uint32_t *zeros; /* [D]: the query of a row past the chunk */
  int64_t packed;        /* the block (b * N + n) whose rows strips and values hold; -1: none yet */
} Scratch;

/* Column c's row of block (b, n): its band's rows, then the compressed rows; NULL where it is none
 * (band columns past K or rows past R, compressed columns past C: zeros). */
static const char *column_row(const Shared *s, int64_t b, int64_t n, int64_t c) {
  const int64_t *p = s->p;
  if (c < s->raw_cols) {
    const int64_t r = n * p[A_Q] + c;
    return c < p[A_K] && r < p[A_R] ? s->rows + (b * p[A_ROW_B] + r * p[A_ROW_R]) * s->size : NULL;
  }
  c -= s->raw_cols;
  return c < p[A_C] ? s->comp + (b * p[A_COMP_B] + c * p[A_COMP_C]) * s->size : NULL;
}

/* Block (b, n)'s columns into the scratch: strips of keys, gathered 16 rows at a time (the columns of
 * a strip are rows `stride` apart: band rows, or compressed rows), and the rows in fp32. */
static void pack_block(const Shared *s, int64_t b, int64_t n, Scratch *scratch) {
  const int64_t *p = s->p;
  const int64_t D = p[A_D], words = s->fp32 ? D : D / 2; /* a key's 32-bit words: fp32 dims, or bf16 pairs */
  for (int64_t c = 0; c < s->cols; c += STRIP) {
    const int compressed = c >= s->raw_cols;
    const int64_t stride = compressed ? p[A_COMP_C] : p[A_ROW_R];
    mmask16 present = 0;
    for (int i = 0; i < STRIP; i++) present |= (mmask16)((column_row(s, b, n, c + i) != NULL) << i);
    uint32_t *strip = scratch->strips + c / STRIP * words * STRIP;
    const char *first = column_row(s, b, n, c);
    if (first == NULL) { /* (a strip's present columns are its first ones) */
      memset(strip, 0, (size_t)words * STRIP * 4);
    } else {
      const m512i at = mm512_mullo_epi32(mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            mm512_set1_epi32((int)(stride * s->size)));
      for (int64_t d = 0; d < words; d++)
        mm512_storeu_si512((void *)(strip + d * STRIP),
                            mm512_mask_i32gather_epi32(mm512_setzero_si512(), present, at, first + 4 * d, 1));
    }
    for (int i = 0; i < STRIP; i++) {
      const char *row = column_row(s, b, n, c + i);
      float *value = scratch->values + (c + i) * D;
      if (row == NULL) {
        memset(value, 0, (size_t)D * 4);
        continue;
      }
      for (int64_t d = 0; d < D; d += 16) {
        const mmask16 lanes = first_lanes(D - d);
        mm512_mask_storeu_ps(value + d, lanes, load_row(row, d, !s->fp32, lanes));
      }
    }
  }
}

/* Logits of the item's rows (queries[r]: row r's words, bf16 pairs or fp32 dims) against strips
 * [c, c + STRIP * strips) of `words` words a key. */
INLINE void logit_tile(const uint32_t *const *queries, const uint32_t *strip, int64_t words, int strips, const int fp32,
                       float *out, int64_t cols) {
  m512 acc[LOGIT_ROWS][2];
  for (int r = 0; r < LOGIT_ROWS; r++) acc[r][0] = acc[r][1] = mm512_setzero_ps();
  for (int64_t d = 0; d < words; d++) {
    const m512i k0 = mm512_loadu_si512((const void *)(strip + d * STRIP));
    const m512i k1 = strips == 2 ? mm512_loadu_si512((const void *)(strip + (words + d) * STRIP)) : k0;
#pragma GCC unroll 8
    for (int r = 0; r < LOGIT_ROWS; r++) {
      const m512i a = mm512_set1_epi32((int)queries[r][d]);
      if (fp32) {
        acc[r][0] = mm512_fmadd_ps(mm512_castsi512_ps(a), mm512_castsi512_ps(k0), acc[r][0]);
        if (strips == 2) acc[r][1] = mm512_fmadd_ps(mm512_castsi512_ps(a), mm512_castsi512_ps(k1), acc[r][1]);
      } else {
        acc[r][0] = mm512_dpbf16_ps(acc[r][0], a, k0);
        if (strips == 2) acc[r][1] = mm512_dpbf16_ps(acc[r][1], a, k1);
      }
    }
  }
  for (int r = 0; r < LOGIT_ROWS; r++) {
    mm512_storeu_ps(out + r * cols, acc[r][0]);
    if (strips == 2) mm512_storeu_ps(out + r * cols + STRIP, acc[r][1]);
  }
}

/* The value products of `rows` weight rows over the columns of `spans`, dims [d, d + 16 * vectors), divided by
 * their denominators, into out[r] + d: fp32, or rounded to bf16. */
INLINE void value_tile(const float *weights, const float *values, const float *denom, int64_t cols,
                       const int64_t (*spans)[2], int64_t D, int64_t d, int rows, int vectors, int fp32,
                       void *const *out) {
  m512 acc[VALUE_ROWS][VALUE_VECTORS];
  for (int r = 0; r < VALUE_ROWS; r++)
    for (int v = 0; v < VALUE_VECTORS; v++) acc[r][v] = mm512_setzero_ps();
  for (int span = 0; span < 2; span++)
    for (int64_t c = spans[span][0]; c < spans[span][1]; c++) {
      m512 value[VALUE_VECTORS];
      for (int v = 0; v < vectors; v++) value[v] = mm512_loadu_ps(values + c * D + d + 16 * v);
#pragma GCC unroll 4
      for (int r = 0; r < VALUE_ROWS; r++) {
        const m512 w = mm512_set1_ps(weights[r * cols + c]);
        for (int v = 0; v < vectors; v++) acc[r][v] = mm512_fmadd_ps(w, value[v], acc[r][v]);
      }
    }
  for (int r = 0; r < rows; r++)
    for (int v = 0; v < vectors; v++) {
      const mmask16 lanes = first_lanes(D - d - 16 * v);
      const m512 result = mm512_div_ps(acc[r][v], mm512_set1_ps(denom[r]));
      if (fp32) mm512_mask_storeu_ps((float *)out[r] + d + 16 * v, lanes, result);
      else mm256_mask_storeu_epi16((uint16_t *)out[r] + d + 16 * v, lanes, mm512_cvtneps_pbh(result));
    }
}

/* The columns [*first, *last) of allowed[query][0 .. count) (rows `stride` apart) that any of `queries`
 * queries attends to, widened to whole strips; an empty span where none. */
static void allowed_span(const uint8_t *allowed, int64_t stride, int64_t queries, int64_t count, int64_t *first,
                         int64_t *last) {
  int64_t lo = count, hi = 0;
  for (int64_t j = 0; j < queries; j++) {
    const uint8_t *row = allowed + j * stride;
    int64_t c = 0, e = count;
    while (c < count && !row[c]) c++;
    if (c == count) continue;
    while (!row[e - 1]) e--;
    lo = c < lo ? c : lo, hi = e > hi ? e : hi;
  }
  *first = lo < hi ? lo / STRIP * STRIP : 0;
  *last = lo < hi ? round_up(hi, STRIP) : 0;
}

/* A work item where it lies: block (b, n), its rows [m0, m0 + valid) inside the chunk, and the columns
 * any of them attends to. */
typedef struct {
  int64_t b, n, m0, valid;
  int64_t spans[2][2]; /* [raw, compressed][first, last) columns */
} Item;

static Item locate(const Shared *s, int64_t item, int64_t items_per_block) {
  const int64_t *p = s->p;
  const int64_t H = p[A_H], N = p[A_N], M = p[A_Q] * H, block = item / items_per_block;
  Item it = {block / N, block % N, item % items_per_block * ITEM_ROWS, 0, {{0, 0}, {s->raw_cols, s->raw_cols}}};
  const int64_t rows = M - it.m0 < ITEM_ROWS ? M - it.m0 : ITEM_ROWS;
  /* (a block's last rows may lie past the chunk) */
  const int64_t inside = (p[A_L] - it.n * p[A_Q]) * H - it.m0;
  it.valid = inside < 0 ? 0 : inside < rows ? inside : rows;
  if (it.valid == 0) return it;
  /* Only the columns some query of the item attends to are computed (a masked column weighs exactly 0):
   * the band's rows before a prompt's first position, the compressed rows not yet complete. */
  const int64_t first_query = it.m0 / H, queries = (it.m0 + it.valid - 1) / H - first_query + 1;
  allowed_span(s->raw_allowed + it.b * p[A_RA_B] + it.n * p[A_RA_N] + first_query * p[A_RA_J], p[A_RA_J], queries,
               p[A_K], &it.spans[0][0], &it.spans[0][1]);
  if (s->cols > s->raw_cols) {
    allowed_span(s->comp_allowed + it.b * p[A_CA_B] + it.n * p[A_CA_N] + first_query * p[A_CA_J], p[A_CA_J], queries,
                 p[A_C], &it.spans[1][0], &it.spans[1][1]);
    it.spans[1][0] += s->raw_cols, it.spans[1][1] += s->raw_cols;
  }
  return it;
}

/* An item's work, in (row, column) products of a head dim (its rows' softmax and stores: a strip's worth). */
static int64_t cost(const Item *it) {
  return it->valid * (it->spans[0][1] - it->spans[0][0] + it->spans[1][1] - it->spans[1][0] + STRIP);
}

static void run_item(const Shared *s, const Item *it, Scratch *scratch) {
  const int64_t *p = s->p;
  const int64_t D = p[A_D], H = p[A_H], words = s->fp32 ? D : D / 2, cols = s->cols;
  const int64_t b = it->b, n = it->n, m0 = it->m0, valid = it->valid, block = b * p[A_N] + n;
  const int64_t(*spans)[2] = it->spans;
  if (scratch->packed != block) {
    pack_block(s, b, n, scratch);
    scratch->packed = block;
  }
  const int64_t first_query = m0 / H;
  const uint8_t *raw_allowed = s->raw_allowed + b * p[A_RA_B] + n * p[A_RA_N] + first_query * p[A_RA_J];
  const uint8_t *comp_allowed = cols > s->raw_cols
                                    ? s->comp_allowed + b * p[A_CA_B] + n * p[A_CA_N] + first_query * p[A_CA_J] : NULL;
  /* the block's (query, head) rows are q's rows from token n*Q on */
  const char *q = s->q + (b * p[A_Q_B] + n * p[A_Q] * p[A_Q_T] + m0 * D) * s->size;
  for (int64_t m = 0; m < valid; m += LOGIT_ROWS) {
    const uint32_t *queries_at[LOGIT_ROWS];
    for (int r = 0; r < LOGIT_ROWS; r++)
      queries_at[r] = m + r < valid ? (const uint32_t *)(q + (m + r) * D * s->size) : scratch->zeros;
    float *out = scratch->weights + m * cols;
    for (int span = 0; span < 2; span++) {
      int64_t c = spans[span][0];
      for (; LOGIT_STRIPS == 2 && c + 2 * STRIP <= spans[span][1]; c += 2 * STRIP) {
        const uint32_t *strip = scratch->strips + c / STRIP * words * STRIP;
        if (s->fp32) logit_tile(queries_at, strip, words, 2, 1, out + c, cols);
        else logit_tile(queries_at, strip, words, 2, 0, out + c, cols);
      }
      for (; c < spans[span][1]; c += STRIP) {
        const uint32_t *strip = scratch->strips + c / STRIP * words * STRIP;
        if (s->fp32) logit_tile(queries_at, strip, words, 1, 1, out + c, cols);
        else logit_tile(queries_at, strip, words, 1, 0, out + c, cols);
      }
    }
  }
  for (int64_t r = 0; r < valid; r++) { /* each row's softmax numerators and denominator */
    const int64_t query = (m0 + r) / H - first_query;
    const float sink = s->sink[(m0 + r) % H];
    float *row = scratch->weights + r * cols;
    const int64_t raw_first = spans[0][0], comp_first = spans[1][0] - s->raw_cols;
    m512 peak = mask_logits(row, raw_first, p[A_K] - raw_first, spans[0][1],
                              raw_allowed + query * p[A_RA_J] + raw_first, s->scale, mm512_set1_ps(sink));
    if (spans[1][1] > spans[1][0])
      peak = mask_logits(row, spans[1][0], p[A_C] - comp_first, spans[1][1],
                         comp_allowed + query * p[A_CA_J] + comp_first, s->scale, peak);
    const float top = mm512_reduce_max_ps(peak);
    peak = mm512_set1_ps(top);
    m512 sum = mm512_setzero_ps();
    for (int span = 0; span < 2; span++)
      for (int64_t c = spans[span][0]; c < spans[span][1]; c += 16) {
        const m512 w = exp_nonpositive(mm512_sub_ps(mm512_loadu_ps(row + c), peak));
        mm512_storeu_ps(row + c, w);
        sum = mm512_add_ps(sum, w);
      }
    const m512 sink_term = exp_nonpositive(mm512_set1_ps(sink - top));
    scratch->denom[r] = mm512_reduce_add_ps(sum) + _mm_cvtss_f32(mm512_castps512_ps128(sink_term));
  }
  for (int64_t m = 0; m < valid; m += VALUE_ROWS) {
    const int count = valid - m < VALUE_ROWS ? (int)(valid - m) : VALUE_ROWS;
    void *out[VALUE_ROWS];
    for (int r = 0; r < count; r++) {
      const int64_t row = m0 + m + r, token = n * p[A_Q] + row / H;
      out[r] = s->out + ((b * p[A_L] + token) * H + row % H) * D * s->size;
    }
    /* (a last tile's rows past `count` multiply whatever the scratch holds there and are never stored) */
    const float *weights = scratch->weights + m * cols;
    int64_t d = 0;
    for (; d + 16 * VALUE_VECTORS <= D; d += 16 * VALUE_VECTORS)
      value_tile(weights, scratch->values, scratch->denom + m, cols, spans, D, d, count, VALUE_VECTORS, s->fp32, out);
    for (; d < D; d += 16)
      value_tile(weights, scratch->values, scratch->denom + m, cols, spans, D, d, count, 1, s->fp32, out);
  }
}

/* Returns 0, -1 where scratch memory could not be had. out [B, L, H, D] of q's dtype, contiguous; D even. */
int band_attention_dots(const void *q, const void *rows, const uint8_t *raw_allowed, const void *comp,
                        const uint8_t *comp_allowed, const float *sink, void *out, const int64_t *p, float scale,
                        int threads) {
  const int64_t D = p[A_D], M = p[A_Q] * p[A_H];
  const int64_t raw_cols = round_up(p[A_K], STRIP), cols = raw_cols + round_up(p[A_C], STRIP);
  const Shared shared = {p, q, rows, comp, raw_allowed, comp_allowed, sink, out, scale, raw_cols, cols,
                         (int)p[A_FP32], p[A_FP32] ? 4 : 2};
  const int64_t items_per_block = (M + ITEM_ROWS - 1) / ITEM_ROWS, items = p[A_B] * p[A_N] * items_per_block;
  Item *plan = malloc((size_t)(items > 0 ? items : 1) * sizeof(Item));
  int failed = plan == NULL;
  if (!failed) {
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
      /* (the weights padded by a tile of rows: the last tiles of rows write and read whole tiles; the values
       * by a vector: a last dims' vector reads one whole) */
      Scratch scratch = {aligned_alloc(64, (size_t)(cols * D * 4)), aligned_alloc(64, (size_t)(cols * D + 16) * 4),
                         aligned_alloc(64, (size_t)((ITEM_ROWS + LOGIT_ROWS) * cols * 4)),
                         aligned_alloc(64, (ITEM_ROWS + LOGIT_ROWS) * 4), calloc((size_t)D + 1, 4), -1};
      const int ready = scratch.strips && scratch.values && scratch.weights && scratch.denom && scratch.zeros;
      failed |= !ready;
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; item++) plan[item] = locate(&shared, item, items_per_block);
      /* Each thread takes a run of consecutive items (which share their blocks' packed rows) of an equal
       * share of the work: the blocks of a prompt's first chunk see fewer rows the earlier they lie. */
      int64_t total = 0;
      for (int64_t item = 0; item < items; item++) total += cost(&plan[item]);
      const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
      int64_t done = 0;
      for (int64_t item = 0; item < items && ready; item++) {
        const int64_t work = cost(&plan[item]);
        if (work && (done + work / 2) * team / total == me) run_item(&shared, &plan[item], &scratch);
        done += work;
      }
      free(scratch.strips), free(scratch.values), free(scratch.weights), free(scratch.denom), free((void *)scratch.zeros);
    }
  }
  free(plan);
  return failed ? -1 : 0;
}
