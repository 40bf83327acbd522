/* The MoE of any number of tokens in blocks of up to 16 picks (dsv4/kernels/cpu_moe.py `moe_blocks`), for
 * a bf16 model: the sums of moe.c's kernel, rounded where it rounds (and dsv4.model.moe.grouped), with
 * the products of bf16 pairs summed into fp32 (exact products, fp32 sums in another order) on AMX
 * tiles (moe_amx.c's `moe_tiles`) or as vdpbf16ps (`moe_dots`, below).
 *
 * The picks' activations are packed once per block of up to 16 of an expert's picks (or of the tokens,
 * for the shared expert) as pairs of columns (`packed[pair][pick]`); the weights are read where they
 * lie, 16 rows at a time. Pass 1: each (block, 16 hidden units) item multiplies the gate and up rows
 * against its block and stores the SwiGLU's units, packed the same way for pass 2. Pass 2: each 16
 * output rows of every token, the blocks in expert order (as the grouped path adds them), then the
 * shared expert's. OpenMP threads share torch's team, as in attention.c. */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "dots.h"
#include "moe.h"
#include "simd.h"

enum { TILE = BLOCK_PICKS };

typedef struct {
  int64_t source; /* the expert, or the number of experts: the shared one */
  int64_t first;  /* its first pick in the sorted picks, or its first token */
  int64_t count;  /* picks (tokens) in the block, at most TILE */
} Block;

/* The block's activations (rows of `width` bf16) as B operands: packed[pair][column], zero past count */
static void pack_block(const uint16_t *const *rows, int64_t count, int64_t width, uint32_t *packed) {
  for (int64_t pair = 0; pair < width / 2; pair++)
    for (int64_t j = 0; j < TILE; j++) packed[pair * TILE + j] = j < count ? ((const uint32_t *)rows[j])[pair] : 0;
}

/* One row of 16 gate and up sums -> the SwiGLU's units as bf16: bf16(bf16(silu(min(bf16(gate), limit))) *
 * clamp(bf16(up))), as moe.c computes them one at a time (silu as gate * sigmoid(gate), the sigmoid
 * from exp_nonpositive of -|gate|: within a few fp32 ulp of moe.c's gate / (1 + expf(-gate))) */
static inline __m256i swiglu_units(const float *gates, const float *ups, float limit) {
  const m512 top = mm512_set1_ps(limit), one = mm512_set1_ps(1.0f);
  const m512 gate = mm512_min_ps(round_row(mm512_loadu_ps(gates), 1), top);
  const m512 up = mm512_min_ps(mm512_max_ps(round_row(mm512_loadu_ps(ups), 1), mm512_set1_ps(-limit)), top);
  const m512 e = exp_nonpositive(mm512_sub_ps(mm512_setzero_ps(), mm512_abs_ps(gate)));
  const mmask16 negative = mm512_cmp_ps_mask(gate, mm512_setzero_ps(), _CMP_LT_OQ);
  const m512 sigmoid = mm512_div_ps(mm512_mask_mov_ps(one, negative, e), mm512_add_ps(one, e));
  return mm512_cvtneps_pbh(mm512_mul_ps(round_row(mm512_mul_ps(gate, sigmoid), 1), up));
}

