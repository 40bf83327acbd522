/* A batch's tokens through a compressor's partial state (dsv4/kernels/cpu_compressor.py's `feed`):
 * dsv4.model.compressor.feed with the state's own reads and writes, as one call instead of a gather, a
 * compiled package and a scatter (~90 us a compressor of `small` in a decode step, most of it the calls'
 * own overhead). Rows of `source` (dsv4.model.plan.CompressPlan) are read where they lie: the state's
 * rows the plan reads, then the tokens' rows (kv | gate + ape, made as they are read), then the empty
 * row (kv 0, score -inf). The new windows' rows are copied out before any state row changes, and the
 * changed rows are all read before the first is written (a new row may come from a row that changes). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dots.h"

/* p[]: tokens, the rows' width (the kv half's; the score half as wide), ratio, the projected rows' strides
 * (a token's, a column's: a compiled product may return them transposed), whether they are fp32 (else
 * bf16), the state's slot and row strides (elements; a pool's view), state rows read, windows, slots a
 * window pools, rows updated */
enum { F_TOKENS, F_WIDTH, F_RATIO, F_STRIDE, F_COLUMN_STRIDE, F_FP32, F_SLOT_STRIDE, F_ROW_STRIDE, F_READ, F_WINDOWS,
       F_SPAN, F_UPDATES, F_COUNT };

typedef struct {
  const void *projected;
  const int64_t *positions, *state_slots, *state_rows;
  const float *ape, *state;
  int64_t tokens, width, ratio, stride, column_stride, slot_stride, row_stride, read;
  int fp32;
} Source;

/* Row `index` of `source` into out[0 .. 2 * width) (fp32) */
static void source_row(const Source *s, int64_t index, float *out) {
  const int64_t width = s->width;
  if (index < s->read) {
    memcpy(out, s->state + s->state_slots[index] * s->slot_stride + s->state_rows[index] * s->row_stride,
           sizeof(float) * 2 * width);
    return;
  }
  const int64_t t = index - s->read;
  if (t >= s->tokens) { /* the empty row */
    for (int64_t i = 0; i < width; i++) out[i] = 0.0f, out[width + i] = -INFINITY;
    return;
  }
  const float *ape = s->ape + s->positions[t] % s->ratio * width;
  for (int64_t i = 0; i < width; i++) {
    const int64_t kv = t * s->stride + i * s->column_stride, gate = kv + width * s->column_stride;
    out[i] = load_at(s->projected, kv, s->fp32);
    out[width + i] = load_at(s->projected, gate, s->fp32) + ape[i];
  }
}

/* projected [T, 2 * width] (strided) bf16 or fp32, positions [T], ape [ratio, width], state [slots, rows,
 * 2 * width] fp32 (strided; updated in place), the plan's state_slots and state_rows [read],
 * window_sources [windows, span], update_slots, update_rows and update_sources [updates] -> windows
 * [windows, span, 2 * width] fp32 */
int compressor_feed(const void *projected, const int64_t *positions, const float *ape, float *state,
                    const int64_t *state_slots, const int64_t *state_rows, const int64_t *window_sources,
                    const int64_t *update_slots, const int64_t *update_rows, const int64_t *update_sources,
                    float *windows, const int64_t *p) {
  const Source s = {projected, positions, state_slots, state_rows, ape, state, p[F_TOKENS], p[F_WIDTH], p[F_RATIO],
                    p[F_STRIDE], p[F_COLUMN_STRIDE], p[F_SLOT_STRIDE], p[F_ROW_STRIDE], p[F_READ], (int)p[F_FP32]};
  const int64_t row = 2 * s.width, updates = p[F_UPDATES];
  for (int64_t n = 0; n < p[F_WINDOWS] * p[F_SPAN]; n++) source_row(&s, window_sources[n], windows + n * row);
  float *changed = malloc(sizeof(float) * (updates ? updates : 1) * row);
  if (!changed) return 1;
  for (int64_t u = 0; u < updates; u++) source_row(&s, update_sources[u], changed + u * row);
  for (int64_t u = 0; u < updates; u++)
    memcpy(state + update_slots[u] * s.slot_stride + update_rows[u] * s.row_stride, changed + u * row,
           sizeof(float) * row);
  free(changed);
  return 0;
}
