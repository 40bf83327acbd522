/* decode_layer: a whole decoder layer of a decode step's few tokens as one call (dsv4/kernels/cpu_layer.py),
 * where nothing in it needs Python: the kernels the model otherwise calls one by one, in the same order on
 * the same values, so the result is theirs to the bit. From a call per kernel (a dozen torch ops and
 * checks around each), a c=1 decode layer of `small` kept ~200 us of overhead beside ~250 us of kernels.
 *   mhc_mix (attention's)  -> x
 *   decode_project         -> q, kv, projected
 *   compressor_feed        -> each compressor's partial state (a step in which none of its windows completes)
 *   the ring write         -> each token's raw row (kv) into its slot's window ring, row position % W
 *   decode_attention       -> the attention's output over the rings and compressed rows
 *   decode_exit            -> the attention sublayer's output y
 *   mhc_mix (the MoE's)    -> the new streams, post and comb, and the MoE's input
 *   moe_routed             -> the MoE's output, rounded into the model's dtype
 * A step's first layer may also embed its tokens (their embedding rows copied into each of its input's
 * streams: ptr[EMBED] set), and its last one run the head on its output (ptr[LOGITS] set):
 *   mhc_mix (hc_head's weights, padded) -> the collapsed, normed row
 *   decode_logits          -> fp32 logits
 * In a step in which windows of the layer's compressors complete, the attention reads their new rows:
 *   compressor_store       -> each fed compressor's new rows (its windows' slots, as its feed copied them
 *                             out), pooled, normed, rotated and packed where they lie in its pool
 * runs between the feeds and the ring write, where the caller sets the stores' pointers. A caller that
 * stores them itself (dsv4/model/decode_layer.py: where index keys are fingerprinted) runs the layer in two
 * calls around its storing instead: phase FRONT (the mix, the projections and the feeds), then BACK (the
 * rest), the intermediates kept between them in the caller's scratch (decode_layer_scratch bytes). Each
 * kernel runs its own parallel region, as when called alone. decode_layers runs a step's layers' calls one
 * after another, so that the caller prepares them all in one stretch of Python, each with the step's
 * inputs that every layer reads (its RoPE tables by the layer's kind, the positions, slots and token ids,
 * and by its ratio the compressed rows its tokens see and how its compressors advance) from one array,
 * not set in each layer's own. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dots.h"

int mhc_mix(const void *streams, const void *output, const float *post, const float *comb, const float *fn,
            const float *base, const float *scale, const float *norm, void *streams_out, void *x_out,
            float *post_out, float *comb_out, const int64_t *p, float hc_eps, float norm_eps, int threads);
int decode_project(const void *x, const uint16_t *w_input, const float *q_norm, const uint16_t *wq_b,
                   const float *kv_norm, const float *cos2, const float *sin2, void *q, void *kv, void *qr,
                   void *projected, const int64_t *p, float eps, int threads);
int compressor_feed(const void *projected, const int64_t *positions, const float *ape, float *state,
                    const int64_t *state_slots, const int64_t *state_rows, const int64_t *window_sources,
                    const int64_t *update_slots, const int64_t *update_rows, const int64_t *update_sources,
                    float *windows, const int64_t *p);
int decode_attention(const void *q, const uint8_t *window, const int64_t *slots, const int64_t *at,
                     const float *sink, const uint8_t *comp_pool, const int64_t *pages, const int64_t *page_rows,
                     const uint8_t *exists, const uint8_t *allowed, void *out, const int64_t *p, float scale,
                     int threads);
int decode_exit(void *out, const float *cos2, const float *sin2, const uint16_t *wo_a, const uint16_t *wo_b,
                void *result, const int64_t *p, int threads);
int compressor_store(const float *windows, const float *norm, const float *cos2, const float *sin2, uint8_t *cache,
                     const int64_t *pages, const int64_t *page_rows, const int64_t *p, float eps, int threads);
int moe_routed(const void *x, const float *gate, const void *route, const int64_t *token_ids, const uint16_t *w13,
               const uint16_t *w2, const uint16_t *shared_w13, const uint16_t *shared_w2, float *out,
               const int64_t *rp, const int64_t *mp, float scaling, float limit, int tiles, int threads);
int decode_logits(const void *x, const uint16_t *head, float *logits, const int64_t *p, int threads);

/* ptr[]: the tensors, in cpu_layer.py's POINTERS order */
enum {
  STREAMS, OUTPUT, POST, COMB,                                     /* the residual, its last output unwritten */
  ATTN_FN, ATTN_BASE, ATTN_SCALE, ATTN_NORM,                       /* the attention's mix */
  W_INPUT, Q_NORM, WQ_B, KV_NORM, COS2, SIN2,                      /* its projections, the RoPE tables */
  POSITIONS,                                                       /* the tokens' positions */
  /* the compressor's, then the indexer's: ape, state, the plan's rows, and where its new windows' rows go */
  APE_0, STATE_0, STATE_SLOTS_0, STATE_ROWS_0, UPDATE_SLOTS_0, UPDATE_ROWS_0, UPDATE_SOURCES_0, WINDOW_SOURCES_0, WINDOWS_0,
  APE_1, STATE_1, STATE_SLOTS_1, STATE_ROWS_1, UPDATE_SLOTS_1, UPDATE_ROWS_1, UPDATE_SOURCES_1, WINDOW_SOURCES_1, WINDOWS_1,
  WINDOW, SLOTS, AT, SINK, COMP_POOL, PAGES, PAGE_ROWS, EXISTS, ALLOWED, /* the attention */
  WO_A, WO_B,                                                      /* its exit */
  FFN_FN, FFN_BASE, FFN_SCALE, FFN_NORM,                           /* the MoE's mix */
  TOKEN_IDS, GATE, ROUTE, W13, W2, SHARED_W13, SHARED_W2,          /* the MoE */
  STREAMS_OUT, OUTPUT_OUT, POST_OUT, COMB_OUT,                     /* the new residual */
  /* the compressor's and the indexer's stores (NULL: none in this call), and where the new rows go */
  STORE_NORM_0, STORE_CACHE_0, STORE_NORM_1, STORE_CACHE_1, WINDOW_COS2, WINDOW_SIN2, WINDOW_PAGES, WINDOW_PAGE_ROWS,
  EMBED,                                                           /* the embedding (NULL: the streams are given) */
  HEAD_FN, HEAD_BASE, HEAD_SCALE, HEAD_NORM, HEAD, LOGITS,         /* the head (LOGITS NULL: none in this call) */
  SCRATCH,                                                         /* the intermediates (NULL: allocated here) */
  POINTER_COUNT
};
/* params[]: each kernel's p[] as its wrapper builds it, and the layer's own (L_*) */
enum { P_LAYER, P_MIX, P_PROJECT, P_FEED_0, P_FEED_1, P_ATTENTION, P_EXIT, P_ROUTE, P_MOE, P_STORE_0, P_STORE_1,
       P_LOGITS, PARAM_COUNT };
