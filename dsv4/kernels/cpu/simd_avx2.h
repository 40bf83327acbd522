/* The portable 512-bit vector operations the kernels are written in (simd.h), on AVX2 and FMA: each
 * does what the AVX-512 intrinsic of its name does, on a pair of 256-bit vectors (lanes 0..7, 8..15),
 * and a mask is the integer of its bits, as AVX-512's. Masked loads and stores of all 16 lanes take
 * the plain instructions; a partial one copies its lanes through a buffer, so no lane past the mask
 * is read or written (the kernels mask the tails of rows that end at an allocation's end).
 *
 * The bf16 pair products (mm512_dpbf16_ps) widen each bf16 exactly into fp32 and sum with FMAs, the
 * odd element's product first, as vdpbf16ps orders them; fp32 -> bf16 rounds to nearest even, NaN
 * kept, as torch rounds. The sums of mm512_reduce_add_ps and mm512_reduce_max_ps pair the lanes in
 * GCC's order for the AVX-512 intrinsics. Where an operation takes an immediate, it is a macro. */
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

typedef struct { __m256 lo, hi; } m512;
typedef struct { __m256i lo, hi; } m512i;
typedef uint16_t mmask16;
typedef uint32_t mmask32;

enum { VECTOR_REGISTERS = 8 }; /* the 512-bit vectors the registers hold (16 of 256 bits): more live sums spill */

#define SIMD_INLINE static inline __attribute__((always_inline))

SIMD_INLINE m512 m512_of(__m256 lo, __m256 hi) { return (m512){lo, hi}; }
SIMD_INLINE m512i m512i_of(__m256i lo, __m256i hi) { return (m512i){lo, hi}; }

