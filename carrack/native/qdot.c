/* Products of ggml block-quantized weights with activations quantized to 8 bits, in integer dot products:
 * y[i, r] = sum_k x[i, k] * W[r, k] for every weight row r and the m rows of x, for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.
 *
 * Activations: each run of 32 values of a row of x becomes int8 codes xq = rint(x / dx) with dx = max|x| / 127
 * (llama.cpp's Q8_0 activations, with a float32 scale where it keeps a half float), so x ~ dx * xq.
 *
 * Weights: every ggml type above decodes, per group of 16 values, as w = scale * code + offset with codes that fit
 * in an unsigned byte (signed types are shifted: Q8_0's code is q + 128, with offset -128 * d). A weight row is
 * decoded once into codes, per-lane scales and per-group offsets (a few KiB, kept in L1/L2) and multiplied there
 * with every activation row:
 *   y = sum_g dx_g * (scale_g * sum_{v in g} code_v * xq_v + offset_g * sum_{v in g} xq_v)
 * The inner sums are exact integers (AVX-512 VNNI: vpdpbusd, 64 byte products per instruction); only the scaling
 * is float. Against dequantize-then-matmul on the quantized activations the difference is float rounding; against
 * float activations, at most half an activation step per value weighted by |w| (the bound the tests check).
 *
 * Rows of W are split over the thread pool in whole tiles. With AVX-512 VNNI, generation (m = 1) runs fused kernels
 * for Q4_0, Q8_0, Q4_K and Q6_K (codes assembled in registers, no buffer) and a prompt (m > 1) is a GEMM over tiles
 * of 16 decoded rows interleaved 4 codes at a time (gemm_piece). The other cases, and the portable and AVX2 builds,
 * decode a row (or a tile of rows) into a buffer and take dot_row. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threadpool.h"
#include "halffloat.h"
/* CARRACK_PORTABLE builds the plain C versions on any machine, for testing */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(CARRACK_PORTABLE)
#define USE_VNNI 1
#endif
#if (defined(USE_VNNI) || defined(__F16C__)) && !defined(CARRACK_PORTABLE)
#include <immintrin.h>
#endif

enum {
    TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q5_0 = 6, TYPE_Q5_1 = 7, TYPE_Q8_0 = 8,
    TYPE_Q2_K = 10, TYPE_Q3_K = 11, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14
};
#define GROUP 16      /* values per weight scale / offset */
#define LANE 4        /* values per int32 lane of a byte dot product */
#define ABLOCK 32     /* values per activation scale */
#define ROW_TILE 16   /* weight rows decoded together for a GEMM */

/* -- weight rows: codes[k] (bytes), scale[k / 16], offset[k / 16]; w = scale * code + offset ------------------- */
typedef void (*row_decoder)(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes,
                            float *restrict scale, float *restrict offset);

static void set_groups(float *scale, float *offset, int groups, float s, float o) {
    for (int g = 0; g < groups; g++) { scale[g] = s; offset[g] = o; }
}

/* 16 bytes -> their 16 low nibbles, then their 16 high nibbles */
static inline void split_nibbles16(const uint8_t *restrict q, uint8_t *restrict out) {
#ifdef USE_VNNI
    const __m128i bytes = _mm_loadu_si128((const __m128i *)q), low = _mm_set1_epi8(0x0f);
    _mm_storeu_si128((__m128i *)out, _mm_and_si128(bytes, low));
    _mm_storeu_si128((__m128i *)(out + 16), _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
#else
    for (int j = 0; j < 16; j++) { out[j] = q[j] & 0x0f; out[j + 16] = q[j] >> 4; }
#endif
}

static void decode_q4_0(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 32; b++, row += 18, codes += 32, scale += 2, offset += 2) {
        const float d = half_to_float(row);
        split_nibbles16(row + 2, codes);
        set_groups(scale, offset, 2, d, -8.0f * d);
    }
}

static void decode_q4_1(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 32; b++, row += 20, codes += 32, scale += 2, offset += 2) {
        split_nibbles16(row + 4, codes);
        set_groups(scale, offset, 2, half_to_float(row), half_to_float(row + 2));
    }
}

/* Q5_0 / Q5_1: bit j of the little-endian u32 qh is the 5th bit of value j */
static void five_bit_codes(const uint8_t *restrict qh_bytes, const uint8_t *restrict qs, uint8_t *restrict codes) {
    const uint32_t qh = (uint32_t)qh_bytes[0] | (uint32_t)qh_bytes[1] << 8 | (uint32_t)qh_bytes[2] << 16 |
                        (uint32_t)qh_bytes[3] << 24;
    split_nibbles16(qs, codes);
#ifdef USE_VNNI
    const __m256i low = _mm256_loadu_si256((const __m256i *)codes);
    _mm256_storeu_si256((__m256i *)codes, _mm256_mask_add_epi8(low, (__mmask32)qh, low, _mm256_set1_epi8(16)));
#else
    for (int j = 0; j < 32; j++) codes[j] |= (uint8_t)(((qh >> j) & 1) << 4);
#endif
}

static void decode_q5_0(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 32; b++, row += 22, codes += 32, scale += 2, offset += 2) {
        const float d = half_to_float(row);
        five_bit_codes(row + 2, row + 6, codes);
        set_groups(scale, offset, 2, d, -16.0f * d);
    }
}

static void decode_q5_1(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 32; b++, row += 24, codes += 32, scale += 2, offset += 2) {
        five_bit_codes(row + 4, row + 8, codes);
        set_groups(scale, offset, 2, half_to_float(row), half_to_float(row + 2));
    }
}

static void decode_q8_0(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 32; b++, row += 34, codes += 32, scale += 2, offset += 2) {
        const float d = half_to_float(row);
        for (int j = 0; j < 32; j++) codes[j] = (uint8_t)(row[2 + j] ^ 0x80); /* int8 q -> q + 128 */
        set_groups(scale, offset, 2, d, -128.0f * d);
    }
}

