/* carrack's integer kernels for quantized models in compiled models (`carrack compile`), bit for bit equal to
 * carrack's session (carrack/ops/contrib_quant.py, carrack/native/qconv.c and qgemm.c define the arithmetic):
 *
 *   cr_qconv2d / cr_qmatmul  QLinearConvExact / QLinearMatMulExact: 8-bit activations minus their zero point
 *                            times the pre-shifted weights, summed exactly in int32, plus the integer bias, then
 *                            requantized: saturate(rint(float32(acc) * multiplier) + y_zero_point).
 *   cr_quantize              QuantizeLinear per tensor: saturate(rint(x / scale) + zero_point) in float32.
 *   cr_dequantize            DequantizeLinear per tensor: (float32(x) - zero_point) * scale.
 *   cr_quantize_axis,        the same per axis (a 1-D scale and zero point along one axis, as per_channel
 *   cr_dequantize_axis       quantization writes them).
 *   cr_qlinear_add           QLinearAdd: rint(a * ka + b * kb + offset) in float32 in exactly this order.
 *   cr_qmaxpool2d            MaxPool over 8-bit planes (padding never wins).
 *
 * The products run as pairs of int16 (activation - zero point, shifted weight) summed into int32 lanes, one lane
 * per output channel: one instruction per pair on every target with vectors (WebAssembly SIMD128
 * i32x4.dot_i16x8_s, AVX-512BW and AVX2 vpmaddwd, SSE2 pmaddwd; vpdpwssd where the target has AVX-512 VNNI or
 * AVX-VNNI, the same wrapping int32 sum fused with the add; with int8 weights AVX-512 VNNI multiplies four bytes a
 * lane instead, vpdpbusd, see CR_QUADS) and a plain C loop elsewhere; integer sums are
 * exact, so every target gives the same bytes. Weights are stored as int8 (int16 when a shifted weight needs it)
 * in blocks of CR_QCB output channels, [block][k / 2][channel][2], widened as they are loaded. Activations are
 * packed per block of CR_QNB output pixels as [k / 2][pixel][2] int16 (im2col for convolutions, a transpose for
 * matrix products) into a scratch block of the arena, and one pixel's pair is splat across the lanes. The float
 * steps round once per operation as numpy does: no contraction into fused multiply-adds (which
 * -ffp-contract=fast would allow).
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

/* output pixels per packed activation block (-D overridable for experiments; the emitter sizes the panel for 32) */
#ifndef CR_QNB
#define CR_QNB 32
#endif
/* output channels per weight block: weights are stored [block][k / 2][16 channels][2] (int8 or int16), so each
 * target reads its lanes' channels of a pair of k as one contiguous load */
#define CR_QCB 16

/* -- int32 lanes, one output channel each: acc[l] += w[2l] * a0 + w[2l + 1] * a1, a = one pixel's activation
 * pair (a0, a1) as one int32, splat; w = the lanes' weight pairs, loaded (and widened from int8) as int16 ------- */
#if defined(CR_QUANT_PORTABLE) || !(defined(__wasm_simd128__) || defined(__AVX512BW__) || defined(__AVX2__) || \
                                      defined(__SSE2__))
#define CR_QL 4
#define CR_QCV 2 /* channel vectors per register tile */
#define CR_QPR 6 /* pixels per register tile */
typedef struct { int32_t lane[4]; } cr_qv;
typedef struct { int16_t pair[8]; } cr_qw;
static inline cr_qv cr_qv_zero(void) { cr_qv v = {{0, 0, 0, 0}}; return v; }
static inline cr_qv cr_qv_splat(const int16_t *a) {
    int32_t w;
    memcpy(&w, a, sizeof w);
    cr_qv v = {{w, w, w, w}};
    return v;
}
static inline cr_qw cr_qw_load8(const int8_t *w) {
    cr_qw v;
    for (int i = 0; i < 8; i++) v.pair[i] = w[i];
    return v;
}
static inline cr_qw cr_qw_load16(const int16_t *w) {
    cr_qw v;
    memcpy(v.pair, w, sizeof v.pair);
    return v;
}
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) {
    int16_t pair[2];
    memcpy(pair, &a.lane[0], sizeof pair);
    for (int l = 0; l < 4; l++) acc.lane[l] += (int32_t)w.pair[2 * l] * pair[0] + (int32_t)w.pair[2 * l + 1] * pair[1];
    return acc;
}
static inline void cr_qv_store(int32_t *p, cr_qv v) { memcpy(p, v.lane, sizeof v.lane); }
#elif defined(__wasm_simd128__)
/* SIMD128's i32x4.dot_i16x8_s: four int32 sums of two int16 products; v128.load8x8_s widens int8 weights. 4 pixels
 * x 2 channel vectors: V8 keeps 15 vector registers, and 6 x 2 (12 sums, 2 weights, a splat and the product)
 * spilled 4 sums and 2 splats per pair of k; 4 x 2 measured 15-22% faster on resnet50's layers (node, interleaved),
 * 5 x 2, 2 x 4, 3 x 4 and 8 x 1 in between */