/* The all-ones lanes of an 8-lane mask's bits, as a vector (the masked AVX2 instructions' form) */
SIMD_INLINE __m256i lanes_of(unsigned bits) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), select), select);
}
SIMD_INLINE mmask16 mask_of(__m256 lo, __m256 hi) {
  return (mmask16)(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}

/* ---- fp32 arithmetic ---- */
SIMD_INLINE m512 mm512_set1_ps(float f) { return m512_of(_mm256_set1_ps(f), _mm256_set1_ps(f)); }
SIMD_INLINE m512 mm512_setzero_ps(void) { return m512_of(_mm256_setzero_ps(), _mm256_setzero_ps()); }
#define SIMD_BINARY(name, op) \
  SIMD_INLINE m512 name(m512 a, m512 b) { return m512_of(op(a.lo, b.lo), op(a.hi, b.hi)); }
SIMD_BINARY(mm512_add_ps, _mm256_add_ps)
SIMD_BINARY(mm512_sub_ps, _mm256_sub_ps)
SIMD_BINARY(mm512_mul_ps, _mm256_mul_ps)
SIMD_BINARY(mm512_div_ps, _mm256_div_ps)
SIMD_BINARY(mm512_max_ps, _mm256_max_ps)
SIMD_BINARY(mm512_min_ps, _mm256_min_ps)
#undef SIMD_BINARY
SIMD_INLINE m512 mm512_fmadd_ps(m512 a, m512 b, m512 c) {
  return m512_of(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
SIMD_INLINE m512 mm512_fnmadd_ps(m512 a, m512 b, m512 c) {
  return m512_of(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
SIMD_INLINE m512 mm512_abs_ps(m512 a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  return m512_of(_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude));
}
/* a * 2^b for b an integer in [-126, 127] (exp_nonpositive's exponents): exact where AVX-512's is */
SIMD_INLINE __m256 scale_half(__m256 a, __m256 b) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(b), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(a, _mm256_castsi256_ps(bits));
}
SIMD_INLINE m512 mm512_scalef_ps(m512 a, m512 b) { return m512_of(scale_half(a.lo, b.lo), scale_half(a.hi, b.hi)); }
#define mm512_roundscale_ps(a, mode) m512_of(_mm256_round_ps((a).lo, (mode)), _mm256_round_ps((a).hi, (mode)))
#define mm512_cmp_ps_mask(a, b, predicate) \
  mask_of(_mm256_cmp_ps((a).lo, (b).lo, (predicate)), _mm256_cmp_ps((a).hi, (b).hi, (predicate)))
/* Within each 128-bit lane, as AVX-512's */
#define mm512_permute_ps(a, control) m512_of(_mm256_permute_ps((a).lo, (control)), _mm256_permute_ps((a).hi, (control)))

/* The 128-bit lane `k` (0..3) of a */
SIMD_INLINE __m128 lane_of(m512 a, int k) {
  switch (k & 3) {
    case 0: return _mm256_castps256_ps128(a.lo);
    case 1: return _mm256_extractf128_ps(a.lo, 1);
    case 2: return _mm256_castps256_ps128(a.hi);
    default: return _mm256_extractf128_ps(a.hi, 1);
  }
}
/* Lanes 0, 1 from a's lanes control[1:0], control[3:2]; lanes 2, 3 from b's control[5:4], control[7:6] */
SIMD_INLINE m512 mm512_shuffle_f32x4(m512 a, m512 b, int control) {
  return m512_of(_mm256_set_m128(lane_of(a, control >> 2), lane_of(a, control)),
                 _mm256_set_m128(lane_of(b, control >> 6), lane_of(b, control >> 4)));
}

SIMD_INLINE float mm512_reduce_add_ps(m512 a) {
  const __m256 halves = _mm256_add_ps(a.hi, a.lo);
  const __m128 quarters = _mm_add_ps(_mm256_extractf128_ps(halves, 1), _mm256_castps256_ps128(halves));
  const __m128 pairs = _mm_add_ps(quarters, _mm_permute_ps(quarters, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_permute_ps(pairs, 1));
}
SIMD_INLINE float mm512_reduce_max_ps(m512 a) {
  const __m256 halves = _mm256_max_ps(a.hi, a.lo);
  const __m128 quarters = _mm_max_ps(_mm256_extractf128_ps(halves, 1), _mm256_castps256_ps128(halves));
  const __m128 pairs = _mm_max_ps(quarters, _mm_permute_ps(quarters, _MM_SHUFFLE(1, 0, 3, 2)));
  const float first = _mm_cvtss_f32(pairs), second = _mm_cvtss_f32(_mm_permute_ps(pairs, 1));
  return first > second ? first : second;
}
SIMD_INLINE __m128 mm512_castps512_ps128(m512 a) { return _mm256_castps256_ps128(a.lo); }

/* ---- masks ---- */
SIMD_INLINE m512 mm512_maskz_mov_ps(mmask16 k, m512 a) {
  return m512_of(_mm256_and_ps(a.lo, _mm256_castsi256_ps(lanes_of(k))),
                 _mm256_and_ps(a.hi, _mm256_castsi256_ps(lanes_of(k >> 8))));
}
SIMD_INLINE m512 mm512_mask_mov_ps(m512 src, mmask16 k, m512 a) {
  return m512_of(_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(lanes_of(k))),
                 _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(lanes_of(k >> 8))));
}
SIMD_INLINE m512 mm512_mask_mul_ps(m512 src, mmask16 k, m512 a, m512 b) {
  return mm512_mask_mov_ps(src, k, mm512_mul_ps(a, b));
}

/* ---- fp32 loads and stores ---- */
/* The `count` lanes of `size` bytes from src to dst that k's bits name (dst's other lanes as they were):
 * a partial masked load's or store's, through a buffer */
SIMD_INLINE void copy_lanes(void *dst, const void *src, uint32_t k, int count, int size) {
  for (int i = 0; i < count; i++)
    if (k >> i & 1) memcpy((char *)dst + i * size, (const char *)src + i * size, size);
}
SIMD_INLINE m512 mm512_loadu_ps(const void *p) {
  return m512_of(_mm256_loadu_ps((const float *)p), _mm256_loadu_ps((const float *)p + 8));
}
SIMD_INLINE m512 mm512_load_ps(const void *p) { return mm512_loadu_ps(p); }
SIMD_INLINE void mm512_storeu_ps(void *p, m512 a) {
  _mm256_storeu_ps((float *)p, a.lo);
  _mm256_storeu_ps((float *)p + 8, a.hi);
}
SIMD_INLINE void mm512_store_ps(void *p, m512 a) { mm512_storeu_ps(p, a); }
SIMD_INLINE m512 mm512_maskz_loadu_ps(mmask16 k, const void *p) {
  if (k == 0xffff) return mm512_loadu_ps(p);
  float lanes[16] = {0};
  copy_lanes(lanes, p, k, 16, 4);
  return mm512_loadu_ps(lanes);
}
SIMD_INLINE m512 mm512_mask_loadu_ps(m512 src, mmask16 k, const void *p) {
  return k == 0xffff ? mm512_loadu_ps(p) : mm512_mask_mov_ps(src, k, mm512_maskz_loadu_ps(k, p));
}
SIMD_INLINE void mm512_mask_storeu_ps(void *p, mmask16 k, m512 a) {
  if (k == 0xffff) {
    mm512_storeu_ps(p, a);
    return;
  }
  float lanes[16];
  mm512_storeu_ps(lanes, a);
  copy_lanes(p, lanes, k, 16, 4);
}

/* ---- integers ---- */
SIMD_INLINE m512i mm512_set1_epi32(int v) { return m512i_of(_mm256_set1_epi32(v), _mm256_set1_epi32(v)); }
SIMD_INLINE m512i mm512_setzero_si512(void) { return m512i_of(_mm256_setzero_si256(), _mm256_setzero_si256()); }
SIMD_INLINE m512i mm512_setr_epi32(int e0, int e1, int e2, int e3, int e4, int e5, int e6, int e7, int e8, int e9,
                                   int e10, int e11, int e12, int e13, int e14, int e15) {
  return m512i_of(_mm256_setr_epi32(e0, e1, e2, e3, e4, e5, e6, e7),
                  _mm256_setr_epi32(e8, e9, e10, e11, e12, e13, e14, e15));
}
SIMD_INLINE m512i mm512_mullo_epi32(m512i a, m512i b) {
  return m512i_of(_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi));
}
SIMD_INLINE m512i mm512_or_si512(m512i a, m512i b) {
  return m512i_of(_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi));
}
SIMD_INLINE m512i mm512_slli_epi32(m512i a, int count) {
  return m512i_of(_mm256_slli_epi32(a.lo, count), _mm256_slli_epi32(a.hi, count));
}
/* 16 uint16 lanes widened into 16 int32 lanes */
SIMD_INLINE m512i mm512_cvtepu16_epi32(__m256i a) {
  return m512i_of(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1)));
}
/* Within each 128-bit lane, the words of a's and b's low (high) halves interleaved, a's first */
SIMD_INLINE m512i mm512_unpacklo_epi16(m512i a, m512i b) {
  return m512i_of(_mm256_unpacklo_epi16(a.lo, b.lo), _mm256_unpacklo_epi16(a.hi, b.hi));
}
SIMD_INLINE m512i mm512_unpackhi_epi16(m512i a, m512i b) {
  return m512i_of(_mm256_unpackhi_epi16(a.lo, b.lo), _mm256_unpackhi_epi16(a.hi, b.hi));
}
SIMD_INLINE m512 mm512_castsi512_ps(m512i a) { return m512_of(_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)); }
SIMD_INLINE m512i mm512_loadu_si512(const void *p) {
  return m512i_of(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1));
}
SIMD_INLINE m512i mm512_load_si512(const void *p) { return mm512_loadu_si512(p); }
SIMD_INLINE m512i mm512_loadu_epi16(const void *p) { return mm512_loadu_si512(p); }
SIMD_INLINE void mm512_storeu_si512(void *p, m512i a) {
  _mm256_storeu_si256((__m256i *)p, a.lo);
  _mm256_storeu_si256((__m256i *)p + 1, a.hi);
}
SIMD_INLINE void mm512_store_si512(void *p, m512i a) { mm512_storeu_si512(p, a); }
/* 32 uint16 lanes, those of k's bits (the rest 0) */
SIMD_INLINE m512i mm512_maskz_loadu_epi16(mmask32 k, const void *p) {
  if (k == 0xffffffffu) return mm512_loadu_si512(p);
  uint16_t lanes[32] = {0};
  copy_lanes(lanes, p, k, 32, 2);
  return mm512_loadu_si512(lanes);
}
/* 16 uint16 lanes, those of k's bits (the rest 0) */
SIMD_INLINE __m256i mm256_maskz_loadu_epi16(mmask16 k, const void *p) {
  if (k == 0xffff) return _mm256_loadu_si256((const __m256i *)p);
  uint16_t lanes[16] = {0};
  copy_lanes(lanes, p, k, 16, 2);
  return _mm256_loadu_si256((const __m256i *)lanes);
}
SIMD_INLINE void mm256_mask_storeu_epi16(void *p, mmask16 k, __m256i a) {
  if (k == 0xffff) {
    _mm256_storeu_si256((__m256i *)p, a);
    return;
  }
  uint16_t lanes[16];
  _mm256_storeu_si256((__m256i *)lanes, a);
  copy_lanes(p, lanes, k, 16, 2);
}
/* 16 bytes, those of k's bits (the rest 0) */
SIMD_INLINE __m128i mm_maskz_loadu_epi8(mmask16 k, const void *p) {
  if (k == 0xffff) return _mm_loadu_si128((const __m128i *)p);
  uint8_t lanes[16] = {0};
  copy_lanes(lanes, p, k, 16, 1);
  return _mm_loadu_si128((const __m128i *)lanes);
}
/* The bits of k whose bytes of a and b differ */
SIMD_INLINE mmask16 mm_mask_cmpneq_epi8_mask(mmask16 k, __m128i a, __m128i b) {
  return (mmask16)(k & ~_mm_movemask_epi8(_mm_cmpeq_epi8(a, b)));
}
/* Gathers of 16 lanes at base + index * scale (1, 2, 4 or 8); the masked one keeps src's lanes off k */
#define mm512_i32gather_ps(index, base, scale) \
  m512_of(_mm256_i32gather_ps((const float *)(base), (index).lo, (scale)), \
          _mm256_i32gather_ps((const float *)(base), (index).hi, (scale)))
