/* The MoE kernels' entries, which route.c's moe_routed calls after routing, and what the block
 * kernels (moe_blocks.c, with the products of moe_amx.c or their own) share. */
#pragma once

#include <stdint.h>

/* Each: x [T, hidden] (bf16, or fp32 where p says so: moe_few alone), the weights (bf16), the picks as
 * dsv4.model.moe.dispatch sorts them, out [T, hidden] fp32; p[] as moe.c's M_* (moe_few) or T_*
 * (the block kernels); 0, or non-zero where scratch memory could not be had. */
int moe_few(const void *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
            const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
            const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads);
int moe_tiles(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
              const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
              const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads);
int moe_dots(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
             const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
             const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads);

/* p[] of the block kernels: as moe.c's moe_few (tokens, picks, local experts, hidden size, an expert's
 * width, the shared expert's (0: none)) */
enum { T_TOKENS, T_PICKS, T_EXPERTS, T_HIDDEN, T_INTER, T_SHARED, T_COUNT };

enum { BLOCK_PICKS = 16 }; /* the picks (or tokens) of a block, and the rows of each product */

/* How a block kernel multiplies: 16 rows of weights (`width` bf16 each, one after another) by a block's
 * activations packed as pairs of columns (`block[pair][pick]`), into [16 rows][16 picks] fp32. */
typedef struct {
  void (*begin)(void); /* on each thread, before its first product (NULL: nothing) */
  void (*end)(void);   /* on each thread, after its last */
  /* the gate rows' and the up rows' products at once */
  void (*gate_up)(const uint16_t *gate_rows, const uint16_t *up_rows, int64_t width, const uint32_t *block,
                  float *gates, float *ups);
  void (*down)(const uint16_t *rows, int64_t width, const uint32_t *block, float *downs);
} BlockProducts;

int moe_blocks(const uint16_t *x, const uint16_t *w13, const uint16_t *w2, const uint16_t *shared_w13,
               const uint16_t *shared_w2, const int64_t *tokens, const int64_t *places, const int32_t *ends,
               const uint8_t *keep, const float *scale, float *out, const int64_t *p, float limit, int threads,
               const BlockProducts *products);
