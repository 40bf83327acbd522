/* Helpers the CPU kernels share, written in 512-bit vectors of 16 fp32 lanes: the AVX-512 intrinsics
 * of their names (simd_avx512.h), or the same operations as pairs of AVX2 vectors (simd_avx2.h) where the
 * kernels are built for a CPU without AVX-512 (dsv4/kernels/cpu_library.py). */
#pragma once

#include <immintrin.h>
#include <stdint.h>

#ifdef __AVX512F__
#include "simd_avx512.h"
#else
#include "simd_avx2.h"
#endif

static inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* exp(x) for x <= 0 (a logit minus its row's peak); 0 below -87 and for -inf (masked). Cephes'
 * expf polynomial: within 2 ulp. */
static inline m512 exp_nonpositive(m512 x) {
  mmask16 tiny = mm512_cmp_ps_mask(x, mm512_set1_ps(-87.0f), _CMP_LT_OQ);
  x = mm512_max_ps(x, mm512_set1_ps(-87.0f));
  m512 n = mm512_roundscale_ps(mm512_mul_ps(x, mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  m512 r = mm512_fnmadd_ps(n, mm512_set1_ps(0.693359375f), x);
  r = mm512_fnmadd_ps(n, mm512_set1_ps(-2.12194440e-4f), r);
  m512 poly = mm512_set1_ps(1.9875691500e-4f);
  poly = mm512_fmadd_ps(poly, r, mm512_set1_ps(1.3981999507e-3f));
  poly = mm512_fmadd_ps(poly, r, mm512_set1_ps(8.3334519073e-3f));
  poly = mm512_fmadd_ps(poly, r, mm512_set1_ps(4.1665795894e-2f));
  poly = mm512_fmadd_ps(poly, r, mm512_set1_ps(1.6666665459e-1f));
  poly = mm512_fmadd_ps(poly, r, mm512_set1_ps(5.0000001201e-1f));
  poly = mm512_fmadd_ps(poly, mm512_mul_ps(r, r), mm512_add_ps(r, mm512_set1_ps(1.0f)));
  return mm512_maskz_mov_ps((mmask16)~tiny, mm512_scalef_ps(poly, n));
}

static inline mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : (mmask16)((1u << n) - 1); }

/* The sum of row[0..n)^2 in fp32 (an RMS norm's) */
static inline float sum_squares(const float *row, int64_t n) {
  m512 acc = mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const m512 v = mm512_maskz_loadu_ps(first_lanes(n - i), row + i);
    acc = mm512_fmadd_ps(v, v, acc);
  }
  return mm512_reduce_add_ps(acc);
}