#define CR_QL 4
#ifndef CR_QCV
#define CR_QCV 2
#endif
#ifndef CR_QPR
#define CR_QPR 4
#endif
typedef v128_t cr_qv;
typedef v128_t cr_qw;
static inline cr_qv cr_qv_zero(void) { return wasm_i32x4_splat(0); }
static inline cr_qv cr_qv_splat(const int16_t *a) { return wasm_v128_load32_splat(a); }
static inline cr_qw cr_qw_load8(const int8_t *w) { return wasm_i16x8_load8x8(w); }
static inline cr_qw cr_qw_load16(const int16_t *w) { return wasm_v128_load(w); }
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) { return wasm_i32x4_add(acc, wasm_i32x4_dot_i16x8(w, a)); }
static inline void cr_qv_store(int32_t *p, cr_qv v) { wasm_v128_store(p, v); }
#elif defined(__AVX512BW__)
#define CR_QL 16
#define CR_QCV 1
#define CR_QPR 8
typedef __m512i cr_qv;
typedef __m512i cr_qw;
static inline cr_qv cr_qv_zero(void) { return _mm512_setzero_si512(); }
static inline cr_qv cr_qv_splat(const int16_t *a) {
    int32_t w;
    memcpy(&w, a, sizeof w);
    return _mm512_set1_epi32(w);
}
static inline cr_qw cr_qw_load8(const int8_t *w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)w)); }
static inline cr_qw cr_qw_load16(const int16_t *w) { return _mm512_loadu_si512((const void *)w); }
#if defined(__AVX512VNNI__)
/* vpdpwssd: the same two int16 products added into the int32 lane, wrapping as vpmaddwd + vpaddd, in one step */
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) { return _mm512_dpwssd_epi32(acc, w, a); }
#else
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) { return _mm512_add_epi32(acc, _mm512_madd_epi16(w, a)); }
#endif
static inline void cr_qv_store(int32_t *p, cr_qv v) { _mm512_storeu_si512((void *)p, v); }
#elif defined(__AVX2__)
#define CR_QL 8
#define CR_QCV 2
#define CR_QPR 6
typedef __m256i cr_qv;
typedef __m256i cr_qw;
static inline cr_qv cr_qv_zero(void) { return _mm256_setzero_si256(); }
static inline cr_qv cr_qv_splat(const int16_t *a) {
    int32_t w;
    memcpy(&w, a, sizeof w);
    return _mm256_set1_epi32(w);
}
static inline cr_qw cr_qw_load8(const int8_t *w) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w)); }
static inline cr_qw cr_qw_load16(const int16_t *w) { return _mm256_loadu_si256((const __m256i *)w); }
#if defined(__AVXVNNI__)
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) { return _mm256_dpwssd_avx_epi32(acc, w, a); }
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) { return _mm256_dpwssd_epi32(acc, w, a); }
#else
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, a)); }
#endif
static inline void cr_qv_store(int32_t *p, cr_qv v) { _mm256_storeu_si256((__m256i *)p, v); }
#elif defined(__SSE2__)
#define CR_QL 4
#define CR_QCV 2
#define CR_QPR 6
typedef __m128i cr_qv;
typedef __m128i cr_qw;
static inline cr_qv cr_qv_zero(void) { return _mm_setzero_si128(); }
static inline cr_qv cr_qv_splat(const int16_t *a) {
    int32_t w;
    memcpy(&w, a, sizeof w);
    return _mm_set1_epi32(w);
}
static inline cr_qw cr_qw_load8(const int8_t *w) {
    __m128i v = _mm_loadl_epi64((const __m128i *)w);
    return _mm_srai_epi16(_mm_unpacklo_epi8(v, v), 8); /* each byte twice, then its sign from the high copy */
}
static inline cr_qw cr_qw_load16(const int16_t *w) { return _mm_loadu_si128((const __m128i *)w); }
static inline cr_qv cr_qv_dot(cr_qv acc, cr_qw w, cr_qv a) { return _mm_add_epi32(acc, _mm_madd_epi16(w, a)); }
static inline void cr_qv_store(int32_t *p, cr_qv v) { _mm_storeu_si128((__m128i *)p, v); }
#endif

/* the same lanes as plain vectors (GCC/Clang vector extensions) for the requantization */
typedef int32_t cr_qi __attribute__((vector_size(CR_QL * 4)));
typedef uint32_t cr_qu __attribute__((vector_size(CR_QL * 4)));
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