/* the layer's p[]: tokens, streams, hidden size, w_input's rows, q_lora_rank, head_dim, heads, fp32 (else
 * bf16), the window W, the ring's slot and row strides (bytes), compressors fed (0..2), where each one's
 * kv | gate columns start in the projected row, whether the MoE runs on AMX tiles, which of a step's RoPE
 * tables the layer reads (decode_layers' step[]: 0 a window layer's, 1 a compressed one's), and which of
 * its ratios' parts (-1: none, a window layer) */
enum { L_TOKENS, L_STREAMS, L_HIDDEN, L_WIDTH, L_Q_RANK, L_DIM, L_HEADS, L_FP32, L_W, L_SLOT_STRIDE, L_RING_ROW,
       L_FEEDS, L_FEED_COLUMN_0, L_FEED_COLUMN_1, L_TILES, L_ROPE, L_RATIO, L_COUNT };
/* decode_layers' step[]: the RoPE tables (cos2, sin2) of a window layer, then of a compressed one, the
 * positions, the slots, the token ids; then by ratio the compressed rows seen (pages, page rows, exists,
 * allowed: NULL where a token sees none yet) and its compressors' plan rows (state slots and rows, update
 * slots, rows and sources, window sources) */
enum { STEP_COS2, STEP_SIN2, STEP_POSITIONS = 4, STEP_SLOTS, STEP_TOKEN_IDS, STEP_RATIOS };
enum { RATIO_PAGES, RATIO_PAGE_ROWS, RATIO_EXISTS, RATIO_ALLOWED, RATIO_STATE_SLOTS, RATIO_STATE_ROWS,
       RATIO_UPDATE_SLOTS, RATIO_UPDATE_ROWS, RATIO_UPDATE_SOURCES, RATIO_WINDOW_SOURCES, RATIO_COUNT };