/* codes[32 * g + l] += add where bit g of bits[l] is set, for g < groups (Q3_K's hmask, Q5_K's qh) */
static inline void add_bit_planes(const uint8_t *restrict bits, int groups, uint8_t add, uint8_t *restrict codes) {
#ifdef USE_VNNI
    const __m256i planes = _mm256_loadu_si256((const __m256i *)bits), value = _mm256_set1_epi8((char)add);
    for (int g = 0; g < groups; g++) {
        const __mmask32 set = _mm256_test_epi8_mask(planes, _mm256_set1_epi8((char)(1 << g)));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(codes + 32 * g));
        _mm256_storeu_si256((__m256i *)(codes + 32 * g), _mm256_mask_add_epi8(c, set, c, value));
    }
#else
    for (int g = 0; g < groups; g++)
        for (int l = 0; l < 32; l++) codes[32 * g + l] += (uint8_t)(((bits[l] >> g) & 1) * add);
#endif
}

/* Q2_K / Q3_K low bits: two halves of 128 values; 2-bit field s of byte qs[l] of a half is its value 32 * s + l */
static void two_bit_codes(const uint8_t *restrict qs, uint8_t *restrict codes) {
    for (int half = 0; half < 2; half++, qs += 32, codes += 128)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) codes[32 * s + l] = (qs[l] >> (2 * s)) & 3;
}

/* block_q2_K: scales[16] (4-bit scale | 4-bit min << 4), qs[64], fp16 d, fp16 dmin */
static void decode_q2_k(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 256; b++, row += 84, codes += 256, scale += 16, offset += 16) {
        const float d = half_to_float(row + 80), dmin = half_to_float(row + 82);
        two_bit_codes(row + 16, codes);
        for (int g = 0; g < 16; g++) { scale[g] = d * (float)(row[g] & 0x0f); offset[g] = -dmin * (float)(row[g] >> 4); }
    }
}

/* block_q3_K: hmask[32] (bit g of hmask[l]: 3rd bit of value 32 * g + l, set means "no -4"), qs[64] as Q2_K,
 * scales[12] (16 6-bit scales, biased by 32), fp16 d */
static void decode_q3_k(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 256; b++, row += 110, codes += 256, scale += 16, offset += 16) {
        const uint8_t *hmask = row, *packed = row + 96;
        const float d = half_to_float(row + 108);
        two_bit_codes(row + 32, codes);
        add_bit_planes(hmask, 8, 4, codes);
        for (int g = 0; g < 16; g++) {
            const int low = g < 8 ? packed[g] & 0x0f : packed[g - 8] >> 4;
            const int high = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
            scale[g] = d * (float)((low | high << 4) - 32);
            offset[g] = -4.0f * scale[g];
        }
    }
}

static void scale_min_k4(int j, const uint8_t *q, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K / Q5_K scales: 8 6-bit scales and mins, 32 values each; w = d * scale * code - dmin * min */
static void k4_scales(const uint8_t *block, float *scale, float *offset) {
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    for (int j = 0; j < 8; j++) {
        int s, m;
        scale_min_k4(j, block + 4, &s, &m);
        set_groups(scale + 2 * j, offset + 2 * j, 2, d * (float)s, -dmin * (float)m);
    }
}

/* block_q4_K: fp16 d, fp16 dmin, scales[12], qs[128]: 4 runs of 32 bytes, low nibbles then high nibbles */
static void decode_q4_k(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 256; b++, row += 144, codes += 256, scale += 16, offset += 16) {
        k4_scales(row, scale, offset);
        for (int part = 0; part < 4; part++)
            for (int l = 0; l < 32; l++) {
                codes[64 * part + l] = row[16 + 32 * part + l] & 0x0f;
                codes[64 * part + 32 + l] = row[16 + 32 * part + l] >> 4;
            }
    }
}

/* block_q5_K: as Q4_K with qh[32] before qs: bit g of qh[l] is the 5th bit of value 32 * g + l */
static void decode_q5_k(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 256; b++, row += 176, codes += 256, scale += 16, offset += 16) {
        const uint8_t *qh = row + 16, *qs = row + 48;
        k4_scales(row, scale, offset);
        for (int part = 0; part < 4; part++)
            for (int l = 0; l < 32; l++) {
                codes[64 * part + l] = qs[32 * part + l] & 0x0f;
                codes[64 * part + 32 + l] = qs[32 * part + l] >> 4;
            }
        add_bit_planes(qh, 8, 16, codes);
    }
}

/* block_q6_K: ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16], fp16 d; w = d * scale * (code - 32).
 * Per half of 128 values: low nibbles of ql[0:64] are values 0-63, high nibbles 64-127; 2-bit field s of qh[l] is
 * the top of value 32 * s + l */
static void decode_q6_k(const uint8_t *restrict row, int64_t k, uint8_t *restrict codes, float *restrict scale,
                        float *restrict offset) {
    for (int64_t b = 0; b < k / 256; b++, row += 210, codes += 256, scale += 16, offset += 16) {
        const float d = half_to_float(row + 208);
        for (int half = 0; half < 2; half++) {
            const uint8_t *ql = row + 64 * half, *qh = row + 128 + 32 * half;
            uint8_t *out = codes + 128 * half;
            for (int l = 0; l < 64; l++) {
                out[l] = ql[l] & 0x0f;
                out[l + 64] = ql[l] >> 4;
            }
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) out[32 * s + l] |= (uint8_t)(((qh[l] >> (2 * s)) & 3) << 4);
        }
        const int8_t *sc = (const int8_t *)(row + 192);
        for (int g = 0; g < 16; g++) {
            scale[g] = d * (float)sc[g];
            offset[g] = -32.0f * scale[g];
        }
    }
}

static row_decoder decoder_for(int type, int64_t *block_values, int64_t *block_bytes) {
    switch (type) {
        case TYPE_Q4_0: *block_values = 32; *block_bytes = 18; return decode_q4_0;
        case TYPE_Q4_1: *block_values = 32; *block_bytes = 20; return decode_q4_1;
        case TYPE_Q5_0: *block_values = 32; *block_bytes = 22; return decode_q5_0;
        case TYPE_Q5_1: *block_values = 32; *block_bytes = 24; return decode_q5_1;
        case TYPE_Q8_0: *block_values = 32; *block_bytes = 34; return decode_q8_0;
        case TYPE_Q2_K: *block_values = 256; *block_bytes = 84; return decode_q2_k;
        case TYPE_Q3_K: *block_values = 256; *block_bytes = 110; return decode_q3_k;
        case TYPE_Q4_K: *block_values = 256; *block_bytes = 144; return decode_q4_k;
        case TYPE_Q5_K: *block_values = 256; *block_bytes = 176; return decode_q5_k;
        case TYPE_Q6_K: *block_values = 256; *block_bytes = 210; return decode_q6_k;
        default: return NULL;
    }
}