/* saturate(rint(float32(acc + bias) * multiplier) + zero_point) into the output type's range, CR_QL channels at
 * once: clamping to the integer bounds before rounding gives the same integers as after, and keeps the rounding
 * trick's range. The product is rounded before the clamp reads it, so no multiply-add is fused. */
static inline cr_qi cr_requantize(cr_qi acc, const int32_t *bias, const float *multiplier, float zero_point,
                                  float lo, float hi) {
    cr_qi b;
    cr_qf m;
    memcpy(&b, bias, sizeof b);
    memcpy(&m, multiplier, sizeof m);
    /* added as unsigned: the four-byte products' partial sums may wrap on the way to an in-range total */
    cr_qf v = __builtin_convertvector((cr_qi)((cr_qu)acc + (cr_qu)b), cr_qf) * m;
    v = cr_qf_clamp(v, lo - zero_point, hi - zero_point);
    v = (v + CR_ROUNDER) - CR_ROUNDER;
    return __builtin_convertvector(v + zero_point, cr_qi);
}

static inline void cr_qstore(void *y, int is_signed, int64_t i, int32_t v) {
    if (is_signed) ((int8_t *)y)[i] = (int8_t)v;
    else ((uint8_t *)y)[i] = (uint8_t)v;
}

/* where a group's requantized outputs go: y[m * m_stride + p * p_stride] for its `channels` channels, with their
 * bias and multiplier (both padded to whole weight blocks) */
typedef struct {
    void *y;
    int y_signed;
    float y_zero_point, lo, hi;
    int64_t m_stride, p_stride, channels;
    const int32_t *bias;
    const float *multiplier;
} cr_qout;

/* channels c0.. (CR_QCV vectors) of one weight block times pixels t.. of the packed activations (`count` valid
 * in the block), requantized into out; pixels past count repeat the first and are not stored */
static inline __attribute__((always_inline)) void cr_qgemm_tile(const void *wblock, int wide, int64_t c0,
                                                                int64_t pairs, const int16_t *panel, int64_t p0,
                                                                int64_t t, int64_t count, const cr_qout *out) {
    cr_qv acc[CR_QPR][CR_QCV];
    const int16_t *a[CR_QPR];
    for (int r = 0; r < CR_QPR; r++) {
        a[r] = panel + (t + r < count ? t + r : t) * 2;
        for (int v = 0; v < CR_QCV; v++) acc[r][v] = cr_qv_zero();
    }
    for (int64_t kp = 0; kp < pairs; kp++) {
        cr_qw w[CR_QCV];
        for (int v = 0; v < CR_QCV; v++) {
            const int64_t at = kp * CR_QCB * 2 + (c0 + v * CR_QL) * 2;
            w[v] = wide ? cr_qw_load16((const int16_t *)wblock + at) : cr_qw_load8((const int8_t *)wblock + at);
        }
        for (int r = 0; r < CR_QPR; r++) {
            cr_qv x = cr_qv_splat(a[r] + kp * CR_QNB * 2);
            for (int v = 0; v < CR_QCV; v++) acc[r][v] = cr_qv_dot(acc[r][v], w[v], x);
        }
    }
    for (int r = 0; r < CR_QPR && t + r < count; r++) {
        for (int v = 0; v < CR_QCV; v++) {
            const int64_t m = c0 + v * CR_QL; /* the vector's first channel within the block */
            int32_t raw[CR_QL];
            cr_qi lanes;
            cr_qv_store(raw, acc[r][v]);
            memcpy(&lanes, raw, sizeof lanes);
            lanes = cr_requantize(lanes, out->bias + m, out->multiplier + m, out->y_zero_point, out->lo, out->hi);
            memcpy(raw, &lanes, sizeof lanes);
            const int64_t valid = out->channels - m < CR_QL ? out->channels - m : CR_QL;
            for (int64_t l = 0; l < valid; l++)
                cr_qstore(out->y, out->y_signed, (m + l) * out->m_stride + (p0 + t + r) * out->p_stride, raw[l]);
        }
    }
}

/* all channels of one group (blocks of CR_QCB, `pairs` pairs of k each) times the packed pixels p0..p0+count-1;
 * out's y, bias and multiplier are at the group's first channel */