#define mm512_mask_i32gather_epi32(src, k, index, base, scale) \
  m512i_of(_mm256_mask_i32gather_epi32((src).lo, (const int *)(base), (index).lo, lanes_of(k), (scale)), \
           _mm256_mask_i32gather_epi32((src).hi, (const int *)(base), (index).hi, lanes_of((k) >> 8), (scale)))

/* ---- bf16 ---- */
/* 8 fp32 lanes rounded into bf16 (to nearest even, NaN kept quiet), one in the low half of each lane */
SIMD_INLINE __m256i bf16_bits(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}
/* 16 fp32 lanes as 16 bf16 (uint16 lanes) */
SIMD_INLINE __m256i mm512_cvtneps_pbh(m512 a) {
  /* (packus interleaves the 128-bit lanes of its operands: lo 0..3, hi 0..3, lo 4..7, hi 4..7) */
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(a.lo), bf16_bits(a.hi)), _MM_SHUFFLE(3, 1, 2, 0));
}
/* acc + a.odd * b.odd + a.even * b.even per 32-bit lane of bf16 pairs (products exact in fp32) */
SIMD_INLINE __m256 dpbf16_half(__m256 acc, __m256i a, __m256i b) {
  const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), acc);
}
SIMD_INLINE m512 mm512_dpbf16_ps(m512 acc, m512i a, m512i b) {
  return m512_of(dpbf16_half(acc.lo, a.lo, b.lo), dpbf16_half(acc.hi, a.hi, b.hi));
}