/* -- activations: per row, codes[k] (int8), lane_scale[k / 4] (dx of the lane's 32-value block), group_sum[k / 16]
 * (dx * sum of the group's codes: what a weight group's offset multiplies) ---------------------------------- */
typedef struct {
    int8_t *codes;
    float *lane_scale, *group_sum;
    float *block_sum; /* [k / 32]: dx * sum of the block's 32 codes, for weights whose groups span 32 values */
    int32_t *code_sum; /* [k / 16]: the sum of each group's codes, for weights whose offset is a multiple of the scale */
} activations_t;

#ifdef USE_VNNI
/* the same as the loop below, 16 values per vector: cvtps rounds to nearest even as nearbyintf does */
static void quantize_activation_row(const float *x, int64_t k, int8_t *codes, float *lane_scale, float *group_sum) {
    for (int64_t b = 0; b < k / ABLOCK; b++, x += ABLOCK, codes += ABLOCK) {
        const __m512 low = _mm512_loadu_ps(x), high = _mm512_loadu_ps(x + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
        const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512i low_codes = _mm512_cvtps_epi32(_mm512_mul_ps(low, _mm512_set1_ps(inverse)));
        const __m512i high_codes = _mm512_cvtps_epi32(_mm512_mul_ps(high, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)codes, _mm512_cvtsepi32_epi8(low_codes));
        _mm_storeu_si128((__m128i *)(codes + 16), _mm512_cvtsepi32_epi8(high_codes));
        _mm256_storeu_ps(lane_scale + b * (ABLOCK / LANE), _mm256_set1_ps(d));
        group_sum[2 * b] = d * (float)_mm512_reduce_add_epi32(low_codes);
        group_sum[2 * b + 1] = d * (float)_mm512_reduce_add_epi32(high_codes);
    }
}
#else
static void quantize_activation_row(const float *x, int64_t k, int8_t *codes, float *lane_scale, float *group_sum) {
    for (int64_t b = 0; b < k / ABLOCK; b++, x += ABLOCK, codes += ABLOCK) {
        float amax = 0.0f;
        for (int j = 0; j < ABLOCK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < ABLOCK; j++) codes[j] = (int8_t)nearbyintf(x[j] * inverse);
        for (int l = 0; l < ABLOCK / LANE; l++) lane_scale[b * (ABLOCK / LANE) + l] = d;
        for (int g = 0; g < ABLOCK / GROUP; g++) {
            int sum = 0;
            for (int j = 0; j < GROUP; j++) sum += codes[g * GROUP + j];
            group_sum[b * (ABLOCK / GROUP) + g] = d * (float)sum;
        }
    }
}
#endif

/* for a row of k values: code_sum[g] = the sum of group g's 16 codes, block_sum[b] = dx_b * the sum of block b's
 * 32 codes */
static void activation_sums(const int8_t *codes, const float *lane_scale, int64_t k, int32_t *code_sum,
                            float *block_sum) {
    for (int64_t g = 0; g < k / GROUP; g++) {
        int32_t sum = 0;
        for (int j = 0; j < GROUP; j++) sum += codes[g * GROUP + j];
        code_sum[g] = sum;
    }
    for (int64_t b = 0; b < k / ABLOCK; b++)
        block_sum[b] = lane_scale[b * (ABLOCK / LANE)] * (float)(code_sum[2 * b] + code_sum[2 * b + 1]);
}

/* -- one decoded weight row (codes, lane_scale[k / 4] = its groups' scales per lane, offset[k / 16]) times one
 * activation row --------------------------------------------------------------------------------------------- */
static float dot_row(const uint8_t *w_codes, const float *w_lane_scale, const float *w_offset, const int8_t *x_codes,
                     const float *x_lane_scale, const float *x_group_sum, int64_t k) {
    float total = 0.0f;
    int64_t i = 0;
#ifdef USE_VNNI
    __m512 acc = _mm512_setzero_ps();
    for (; i + 64 <= k; i += 64) {
        const __m512i products = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(w_codes + i),
                                                     _mm512_loadu_si512(x_codes + i));
        const __m512 scales = _mm512_mul_ps(_mm512_loadu_ps(w_lane_scale + i / LANE),
                                            _mm512_loadu_ps(x_lane_scale + i / LANE));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(products), scales, acc);
    }
    __m512 offsets = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= k / GROUP; g += 16)
        offsets = _mm512_fmadd_ps(_mm512_loadu_ps(w_offset + g), _mm512_loadu_ps(x_group_sum + g), offsets);
    total = _mm512_reduce_add_ps(_mm512_add_ps(acc, offsets));
    for (; g < k / GROUP; g++) total += w_offset[g] * x_group_sum[g];
#else
    for (int64_t g = 0; g < k / GROUP; g++) total += w_offset[g] * x_group_sum[g];
#endif
    for (; i < k; i += LANE) {
        int sum = 0;
        for (int j = 0; j < LANE; j++) sum += (int)w_codes[i + j] * (int)x_codes[i + j];
        total += (float)sum * w_lane_scale[i / LANE] * x_lane_scale[i / LANE];
    }
    return total;
}

#ifdef USE_VNNI
/* One Q8_0 / Q4_0 row times one activation row without the decoded buffer: two 32-value blocks per 64 codes, one
 * vpdpbusd, each block's d * dx applied to its 8 lanes; the code shift (+128 / +8) meets the blocks' dx * sum(xq). */
/* Blocks b and b + 1 (unsigned codes c0, c1, scales d0, d1) into the accumulator: one vpdpbusd over their 64
 * codes, each block's d * dx on its 8 lanes; the blocks' d * sum(xq) go to `offsets` for the code shift. */
