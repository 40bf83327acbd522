/* What the AMX kernels (band_amx.c, moe_amx.c) share: every tile 16 rows of 64 bytes. */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define AMX __attribute__((target("amx-tile,amx-bf16")))

enum { TILE = 16, STEP = 32 /* bf16 elements a tile row holds */ };

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} TileConfig;

/* All eight tiles 16 rows of 64 bytes (band_amx.c: 0..3 accumulate, 4..5 hold A operands, 6..7 B operands). */
AMX static inline void configure_tiles(void) {
  TileConfig config;
  memset(&config, 0, sizeof config);
  config.palette = 1;
  for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = TILE;
  _tile_loadconfig(&config);
}

