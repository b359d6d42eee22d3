/* carrack's integer kernels for quantized models in compiled models (`carrack compile`), bit for bit equal to
 * carrack's session (carrack/ops/contrib_quant.py, carrack/native/qconv.c and qgemm.c define the arithmetic):
 *
 *   cr_qconv2d / cr_qmatmul  QLinearConvExact / QLinearMatMulExact: 8-bit activations minus their zero point
 *                            times the pre-shifted weights, summed exactly in int32, plus the integer bias, then
 *                            requantized: saturate(rint(float32(acc) * multiplier) + y_zero_point).
 *   cr_quantize              QuantizeLinear per tensor: saturate(rint(x / scale) + zero_point) in float32.
 *   cr_dequantize            DequantizeLinear per tensor: (float32(x) - zero_point) * scale.
 *   cr_qlinear_add           QLinearAdd: rint(a * ka + b * kb + offset) in float32 in exactly this order.
 *   cr_qmaxpool2d            MaxPool over 8-bit planes (padding never wins).
 *
 * The products run as pairs of int16 (activation - zero point, shifted weight) summed into int32 lanes: one
 * instruction per pair on every target with vectors (WebAssembly SIMD128 i32x4.dot_i16x8_s, AVX-512BW and AVX2
 * vpmaddwd, SSE2 pmaddwd) and a plain C loop elsewhere; integer sums are exact, so every target gives the same
 * bytes. Activations are packed per block of CR_QNB output pixels as [k / 2][pixel][2] int16 (im2col for
 * convolutions, a transpose for matrix products) into a scratch block of the arena. The float steps round once
 * per operation as numpy does: no contraction into fused multiply-adds (which -ffp-contract=fast would allow).
 */
#ifndef CARRACK_QUANT_H
#define CARRACK_QUANT_H

#include "carrack_values.h"

/* CR_QUANT_PORTABLE (-DCR_QUANT_PORTABLE) keeps the plain C loop on any target (the tests' portable build) */
#if defined(CR_QUANT_PORTABLE)
#elif defined(__wasm_simd128__)
#include <wasm_simd128.h>
#elif defined(__AVX2__) || defined(__AVX512BW__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__clang__)
#define CR_EXACT_FLOAT _Pragma("clang fp contract(off)")
#define CR_EXACT_FN
#else
#define CR_EXACT_FLOAT
#define CR_EXACT_FN __attribute__((optimize("fp-contract=off")))
#endif

/* output pixels per packed activation block (a multiple of every target's tile width) */
#define CR_QNB 32
/* output channels per register tile */
#define CR_QMR 4

/* -- int32 lanes from int16 pairs: acc[l] += b[2l] * w0 + b[2l + 1] * w1, w = the pair (w0, w1) as one int32 -- */
#if defined(CR_QUANT_PORTABLE) || !(defined(__wasm_simd128__) || defined(__AVX512BW__) || defined(__AVX2__) || \
                                      defined(__SSE2__))
