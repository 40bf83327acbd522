/* band_attention: the whole sink attention of prefill chunks' query blocks over their bands of raw
 * rows and the compressed rows, for a bf16 model on AMX tiles (a Xeon since Sapphire Rapids;
 * dsv4/kernels/cpu_attention.py). Its oracle is dsv4.model.attention.banded_sink_attention.
 *
 * The queries and rows hold bf16 values, so the logits' products are exact on the tiles (bf16 pairs
 * summed into fp32). The softmax weights are fp32 and are not bf16 values: each is split into three
 * bf16 pieces that sum to it exactly (hi = bf16(w), mid = bf16(w - hi), lo = w - hi - mid), and the
 * value products run on the tiles once per piece. Every product is then exact and only the order of
 * the fp32 sums differs from fp32 arithmetic (the tiles flush pieces below 2^-126 to zero: weights
 * under 2^-109 of the row's peak, beyond any rounding that matters).
 *
 * The chunk's rows are packed once for every block whose band covers them, in the two layouts the
 * tiles read: keys as strips of 16 rows (`keys[group][pair][row]`: the logits' B operand) and values
 * as interleaved row pairs (`values[pair][dim]`: the value products' B operand). Queries are read in
 * place (a block's (query, head) rows are consecutive rows of q). Each work item is a block's range
 * of up to ITEM_ROWS (query, head) rows: its logits, then its softmax a row at a time while the row
 * is in cache, then its value products, divided by the row's denominator and rounded to bf16 as they
 * leave the tiles. OpenMP threads share torch's team, as in attention.c. */

#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "band.h"

enum { ITEM_ROWS = 128 };

/* Whether this process may use the tiles (Linux grants them on request; oneDNN asks the same). */
int amx_ready(void) {
  enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

/* 16 source rows from `first` as a strip of keys: strip[pair][row], rows at or past `count` zero. */
static void pack_keys(const uint16_t *rows, int64_t stride, int64_t first, int64_t count, int64_t D, uint32_t *strip) {
  const int64_t pairs = D / 2;
  for (int64_t j = 0; j < TILE; j++) {
    const uint32_t *src = first + j < count ? (const uint32_t *)(rows + (first + j) * stride) : NULL;
    for (int64_t d = 0; d < pairs; d++) strip[d * TILE + j] = src ? src[d] : 0;
  }
}

/* Source rows 2i and 2i + 1 as one row of interleaved pairs: out[d] = (row 2i [d], row 2i+1 [d]). */
static void pack_values(const uint16_t *rows, int64_t stride, int64_t first, int64_t count, int64_t D, uint32_t *out) {
  const uint16_t *even = first < count ? rows + first * stride : NULL;
  const uint16_t *odd = first + 1 < count ? rows + (first + 1) * stride : NULL;
  for (int64_t d = 0; d < D; d += 16) {
    const __m512i lo = even ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(even + d))) : _mm512_setzero_si512();
    const __m512i hi = odd ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)(odd + d))) : _mm512_setzero_si512();
    _mm512_storeu_si512((void *)(out + d), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

static inline __m512 bf16_to_fp32(__m256bh x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)x), 16));
}

typedef struct {
  const int64_t *p;
  const uint16_t *q;
  const uint32_t *keys, *values, *comp_keys, *comp_values; /* packed */
  const uint8_t *raw_allowed, *comp_allowed;
  const float *sink;
  uint16_t *out;
  float scale;
  int64_t packed_rows, raw_cols, cols; /* per batch row; raw_cols = round_up(K, 32), cols adds round_up(C, 32) */
} Shared;

typedef struct {
  float *logits;     /* [ITEM_ROWS][cols] */
  uint16_t *pieces;  /* [3][ITEM_ROWS][cols] */
  float *denom;      /* [ITEM_ROWS] */
  uint16_t *queries; /* [ITEM_ROWS][D]: a block's rows past its queries, zero */
  float *staged;     /* [4][TILE][TILE] */
} Scratch;