static void cr_qgemm(const void *w, int wide, int64_t pairs, const int16_t *panel, int64_t p0, int64_t count,
                     const cr_qout *out) {
    const int64_t block_elements = pairs * CR_QCB * 2;
    for (int64_t b = 0; b * CR_QCB < out->channels; b++) {
        const void *wblock = wide ? (const void *)((const int16_t *)w + b * block_elements)
                                  : (const void *)((const int8_t *)w + b * block_elements);
        cr_qout block = *out;
        block.y = (unsigned char *)out->y + b * CR_QCB * out->m_stride;
        block.bias = out->bias + b * CR_QCB;
        block.multiplier = out->multiplier + b * CR_QCB;
        block.channels = out->channels - b * CR_QCB < CR_QCB ? out->channels - b * CR_QCB : CR_QCB;
        for (int64_t c0 = 0; c0 < block.channels; c0 += CR_QCV * CR_QL)
            for (int64_t t = 0; t < count; t += CR_QPR) {
                if (wide) cr_qgemm_tile(wblock, 1, c0, pairs, panel, p0, t, count, &block);
                else cr_qgemm_tile(wblock, 0, c0, pairs, panel, p0, t, count, &block);
            }
    }
}

/* The pixels [begin, end) of a run of `run` output pixels whose tap reads columns first, first + sw, ... that fall
 * inside a row of wd columns (the others read the padding); returns end. */
static inline int64_t cr_tap_span(int64_t first, int64_t wd, int64_t sw, int64_t run, int64_t *begin) {
    *begin = first >= 0 ? 0 : (-first + sw - 1) / sw;
    const int64_t end = wd - first <= 0 ? 0 : (wd - first + sw - 1) / sw;
    return end < run ? end : run;
}

/* -- AVX-512 VNNI: four byte products per lane (vpdpbusd) -------------------------------------------------------
 * With int8 weights, AVX-512 VNNI builds multiply 8-bit activations by the weights four k at a time: vpdpbusd adds
 * u[k..k+3] (uint8) times w[k..k+3] (int8) to each int32 lane. The activations stay unshifted bytes u (x, or x ^ 0x80
 * = x + 128 for int8), so sum (x - x_zp) w = sum u w - u_zp sum w, with u_zp the zero point in the same offset; the
 * padding holds u_zp (its u - u_zp is 0). Each group's bias gets -u_zp * sum w per channel before the products, and
 * every sum wraps in int32 (vpdpbusd does not saturate; one step's four products are at most 4 * 255 * 128), so
 * the total is the exact sum whenever that fits int32, which the emitter has checked: the same bits as the pairs.
 * The weights keep their pair layout: two pairs' blocks (32 bytes each) are interleaved into quads as loaded. The
 * panel is [k / 4][pixel][4] uint8 in the same scratch (half the bytes of the int16 pairs, rounded up). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(CR_QUANT_PORTABLE)
#define CR_QUADS 1
static inline __attribute__((always_inline)) __m512i cr_quad_weights(__m256i low, __m256i high) {
    /* word c of the first pair block and word c of the second become lane c's four bytes */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23,
                                                7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
}

static inline __attribute__((always_inline)) void cr_quad_products(__m512i *acc, const uint8_t *const *a,
                                                                   int64_t kq, __m512i wq) {
    for (int r = 0; r < CR_QPR; r++) {
        int32_t bytes;
        memcpy(&bytes, a[r] + kq * CR_QNB * 4, sizeof bytes);
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_set1_epi32(bytes), wq);
    }
}

static void cr_qgemm_quads(const int8_t *w, int64_t pairs, const uint8_t *panel, int64_t p0, int64_t count,
                           const cr_qout *out) {
    const int64_t quads = (pairs + 1) / 2, block_elements = pairs * CR_QCB * 2;
    for (int64_t b = 0; b * CR_QCB < out->channels; b++) {
        const int8_t *wblock = w + b * block_elements;
        const int64_t m = b * CR_QCB, valid = out->channels - m < CR_QCB ? out->channels - m : CR_QCB;
        for (int64_t t = 0; t < count; t += CR_QPR) {
            __m512i acc[CR_QPR];
            const uint8_t *a[CR_QPR];
            for (int r = 0; r < CR_QPR; r++) {
                a[r] = panel + (t + r < count ? t + r : t) * 4;
                acc[r] = _mm512_setzero_si512();
            }
            int64_t kq = 0;
            for (; 2 * kq + 1 < pairs; kq++) {
                const __m256i *pair = (const __m256i *)(wblock + 2 * kq * CR_QCB * 2);
                cr_quad_products(acc, a, kq, cr_quad_weights(_mm256_loadu_si256(pair), _mm256_loadu_si256(pair + 1)));
            }
            if (kq < quads) /* an odd last pair: the quad's second half is zero weights */
                cr_quad_products(acc, a, kq, cr_quad_weights(_mm256_loadu_si256((const __m256i *)(wblock + 2 * kq *
                                                                                CR_QCB * 2)), _mm256_setzero_si256()));
            for (int r = 0; r < CR_QPR && t + r < count; r++) {
                int32_t raw[CR_QL];
                cr_qi lanes;
                _mm512_storeu_si512((void *)raw, acc[r]);
                memcpy(&lanes, raw, sizeof lanes);
                lanes = cr_requantize(lanes, out->bias + m, out->multiplier + m, out->y_zero_point, out->lo, out->hi);
                memcpy(raw, &lanes, sizeof lanes);
                for (int64_t l = 0; l < valid; l++)
                    cr_qstore(out->y, out->y_signed, (m + l) * out->m_stride + (p0 + t + r) * out->p_stride, raw[l]);
            }
        }
    }
}