static inline __attribute__((always_inline)) void add_block_pair(__m256i c0, __m256i c1, float d0, float d1,
                                                                 int64_t b, const int8_t *x_codes,
                                                                 const float *x_lane_scale,
                                                                 const float *x_group_sum, __m512 *acc,
                                                                 float *offsets) {
    const __m512i products = _mm512_dpbusd_epi32(
        _mm512_setzero_si512(), _mm512_inserti64x4(_mm512_castsi256_si512(c0), c1, 1),
        _mm512_loadu_si512(x_codes + 32 * b));
    const __m512 scales = _mm512_insertf32x8(_mm512_set1_ps(d0 * x_lane_scale[8 * b]),
                                             _mm256_set1_ps(d1 * x_lane_scale[8 * b + 8]), 1);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(products), scales, *acc);
    *offsets += d0 * (x_group_sum[2 * b] + x_group_sum[2 * b + 1]) +
                d1 * (x_group_sum[2 * b + 2] + x_group_sum[2 * b + 3]);
}

static float dot_q8_0(const uint8_t *row, int64_t k, const int8_t *x_codes, const float *x_lane_scale,
                      const float *x_group_sum) {
    const __m256i sign = _mm256_set1_epi8((char)0x80);
    __m512 acc = _mm512_setzero_ps();
    float offsets = 0.0f;
    int64_t b = 0;
    for (; b + 2 <= k / 32; b += 2, row += 68) {
        _mm_prefetch((const char *)row + 1024, _MM_HINT_T0);
        const float d0 = half_to_float(row), d1 = half_to_float(row + 34);
        const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + 2)), sign);
        const __m256i q1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(row + 36)), sign);
        add_block_pair(q0, q1, d0, d1, b, x_codes, x_lane_scale, x_group_sum, &acc, &offsets);
    }
    float total = _mm512_reduce_add_ps(acc) - 128.0f * offsets;
    for (; b < k / 32; b++, row += 34) { /* an odd last block, with the codes shifted as above: gcc 12 at -O3
                                           * with VNNI vectorized the plain int8 x int8 sum into wrong code */
        const float d = half_to_float(row);
        int sum = 0;
        for (int j = 0; j < 32; j++) sum += (int)(uint8_t)(row[2 + j] ^ 0x80) * (int)x_codes[32 * b + j];
        total += d * (x_lane_scale[8 * b] * (float)sum - 128.0f * (x_group_sum[2 * b] + x_group_sum[2 * b + 1]));
    }
    return total;
}

static float dot_q4_0(const uint8_t *row, int64_t k, const int8_t *x_codes, const float *x_lane_scale,
                      const float *x_group_sum) {
    const __m128i low_mask = _mm_set1_epi8(0x0f);
    __m512 acc = _mm512_setzero_ps();
    float offsets = 0.0f;
    int64_t b = 0;
    for (; b + 2 <= k / 32; b += 2, row += 36) {
        _mm_prefetch((const char *)row + 1024, _MM_HINT_T0);
        const float d0 = half_to_float(row), d1 = half_to_float(row + 18);
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(row + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(row + 20));
        const __m256i c0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q0, 4), low_mask), _mm_and_si128(q0, low_mask));
        const __m256i c1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q1, 4), low_mask), _mm_and_si128(q1, low_mask));
        add_block_pair(c0, c1, d0, d1, b, x_codes, x_lane_scale, x_group_sum, &acc, &offsets);
    }
    float total = _mm512_reduce_add_ps(acc) - 8.0f * offsets;
    for (; b < k / 32; b++, row += 18) { /* an odd last block */
        const float d = half_to_float(row);
        int sum = 0;
        for (int j = 0; j < 16; j++)
            sum += ((row[2 + j] & 0x0f) - 8) * x_codes[32 * b + j] + ((row[2 + j] >> 4) - 8) * x_codes[32 * b + j + 16];
        total += d * x_lane_scale[8 * b] * (float)sum;
    }
    return total;
}

/* One Q6_K row times one activation row without the decoded buffer: per half of 128 values, four runs of 32 codes
 * from the low/high nibbles and 2-bit fields, two vpdpbusd of 64 codes each; the 16 groups' d * scale * dx are one
 * vector per block, spread to the lanes of each 64 values by a permutation. */
static float dot_q6_k(const uint8_t *row, int64_t k, const int8_t *x_codes, const float *x_lane_scale,
                      const float *x_group_sum) {
    const __m512i low_mask = _mm512_set1_epi8(0x0f), two_bits = _mm512_set1_epi8(3);
    const __m512i top_two_bits = _mm512_set1_epi8(0x30);
    const __m512i group_of_lane = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i every_fourth = _mm512_set_epi32(60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
    __m512 acc = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++, row += 210, x_codes += 256, x_lane_scale += 64, x_group_sum += 16) {
        _mm_prefetch((const char *)row + 1024, _MM_HINT_T0);
        const __m512 weight_scales = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 192)))),
            _mm512_set1_ps(half_to_float(row + 208)));
        const __m512 scales = _mm512_mul_ps(weight_scales, _mm512_i32gather_ps(every_fourth, x_lane_scale, 4));
        /* w = d * sc * (code - 32): the -32 meets dx * sum(xq) of each group */
        offsets = _mm512_fmadd_ps(weight_scales, _mm512_loadu_ps(x_group_sum), offsets);
        for (int half = 0; half < 2; half++) {
            /* ql's 64 bytes are the low nibbles of values 0-63 and the high nibbles of 64-127; qh's 32 bytes,
             * broadcast to both halves with the upper half shifted by 2, give the top bits of values 0-63 at bits
             * 0-1 and of values 64-127 at bits 4-5 */
            const __m512i low = _mm512_loadu_si512(row + 64 * half);
            const __m512i high_broadcast =
                _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 128 + 32 * half)));
            const __m512i high = _mm512_mask_srli_epi16(high_broadcast, 0xffff0000u, high_broadcast, 2);
            const __m512i codes[2] = {
                _mm512_or_si512(_mm512_and_si512(low, low_mask),
                                _mm512_slli_epi16(_mm512_and_si512(high, two_bits), 4)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), low_mask),
                                _mm512_and_si512(high, top_two_bits))};
            for (int pair = 0; pair < 2; pair++) {
                const int chunk = 2 * half + pair; /* 64 values: groups 4 * chunk .. 4 * chunk + 3 */
                const __m512i products = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[pair],
                                                             _mm512_loadu_si512(x_codes + 64 * chunk));
                const __m512 lane_scales = _mm512_permutexvar_ps(
                    _mm512_add_epi32(group_of_lane, _mm512_set1_epi32(4 * chunk)), scales);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(products), lane_scales, acc);
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_fnmadd_ps(_mm512_set1_ps(32.0f), offsets, acc));
}