/* Row m of a block is valid: a (query, head) row of a query inside the chunk. */
static inline int valid_row(const Shared *s, int64_t n, int64_t m) {
  const int64_t *p = s->p;
  return m < p[A_Q] * p[A_H] && n * p[A_Q] + m / p[A_H] < p[A_L];
}

/* Logits of rows [m0, m0 + rows) of block (b, n) -> scratch logits (raw columns, then compressed). */
AMX static void item_logits(const Shared *s, const uint16_t *queries, int64_t b, int64_t n, int64_t rows, float *logits) {
  const int64_t *p = s->p;
  const int64_t D = p[A_D], cols = s->cols, steps = D / STEP, strip = D / 2 * TILE;
  const int64_t groups = s->packed_rows / TILE, first_group = n * p[A_Q] / TILE;
  for (int64_t c = 0; c < cols; c += 2 * TILE) {
    const uint32_t *k[2];
    for (int half = 0; half < 2; half++) {
      const int64_t col = c + half * TILE;
      k[half] = col < s->raw_cols ? s->keys + (b * groups + first_group + col / TILE) * strip
                                  : s->comp_keys + (b * ((cols - s->raw_cols) / TILE) + (col - s->raw_cols) / TILE) * strip;
    }
    for (int64_t m = 0; m < rows; m += 2 * TILE) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t step = 0; step < steps; step++) {
        _tile_loadd(4, queries + m * D + step * STEP, D * 2);
        _tile_loadd(5, queries + (m + TILE) * D + step * STEP, D * 2);
        _tile_loadd(6, k[0] + step * TILE * TILE, TILE * 4);
        _tile_loadd(7, k[1] + step * TILE * TILE, TILE * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, logits + m * cols + c, cols * 4);
      _tile_stored(1, logits + m * cols + c + TILE, cols * 4);
      _tile_stored(2, logits + (m + TILE) * cols + c, cols * 4);
      _tile_stored(3, logits + (m + TILE) * cols + c + TILE, cols * 4);
    }
  }
}

/* The softmax numerators of an item's rows as three bf16 pieces each, and their denominators. */
static void item_softmax(const Shared *s, int64_t b, int64_t n, int64_t m0, int64_t rows, Scratch *scratch) {
  const int64_t *p = s->p;
  const int64_t H = p[A_H], cols = s->cols, plane = ITEM_ROWS * cols;
  for (int64_t r = 0; r < rows; r++) {
    const int64_t m = m0 + r;
    float *row = scratch->logits + r * cols;
    uint16_t *hi = scratch->pieces + r * cols, *mid = hi + plane, *lo = mid + plane;
    if (!valid_row(s, n, m)) { /* (past the chunk: weighs nothing, never stored) */
      memset(hi, 0, cols * 2), memset(mid, 0, cols * 2), memset(lo, 0, cols * 2);
      scratch->denom[r] = 1.0f;
      continue;
    }
    const int64_t query = m / H;
    const float sink = s->sink[m % H];
    __m512 peak = mask_logits(row, 0, p[A_K], s->raw_cols,
                              s->raw_allowed + b * p[A_RA_B] + n * p[A_RA_N] + query * p[A_RA_J], s->scale,
                              _mm512_set1_ps(sink));
    if (cols > s->raw_cols)
      peak = mask_logits(row, s->raw_cols, p[A_C], cols,
                         s->comp_allowed + b * p[A_CA_B] + n * p[A_CA_N] + query * p[A_CA_J], s->scale, peak);
    const float top = _mm512_reduce_max_ps(peak);
    peak = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t c = 0; c < cols; c += 16) {
      const __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + c), peak));
      sum = _mm512_add_ps(sum, w);
      const __m256bh w_hi = _mm512_cvtneps_pbh(w);
      const __m512 rest = _mm512_sub_ps(w, bf16_to_fp32(w_hi));
      const __m256bh w_mid = _mm512_cvtneps_pbh(rest);
      const __m256bh w_lo = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, bf16_to_fp32(w_mid)));
      _mm256_storeu_si256((void *)(hi + c), (__m256i)w_hi);
      _mm256_storeu_si256((void *)(mid + c), (__m256i)w_mid);
      _mm256_storeu_si256((void *)(lo + c), (__m256i)w_lo);
    }
    const __m512 sink_term = exp_nonpositive(_mm512_set1_ps(sink - top));
    scratch->denom[r] = _mm512_reduce_add_ps(sum) + _mm_cvtss_f32(_mm512_castps512_ps128(sink_term));
  }
}

