/* What the two band attention kernels share (band_amx.c on AMX tiles, band_dots.c as bf16 pair products):
 * their arguments' layout and the softmax's masking. */
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "simd.h"

/* p[]: the shapes, then the element strides of the inputs (every innermost stride is 1). */
enum {
  A_B, A_N, A_Q, A_H, A_K, A_C, A_D, A_L, A_R, /* batch, blocks, queries a block, heads, band rows,
                                                  compressed rows, head dim, the chunk's queries, source rows */
  A_Q_B, A_Q_T,                /* q[b][t][h][d] ([h][d] contiguous) */
  A_ROW_B, A_ROW_R,            /* rows[b][r][d]: block n's band is rows n*Q .. n*Q + K */
  A_RA_B, A_RA_N, A_RA_J,      /* raw_allowed[b][n][query][k] */
  A_COMP_B, A_COMP_C,          /* compressed[b][c][d] */
  A_CA_B, A_CA_N, A_CA_J,      /* compressed_allowed[b][n][query][c] */
  A_FP32,                      /* q, rows, compressed and out are fp32 (band_dots.c alone), else bf16 */
  A_COUNT
};

/* Scales and masks a row's logits in [first, first + count) (columns `allowed` marks), -inf past them
 * up to `end`; returns the running peak. */
static inline m512 mask_logits(float *row, int64_t first, int64_t count, int64_t end, const uint8_t *allowed,
                                 float scale, m512 peak) {
  for (int64_t i = 0; i < end - first; i += 16) {
    const mmask16 lanes = first_lanes(count - i > 0 ? count - i : 0);
    const mmask16 keep = mm_mask_cmpneq_epi8_mask(lanes, mm_maskz_loadu_epi8(lanes, allowed + i), _mm_setzero_si128());
    const m512 v = mm512_mask_mul_ps(mm512_set1_ps(-__builtin_inff()), keep, mm512_loadu_ps(row + first + i),
                                        mm512_set1_ps(scale));
    mm512_storeu_ps(row + first + i, v);
    peak = mm512_max_ps(peak, v);
  }
  return peak;
}