/* fixed[c] = bias[c] - u_zp * (sum of channel c's weights), wrapping in int32, for the `padded` channels of a group */
static void cr_quad_bias(const int8_t *w, int64_t pairs, const int32_t *bias, int32_t u_zero_point, int64_t padded,
                         int32_t *fixed) {
    for (int64_t c = 0; c < padded; c++) {
        const int8_t *lane = w + (c / CR_QCB) * pairs * CR_QCB * 2 + (c % CR_QCB) * 2;
        int64_t sum = 0;
        for (int64_t kp = 0; kp < pairs; kp++) sum += lane[kp * CR_QCB * 2] + lane[kp * CR_QCB * 2 + 1];
        fixed[c] = (int32_t)((uint32_t)bias[c] - (uint32_t)u_zero_point * (uint32_t)sum);
    }
}

static inline uint8_t cr_quad_byte(const void *x, int x_signed, int64_t i) {
    return x_signed ? (uint8_t)(((const uint8_t *)x)[i] ^ 0x80) : ((const uint8_t *)x)[i];
}

/* the same for a 1x1 convolution at stride 1 without padding: pixels p0.. of channels 4 kq .. 4 kq + 3 are four
 * contiguous runs of the planes, interleaved bytewise 16 pixels a step */
static void cr_qpack_pointwise_quads(const uint8_t *x, int x_signed, uint8_t u_zero_point, int64_t channels,
                                     int64_t plane, int64_t quads, int64_t p0, int64_t count, uint8_t *panel) {
    const __m128i flip = _mm_set1_epi8(x_signed ? (char)0x80 : 0), fill = _mm_set1_epi8((char)u_zero_point);
    for (int64_t kq = 0; kq < quads; kq++) {
        const uint8_t *rows[4];
        for (int i = 0; i < 4; i++) rows[i] = 4 * kq + i < channels ? x + (4 * kq + i) * plane + p0 : NULL;
        uint8_t *dst = panel + kq * CR_QNB * 4;
        int64_t t = 0;
        for (; t + 16 <= count; t += 16) {
            __m128i v[4];
            for (int i = 0; i < 4; i++)
                v[i] = rows[i] ? _mm_xor_si128(_mm_loadu_si128((const __m128i *)(rows[i] + t)), flip) : fill;
            const __m128i ab_lo = _mm_unpacklo_epi8(v[0], v[1]), ab_hi = _mm_unpackhi_epi8(v[0], v[1]);
            const __m128i cd_lo = _mm_unpacklo_epi8(v[2], v[3]), cd_hi = _mm_unpackhi_epi8(v[2], v[3]);
            _mm_storeu_si128((__m128i *)(dst + 4 * t), _mm_unpacklo_epi16(ab_lo, cd_lo));
            _mm_storeu_si128((__m128i *)(dst + 4 * t + 16), _mm_unpackhi_epi16(ab_lo, cd_lo));
            _mm_storeu_si128((__m128i *)(dst + 4 * t + 32), _mm_unpacklo_epi16(ab_hi, cd_hi));
            _mm_storeu_si128((__m128i *)(dst + 4 * t + 48), _mm_unpackhi_epi16(ab_hi, cd_hi));
        }
        for (; t < count; t++)
            for (int i = 0; i < 4; i++) dst[4 * t + i] = rows[i] ? (uint8_t)(rows[i][t] ^ (x_signed ? 0x80 : 0))
                                                                : u_zero_point;
    }
}