enum { FRONT = 1, BACK = 2 }; /* `phases`: which of them a call runs */
/* f[]: the mixes' hc_eps and norm eps, the projections' norm eps, the attention's scale, the MoE's
 * routed scaling factor and SwiGLU limit, the stores' norm eps */
enum { F_HC_EPS, F_NORM_EPS, F_PROJECT_EPS, F_ATTENTION_SCALE, F_SCALING, F_SWIGLU_LIMIT, F_STORE_EPS_0, F_STORE_EPS_1,
       FLOAT_COUNT };

enum { MID_STREAMS, X, MID_POST, MID_COMB, Q, KV, QR, PROJECTED, ATTENDED, Y, MOE_X, MOE_OUT, PARTS };

/* Where each intermediate starts in the scratch (64-byte aligned); returns the scratch's bytes */
static int64_t scratch_layout(const int64_t *p, int64_t starts[PARTS]) {
  const int64_t T = p[L_TOKENS], n = p[L_STREAMS], hidden = p[L_HIDDEN], dim = p[L_DIM], heads = p[L_HEADS];
  const int64_t size = p[L_FP32] ? 4 : 2;
  const int64_t sizes[PARTS] = {T * n * hidden * size, T * hidden * size, T * n * 4, T * n * n * 4,
                                T * heads * dim * size, T * dim * size, T * p[L_Q_RANK] * size, T * p[L_WIDTH] * size,
                                T * heads * dim * size, T * hidden * size, T * hidden * size, T * hidden * 4};
  int64_t total = 0;
  for (int i = 0; i < PARTS; i++) starts[i] = total, total += round_up(sizes[i], 64);
  return total;
}

/* The bytes of the scratch a layer of p[] (the layer's own) keeps between its two phases */
int64_t decode_layer_scratch(const int64_t *p) {
  int64_t starts[PARTS];
  return scratch_layout(p, starts);
}

