/* moe_tiles: moe_blocks.c's MoE of any number of tokens with its products on AMX tiles, for a bf16 model
 * on a CPU that has them: the weights are the A operands where they lie (16 rows of an expert's
 * projection by 32 of their columns a tile), a block's packed activations the B operands. */

#include <stdint.h>

#include "amx.h"
#include "moe.h"

AMX static void begin_tiles(void) { configure_tiles(); }

AMX static void end_tiles(void) { _tile_release(); }

AMX static void gate_up_tiles(const uint16_t *gate_rows, const uint16_t *up_rows, int64_t width, const uint32_t *block,
                              float *gates, float *ups) {
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t k = 0; k < width; k += STEP) {
    _tile_loadd(2, gate_rows + k, width * 2);
    _tile_loadd(3, up_rows + k, width * 2);
    _tile_loadd(4, block + k / 2 * TILE, TILE * 4);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
  }
  _tile_stored(0, gates, TILE * 4);
  _tile_stored(1, ups, TILE * 4);
}

AMX static void down_tiles(const uint16_t *rows, int64_t width, const uint32_t *block, float *downs) {
  _tile_zero(0);
  for (int64_t k = 0; k < width; k += STEP) {
    _tile_loadd(2, rows + k, width * 2);
    _tile_loadd(4, block + k / 2 * TILE, TILE * 4);
    _tile_dpbf16ps(0, 2, 4);
  }
  _tile_stored(0, downs, TILE * 4);
}

int moe_tiles(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
              const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
              const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads) {
  static const BlockProducts tiles = {begin_tiles, end_tiles, gate_up_tiles, down_tiles};
  return moe_blocks(x, w13, w2, shared_w13, shared_w2, tokens, places, ends, keep, scale, out, p, limit, threads,
                    &tiles);
}