/* panel[k / 4][p][k % 4] = u of x[c][ih][iw] for the k = (c, i, j) of one group (u_zp outside the image and past k) */
static void cr_qpack_conv_quads(const void *x, int x_signed, uint8_t u_zero_point, int64_t channels, int64_t h,
                                int64_t wd, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh,
                                int64_t dw, int64_t pt, int64_t pl, int64_t quads, int64_t p0, int64_t count,
                                uint8_t *panel) {
    if (kh == 1 && kw == 1 && sh == 1 && sw == 1 && pt == 0 && pl == 0 && ow == wd) {
        cr_qpack_pointwise_quads((const uint8_t *)x, x_signed, u_zero_point, channels, h * wd, quads, p0, count,
                                 panel);
        return;
    }
    memset(panel, u_zero_point, (size_t)(quads * CR_QNB * 4));
    for (int64_t p = 0; p < count;) {
        const int64_t q = p0 + p, out_row = q / ow, out_col = q % ow;
        const int64_t run = count - p < ow - out_col ? count - p : ow - out_col;
        int64_t k = 0;
        for (int64_t c = 0; c < channels; c++) {
            for (int64_t i = 0; i < kh; i++) {
                const int64_t row = out_row * sh - pt + i * dh;
                if (row < 0 || row >= h) {
                    k += kw;
                    continue;
                }
                const int64_t line = (c * h + row) * wd;
                for (int64_t j = 0; j < kw; j++, k++) {
                    uint8_t *dst = panel + (k / 4) * CR_QNB * 4 + (k & 3) + p * 4;
                    const int64_t first = out_col * sw - pl + j * dw;
                    int64_t begin;
                    const int64_t end = cr_tap_span(first, wd, sw, run, &begin);
                    for (int64_t t = begin; t < end; t++) dst[t * 4] = cr_quad_byte(x, x_signed, line + first + t * sw);
                }
            }
        }
        p += run;
    }
}
#endif

/* -- QLinearConvExact ------------------------------------------------------------------------------------------- */
/* panel[k / 2][p][k % 2] = x[c][ih][iw] - x_zero_point (0 outside the image: the shifted padding) for the k = (c, i,
 * j) of one group and the pixels p0..p0+count-1; pixels past count and the odd k's pair are zeros */
/* the same for a 1x1 convolution at stride 1 without padding over uint8: pixels p0.. of channels 2 kp and 2 kp + 1
 * are two contiguous runs of the planes, interleaved into the pairs (8 pixels a step on SIMD128) */
static void cr_qpack_pointwise(const uint8_t *x, int32_t x_zero_point, int64_t channels, int64_t plane,
                               int64_t kpad, int64_t p0, int64_t count, int16_t *panel) {
    for (int64_t kp = 0; kp < kpad / 2; kp++) {
        const uint8_t *even = x + 2 * kp * plane + p0, *odd = 2 * kp + 1 < channels ? even + plane : NULL;
        int16_t *dst = panel + kp * CR_QNB * 2;
        int64_t t = 0;
#if defined(__wasm_simd128__) && !defined(CR_QUANT_PORTABLE)
        const v128_t zp = wasm_i16x8_splat((int16_t)x_zero_point);
        for (; odd && t + 8 <= count; t += 8) {
            v128_t a = wasm_i16x8_sub(wasm_u16x8_load8x8(even + t), zp);
            v128_t b = wasm_i16x8_sub(wasm_u16x8_load8x8(odd + t), zp);
            wasm_v128_store(dst + 2 * t, wasm_i16x8_shuffle(a, b, 0, 8, 1, 9, 2, 10, 3, 11));
            wasm_v128_store(dst + 2 * t + 8, wasm_i16x8_shuffle(a, b, 4, 12, 5, 13, 6, 14, 7, 15));
        }
#endif
        for (; t < count; t++) {
            dst[2 * t] = (int16_t)(even[t] - x_zero_point);
            dst[2 * t + 1] = odd ? (int16_t)(odd[t] - x_zero_point) : 0;
        }
    }
}