int decode_layer(void *const *ptr, const int64_t *const *params, const float *f, int phases, int threads) {
  const int64_t *p = params[P_LAYER];
  const int64_t T = p[L_TOKENS], hidden = p[L_HIDDEN], dim = p[L_DIM], size = p[L_FP32] ? 4 : 2;
  int64_t starts[PARTS];
  const int64_t total = scratch_layout(p, starts);
  char *scratch = ptr[SCRATCH] ? ptr[SCRATCH] : aligned_alloc(64, (size_t)total);
  if (!scratch) return 1;
  char *at[PARTS];
  for (int i = 0; i < PARTS; i++) at[i] = scratch + starts[i];

  int status = 0;
  if (phases & FRONT && ptr[EMBED]) { /* each token's embedding row into every stream */
    const int64_t n = p[L_STREAMS], *ids = ptr[TOKEN_IDS];
    for (int64_t t = 0; t < T; t++)
      for (int64_t i = 0; i < n; i++)
        memcpy((char *)ptr[STREAMS] + (t * n + i) * hidden * size, (const char *)ptr[EMBED] + ids[t] * hidden * size,
               (size_t)(hidden * size));
  }
  if (phases & FRONT)
    status = mhc_mix(ptr[STREAMS], ptr[OUTPUT], ptr[POST], ptr[COMB], ptr[ATTN_FN], ptr[ATTN_BASE], ptr[ATTN_SCALE],
                     ptr[ATTN_NORM], at[MID_STREAMS], at[X], (float *)at[MID_POST], (float *)at[MID_COMB], params[P_MIX],
                     f[F_HC_EPS], f[F_NORM_EPS], threads);
  if (!status && phases & FRONT)
    status = decode_project(at[X], ptr[W_INPUT], ptr[Q_NORM], ptr[WQ_B], ptr[KV_NORM], ptr[COS2], ptr[SIN2], at[Q],
                            at[KV], at[QR], at[PROJECTED], params[P_PROJECT], f[F_PROJECT_EPS], threads);
  for (int c = 0; c < p[L_FEEDS] && !status && phases & FRONT; c++) {
    const int o = c * (APE_1 - APE_0);
    status = compressor_feed(at[PROJECTED] + p[L_FEED_COLUMN_0 + c] * size, ptr[POSITIONS], ptr[APE_0 + o],
                             ptr[STATE_0 + o], ptr[STATE_SLOTS_0 + o], ptr[STATE_ROWS_0 + o], ptr[WINDOW_SOURCES_0 + o],
                             ptr[UPDATE_SLOTS_0 + o], ptr[UPDATE_ROWS_0 + o], ptr[UPDATE_SOURCES_0 + o],
                             ptr[WINDOWS_0 + o], params[P_FEED_0 + c]);
  }
  for (int64_t c = 0; c < p[L_FEEDS] && !status && phases == (FRONT | BACK) && ptr[STORE_NORM_0 + 2 * c]; c++)
    status = compressor_store(ptr[WINDOWS_0 + c * (APE_1 - APE_0)], ptr[STORE_NORM_0 + 2 * c], ptr[WINDOW_COS2],
                              ptr[WINDOW_SIN2], ptr[STORE_CACHE_0 + 2 * c], ptr[WINDOW_PAGES], ptr[WINDOW_PAGE_ROWS],
                              params[P_STORE_0 + c], f[F_STORE_EPS_0 + c], threads);
  if (!(phases & BACK)) {
    if (!ptr[SCRATCH]) free(scratch);
    return status;
  }
  if (!status) {
    const int64_t *slots = ptr[SLOTS], *positions = ptr[AT];
    for (int64_t t = 0; t < T; t++)
      memcpy((char *)ptr[WINDOW] + slots[t] * p[L_SLOT_STRIDE] + positions[t] % p[L_W] * p[L_RING_ROW],
             at[KV] + t * dim * size, (size_t)(dim * size));
    status = decode_attention(at[Q], ptr[WINDOW], slots, positions, ptr[SINK], ptr[COMP_POOL], ptr[PAGES],
                              ptr[PAGE_ROWS], ptr[EXISTS], ptr[ALLOWED], at[ATTENDED], params[P_ATTENTION],
                              f[F_ATTENTION_SCALE], threads);
  }
  if (!status)
    status = decode_exit(at[ATTENDED], ptr[COS2], ptr[SIN2], ptr[WO_A], ptr[WO_B], at[Y], params[P_EXIT], threads);
  if (!status)
    status = mhc_mix(at[MID_STREAMS], at[Y], (float *)at[MID_POST], (float *)at[MID_COMB], ptr[FFN_FN], ptr[FFN_BASE],
                     ptr[FFN_SCALE], ptr[FFN_NORM], ptr[STREAMS_OUT], at[MOE_X], ptr[POST_OUT], ptr[COMB_OUT],
                     params[P_MIX], f[F_HC_EPS], f[F_NORM_EPS], threads);
  if (!status)
    status = moe_routed(at[MOE_X], ptr[GATE], ptr[ROUTE], ptr[TOKEN_IDS], ptr[W13], ptr[W2], ptr[SHARED_W13],
                        ptr[SHARED_W2], (float *)at[MOE_OUT], params[P_ROUTE], params[P_MOE], f[F_SCALING],
                        f[F_SWIGLU_LIMIT], (int)p[L_TILES], threads);
  if (!status) { /* the MoE's output in the model's dtype, as torch rounds it */
    const float *moe = (const float *)at[MOE_OUT];
    for (int64_t i = 0; i < T * hidden; i++) {
      if (p[L_FP32]) ((float *)ptr[OUTPUT_OUT])[i] = moe[i];
      else ((uint16_t *)ptr[OUTPUT_OUT])[i] = to_bf16(moe[i]);
    }
  }
  if (!status && ptr[LOGITS]) /* the head, its mix's outputs where the layer's first mix put its own */
    status = mhc_mix(ptr[STREAMS_OUT], ptr[OUTPUT_OUT], ptr[POST_OUT], ptr[COMB_OUT], ptr[HEAD_FN], ptr[HEAD_BASE],
                     ptr[HEAD_SCALE], ptr[HEAD_NORM], at[MID_STREAMS], at[X], (float *)at[MID_POST], (float *)at[MID_COMB],
                     params[P_MIX], f[F_HC_EPS], f[F_NORM_EPS], threads);
  if (!status && ptr[LOGITS])
    status = decode_logits(at[X], ptr[HEAD], ptr[LOGITS], params[P_LOGITS], threads);
  if (!ptr[SCRATCH]) free(scratch);
  return status;
}