#define CR_QL 4
typedef struct { int32_t lane[4]; } cr_qv;
static inline cr_qv cr_qv_zero(void) { cr_qv v = {{0, 0, 0, 0}}; return v; }
static inline cr_qv cr_qv_splat(int32_t w) { cr_qv v = {{w, w, w, w}}; return v; }
static inline cr_qv cr_qv_dot(cr_qv acc, const int16_t *b, cr_qv w) {
    int16_t pair[2];
    memcpy(pair, &w.lane[0], sizeof pair);
    for (int l = 0; l < 4; l++) acc.lane[l] += (int32_t)b[2 * l] * pair[0] + (int32_t)b[2 * l + 1] * pair[1];
    return acc;
}
static inline void cr_qv_store(int32_t *p, cr_qv v) { memcpy(p, v.lane, sizeof v.lane); }
#elif defined(__wasm_simd128__)
#define CR_QL 4
/* SIMD128's i32x4.dot_i16x8_s: four int32 sums of two int16 products */
typedef v128_t cr_qv;
static inline cr_qv cr_qv_zero(void) { return wasm_i32x4_splat(0); }
static inline cr_qv cr_qv_splat(int32_t w) { return wasm_i32x4_splat(w); }
static inline cr_qv cr_qv_dot(cr_qv acc, const int16_t *b, cr_qv w) {
    return wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(wasm_v128_load(b), w));
}
static inline void cr_qv_store(int32_t *p, cr_qv v) { wasm_v128_store(p, v); }
#elif defined(__AVX512BW__)
#define CR_QL 16
typedef __m512i cr_qv;
static inline cr_qv cr_qv_zero(void) { return _mm512_setzero_si512(); }
static inline cr_qv cr_qv_splat(int32_t w) { return _mm512_set1_epi32(w); }
static inline cr_qv cr_qv_dot(cr_qv acc, const int16_t *b, cr_qv w) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_loadu_si512((const void *)b), w));
}
static inline void cr_qv_store(int32_t *p, cr_qv v) { _mm512_storeu_si512((void *)p, v); }
#elif defined(__AVX2__)
#define CR_QL 8
typedef __m256i cr_qv;
static inline cr_qv cr_qv_zero(void) { return _mm256_setzero_si256(); }
static inline cr_qv cr_qv_splat(int32_t w) { return _mm256_set1_epi32(w); }
static inline cr_qv cr_qv_dot(cr_qv acc, const int16_t *b, cr_qv w) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)b), w));
}
static inline void cr_qv_store(int32_t *p, cr_qv v) { _mm256_storeu_si256((__m256i *)p, v); }
#elif defined(__SSE2__)
#define CR_QL 4
typedef __m128i cr_qv;
static inline cr_qv cr_qv_zero(void) { return _mm_setzero_si128(); }
static inline cr_qv cr_qv_splat(int32_t w) { return _mm_set1_epi32(w); }
static inline cr_qv cr_qv_dot(cr_qv acc, const int16_t *b, cr_qv w) {
    return _mm_add_epi32(acc, _mm_madd_epi16(_mm_loadu_si128((const __m128i *)b), w));
}
static inline void cr_qv_store(int32_t *p, cr_qv v) { _mm_storeu_si128((__m128i *)p, v); }
#endif
/* vectors per register-tile row: a tile is CR_QMR channels x CR_QNV * CR_QL pixels */
#define CR_QNV (CR_QNB / CR_QL < 2 ? CR_QNB / CR_QL : 2)

/* the same lanes as plain vectors (GCC/Clang vector extensions) for the requantization */
typedef int32_t cr_qi __attribute__((vector_size(CR_QL * 4)));
typedef float cr_qf __attribute__((vector_size(CR_QL * 4)));
/* 1.5 * 2**23: (v + it) - it is v rounded half to even for |v| <= 2**22 (v is clamped well inside) */
#define CR_ROUNDER 12582912.0f

