/* The portable 512-bit vector operations the kernels are written in (simd.h), on AVX-512: each is the
 * AVX-512 intrinsic of its name, and the types are AVX-512's. The bf16 operations take and give their
 * bf16 vectors as integer vectors (the AVX2 build has no bf16 types). */
#pragma once

#include <immintrin.h>

typedef __m512 m512;
typedef __m512i m512i;
typedef __mmask16 mmask16;
typedef __mmask32 mmask32;

enum { VECTOR_REGISTERS = 32 }; /* the 512-bit vectors the registers hold: how many sums a loop keeps */

#define mm512_abs_ps _mm512_abs_ps
#define mm512_add_ps _mm512_add_ps
#define mm512_castps512_ps128 _mm512_castps512_ps128
#define mm512_castsi512_ps _mm512_castsi512_ps
#define mm512_cmp_ps_mask _mm512_cmp_ps_mask
#define mm512_cvtepu16_epi32 _mm512_cvtepu16_epi32
#define mm512_cvtneps_pbh(v) ((__m256i)_mm512_cvtneps_pbh(v))
#define mm512_div_ps _mm512_div_ps
#define mm512_dpbf16_ps(acc, a, b) _mm512_dpbf16_ps((acc), (__m512bh)(a), (__m512bh)(b))
#define mm512_fmadd_ps _mm512_fmadd_ps
#define mm512_fnmadd_ps _mm512_fnmadd_ps
#define mm512_i32gather_ps _mm512_i32gather_ps
#define mm512_load_ps _mm512_load_ps
#define mm512_load_si512 _mm512_load_si512
#define mm512_loadu_epi16 _mm512_loadu_epi16
#define mm512_loadu_ps _mm512_loadu_ps
#define mm512_loadu_si512 _mm512_loadu_si512
#define mm512_mask_i32gather_epi32 _mm512_mask_i32gather_epi32
#define mm512_mask_loadu_ps _mm512_mask_loadu_ps
#define mm512_mask_mov_ps _mm512_mask_mov_ps
#define mm512_mask_mul_ps _mm512_mask_mul_ps
#define mm512_mask_storeu_ps _mm512_mask_storeu_ps
#define mm512_maskz_loadu_epi16 _mm512_maskz_loadu_epi16
#define mm512_maskz_loadu_ps _mm512_maskz_loadu_ps
#define mm512_maskz_mov_ps _mm512_maskz_mov_ps
#define mm512_max_ps _mm512_max_ps
#define mm512_min_ps _mm512_min_ps
#define mm512_mul_ps _mm512_mul_ps
#define mm512_mullo_epi32 _mm512_mullo_epi32
#define mm512_or_si512 _mm512_or_si512
#define mm512_permute_ps _mm512_permute_ps
#define mm512_reduce_add_ps _mm512_reduce_add_ps
#define mm512_reduce_max_ps _mm512_reduce_max_ps
#define mm512_roundscale_ps _mm512_roundscale_ps
#define mm512_scalef_ps _mm512_scalef_ps
#define mm512_set1_epi32 _mm512_set1_epi32
#define mm512_set1_ps _mm512_set1_ps
#define mm512_setr_epi32 _mm512_setr_epi32
#define mm512_setzero_ps _mm512_setzero_ps
#define mm512_setzero_si512 _mm512_setzero_si512
#define mm512_shuffle_f32x4 _mm512_shuffle_f32x4
#define mm512_slli_epi32 _mm512_slli_epi32
#define mm512_store_ps _mm512_store_ps
#define mm512_store_si512 _mm512_store_si512
#define mm512_storeu_ps _mm512_storeu_ps
#define mm512_storeu_si512 _mm512_storeu_si512
#define mm512_sub_ps _mm512_sub_ps
#define mm512_unpackhi_epi16 _mm512_unpackhi_epi16
#define mm512_unpacklo_epi16 _mm512_unpacklo_epi16
#define mm256_mask_storeu_epi16 _mm256_mask_storeu_epi16
#define mm256_maskz_loadu_epi16 _mm256_maskz_loadu_epi16
#define mm_mask_cmpneq_epi8_mask _mm_mask_cmpneq_epi8_mask
#define mm_maskz_loadu_epi8 _mm_maskz_loadu_epi8