/* `count` whole layers' calls, each as decode_layer takes it but for the pointers step[] gives (STEP_*),
 * one after another; stops at the first that fails (its status) */
int decode_layers(int64_t count, void *const *const *ptrs, const int64_t *const *const *params,
                  const float *const *floats, void *const *step, int threads) {
  void *mine[POINTER_COUNT];
  for (int64_t i = 0; i < count; i++) {
    memcpy(mine, ptrs[i], sizeof mine);
    const int64_t rope = 2 * params[i][P_LAYER][L_ROPE];
    mine[COS2] = step[STEP_COS2 + rope], mine[SIN2] = step[STEP_SIN2 + rope];
    mine[POSITIONS] = mine[AT] = step[STEP_POSITIONS];
    mine[SLOTS] = step[STEP_SLOTS], mine[TOKEN_IDS] = step[STEP_TOKEN_IDS];
    if (params[i][P_LAYER][L_RATIO] >= 0) {
      void *const *ratio = step + STEP_RATIOS + params[i][P_LAYER][L_RATIO] * RATIO_COUNT;
      mine[PAGES] = ratio[RATIO_PAGES], mine[PAGE_ROWS] = ratio[RATIO_PAGE_ROWS];
      mine[EXISTS] = ratio[RATIO_EXISTS], mine[ALLOWED] = ratio[RATIO_ALLOWED];
      if (!ratio[RATIO_PAGES]) mine[COMP_POOL] = NULL; /* (no row seen yet) */
      for (int c = 0; c < 2; c++) { /* (both compressors advance by the ratio's plan) */
        const int o = c * (APE_1 - APE_0);
        mine[STATE_SLOTS_0 + o] = ratio[RATIO_STATE_SLOTS], mine[STATE_ROWS_0 + o] = ratio[RATIO_STATE_ROWS];
        mine[UPDATE_SLOTS_0 + o] = ratio[RATIO_UPDATE_SLOTS], mine[UPDATE_ROWS_0 + o] = ratio[RATIO_UPDATE_ROWS];
        mine[UPDATE_SOURCES_0 + o] = ratio[RATIO_UPDATE_SOURCES];
        mine[WINDOW_SOURCES_0 + o] = ratio[RATIO_WINDOW_SOURCES];
      }
    }
    const int status = decode_layer(mine, params[i], floats[i], FRONT | BACK, threads);
    if (status) return status;
  }
  return 0;
}