/* Q4_K's 12 bytes of 6-bit scales and mins as 8 bytes each (scale_min_k4 for all 8 sub-blocks in 32-bit words):
 * sub-blocks 0-3 keep the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 take a nibble of bytes 8-11 and the
 * top 2 bits of bytes 0-3 (scales) or 4-7 (mins) */
static inline void k4_scale_bytes(const uint8_t *packed, uint64_t *scales, uint64_t *mins) {
    uint32_t word[3];
    memcpy(word, packed, sizeof word);
    const uint32_t low6 = 0x3f3f3f3fu, nibble = 0x0f0f0f0fu, top2 = 0x03030303u;
    const uint32_t scales_high = (word[2] & nibble) | (((word[0] >> 6) & top2) << 4);
    const uint32_t mins_high = ((word[2] >> 4) & nibble) | (((word[1] >> 6) & top2) << 4);
    *scales = (uint64_t)(word[0] & low6) | (uint64_t)scales_high << 32;
    *mins = (uint64_t)(word[1] & low6) | (uint64_t)mins_high << 32;
}

/* One Q4_K row times one activation row without the decoded buffer (generation's matrix-vector products): per
 * super-block the 8 sub-blocks' d * scale * dx are one vector (scales and mins decoded in 32-bit words, not per
 * sub-block) and the mins' dmin * min * dx * sum(xq) one fused step into a vector of offsets; per 64 values, the
 * 32 bytes of nibbles become 64 codes in order, one vpdpbusd with the activation codes, and the two sub-blocks'
 * factors spread to their 8 lanes each by a permutation. Two accumulators (parts 0-1, 2-3) halve the chain. */
static float dot_q4_k(const uint8_t *row, int64_t k, const int8_t *x_codes, const float *x_lane_scale,
                      const float *x_block_sum) {
    const __m512i nibble_mask = _mm512_set1_epi8(0x0f);
    const __m256i every_eighth = _mm256_set_epi32(56, 48, 40, 32, 24, 16, 8, 0);
    __m512i part_lanes[4];
    for (int part = 0; part < 4; part++)
        part_lanes[part] = _mm512_set_epi32(2 * part + 1, 2 * part + 1, 2 * part + 1, 2 * part + 1, 2 * part + 1,
                                            2 * part + 1, 2 * part + 1, 2 * part + 1, 2 * part, 2 * part, 2 * part,
                                            2 * part, 2 * part, 2 * part, 2 * part, 2 * part);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < k / 256; b++, row += 144, x_codes += 256, x_lane_scale += 64, x_block_sum += 8) {
        _mm_prefetch((const char *)row + 1024, _MM_HINT_T0);
        uint64_t scale_bytes, min_bytes;
        k4_scale_bytes(row + 4, &scale_bytes, &min_bytes);
        const float d = half_to_float(row), dmin = half_to_float(row + 2);
        const __m256 scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)scale_bytes)));
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)min_bytes)));
        const __m256 dx = _mm256_i32gather_ps(x_lane_scale, every_eighth, 4);
        const __m512 factors = _mm512_zextps256_ps512(_mm256_mul_ps(_mm256_mul_ps(scales, _mm256_set1_ps(d)), dx));
        offsets = _mm256_fmadd_ps(_mm256_mul_ps(mins, _mm256_set1_ps(dmin)), _mm256_loadu_ps(x_block_sum), offsets);
        for (int part = 0; part < 4; part++) {
            /* the 32 bytes in both halves (a load-port broadcast), the upper half shifted: low nibbles, then high
             * nibbles, in order, without a lane insert */
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 16 + 32 * part)));
            const __m512i codes = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xffff0000u, q, 4), nibble_mask);
            const __m512i products = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                                         _mm512_loadu_si512(x_codes + 64 * part));
            acc[part / 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(products),
                                            _mm512_permutexvar_ps(part_lanes[part], factors), acc[part / 2]);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) -
           _mm512_reduce_add_ps(_mm512_zextps256_ps512(offsets));
}
#endif

static void expand_to_lanes(const float *group_scale, int64_t groups, float *lane_scale) {
    for (int64_t g = 0; g < groups; g++)
        for (int l = 0; l < GROUP / LANE; l++) lane_scale[g * (GROUP / LANE) + l] = group_scale[g];
}

/* 1 when `type` is one this file decodes */
int carrack_qdot_supports(int type) {
    int64_t values, bytes;
    return decoder_for(type, &values, &bytes) != NULL;
}

/* xq (m, k) int8 and the per-32 scales dx (m, k / 32) of x (m, k): what the products multiply (for tests).
 * Returns 0, or -1 for a k that is not a multiple of 32. */
int carrack_qdot_quantize(const float *x, int64_t m, int64_t k, int8_t *codes, float *block_scale) {
    if (k % ABLOCK != 0) return -1;
    float *lane_scale = malloc((size_t)(k / LANE) * sizeof(float)), *group_sum = malloc((size_t)(k / GROUP) * sizeof(float));
    if (lane_scale == NULL || group_sum == NULL) { free(lane_scale); free(group_sum); return -2; }
    for (int64_t i = 0; i < m; i++) {
        quantize_activation_row(x + i * k, k, codes + i * k, lane_scale, group_sum);
        for (int64_t b = 0; b < k / ABLOCK; b++) block_scale[i * (k / ABLOCK) + b] = lane_scale[b * (ABLOCK / LANE)];
    }
    free(lane_scale);
    free(group_sum);
    return 0;
}

/* aligned_alloc wants a multiple of the alignment */
static size_t padded(int64_t bytes) { return (size_t)((bytes + 63) / 64 * 64); }

typedef struct {
    const uint8_t *w;
    row_decoder decode;
    int64_t row_bytes, n, k, m;
    activations_t x;
    float *y;
    _Atomic int status;
} qdot_call_t;