/* The value products of an item's rows, divided by their denominators, into out as bf16. */
AMX static void item_values(const Shared *s, int64_t b, int64_t n, int64_t m0, int64_t rows, Scratch *scratch) {
  const int64_t *p = s->p;
  const int64_t D = p[A_D], H = p[A_H], cols = s->cols, plane = ITEM_ROWS * cols;
  const uint32_t *band = s->values + (b * s->packed_rows / 2 + n * p[A_Q] / 2) * D;
  const uint32_t *comp = s->comp_values + b * (cols - s->raw_cols) / 2 * D;
  for (int64_t m = 0; m < rows; m += 2 * TILE) {
    for (int64_t d = 0; d < D; d += 2 * TILE) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t c = 0; c < cols; c += STEP) {
        const uint32_t *v = c < s->raw_cols ? band + c / 2 * D : comp + (c - s->raw_cols) / 2 * D;
        _tile_loadd(6, v + d, D * 4);
        _tile_loadd(7, v + d + TILE, D * 4);
        for (int piece = 0; piece < 3; piece++) {
          const uint16_t *w = scratch->pieces + piece * plane + m * cols + c;
          _tile_loadd(4, w, cols * 2);
          _tile_loadd(5, w + TILE * cols, cols * 2);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
      }
      float *staged = scratch->staged;
      _tile_stored(0, staged, TILE * 4);
      _tile_stored(1, staged + TILE * TILE, TILE * 4);
      _tile_stored(2, staged + 2 * TILE * TILE, TILE * 4);
      _tile_stored(3, staged + 3 * TILE * TILE, TILE * 4);
      for (int t = 0; t < 4; t++) {
        for (int64_t r = 0; r < TILE; r++) {
          const int64_t local = m + (t / 2) * TILE + r, row = m0 + local;
          if (!valid_row(s, n, row)) continue;
          const int64_t token = n * p[A_Q] + row / H;
          const __m512 value = _mm512_div_ps(_mm512_loadu_ps(staged + (t * TILE + r) * TILE),
                                             _mm512_set1_ps(scratch->denom[local]));
          uint16_t *at = s->out + ((b * p[A_L] + token) * H + row % H) * D + d + (t % 2) * TILE;
          _mm256_storeu_si256((void *)at, (__m256i)_mm512_cvtneps_pbh(value));
        }
      }
    }
  }
}

AMX static void run_item(const Shared *s, int64_t item, int64_t items_per_block, Scratch *scratch) {
  const int64_t *p = s->p;
  const int64_t D = p[A_D], M = p[A_Q] * p[A_H], N = p[A_N];
  const int64_t block = item / items_per_block, b = block / N, n = block % N;
  const int64_t m0 = item % items_per_block * ITEM_ROWS;
  const int64_t rows = round_up(M, 2 * TILE) - m0 < ITEM_ROWS ? round_up(M, 2 * TILE) - m0 : ITEM_ROWS;
  /* the block's (query, head) rows are q's rows from token n*Q on; a copy where some lie past the chunk */
  const uint16_t *queries = s->q + b * p[A_Q_B] + (n * p[A_Q]) * p[A_Q_T] + m0 * D;
  if (!valid_row(s, n, m0 + rows - 1)) {
    for (int64_t r = 0; r < rows; r++) {
      if (valid_row(s, n, m0 + r)) memcpy(scratch->queries + r * D, queries + r * D, D * 2);
      else memset(scratch->queries + r * D, 0, D * 2);
    }
    queries = scratch->queries;
  }
  item_logits(s, queries, b, n, rows, scratch->logits);
  item_softmax(s, b, n, m0, rows, scratch);
  item_values(s, b, n, m0, rows, scratch);
}