static void cr_qpack_conv(const void *x, int x_signed, int32_t x_zero_point, int64_t channels, int64_t h,
                          int64_t wd, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh,
                          int64_t dw, int64_t pt, int64_t pl, int64_t kpad, int64_t p0, int64_t count,
                          int16_t *panel) {
    if (!x_signed && kh == 1 && kw == 1 && sh == 1 && sw == 1 && pt == 0 && pl == 0 && ow == wd) {
        cr_qpack_pointwise((const uint8_t *)x, x_zero_point, channels, h * wd, kpad, p0, count, panel);
        return;
    }
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
                    int64_t begin;
                    const int64_t end = cr_tap_span(first, wd, sw, run, &begin);
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

#ifdef CR_QUADS
static void cr_qconv2d_quads(const void *x, int x_signed, int32_t x_zero_point, const int8_t *w, const int32_t *bias,
                             const float *multiplier, void *y, int y_signed, int32_t y_zero_point, int64_t n,
                             int64_t c, int64_t h, int64_t wd, int64_t m, int64_t oh, int64_t ow, int64_t kh,
                             int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl,
                             int64_t groups, int64_t pairs, uint8_t *panel) {
    const int64_t cg = c / groups, mg = m / groups, pixels = oh * ow, padded = (mg + CR_QCB - 1) / CR_QCB * CR_QCB;
    const int64_t group_elements = padded * pairs * 2, quads = (pairs + 1) / 2;
    const int32_t u_zero_point = x_zero_point + (x_signed ? 128 : 0);
    int32_t fixed[padded];
    for (int64_t g = 0; g < groups; g++) {
        const int8_t *wg = w + g * group_elements;
        cr_quad_bias(wg, pairs, bias + g * padded, u_zero_point, padded, fixed);
        for (int64_t b = 0; b < n; b++) {
            const void *xg = (const unsigned char *)x + (b * c + g * cg) * h * wd;
            cr_qout out = {(unsigned char *)y + (b * m + g * mg) * pixels, y_signed, (float)y_zero_point,
                           y_signed ? -128.0f : 0.0f, y_signed ? 127.0f : 255.0f, pixels, 1, mg, fixed,
                           multiplier + g * padded};
            for (int64_t p0 = 0; p0 < pixels; p0 += CR_QNB) {
                int64_t count = pixels - p0 < CR_QNB ? pixels - p0 : CR_QNB;
                cr_qpack_conv_quads(xg, x_signed, (uint8_t)u_zero_point, cg, h, wd, ow, kh, kw, sh, sw, dh, dw, pt,
                                    pl, quads, p0, count, panel);
                cr_qgemm_quads(wg, pairs, panel, p0, count, &out);
            }
        }
    }
}
#endif

/* y[n][m][oh][ow] for x [n][c][h][w] (uint8 or int8). w: per group, its (m / groups) channels' shifted weights
 * in blocks of CR_QCB channels, [block][k / 2][CR_QCB][2] over the group's k = (c / groups) * kh * kw padded to
 * 2 * pairs, int8 (wide 0) or int16 (wide 1); bias int32 and multiplier per channel, each group's padded to whole
 * blocks; panel: the scratch of 2 * pairs * CR_QNB int16 */
static CR_UNUSED void cr_qconv2d(const void *x, int x_signed, int32_t x_zero_point, const void *w, int wide,
                                 const int32_t *bias, const float *multiplier, void *y, int y_signed,
                                 int32_t y_zero_point, int64_t n, int64_t c, int64_t h, int64_t wd, int64_t m,
                                 int64_t oh, int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh,
                                 int64_t dw, int64_t pt, int64_t pl, int64_t groups, int64_t pairs, int16_t *panel) {
    const int64_t cg = c / groups, mg = m / groups, pixels = oh * ow, padded = (mg + CR_QCB - 1) / CR_QCB * CR_QCB;
    const int64_t group_elements = padded * pairs * 2;
#ifdef CR_QUADS
    if (!wide) {
        cr_qconv2d_quads(x, x_signed, x_zero_point, (const int8_t *)w, bias, multiplier, y, y_signed, y_zero_point, n,
                         c, h, wd, m, oh, ow, kh, kw, sh, sw, dh, dw, pt, pl, groups, pairs, (uint8_t *)panel);
        return;
    }
#endif
    for (int64_t b = 0; b < n; b++) {
        for (int64_t g = 0; g < groups; g++) {
            const void *xg = (const unsigned char *)x + (b * c + g * cg) * h * wd;
            const void *wg = wide ? (const void *)((const int16_t *)w + g * group_elements)
                                  : (const void *)((const int8_t *)w + g * group_elements);
            cr_qout out = {(unsigned char *)y + (b * m + g * mg) * pixels, y_signed, (float)y_zero_point,
                           y_signed ? -128.0f : 0.0f, y_signed ? 127.0f : 255.0f, pixels, 1, mg,
                           bias + g * padded, multiplier + g * padded};
            for (int64_t p0 = 0; p0 < pixels; p0 += CR_QNB) {
                int64_t count = pixels - p0 < CR_QNB ? pixels - p0 : CR_QNB;
                cr_qpack_conv(xg, x_signed, x_zero_point, cg, h, wd, ow, kh, kw, sh, sw, dh, dw, pt, pl, 2 * pairs,
                              p0, count, panel);
                cr_qgemm(wg, wide, pairs, panel, p0, count, &out);
            }
        }
    }
}

/* -- QLinearMatMulExact ----------------------------------------------------------------------------------------- */
/* y[r][n] for x [rows][k] (8-bit) and the weight [k][n] as cr_qconv2d's one group of n channels */
static CR_UNUSED void cr_qmatmul(const void *x, int x_signed, int32_t x_zero_point, const void *w, int wide,
                                 const int32_t *bias, const float *multiplier, void *y, int y_signed,
                                 int32_t y_zero_point, int64_t rows, int64_t k, int64_t n, int64_t pairs,
                                 int16_t *panel) {
    cr_qout out = {y, y_signed, (float)y_zero_point, y_signed ? -128.0f : 0.0f, y_signed ? 127.0f : 255.0f, 1, n, n,
                   bias, multiplier};
#ifdef CR_QUADS
    if (!wide) {
        const int64_t padded = (n + CR_QCB - 1) / CR_QCB * CR_QCB, quads = (pairs + 1) / 2;
        const int32_t u_zero_point = x_zero_point + (x_signed ? 128 : 0);
        int32_t fixed[padded];
        uint8_t *bytes = (uint8_t *)panel;
        cr_quad_bias((const int8_t *)w, pairs, bias, u_zero_point, padded, fixed);
        out.bias = fixed;
        for (int64_t p0 = 0; p0 < rows; p0 += CR_QNB) {
            int64_t count = rows - p0 < CR_QNB ? rows - p0 : CR_QNB;
            memset(bytes, u_zero_point, (size_t)(quads * CR_QNB * 4));
            for (int64_t p = 0; p < count; p++)
                for (int64_t j = 0; j < k; j++)
                    bytes[(j / 4) * CR_QNB * 4 + p * 4 + (j & 3)] = cr_quad_byte(x, x_signed, (p0 + p) * k + j);
            cr_qgemm_quads((const int8_t *)w, pairs, bytes, p0, count, &out);
        }
        return;
    }
#endif
    for (int64_t p0 = 0; p0 < rows; p0 += CR_QNB) {
        int64_t count = rows - p0 < CR_QNB ? rows - p0 : CR_QNB;
        memset(panel, 0, (size_t)(2 * pairs * CR_QNB) * sizeof(int16_t));
        for (int64_t p = 0; p < count; p++)
            for (int64_t j = 0; j < k; j++)
                panel[(j / 2) * CR_QNB * 2 + p * 2 + (j & 1)] =
                    (int16_t)(cr_qload(x, x_signed, (p0 + p) * k + j) - x_zero_point);
        cr_qgemm(w, wide, pairs, panel, p0, count, &out);
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

/* Per-axis (per-channel) forms: x seen as [outer][channels][inner], one scale and zero point per channel, each
 * element rounded as the per-tensor forms do */
static CR_EXACT_FN CR_UNUSED void cr_quantize_axis(const float *x, const float *scale, const float *zero_point,
                                                   void *y, int y_signed, int64_t outer, int64_t channels,
                                                   int64_t inner) {
    CR_EXACT_FLOAT
    const float lo = y_signed ? -128.0f : 0.0f, hi = y_signed ? 127.0f : 255.0f;
    for (int64_t o = 0; o < outer; o++)
        for (int64_t c = 0; c < channels; c++) {
            const int64_t base = (o * channels + c) * inner;
            for (int64_t i = base; i < base + inner; i++) {
                float v = rintf(x[i] / scale[c]) + zero_point[c];
                v = v > lo ? v : lo;
                v = v < hi ? v : hi;
                cr_qstore(y, y_signed, i, (int32_t)v);
            }
        }
}

static CR_EXACT_FN CR_UNUSED void cr_dequantize_axis(const void *x, int x_signed, const float *zero_point,
                                                     const float *scale, float *y, int64_t outer, int64_t channels,
                                                     int64_t inner) {
    CR_EXACT_FLOAT
    for (int64_t o = 0; o < outer; o++)
        for (int64_t c = 0; c < channels; c++) {
            const int64_t base = (o * channels + c) * inner;
            for (int64_t i = base; i < base + inner; i++)
                y[i] = ((float)cr_qload(x, x_signed, i) - zero_point[c]) * scale[c];
        }
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
    /* uint8 (the QDQ residual adds): CR_QL lanes at a time, the same float steps in the same order */
    typedef uint8_t cr_qbytes __attribute__((vector_size(CR_QL)));
    const uint8_t *pa = (const uint8_t *)a, *pb = (const uint8_t *)b;
    uint8_t *py = (uint8_t *)y;
    int64_t i = 0;
    for (; i + CR_QL <= count; i += CR_QL) {
        cr_qbytes va, vb;
        memcpy(&va, pa + i, sizeof va);
        memcpy(&vb, pb + i, sizeof vb);
        cr_qf v = __builtin_convertvector(va, cr_qf) * ka;
        cr_qf u = __builtin_convertvector(vb, cr_qf) * kb;
        v = cr_qf_clamp((v + u) + offset, 0.0f, 255.0f);
        cr_qbytes out = __builtin_convertvector(__builtin_convertvector((v + CR_ROUNDER) - CR_ROUNDER, cr_qi), cr_qbytes);
        memcpy(py + i, &out, sizeof out);
    }
    a = pa + i;
    b = pb + i;
    y = py + i;
    count -= i;
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