int moe_blocks(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
               const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
               const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads,
               const BlockProducts *products) {
  const int64_t n_tok = p[T_TOKENS], n_pick = p[T_PICKS], n_exp = p[T_EXPERTS], hidden_n = p[T_HIDDEN];
  const int64_t inter = p[T_INTER], shared = p[T_SHARED], width = inter > shared ? inter : shared;
  /* the blocks: each expert's picks (sorted by expert, this rank's first), then the tokens' shared expert */
  const int64_t most = n_pick / TILE + n_exp + (shared ? n_tok / TILE + 1 : 0) + 1;
  Block *blocks = malloc(sizeof(Block) * most);
  if (!blocks) return 1;
  int64_t count = 0;
  for (int64_t k = 0; k < n_pick;) {
    const int64_t g = expert_of(places[k], ends, n_exp, keep[k]);
    if (g < 0) break; /* (other ranks' picks sort last) */
    int64_t end = k;
    while (end < n_pick && end - k < TILE && expert_of(places[end], ends, n_exp, keep[end]) == g) end++;
    blocks[count++] = (Block){g, k, end - k};
    k = end;
  }
  const int64_t routed_blocks = count;
  for (int64_t t = 0; shared && t < n_tok; t += TILE) blocks[count++] = (Block){n_exp, t, n_tok - t < TILE ? n_tok - t : TILE};
  uint32_t *packed_x = malloc(sizeof(uint32_t) * (count ? count : 1) * hidden_n / 2 * TILE);
  uint32_t *packed_h = malloc(sizeof(uint32_t) * (count ? count : 1) * width / 2 * TILE);
  if (!packed_x || !packed_h) {
    free(blocks), free(packed_x), free(packed_h);
    return 1;
  }
  const int64_t chunks = width / TILE, out_chunks = hidden_n / TILE;
#pragma omp parallel num_threads(threads)
  {
    if (products->begin) products->begin();
    float gates[TILE * TILE], ups[TILE * TILE];
#pragma omp for schedule(static)
    for (int64_t b = 0; b < count; b++) {
      const uint16_t *rows[TILE];
      for (int64_t j = 0; j < blocks[b].count; j++)
        rows[j] = x + (blocks[b].source == n_exp ? blocks[b].first + j : tokens[blocks[b].first + j]) * hidden_n;
      pack_block(rows, blocks[b].count, hidden_n, packed_x + b * hidden_n / 2 * TILE);
    }
    /* pass 1: h = bf16(bf16(silu(min(gate, limit))) * clamp(up)), packed as pass 2's B operands */
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < count * chunks; item++) {
      const Block *block = blocks + item / chunks;
      const int64_t is_shared = block->source == n_exp, width_u = is_shared ? shared : inter;
      const int64_t i0 = item % chunks * TILE;
      if (i0 >= width_u) continue;
      const uint16_t *w = is_shared ? shared_w13 : w13 + block->source * 2 * inter * hidden_n;
      const uint32_t *b_x = packed_x + item / chunks * hidden_n / 2 * TILE;
      products->gate_up(w + i0 * hidden_n, w + (width_u + i0) * hidden_n, hidden_n, b_x, gates, ups);
      /* units i0 + r and i0 + r + 1 of the block's 16 columns as one row of packed pairs (columns past
       * the block's picks hold what their zero activations give: never read back) */
      uint32_t *h = packed_h + item / chunks * width / 2 * TILE + i0 / 2 * TILE;
      for (int64_t r = 0; r < TILE; r += 2)
        mm512_storeu_si512((void *)(h + r / 2 * TILE),
                            mm512_or_si512(mm512_cvtepu16_epi32(swiglu_units(gates + r * TILE, ups + r * TILE, limit)),
                                            mm512_slli_epi32(mm512_cvtepu16_epi32(swiglu_units(
                                                gates + (r + 1) * TILE, ups + (r + 1) * TILE, limit)), 16)));
    }
    /* pass 2 (after the implied barrier): 16 output rows of every token at a time */
#pragma omp for schedule(static)
    for (int64_t c = 0; c < out_chunks; c++) {
      const int64_t o0 = c * TILE;
      float downs[TILE * TILE];
      for (int64_t t = 0; t < n_tok; t++)
        for (int64_t r = 0; r < TILE; r++) out[t * hidden_n + o0 + r] = 0.0f;
      const m512i down_column = mm512_mullo_epi32(mm512_set1_epi32(TILE), mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      for (int64_t b = 0; b < count; b++) {
        const int64_t is_shared = b >= routed_blocks, width_u = is_shared ? shared : inter;
        const uint16_t *w = is_shared ? shared_w2 + o0 * shared : w2 + (blocks[b].source * hidden_n + o0) * inter;
        const uint32_t *b_h = packed_h + b * width / 2 * TILE;
        products->down(w, width_u, b_h, downs);
        for (int64_t j = 0; j < blocks[b].count; j++) { /* column j: its 16 output rows, rounded, weighted */
          const int64_t pick = blocks[b].first + j, token = is_shared ? pick : tokens[pick];
          const m512 weight = mm512_set1_ps(is_shared ? 1.0f : scale[pick]); /* (x 1: exact) */
          const m512 down = round_row(mm512_i32gather_ps(down_column, downs + j, 4), 1);
          float *row = out + token * hidden_n + o0;
          mm512_storeu_ps(row, mm512_add_ps(mm512_loadu_ps(row), mm512_mul_ps(down, weight)));
        }
      }
    }
    if (products->end) products->end();
  }
  free(blocks), free(packed_x), free(packed_h);
  return 0;
}

/* ---- moe_dots: the products as vdpbf16ps (mm512_dpbf16_ps), for a CPU without AMX tiles ------------- */
/* Each weight pair is broadcast against the block's pair of 16 picks: a row's 16 sums in one register. */

static void gate_up_dots(const uint16_t *gate_rows, const uint16_t *up_rows, int64_t width, const uint32_t *block,
                         float *gates, float *ups) {
  for (int half = 0; half < 2; half++) { /* 8 gate rows and their 8 up rows at a time: 16 registers */
    m512 acc[16];
    const int64_t first = half * 8;
    for (int r = 0; r < 16; r++) acc[r] = mm512_setzero_ps();
    const uint32_t *g = (const uint32_t *)(gate_rows + first * width), *u = (const uint32_t *)(up_rows + first * width);
    for (int64_t k = 0; k < width / 2; k++) {
      const m512i b = mm512_loadu_si512((const void *)(block + k * TILE));
#pragma GCC unroll 8
      for (int r = 0; r < 8; r++) {
        acc[r] = mm512_dpbf16_ps(acc[r], mm512_set1_epi32((int)g[r * width / 2 + k]), b);
        acc[8 + r] = mm512_dpbf16_ps(acc[8 + r], mm512_set1_epi32((int)u[r * width / 2 + k]), b);
      }
    }
    for (int r = 0; r < 8; r++) {
      mm512_storeu_ps(gates + (first + r) * TILE, acc[r]);
      mm512_storeu_ps(ups + (first + r) * TILE, acc[8 + r]);
    }
  }
}

static void down_dots(const uint16_t *rows, int64_t width, const uint32_t *block, float *downs) {
  m512 acc[TILE];
  for (int r = 0; r < TILE; r++) acc[r] = mm512_setzero_ps();
  const uint32_t *pairs = (const uint32_t *)rows;
  for (int64_t k = 0; k < width / 2; k++) {
    const m512i b = mm512_loadu_si512((const void *)(block + k * TILE));
#pragma GCC unroll 16
    for (int r = 0; r < TILE; r++)
      acc[r] = mm512_dpbf16_ps(acc[r], mm512_set1_epi32((int)pairs[r * width / 2 + k]), b);
  }
  for (int r = 0; r < TILE; r++) mm512_storeu_ps(downs + r * TILE, acc[r]);
}

int moe_dots(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
             const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
             const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads) {
  static const BlockProducts dots = {NULL, NULL, gate_up_dots, down_dots};
  return moe_blocks(x, w13, w2, shared_w13, shared_w2, tokens, places, ends, keep, scale, out, p, limit, threads, &dots);
}