/* Returns 0, -1 where scratch memory could not be had. out [B, L, H, D] bf16, contiguous. */
AMX int band_attention(const uint16_t *q, const uint16_t *rows, const uint8_t *raw_allowed, const uint16_t *comp,
                       const uint8_t *comp_allowed, const float *sink, uint16_t *out, const int64_t *p, float scale,
                       int threads) {
  const int64_t B = p[A_B], N = p[A_N], Q = p[A_Q], D = p[A_D], M = Q * p[A_H];
  const int64_t raw_cols = round_up(p[A_K], STEP), comp_cols = round_up(p[A_C], STEP), cols = raw_cols + comp_cols;
  const int64_t packed_rows = round_up((N - 1) * Q + raw_cols, STEP); /* every band's columns */
  uint32_t *keys = aligned_alloc(64, (size_t)(B * packed_rows * D * 2));
  uint32_t *values = aligned_alloc(64, (size_t)(B * packed_rows * D * 2));
  uint32_t *comp_keys = aligned_alloc(64, (size_t)(B * (comp_cols ? comp_cols : STEP) * D * 2));
  uint32_t *comp_values = aligned_alloc(64, (size_t)(B * (comp_cols ? comp_cols : STEP) * D * 2));
  int failed = !keys || !values || !comp_keys || !comp_values;
  const Shared shared = {p, q, keys, values, comp_keys, comp_values, raw_allowed, comp_allowed, sink, out, scale,
                         packed_rows, raw_cols, cols};
  const int64_t strips = packed_rows / STEP, comp_strips = comp_cols / STEP, per_batch = strips + comp_strips;
  const int64_t items_per_block = (round_up(M, 2 * TILE) + ITEM_ROWS - 1) / ITEM_ROWS, items = B * N * items_per_block;
  if (!failed) {
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) reduction(| : failed)
    {
      /* 32 source rows at a time: two strips of keys, sixteen rows of value pairs */
#pragma omp for schedule(static)
      for (int64_t unit = 0; unit < B * per_batch; unit++) {
        const int64_t b = unit / per_batch, at = unit % per_batch;
        const int compressed = at >= strips;
        const uint16_t *source = compressed ? comp + b * p[A_COMP_B] : rows + b * p[A_ROW_B];
        const int64_t stride = compressed ? p[A_COMP_C] : p[A_ROW_R], count = compressed ? p[A_C] : p[A_R];
        const int64_t first = (compressed ? at - strips : at) * STEP, height = compressed ? comp_cols : packed_rows;
        uint32_t *k = (compressed ? comp_keys : keys) + (b * height + first) * D / 2;
        uint32_t *v = (compressed ? comp_values : values) + (b * height + first) / 2 * D;
        pack_keys(source, stride, first, count, D, k);
        pack_keys(source, stride, first + TILE, count, D, k + TILE * D / 2);
        for (int64_t pair = 0; pair < TILE; pair++) pack_values(source, stride, first + 2 * pair, count, D, v + pair * D);
      }
      Scratch scratch = {aligned_alloc(64, (size_t)(ITEM_ROWS * cols * 4)), aligned_alloc(64, (size_t)(3 * ITEM_ROWS * cols * 2)),
                         aligned_alloc(64, ITEM_ROWS * 4), aligned_alloc(64, (size_t)(ITEM_ROWS * D * 2)),
                         aligned_alloc(64, 4 * TILE * TILE * 4)};
      const int ready = scratch.logits && scratch.pieces && scratch.denom && scratch.queries && scratch.staged;
      failed |= !ready;
      if (ready) configure_tiles();
#pragma omp for schedule(static)
      for (int64_t item = 0; item < items; item++)
        if (ready) run_item(&shared, item, items_per_block, &scratch);
      if (ready) _tile_release();
      free(scratch.logits), free(scratch.pieces), free(scratch.denom), free(scratch.queries), free(scratch.staged);
    }
  }
  free(keys), free(values), free(comp_keys), free(comp_values);
  return failed ? -1 : 0;
}