static inline cr_qf cr_qf_clamp(cr_qf v, float lo, float hi) {
    cr_qi low = v < lo, high = v > hi, bits, lo_bits, hi_bits;
    cr_qf lo_v = (cr_qf){0} + lo, hi_v = (cr_qf){0} + hi;
    memcpy(&bits, &v, sizeof bits);
    memcpy(&lo_bits, &lo_v, sizeof lo_bits);
    memcpy(&hi_bits, &hi_v, sizeof hi_bits);
    bits = (low & lo_bits) | (high & hi_bits) | (~(low | high) & bits);
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline int32_t cr_qload(const void *x, int is_signed, int64_t i) {
    return is_signed ? (int32_t)((const int8_t *)x)[i] : (int32_t)((const uint8_t *)x)[i];
}

/* saturate(rint(float32(acc) * multiplier) + zero_point) into the output type's range, for CR_QL sums at once:
 * clamping to the integer bounds before rounding gives the same integers as after, and keeps the rounding
 * trick's range. The product is rounded before the clamp reads it, so no multiply-add is fused. */
static inline cr_qi cr_requantize(cr_qi acc, float multiplier, float zero_point, float lo, float hi) {
    cr_qf v = __builtin_convertvector(acc, cr_qf) * multiplier;
    v = cr_qf_clamp(v, lo - zero_point, hi - zero_point);
    v = (v + CR_ROUNDER) - CR_ROUNDER;
    return __builtin_convertvector(v + zero_point, cr_qi);
}

static inline void cr_qstore(void *y, int is_signed, int64_t i, int32_t v) {
    if (is_signed) ((int8_t *)y)[i] = (int8_t)v;
    else ((uint8_t *)y)[i] = (uint8_t)v;
}

/* where the requantized tile goes: y[m * m_stride + p * p_stride], channel m's bias, multiplier */
typedef struct {
    void *y;
    int y_signed;
    float y_zero_point, lo, hi;
    int64_t m_stride, p_stride;
    const int32_t *bias;
    const float *multiplier;
} cr_qout;

/* rows m0..m0+rows-1 of w [.., kpad] times the packed block (`count` pixels from pixel p0), requantized into out.
 * Missing rows (rows < CR_QMR) repeat the first row's weights and are not stored. */
static void cr_qgemm_block(const int16_t *w, int64_t kpad, int64_t m0, int64_t rows, const int16_t *panel,
                           int64_t p0, int64_t count, const cr_qout *out) {
    const int64_t pairs = kpad / 2;
    for (int64_t t = 0; t < count; t += CR_QNV * CR_QL) {
        const int32_t *wr[CR_QMR];
        for (int r = 0; r < CR_QMR; r++) wr[r] = (const int32_t *)(const void *)(w + (m0 + (r < rows ? r : 0)) * kpad);
        cr_qv acc[CR_QMR][CR_QNV];
        for (int r = 0; r < CR_QMR; r++)
            for (int v = 0; v < CR_QNV; v++) acc[r][v] = cr_qv_zero();
        const int16_t *b = panel + t * 2;
        for (int64_t kp = 0; kp < pairs; kp++, b += CR_QNB * 2) {
            for (int r = 0; r < CR_QMR; r++) {
                int32_t pair;
                memcpy(&pair, wr[r] + kp, sizeof pair);
                cr_qv wv = cr_qv_splat(pair);
                for (int v = 0; v < CR_QNV; v++) acc[r][v] = cr_qv_dot(acc[r][v], b + v * CR_QL * 2, wv);
            }
        }
        int32_t sums[CR_QNV * CR_QL];
        int64_t valid = count - t < CR_QNV * CR_QL ? count - t : CR_QNV * CR_QL;
        for (int r = 0; r < rows; r++) {
            int64_t m = m0 + r;
            for (int v = 0; v < CR_QNV; v++) {
                int32_t raw[CR_QL];
                cr_qi lanes;
                cr_qv_store(raw, acc[r][v]);
                memcpy(&lanes, raw, sizeof lanes);
                lanes = cr_requantize(lanes + out->bias[m], out->multiplier[m], out->y_zero_point, out->lo, out->hi);
                memcpy(sums + v * CR_QL, &lanes, sizeof lanes);
            }
            int64_t at = m * out->m_stride + (p0 + t) * out->p_stride;
            if (out->p_stride == 1 && !out->y_signed) {
                uint8_t *y = (uint8_t *)out->y + at;
                for (int64_t p = 0; p < valid; p++) y[p] = (uint8_t)sums[p];
            } else {
                for (int64_t p = 0; p < valid; p++) cr_qstore(out->y, out->y_signed, at + p * out->p_stride, sums[p]);
            }
        }
    }
}

static void cr_qgemm_rows(const int16_t *w, int64_t kpad, int64_t m_begin, int64_t m_end, const int16_t *panel,
                          int64_t p0, int64_t count, const cr_qout *out) {
    for (int64_t m = m_begin; m < m_end; m += CR_QMR)
        cr_qgemm_block(w, kpad, m, m_end - m < CR_QMR ? m_end - m : CR_QMR, panel, p0, count, out);
}

/* -- QLinearConvExact ------------------------------------------------------------------------------------------- */
/* panel[k / 2][p][k % 2] = x[c][ih][iw] - x_zero_point (0 outside the image: the shifted padding) for the k = (c, i,
 * j) of one group and the pixels p0..p0+count-1; pixels past count and the odd k's pair are zeros */
static void cr_qpack_conv(const void *x, int x_signed, int32_t x_zero_point, int64_t channels, int64_t h,
                          int64_t wd, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh,
                          int64_t dw, int64_t pt, int64_t pl, int64_t kpad, int64_t p0, int64_t count,
                          int16_t *panel) {
    memset(panel, 0, (size_t)(kpad * CR_QNB) * sizeof(int16_t));
    for (int64_t p = 0; p < count;) { /* a run of pixels along one output row */
        const int64_t q = p0 + p, out_row = q / ow, out_col = q % ow;
        const int64_t run = count - p < ow - out_col ? count - p : ow - out_col;
        int64_t k = 0;
        for (int64_t c = 0; c < channels; c++) {
            for (int64_t i = 0; i < kh; i++) {
                const int64_t row = out_row * sh - pt + i * dh;
                if (row < 0 || row >= h) { /* the padding: zeros already */
                    k += kw;
                    continue;
                }
                const int64_t line = (c * h + row) * wd;
                for (int64_t j = 0; j < kw; j++, k++) {
                    int16_t *dst = panel + (k / 2) * CR_QNB * 2 + (k & 1) + p * 2;
                    const int64_t first = out_col * sw - pl + j * dw; /* the run's first column */
                    int64_t begin = first >= 0 ? 0 : (-first + sw - 1) / sw;
                    int64_t end = wd - first <= 0 ? 0 : (wd - first + sw - 1) / sw;
                    end = end < run ? end : run;
                    if (x_signed) {
                        const int8_t *src = (const int8_t *)x + line + first;
                        for (int64_t t = begin; t < end; t++) dst[t * 2] = (int16_t)(src[t * sw] - x_zero_point);
                    } else {
                        const uint8_t *src = (const uint8_t *)x + line + first;
                        for (int64_t t = begin; t < end; t++) dst[t * 2] = (int16_t)(src[t * sw] - x_zero_point);
                    }
                }
            }
        }
        p += run;
    }
}

/* y[n][m][oh][ow] for x [n][c][h][w] (uint8 or int8) and w [m][kpad] int16 (group-major rows, each group's
 * (c / groups) * kh * kw shifted weights padded to even); bias int32 [m], multiplier [m]; panel: the scratch of
 * kpad * CR_QNB int16 */
static CR_UNUSED void cr_qconv2d(const void *x, int x_signed, int32_t x_zero_point, const int16_t *w,
                                 const int32_t *bias, const float *multiplier, void *y, int y_signed,
                                 int32_t y_zero_point, int64_t n, int64_t c, int64_t h, int64_t wd, int64_t m,
                                 int64_t oh, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh,
                                 int64_t dw, int64_t pt, int64_t pl, int64_t groups, int64_t kpad, int16_t *panel) {
    const int64_t cg = c / groups, mg = m / groups, pixels = oh * ow;
    cr_qout out = {0, y_signed, (float)y_zero_point, y_signed ? -128.0f : 0.0f, y_signed ? 127.0f : 255.0f,
                   pixels, 1, bias, multiplier};
    for (int64_t b = 0; b < n; b++) {
        out.y = (unsigned char *)y + b * m * pixels;
        for (int64_t g = 0; g < groups; g++) {
            const void *xg = (const unsigned char *)x + (b * c + g * cg) * h * wd;
            for (int64_t p0 = 0; p0 < pixels; p0 += CR_QNB) {
                int64_t count = pixels - p0 < CR_QNB ? pixels - p0 : CR_QNB;
                cr_qpack_conv(xg, x_signed, x_zero_point, cg, h, wd, ow, kh, kw, sh, sw, dh, dw, pt, pl, kpad, p0,
                              count, panel);
                cr_qgemm_rows(w, kpad, g * mg, (g + 1) * mg, panel, p0, count, &out);
            }
        }
    }
}

/* -- QLinearMatMulExact ----------------------------------------------------------------------------------------- */
/* y[r][n] for x [rows][k] (8-bit) and w [n][kpad] int16 (the weight [k][n] transposed, k padded to even) */
static CR_UNUSED void cr_qmatmul(const void *x, int x_signed, int32_t x_zero_point, const int16_t *w,
                                 const int32_t *bias, const float *multiplier, void *y, int y_signed,
                                 int32_t y_zero_point, int64_t rows, int64_t k, int64_t n, int64_t kpad,
                                 int16_t *panel) {
    cr_qout out = {y, y_signed, (float)y_zero_point, y_signed ? -128.0f : 0.0f, y_signed ? 127.0f : 255.0f, 1, n,
                   bias, multiplier};
    for (int64_t p0 = 0; p0 < rows; p0 += CR_QNB) {
        int64_t count = rows - p0 < CR_QNB ? rows - p0 : CR_QNB;
        memset(panel, 0, (size_t)(kpad * CR_QNB) * sizeof(int16_t));
        for (int64_t p = 0; p < count; p++)
            for (int64_t j = 0; j < k; j++)
                panel[(j / 2) * CR_QNB * 2 + p * 2 + (j & 1)] =
                    (int16_t)(cr_qload(x, x_signed, (p0 + p) * k + j) - x_zero_point);
        cr_qgemm_rows(w, kpad, 0, n, panel, p0, count, &out);
    }
}

/* -- QuantizeLinear, DequantizeLinear, QLinearAdd ------------------------------------------------------------------ */
static CR_EXACT_FN CR_UNUSED void cr_quantize(const float *x, float scale, float zero_point, void *y, int y_signed,
                                              int64_t count) {
    CR_EXACT_FLOAT
    const float lo = y_signed ? -128.0f : 0.0f, hi = y_signed ? 127.0f : 255.0f;
    for (int64_t i = 0; i < count; i++) {
        float v = rintf(x[i] / scale) + zero_point;
        v = v > lo ? v : lo;
        v = v < hi ? v : hi;
        cr_qstore(y, y_signed, i, (int32_t)v);
    }
}

static CR_EXACT_FN CR_UNUSED void cr_dequantize(const void *x, int x_signed, float zero_point, float scale, float *y,
                                                int64_t count) {
    CR_EXACT_FLOAT
    for (int64_t i = 0; i < count; i++) y[i] = ((float)cr_qload(x, x_signed, i) - zero_point) * scale;
}

/* y = saturate(rint(a * ka + b * kb + offset)) with a and b broadcast over a 6-D shape (element strides) */
static CR_EXACT_FN CR_UNUSED void cr_qlinear_add(const void *a, int a_signed, const int64_t *sa, const void *b,
                                                 int b_signed, const int64_t *sb, float ka, float kb, float offset,
                                                 void *y, int y_signed, const int64_t *shape) {
    CR_EXACT_FLOAT
    const float lo = y_signed ? -128.0f : 0.0f, hi = y_signed ? 127.0f : 255.0f;
    int64_t count = cr_count(shape), index[CR_RANK] = {0}, oa = 0, ob = 0;
    for (int64_t i = 0; i < count; i++) {
        float v = (float)cr_qload(a, a_signed, oa) * ka;
        v = v + (float)cr_qload(b, b_signed, ob) * kb;
        v = rintf(v + offset);
        v = v > lo ? v : lo;
        v = v < hi ? v : hi;
        cr_qstore(y, y_signed, i, (int32_t)v);
        for (int d = CR_RANK - 1; d >= 0; d--) {
            index[d]++;
            oa += sa[d];
            ob += sb[d];
            if (index[d] < shape[d]) break;
            oa -= sa[d] * shape[d];
            ob -= sb[d] * shape[d];
            index[d] = 0;
        }
    }
}

/* the same for a and b of one shape, contiguous */
#define CR_QADD_FLAT(TA, TB, TY, LO, HI)                                                                    \
    do {                                                                                                 \
        const TA *pa = (const TA *)a;                                                                    \
        const TB *pb = (const TB *)b;                                                                    \
        TY *py = (TY *)y;                                                                                \
        for (int64_t i = 0; i < count; i++) {                                                            \
            float v = (float)pa[i] * ka;                                                                 \
            float u = (float)pb[i] * kb;                                                                 \
            v = (v + u) + offset;                                                                        \
            v = v > (LO) ? v : (LO);                                                                     \
            v = v < (HI) ? v : (HI);                                                                     \
            py[i] = (TY)(int32_t)((v + CR_ROUNDER) - CR_ROUNDER);                                        \
        }                                                                                                \
    } while (0)

static CR_EXACT_FN CR_UNUSED void cr_qlinear_add_flat(const void *a, int a_signed, const void *b, int b_signed,
                                                      float ka, float kb, float offset, void *y, int y_signed,
                                                      int64_t count) {
    CR_EXACT_FLOAT
    if (a_signed || b_signed || y_signed) { /* the rarer mixes: the broadcasting loop over one flat dim */
        const int64_t shape[CR_RANK] = {1, 1, 1, 1, 1, count}, strides[CR_RANK] = {0, 0, 0, 0, 0, 1};
        cr_qlinear_add(a, a_signed, strides, b, b_signed, strides, ka, kb, offset, y, y_signed, shape);
        return;
    }
    CR_QADD_FLAT(uint8_t, uint8_t, uint8_t, 0.0f, 255.0f);
}

/* -- MaxPool on 8-bit planes: windows' taps inside the image (padding never wins) ------------------------------ */
static CR_UNUSED void cr_qmaxpool2d(const void *x, int is_signed, void *y, int64_t planes, int64_t h, int64_t wd,
                                    int64_t oh, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw,
                                    int64_t dh, int64_t dw, int64_t pt, int64_t pl) {
    for (int64_t p = 0; p < planes; p++) {
        for (int64_t r = 0; r < oh; r++) {
            for (int64_t q = 0; q < ow; q++) {
                int32_t best = is_signed ? -128 : 0;
                for (int64_t i = 0; i < kh; i++) {
                    int64_t row = r * sh - pt + i * dh;
                    if (row < 0 || row >= h) continue;
                    for (int64_t j = 0; j < kw; j++) {
                        int64_t col = q * sw - pl + j * dw;
                        if (col < 0 || col >= wd) continue;
                        int32_t v = cr_qload(x, is_signed, p * h * wd + row * wd + col);
                        best = v > best ? v : best;
                    }
                }
                cr_qstore(y, is_signed, p * oh * ow + r * ow + q, best);
            }
        }
    }
}

#endif