#ifdef USE_VNNI
/* -- a prompt's GEMM (AVX-512 VNNI): ROW_TILE = 16 weight rows decoded, then interleaved so that one 64-byte vector
 * holds 4 consecutive codes of each of the 16 rows; a vpdpbusd with 4 activation codes broadcast then adds to the
 * 16 rows' sums at once. Each span of 32 values (16 for Q2_K, Q3_K, Q6_K, whose scales are per 16) is summed in
 * int32 and scaled once (weight scale x activation scale, per row in the 16 lanes), for up to 8 activation rows
 * sharing every weight load. On this loop's cores a float vector step costs about what a vpdpbusd does, so the
 * float steps per integer step are what the spans and the offsets folded into the sums (code_bias) cut. --- */
typedef struct {
    uint8_t *codes;      /* [k / 4][16 rows][4] */
    float *scale, *offset; /* [k / 16][16 rows] */
} interleaved_tile_t;

/* 16 rows of 16 int32 (each 4 codes) -> 16 vectors, vector c holding column c of every row: out[c * 16 + r] =
 * in[r * stride + c], a 16 x 16 transpose in registers (dword, qword, then 128-bit lane shuffles) */
static void transpose_16x16_dwords(const uint8_t *in, int64_t stride, uint8_t *out) {
    __m512i r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(in + i * stride);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + j], lane L: rows g..g+3 at column 4 L + j */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
        u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
        u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i low01 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i low23 = _mm512_shuffle_i32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512i high01 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512i high23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        _mm512_storeu_si512(out + (0 + j) * 64, _mm512_shuffle_i32x4(low01, high01, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(out + (4 + j) * 64, _mm512_shuffle_i32x4(low01, high01, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_storeu_si512(out + (8 + j) * 64, _mm512_shuffle_i32x4(low23, high23, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_storeu_si512(out + (12 + j) * 64, _mm512_shuffle_i32x4(low23, high23, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}

/* the decoded rows (codes [16][k], zero past `rows`) into the tile's layout */
static void interleave_tile(const uint8_t *restrict codes, const float *restrict scale,
                            const float *restrict offset, int64_t rows, int64_t k, interleaved_tile_t *tile) {
    uint8_t *restrict tile_codes = tile->codes;
    float *restrict tile_scale = tile->scale, *restrict tile_offset = tile->offset;
    int64_t c = 0;
    for (; c + 16 <= k / 4; c += 16) transpose_16x16_dwords(codes + c * 4, k, tile_codes + c * 64);
    for (; c < k / 4; c++)
        for (int64_t r = 0; r < 16; r++) memcpy(tile_codes + (c * 16 + r) * 4, codes + r * k + c * 4, 4);
    for (int64_t g = 0; g < k / GROUP; g++)
        for (int64_t r = 0; r < 16; r++) {
            tile_scale[g * 16 + r] = r < rows ? scale[r * (k / GROUP) + g] : 0.0f;
            tile_offset[g * 16 + r] = r < rows ? offset[r * (k / GROUP) + g] : 0.0f;
        }
}

static inline __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* y[i, r0 + 0..rows) for the activation rows i in [i0, i0 + count), count <= 8 (each a chain of vpdpbusd of its
 * own: eight hide the instruction's latency). `span` (16 or 32) values are summed in int32 before one float
 * scaling: 32 where the weights' scale and offset hold for 32 values (all but Q2_K, Q3_K, Q6_K), as the
 * activations' scale does. With a `bias` (weights whose offset is -bias * scale: codes shifted from signed values),
 * the sums start at -bias * sum(xq) and the offset needs no float step of its own. */
static inline __attribute__((always_inline)) void tile_times_rows(const interleaved_tile_t *tile,
                                                                  const activations_t *x, int64_t k, int64_t i0,
                                                                  const int count, const int span,
                                                                  const int biased, int bias, float *y,
                                                                  int64_t n, int64_t r0, int64_t rows) {
    __m512 acc[8];
    const int8_t *x_codes[8];
    const float *x_lanes[8], *x_sums[8];
    const int32_t *x_code_sums[8];
    for (int t = 0; t < count; t++) {
        acc[t] = _mm512_setzero_ps();
        x_code_sums[t] = x->code_sum + (i0 + t) * (k / GROUP);
        x_codes[t] = x->codes + (i0 + t) * k;
        x_lanes[t] = x->lane_scale + (i0 + t) * (k / LANE);
        x_sums[t] = span == ABLOCK ? x->block_sum + (i0 + t) * (k / ABLOCK) : x->group_sum + (i0 + t) * (k / GROUP);
    }
    for (int64_t s = 0; s < k / span; s++) {
        __m512i sums[8];
        const int64_t g = s * (span / GROUP); /* the span's first group: its scale and offset hold for the span */
        for (int t = 0; t < count; t++)
            sums[t] = !biased ? _mm512_setzero_si512()
                      : _mm512_set1_epi32(-bias * (span == GROUP ? x_code_sums[t][g]
                                                                 : x_code_sums[t][g] + x_code_sums[t][g + 1]));
        for (int q = 0; q < span / 4; q++) {
            const __m512i w = _mm512_loadu_si512(tile->codes + (s * (span / 4) + q) * 64);
            for (int t = 0; t < count; t++)
                sums[t] = _mm512_dpbusd_epi32(sums[t], w, broadcast4(x_codes[t] + s * span + q * 4));
        }
        const __m512 scale = _mm512_loadu_ps(tile->scale + g * 16), offset = _mm512_loadu_ps(tile->offset + g * 16);
        for (int t = 0; t < count; t++) {
            const __m512 lane = _mm512_mul_ps(scale, _mm512_set1_ps(x_lanes[t][g * (GROUP / LANE)]));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t]), lane, acc[t]);
            if (!biased) acc[t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sums[t][s]), acc[t]);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << rows) - 1);
    for (int t = 0; t < count; t++) _mm512_mask_storeu_ps(y + (i0 + t) * n + r0, mask, acc[t]);
}

/* every activation row times one tile, 8 rows at a time, then 4, then 1 */
static inline __attribute__((always_inline)) void tile_times_all_rows(const interleaved_tile_t *tile,
                                                                      const activations_t *x, int64_t k, int64_t m,
                                                                      const int span, const int biased, int bias,
                                                                      float *y, int64_t n, int64_t r0,
                                                                      int64_t rows) {
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) tile_times_rows(tile, x, k, i, 8, span, biased, bias, y, n, r0, rows);
    for (; i + 4 <= m; i += 4) tile_times_rows(tile, x, k, i, 4, span, biased, bias, y, n, r0, rows);
    for (; i < m; i++) tile_times_rows(tile, x, k, i, 1, span, biased, bias, y, n, r0, rows);
}

/* 1 when a type's weight scale and offset hold for 32 values (and k is whole 32-value spans) */
static int scales_span_32(row_decoder decode) {
    return decode != decode_q2_k && decode != decode_q3_k && decode != decode_q6_k;
}

/* b where a type's offset is -b * scale (its codes are signed values shifted by b), else 0 */
static int code_bias(row_decoder decode) {
    return decode == decode_q6_k ? 32 : decode == decode_q3_k ? 4 : decode == decode_q8_0 ? 128
           : decode == decode_q4_0 ? 8 : decode == decode_q5_0 ? 16 : 0;
}

/* every activation row times one tile, with the span and offset handling of the type */
static void tile_times_activations(const interleaved_tile_t *tile, const qdot_call_t *c, int64_t r0,
                                   int64_t rows) {
    const int bias = code_bias(c->decode);
    if (scales_span_32(c->decode)) {
        if (bias) tile_times_all_rows(tile, &c->x, c->k, c->m, ABLOCK, 1, bias, c->y, c->n, r0, rows);
        else tile_times_all_rows(tile, &c->x, c->k, c->m, ABLOCK, 0, 0, c->y, c->n, r0, rows);
    } else {
        if (bias) tile_times_all_rows(tile, &c->x, c->k, c->m, GROUP, 1, bias, c->y, c->n, r0, rows);
        else tile_times_all_rows(tile, &c->x, c->k, c->m, GROUP, 0, 0, c->y, c->n, r0, rows);
    }
}

static void gemm_tiles(qdot_call_t *c, int64_t begin, int64_t end, uint8_t *codes, float *group_scale,
                       float *offset, interleaved_tile_t *tile) {
    const int64_t k = c->k;
    for (int64_t r0 = begin; r0 < end; r0 += 16) {
        const int64_t rows = end - r0 < 16 ? end - r0 : 16;
        for (int64_t t = 0; t < rows; t++)
            c->decode(c->w + (r0 + t) * c->row_bytes, k, codes + t * k, group_scale + t * (k / GROUP),
                      offset + t * (k / GROUP));
        if (rows < 16) memset(codes + rows * k, 0, (size_t)((16 - rows) * k));
        interleave_tile(codes, group_scale, offset, rows, k, tile);
        tile_times_activations(tile, c, r0, rows);
    }
}

static int gemm_piece(qdot_call_t *c, int64_t begin, int64_t end) {
    const int64_t k = c->k;
    interleaved_tile_t tile = {aligned_alloc(64, padded(16 * k)), malloc((size_t)(k / GROUP * 16) * sizeof(float)),
                               malloc((size_t)(k / GROUP * 16) * sizeof(float))};
    uint8_t *codes = aligned_alloc(64, padded(16 * k));
    float *group_scale = malloc((size_t)(16 * (k / GROUP)) * sizeof(float));
    float *offset = malloc((size_t)(16 * (k / GROUP)) * sizeof(float));
    const int ok = tile.codes && tile.scale && tile.offset && codes && group_scale && offset;
    if (ok) gemm_tiles(c, begin, end, codes, group_scale, offset, &tile);
    free(tile.codes);
    free(tile.scale);
    free(tile.offset);
    free(codes);
    free(group_scale);
    free(offset);
    return ok ? 0 : -2;
}
#endif

/* the weight rows of tiles [first_tile, end_tile), a tile of decoded rows at a time, times every activation row
 * (pieces are whole tiles, so which rows share a tile, and so every sum's order, does not depend on the threads) */
static void qdot_piece(void *p, int64_t first_tile, int64_t end_tile, int64_t slot) {
    qdot_call_t *c = p;
    (void)slot;
    const int64_t k = c->k, tile = c->m > 1 ? ROW_TILE : 1;
    const int64_t begin = first_tile * tile, end = end_tile * tile < c->n ? end_tile * tile : c->n;
#ifdef USE_VNNI
    float (*fused)(const uint8_t *, int64_t, const int8_t *, const float *, const float *) =
        c->decode == decode_q6_k ? dot_q6_k
        : c->decode == decode_q8_0 ? dot_q8_0 : c->decode == decode_q4_0 ? dot_q4_0 : NULL;
    if (c->m == 1 && c->decode == decode_q4_k) {
        for (int64_t r = begin; r < end; r++)
            c->y[r] = dot_q4_k(c->w + r * c->row_bytes, k, c->x.codes, c->x.lane_scale, c->x.block_sum);
        return;
    }
    if (c->m == 1 && fused != NULL) {
        float (*dot)(const uint8_t *, int64_t, const int8_t *, const float *, const float *) = fused;
        for (int64_t r = begin; r < end; r++)
            c->y[r] = dot(c->w + r * c->row_bytes, k, c->x.codes, c->x.lane_scale, c->x.group_sum);
        return;
    }
    if (c->m > 1) {
        const int status = gemm_piece(c, begin, end);
        if (status) atomic_store(&c->status, status);
        return;
    }
#endif
    uint8_t *codes = aligned_alloc(64, padded(tile * k));
    float *group_scale = malloc((size_t)(k / GROUP) * sizeof(float));
    float *lane_scale = aligned_alloc(64, padded(tile * (k / LANE) * 4));
    float *offset = malloc((size_t)(tile * (k / GROUP)) * sizeof(float));
    if (codes == NULL || group_scale == NULL || lane_scale == NULL || offset == NULL) {
        atomic_store(&c->status, -2);
    } else {
        for (int64_t r0 = begin; r0 < end; r0 += tile) {
            const int64_t rows = end - r0 < tile ? end - r0 : tile;
            for (int64_t t = 0; t < rows; t++) {
                c->decode(c->w + (r0 + t) * c->row_bytes, k, codes + t * k, group_scale, offset + t * (k / GROUP));
                expand_to_lanes(group_scale, k / GROUP, lane_scale + t * (k / LANE));
            }
            for (int64_t i = 0; i < c->m; i++) {
                const int8_t *x_codes = c->x.codes + i * k;
                const float *x_lanes = c->x.lane_scale + i * (k / LANE), *x_sums = c->x.group_sum + i * (k / GROUP);
                for (int64_t t = 0; t < rows; t++)
                    c->y[i * c->n + r0 + t] = dot_row(codes + t * k, lane_scale + t * (k / LANE),
                                                      offset + t * (k / GROUP), x_codes, x_lanes, x_sums, k);
            }
        }
    }
    free(codes);
    free(group_scale);
    free(lane_scale);
    free(offset);
}

CARRACK_POOL_CLIENT(qdot)

/* values of x from which its quantization is split over threads */
#define QUANTIZE_PARALLEL_MIN (1 << 16)
/* matrices one grouped call may take */
#define MAX_GROUP 8

typedef struct {
    const float *x;
    int64_t k;
    const activations_t *out;
} quantize_call_t;

static void quantize_rows(void *p, int64_t begin, int64_t end, int64_t slot) {
    const quantize_call_t *q = p;
    const activations_t *a = q->out;
    const int64_t k = q->k;
    (void)slot;
    for (int64_t i = begin; i < end; i++) {
        quantize_activation_row(q->x + i * k, k, a->codes + i * k, a->lane_scale + i * (k / LANE),
                                a->group_sum + i * (k / GROUP));
        activation_sums(a->codes + i * k, a->lane_scale + i * (k / LANE), k, a->code_sum + i * (k / GROUP),
                        a->block_sum + i * (k / ABLOCK));
    }
}

/* the matrices of a grouped call, their tiles numbered one after the other */
typedef struct {
    qdot_call_t calls[MAX_GROUP];
    int64_t first_tile[MAX_GROUP + 1];
    int count;
} qdot_group_t;

static void group_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    qdot_group_t *g = p;
    for (int i = 0; i < g->count; i++) {
        const int64_t lo = begin > g->first_tile[i] ? begin : g->first_tile[i];
        const int64_t hi = end < g->first_tile[i + 1] ? end : g->first_tile[i + 1];
        if (hi > lo) qdot_piece(&g->calls[i], lo - g->first_tile[i], hi - g->first_tile[i], slot);
    }
}

/* y[i] (m, n[i]) = x (m, k) @ W_i.T for `count` matrices W_i (n[i] rows of row_bytes[i] bytes of ggml type
 * types[i]) that share x: x is quantized once (8 bits per 32 values) and all the matrices' rows are split over
 * up to `threads` threads in one parallel region (the projections of one layer). Every output is what a call per
 * matrix gives. Returns 0, -1 for an unknown type, a k that is not a whole number of blocks or more than
 * MAX_GROUP matrices, -2 when out of memory. */
int carrack_qdot_matmul_group(int count, const uint8_t *const *w, const int *types, const int64_t *row_bytes,
                              const int64_t *n, int64_t k, const float *x, int64_t m, float *const *y,
                              int64_t threads) {
    if (count < 1 || count > MAX_GROUP) return -1;
    qdot_group_t g;
    g.count = count;
    g.first_tile[0] = 0;
    activations_t a = {NULL, NULL, NULL, NULL, NULL};
    const int64_t tile = m > 1 ? ROW_TILE : 1;
    for (int i = 0; i < count; i++) {
        int64_t block_values, block_bytes;
        row_decoder decode = decoder_for(types[i], &block_values, &block_bytes);
        if (decode == NULL || k % block_values != 0 || k % ABLOCK != 0 ||
            row_bytes[i] != k / block_values * block_bytes)
            return -1;
        qdot_call_t *c = &g.calls[i];
        c->w = w[i], c->decode = decode, c->row_bytes = row_bytes[i], c->n = n[i], c->k = k, c->m = m;
        c->y = y[i];
        atomic_init(&c->status, 0);
        g.first_tile[i + 1] = g.first_tile[i] + (n[i] + tile - 1) / tile;
    }
    a.codes = aligned_alloc(64, padded(m * k));
    a.lane_scale = aligned_alloc(64, padded(m * (k / LANE) * 4));
    a.group_sum = malloc((size_t)(m * (k / GROUP)) * sizeof(float));
    a.block_sum = malloc((size_t)(m * (k / ABLOCK)) * sizeof(float));
    a.code_sum = malloc((size_t)(m * (k / GROUP)) * sizeof(int32_t));
    int status = 0;
    if (a.codes == NULL || a.lane_scale == NULL || a.group_sum == NULL || a.block_sum == NULL || a.code_sum == NULL) {
        status = -2;
    } else {
        quantize_call_t q = {x, k, &a};
        /* a prompt's rows are quantized on the run's threads too (per row: the split changes no code) */
        const int64_t quantize_threads = m * k >= QUANTIZE_PARALLEL_MIN ? threads : 1;
        parallel_for(quantize_rows, &q, 0, m, pieces_for(m, quantize_threads), quantize_threads);
        for (int i = 0; i < count; i++) g.calls[i].x = a;
        const int64_t tiles = g.first_tile[count];
        parallel_for(group_piece, &g, 0, tiles, pieces_for(tiles, threads), threads);
        for (int i = 0; i < count && status == 0; i++) status = atomic_load(&g.calls[i].status);
    }
    free(a.codes);
    free(a.lane_scale);
    free(a.group_sum);
    free(a.block_sum);
    free(a.code_sum);
    return status;
}

/* y (m, n) = x (m, k) @ W.T for W's n rows of `row_bytes` bytes of ggml blocks, x quantized to 8 bits per 32
 * values, on up to `threads` threads. Returns 0, -1 for an unknown type or a k that is not a whole number of blocks,
 * -2 when out of memory. */
int carrack_qdot_matmul(const uint8_t *w, int type, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                        int64_t m, float *y, int64_t threads) {
    return carrack_qdot_matmul_group(1, &w, &type, &row_bytes, &n, k, x, m, &y, threads);
}
