/* Native kernels of quantized models (8-bit activations, integer-exact), around qgemm.c's int8 GEMM:
 *
 *   qconv_transpose   dst[c][r] = src[r][c] ^ mask for bytes (16x16 SSE2 tiles): NCHW planes to pixel rows (the
 *                     GEMM's A of a 1x1 convolution) and the GEMM's [pixels, channels] result back to NCHW planes.
 *   qconv_im2col      rows A[p][(i, j, c)] of output pixels [p0, p1) of one image (or one group's channels): the
 *                     input rows they read are first copied into a padded channels-last band (padding holds the
 *                     input zero point, so it adds exactly 0 after the zero-point correction), then each kernel
 *                     row of a pixel is one contiguous copy of kw * C bytes.
 *   qconv_depthwise   direct depthwise convolution: int32 accumulation over stride-phase planes, then the
 *                     requantization.
 *   qconv_qlinear_add QLinearAdd's float32 formula, elementwise.
 *   qconv_quantize    QuantizeLinear of float32 values with one scale and zero point, to 8 bits.
 *   qconv_dequantize  DequantizeLinear of 8-bit values with one scale and zero point, to float32.
 *   qconv_maxpool     MaxPool over 8-bit planes.
 *
 * `mask` 0x80 turns int8 values into uint8 ones (x ^ 0x80 == x + 128): the caller adds 128 to the zero point.
 * No -ffast-math: the requantization must round exactly as the numpy path does (and no FMA contraction). Every
 * vector path has a plain C fallback.
 */
// carrack-cflags: -ffp-contract=off
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threadpool.h"

#if defined(__AVX512BW__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

/* geometry, in the order of the int64 array the caller passes */
enum { G_C, G_H, G_W, G_KH, G_KW, G_OH, G_OW, G_SH, G_SW, G_DH, G_DW, G_PT, G_PL, G_COUNT };

/* -- byte transpose -------------------------------------------------------------------------------------------- */
#if defined(__SSE2__)
/* 16 rows of 16 bytes -> 16 columns: four rounds of interleaving, bytes to 64-bit halves */
static inline void tile16(const uint8_t *src, int64_t sld, uint8_t *dst, int64_t dld, __m128i mask) {
    __m128i r[16], a[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) r[i] = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(src + i * sld)), mask);
#pragma GCC unroll 8
    for (int p = 0; p < 8; p++) { /* a[2p + h]: rows 2p, 2p+1 interleaved, columns 8h..8h+7 */
        a[2 * p] = _mm_unpacklo_epi8(r[2 * p], r[2 * p + 1]);
        a[2 * p + 1] = _mm_unpackhi_epi8(r[2 * p], r[2 * p + 1]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; q++) /* r[4q + b]: rows 4q..4q+3, columns 4b..4b+3 */
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            r[4 * q + 2 * h] = _mm_unpacklo_epi16(a[4 * q + h], a[4 * q + 2 + h]);
            r[4 * q + 2 * h + 1] = _mm_unpackhi_epi16(a[4 * q + h], a[4 * q + 2 + h]);
        }
#pragma GCC unroll 2
    for (int o = 0; o < 2; o++) /* a[8o + e]: rows 8o..8o+7, columns 2e, 2e+1 */
#pragma GCC unroll 4
        for (int b = 0; b < 4; b++) {
            a[8 * o + 2 * b] = _mm_unpacklo_epi32(r[8 * o + b], r[8 * o + 4 + b]);
            a[8 * o + 2 * b + 1] = _mm_unpackhi_epi32(r[8 * o + b], r[8 * o + 4 + b]);
        }
#pragma GCC unroll 8
    for (int e = 0; e < 8; e++) {
        _mm_storeu_si128((__m128i *)(dst + (2 * e) * dld), _mm_unpacklo_epi64(a[e], a[8 + e]));
        _mm_storeu_si128((__m128i *)(dst + (2 * e + 1) * dld), _mm_unpackhi_epi64(a[e], a[8 + e]));
    }
}
#endif

static void transpose_scalar(const uint8_t *src, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int64_t sld,
                             uint8_t *dst, int64_t dld, uint8_t mask) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t c = c0; c < c1; c++) dst[c * dld + r] = src[r * sld + c] ^ mask;
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
/* fewer than 16 rows (channels), 16 columns: the tile's missing rows are zeros, each column's `rows` bytes are
 * stored under a mask */
static inline void tile16_narrow(const uint8_t *src, int64_t rows, int64_t sld, uint8_t *dst, int64_t dld,
                                 __m128i mask) {
    uint8_t t[16 * 16];
    uint8_t in[16 * 16];
    memset(in, 0, sizeof in);
    for (int64_t r = 0; r < rows; r++) memcpy(in + 16 * r, src + r * sld, 16);
    tile16(in, 16, t, 16, mask);
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    for (int c = 0; c < 16; c++) _mm_mask_storeu_epi8(dst + c * dld, keep, _mm_loadu_si128((const __m128i *)(t + 16 * c)));
}
#endif

/* dst[c * dld + r] = src[r * sld + c] ^ mask for r < rows, c < cols. A dimension of 16 or more is covered by whole
 * tiles, the last one overlapping its neighbour (writing the same bytes twice is harmless); 64x64 blocks keep
 * both sides' cache lines in L1 while they fill. */
void qconv_transpose(const uint8_t *src, int64_t rows, int64_t cols, int64_t sld, uint8_t *dst, int64_t dld,
                     int32_t mask) {
#if defined(__SSE2__)
    const __m128i m = _mm_set1_epi8((char)mask);
    if (rows >= 16 && cols >= 16) {
        for (int64_t r0 = 0; r0 < rows; r0 += 64)
            for (int64_t c0 = 0; c0 < cols; c0 += 64)
                for (int64_t r = r0; r < r0 + 64 && r < rows; r += 16) {
                    const int64_t rt = r + 16 <= rows ? r : rows - 16;
                    for (int64_t c = c0; c < c0 + 64 && c < cols; c += 16) {
                        const int64_t ct = c + 16 <= cols ? c : cols - 16;
                        tile16(src + rt * sld + ct, sld, dst + ct * dld + rt, dld, m);
                    }
                }
        return;
    }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    if (rows > 0 && rows < 16 && cols >= 16) {
        for (int64_t c = 0; c < cols; c += 16) {
            const int64_t ct = c + 16 <= cols ? c : cols - 16;
            tile16_narrow(src + ct, rows, sld, dst + ct * dld, dld, m);
        }
        return;
    }
#endif
#endif
    for (int64_t r = 0; r < rows; r += 64) /* blocks keep the scattered writes within a few cache lines */
        for (int64_t c = 0; c < cols; c += 64)
            transpose_scalar(src, r, r + 64 < rows ? r + 64 : rows, c, c + 64 < cols ? c + 64 : cols, sld, dst, dld,
                             (uint8_t)mask);
}

/* n bytes from src to dst (short runs: a few vector moves instead of a library call) */
static inline void copy_run(uint8_t *dst, const uint8_t *src, int64_t n) {
#if defined(__AVX512BW__)
    for (; n >= 64; n -= 64, src += 64, dst += 64) _mm512_storeu_si512(dst, _mm512_loadu_si512(src));
    if (n) {
        const __mmask64 keep = ((__mmask64)1 << n) - 1;
        _mm512_mask_storeu_epi8(dst, keep, _mm512_maskz_loadu_epi8(keep, src));
    }
#else
    memcpy(dst, src, (size_t)n);
#endif
}

/* -- im2col -------------------------------------------------------------------------------------------------------- */
static inline int64_t band_width(const int64_t *g) {
    int64_t need = (g[G_OW] - 1) * g[G_SW] + (g[G_KW] - 1) * g[G_DW] + 1;
    return need > g[G_PL] + g[G_W] ? need : g[G_PL] + g[G_W];
}

static inline int64_t band_rows(const int64_t *g, int64_t oh0, int64_t oh1) {
    return (oh1 - oh0) * g[G_SH] + (g[G_KH] - 1) * g[G_DH] + 1;
}

/* bytes of the band qconv_im2col needs for any run of `pixels` consecutive output pixels */
int64_t qconv_band_bytes(const int64_t *g, int64_t pixels) {
    int64_t spans = (pixels + g[G_OW] - 1) / g[G_OW] + 1; /* output rows such a run may touch */
    if (spans > g[G_OH]) spans = g[G_OH];
    return band_rows(g, 0, spans - 1) * band_width(g) * g[G_C];
}

/* whether band row r (relative to the first output row's first tap) is read by some tap of output rows 0..last */
static inline int row_used(const int64_t *g, int64_t r, int64_t last) {
    const int64_t sh = g[G_SH], dh = g[G_DH];
    if (dh == 1 && sh <= g[G_KH]) return 1; /* the taps of neighbouring output rows meet */
    for (int64_t i = 0; i < g[G_KH]; i++) {
        int64_t rest = r - i * dh;
        if (rest >= 0 && rest % sh == 0 && rest / sh <= last) return 1;
    }
    return 0;
}

/* band[r][col][c]: input row ih0 + r, column col - pl, channel c (^ mask), `fill` outside the image; rows no tap
 * reads (a stride larger than the kernel skips them) are left unwritten */
static void build_band(const uint8_t *x, const int64_t *g, int64_t ih0, int64_t rows, int64_t last, uint8_t fill,
                       uint8_t mask, uint8_t *band) {
    const int64_t C = g[G_C], H = g[G_H], W = g[G_W], pl = g[G_PL], wp = band_width(g);
    for (int64_t r = 0; r < rows; r++) {
        if (!row_used(g, r, last)) continue;
        uint8_t *dst = band + r * wp * C;
        int64_t ih = ih0 + r;
        if (ih < 0 || ih >= H) {
            memset(dst, fill, (size_t)(wp * C));
            continue;
        }
        memset(dst, fill, (size_t)(pl * C));
        qconv_transpose(x + ih * W, C, W, H * W, dst + pl * C, C, mask);
        memset(dst + (pl + W) * C, fill, (size_t)((wp - pl - W) * C));
    }
}

/* A[p - p0][(i * kw + j) * C + c] = x[c][oh * sh - pt + i * dh][ow * sw - pl + j * dw] (fill outside) for the
 * output pixels p = oh * OW + ow in [p0, p1); `band` holds qconv_band_bytes(g, p1 - p0) bytes of scratch. */
void qconv_im2col(const uint8_t *x, const int64_t *g, int64_t p0, int64_t p1, int32_t fill, int32_t mask,
                  uint8_t *band, uint8_t *a, int64_t lda) {
    if (p1 <= p0) return;
    const int64_t C = g[G_C], OW = g[G_OW], kh = g[G_KH], kw = g[G_KW], sh = g[G_SH], sw = g[G_SW];
    const int64_t dh = g[G_DH], dw = g[G_DW], wp = band_width(g);
    const int64_t oh0 = p0 / OW, oh1 = (p1 - 1) / OW;
    build_band(x, g, oh0 * sh - g[G_PT], band_rows(g, oh0, oh1), oh1 - oh0, (uint8_t)fill, (uint8_t)mask, band);
    const size_t run = (size_t)(kw * C);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t oh = p / OW, ow = p % OW;
        uint8_t *dst = a + (p - p0) * lda;
        const uint8_t *src = band + ((oh - oh0) * sh * wp + ow * sw) * C;
        for (int64_t i = 0; i < kh; i++, dst += run) {
            const uint8_t *row = src + i * dh * wp * C;
            if (dw == 1) {
                copy_run(dst, row, (int64_t)run);
            } else {
                for (int64_t j = 0; j < kw; j++) copy_run(dst + j * C, row + j * dw * C, C);
            }
        }
    }
}

/* -- depthwise ----------------------------------------------------------------------------------------------------- */
#define DW_ACC 16384 /* accumulators per band of output rows (64 KiB) */

static inline uint8_t requantize_one(int32_t acc, float multiplier, float zero_point, float lo, float hi) {
    float v = rintf((float)acc * multiplier) + zero_point;
    v = v > lo ? v : lo;
    v = v < hi ? v : hi;
    return (uint8_t)(int32_t)v; /* int8 results keep their two's-complement byte */
}

/* dst[t] = (src[t * step] ^ m8) - x_zp as int16 */
static inline void widen_row(const uint8_t *restrict src, int64_t step, int64_t n, uint8_t m8, int32_t x_zp,
                             int16_t *restrict dst) {
    int64_t t = 0;
    if (step == 1) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        const __m256i m = _mm256_set1_epi8((char)m8);
        const __m512i zp = _mm512_set1_epi16((short)x_zp);
        for (; t < n; t += 32) {
            const __mmask32 k = n - t >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (n - t)) - 1);
            __m256i v = _mm256_xor_si256(_mm256_maskz_loadu_epi8(k, src + t), m);
            _mm512_mask_storeu_epi16(dst + t, k, _mm512_sub_epi16(_mm512_cvtepu8_epi16(v), zp));
        }
#endif
        for (; t < n; t++) dst[t] = (int16_t)((int32_t)(src[t] ^ m8) - x_zp);
    } else {
#if defined(__AVX512BW__)
        if (step == 2) { /* the even bytes of 64 are the low halves of 32 int16 lanes */
            const __m512i m = _mm512_set1_epi16((short)m8), low = _mm512_set1_epi16(0xFF);
            const __m512i zp = _mm512_set1_epi16((short)x_zp);
            for (; t < n; t += 32) {
                const int64_t bytes = n - t >= 32 ? 64 : 2 * (n - t) - 1; /* never past src[2 (n - 1)] */
                const __mmask64 k = bytes >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << bytes) - 1);
                const __mmask32 out = n - t >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (n - t)) - 1);
                __m512i v = _mm512_and_si512(_mm512_xor_si512(_mm512_maskz_loadu_epi8(k, src + 2 * t), m), low);
                _mm512_mask_storeu_epi16(dst + t, out, _mm512_sub_epi16(v, zp));
            }
        }
#endif
        for (; t < n; t++) dst[t] = (int16_t)((int32_t)(src[t * step] ^ m8) - x_zp);
    }
}

/* dst[t] = requantize(acc[t]) (vector code: the same float32 operations) */
static inline void requantize_row(const uint32_t *restrict acc, int64_t n, float multiplier, float zero_point,
                                  float lo, float hi, uint8_t *restrict dst) {
    int64_t t = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BW__)
    const __m512 vm = _mm512_set1_ps(multiplier), vz = _mm512_set1_ps(zero_point);
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    for (; t < n; t += 16) {
        const __mmask16 k = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(k, acc + t)), vm);
        v = _mm512_add_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), vz);
        v = _mm512_min_ps(_mm512_max_ps(v, vlo), vhi);
        _mm_mask_storeu_epi8(dst + t, k, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
    }
#endif
    for (; t < n; t++) dst[t] = requantize_one((int32_t)acc[t], multiplier, zero_point, lo, hi);
}

/* Phase planes of one input plane: phase (a, b) holds padded pixel (r * sh + a, t * sw + b) at [r][t] (pw columns,
 * ph rows and a spare row) as x - x_zp in int16, 0 in the padding (which therefore adds nothing). Every tap of
 * every output then reads one phase at a fixed offset from its output's index: the kernel is a few long,
 * contiguous multiply-adds over rows of pw columns (the columns past OW are computed and dropped). */
static void fill_phases(const uint8_t *plane, const int64_t *g, int64_t ph, int64_t pw, uint8_t m8, int32_t x_zp,
                        int16_t *phases) {
    const int64_t H = g[G_H], W = g[G_W], sh = g[G_SH], sw = g[G_SW], pt = g[G_PT], pl = g[G_PL];
    const int64_t size = (ph + 1) * pw;
    for (int64_t a = 0; a < sh; a++)
        for (int64_t r = 0; r <= ph; r++) {
            const int64_t ih = r * sh + a - pt;
            for (int64_t b = 0; b < sw; b++) {
                int16_t *dst = phases + (a * sw + b) * size + r * pw;
                if (ih < 0 || ih >= H || r == ph) {
                    memset(dst, 0, (size_t)pw * sizeof *dst);
                    continue;
                }
                /* columns t with iw = t * sw + b - pl inside [0, W): [t0, t1) */
                int64_t t0 = pl - b <= 0 ? 0 : (pl - b + sw - 1) / sw;
                int64_t t1 = W - 1 + pl - b < 0 ? 0 : (W - 1 + pl - b) / sw + 1;
                t1 = t1 < pw ? t1 : pw;
                t0 = t0 < t1 ? t0 : t1;
                memset(dst, 0, (size_t)t0 * sizeof *dst);
                widen_row(plane + ih * W + t0 * sw + b - pl, sw, t1 - t0, m8, x_zp, dst + t0);
                memset(dst + t1, 0, (size_t)(pw - t1) * sizeof *dst);
            }
        }
}

/* acc[q] += src[q] * wt, wrapping */
static inline void accumulate(uint32_t *restrict acc, const int16_t *restrict src, int64_t n, int32_t wt) {
    for (int64_t q = 0; q < n; q++) acc[q] += (uint32_t)((int32_t)src[q] * wt);
}

/* scratch bytes qconv_depthwise needs */
int64_t qconv_depthwise_scratch(const int64_t *g) {
    const int64_t sh = g[G_SH], sw = g[G_SW];
    const int64_t ph = (g[G_OH] - 1) + ((g[G_KH] - 1) * g[G_DH]) / sh + 1;
    const int64_t pw = (band_width(g) + sw - 1) / sw;
    const int64_t accs = pw > DW_ACC ? pw : DW_ACC;
    return ((sh * sw * (ph + 1) * pw * (int64_t)sizeof(int16_t) + 63) & ~(int64_t)63) + accs * (int64_t)sizeof(uint32_t);
}

/* Output channels [c0, c1) of one image: y[co][oh][ow] = requantize(bias[co] + sum_{i,j} (x[ci] - x_zp) * w[co][i][j])
 * with ci = co / mult, x_zp the zero point of the (mask-adjusted) uint8 input, w int32 [C * mult][kh * kw] with
 * |w| <= 2**15. The accumulator wraps like int32; requantization as the numpy path:
 * clamp(rint(float(acc) * multiplier[co]) + y_zp) into uint8 (out_signed 0) or int8 (1). */
void qconv_depthwise(const uint8_t *x, const int64_t *g, int64_t mult, int64_t c0, int64_t c1, const int32_t *w,
                     const int32_t *bias, const float *multiplier, int32_t x_zp, int32_t mask, int32_t y_zp,
                     int32_t out_signed, uint8_t *scratch, uint8_t *y) {
    const int64_t H = g[G_H], W = g[G_W], kh = g[G_KH], kw = g[G_KW], OH = g[G_OH], OW = g[G_OW];
    const int64_t sh = g[G_SH], sw = g[G_SW], dh = g[G_DH], dw = g[G_DW];
    const int64_t ph = (OH - 1) + ((kh - 1) * dh) / sh + 1, pw = (band_width(g) + sw - 1) / sw;
    const int64_t size = (ph + 1) * pw;
    const float lo = out_signed ? -128.0f : 0.0f, hi = out_signed ? 127.0f : 255.0f, zp = (float)y_zp;
    int16_t *phases = (int16_t *)scratch;
    uint32_t *acc = (uint32_t *)(scratch + ((sh * sw * size * (int64_t)sizeof(int16_t) + 63) & ~(int64_t)63));
    int64_t band = DW_ACC / pw; /* output rows per accumulator band (at least one row of pw accumulators) */
    if (band < 1) band = 1;
    int64_t filled = -1;
    for (int64_t co = c0; co < c1; co++) {
        const int64_t ci = co / mult;
        if (ci != filled) {
            fill_phases(x + ci * H * W, g, ph, pw, (uint8_t)mask, x_zp, phases);
            filled = ci;
        }
        const int32_t *wc = w + co * kh * kw;
        const float mul = multiplier[co];
        for (int64_t oh0 = 0; oh0 < OH; oh0 += band) {
            const int64_t rows = OH - oh0 < band ? OH - oh0 : band, n = rows * pw;
            for (int64_t q = 0; q < n; q++) acc[q] = (uint32_t)bias[co];
            for (int64_t i = 0; i < kh; i++)
                for (int64_t j = 0; j < kw; j++) {
                    const int64_t a = (i * dh) % sh, b = (j * dw) % sw;
                    const int16_t *src = phases + (a * sw + b) * size + (oh0 + (i * dh) / sh) * pw + (j * dw) / sw;
                    const int32_t wt = wc[i * kw + j];
                    accumulate(acc, src, n, wt);
                }
            for (int64_t r = 0; r < rows; r++)
                requantize_row(acc + r * pw, OW, mul, zp, lo, hi, y + co * OH * OW + (oh0 + r) * OW);
        }
    }
}

/* -- QLinearAdd ---------------------------------------------------------------------------------------------------- */
/* y = clamp(rint(a * ka + b * kb + offset)) elementwise over n 8-bit values, in float32 in exactly this order (the
 * numpy path's formula); `in_signed` / `out_signed` choose int8 over uint8 for the inputs / the output. */
#define ADD_LOOP(TIN, TOUT, LO, HI)                                                              \
    do {                                                                                         \
        const TIN *pa = (const TIN *)a, *pb = (const TIN *)b;                                    \
        TOUT *py = (TOUT *)y;                                                                    \
        for (int64_t i = 0; i < n; i++) {                                                        \
            float v = (float)pa[i] * ka;                                                         \
            v = v + (float)pb[i] * kb;                                                           \
            v = rintf(v + offset);                                                               \
            v = v > (LO) ? v : (LO);                                                             \
            v = v < (HI) ? v : (HI);                                                             \
            py[i] = (TOUT)(int32_t)v;                                                            \
        }                                                                                        \
    } while (0)

#if defined(__AVX512BW__)
/* 16 values of one operand as float32: widened from 8 bits, signed or not */
static inline __m512 widen16(const uint8_t *p, int in_signed) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(in_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}

/* The same float32 operations as ADD_LOOP, 16 lanes at a time (mul, mul, add, add, round to nearest even, clamp;
 * max/min return the bound for a NaN as the scalar comparisons do); returns how many values it did. */
static int64_t qlinear_add_avx512(const uint8_t *a, const uint8_t *b, int64_t n, float ka, float kb, float offset,
                                  int32_t in_signed, int32_t out_signed, uint8_t *y) {
    const __m512 vka = _mm512_set1_ps(ka), vkb = _mm512_set1_ps(kb), voff = _mm512_set1_ps(offset);
    const __m512 lo = _mm512_set1_ps(out_signed ? -128.0f : 0.0f), hi = _mm512_set1_ps(out_signed ? 127.0f : 255.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(widen16(a + i, in_signed), vka);
        v = _mm512_add_ps(v, _mm512_mul_ps(widen16(b + i, in_signed), vkb));
        v = _mm512_roundscale_ps(_mm512_add_ps(v, voff), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128((__m128i *)(y + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(v)));
    }
    return i;
}
#endif

void qconv_qlinear_add(const uint8_t *a, const uint8_t *b, int64_t n, float ka, float kb, float offset,
                       int32_t in_signed, int32_t out_signed, uint8_t *y) {
#if defined(__AVX512BW__)
    const int64_t done = qlinear_add_avx512(a, b, n, ka, kb, offset, in_signed, out_signed, y);
    a += done, b += done, y += done, n -= done;
#endif
    if (!in_signed && !out_signed) ADD_LOOP(uint8_t, uint8_t, 0.0f, 255.0f);
    else if (!in_signed) ADD_LOOP(uint8_t, int8_t, -128.0f, 127.0f);
    else if (!out_signed) ADD_LOOP(int8_t, uint8_t, 0.0f, 255.0f);
    else ADD_LOOP(int8_t, int8_t, -128.0f, 127.0f);
}

/* -- QuantizeLinear, float32 per tensor ----------------------------------------------------------------------------- */
/* y = clamp(rint(x / scale) + zero_point) over n float32 values, in float32 in this order (true division, round half
 * to even): the numpy fast path's formula. Returns 1 when some quotient is a NaN (y then partly written: the caller
 * takes its general path), else 0. */
int64_t qconv_quantize(const float *x, int64_t n, float scale, float zero_point, int32_t out_signed, uint8_t *y) {
    const float lo = out_signed ? -128.0f : 0.0f, hi = out_signed ? 127.0f : 255.0f;
    int64_t i = 0;
#if defined(__AVX512BW__)
    const __m512 vs = _mm512_set1_ps(scale), vz = _mm512_set1_ps(zero_point);
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
    __mmask16 nan = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vs),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_add_ps(q, vz);
        nan |= _mm512_cmp_ps_mask(q, q, _CMP_UNORD_Q);
        q = _mm512_min_ps(_mm512_max_ps(q, vlo), vhi);
        _mm_storeu_si128((__m128i *)(y + i), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
    }
    if (nan) return 1;
#endif
    for (; i < n; i++) {
        float q = rintf(x[i] / scale) + zero_point;
        if (q != q) return 1;
        q = q > lo ? q : lo;
        q = q < hi ? q : hi;
        y[i] = out_signed ? (uint8_t)(int8_t)(int32_t)q : (uint8_t)(int32_t)q;
    }
    return 0;
}

/* -- DequantizeLinear, 8 bits per tensor to float32 ------------------------------------------------------------------ */
/* y = ((float)x - zero_point) * scale over n 8-bit values (signed or not): the numpy path's float32 operations in
 * its order (the difference is exact, the product rounds once). */
void qconv_dequantize(const uint8_t *x, int64_t n, float zero_point, float scale, int32_t in_signed, float *y) {
    int64_t i = 0;
#if defined(__AVX512BW__)
    const __m512 vs = _mm512_set1_ps(scale), vz = _mm512_set1_ps(zero_point);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_sub_ps(widen16(x + i, in_signed), vz), vs));
#endif
    for (; i < n; i++) y[i] = ((float)(in_signed ? (int32_t)(int8_t)x[i] : (int32_t)x[i]) - zero_point) * scale;
}

/* -- MaxPool on 8-bit values ----------------------------------------------------------------------------------------- */
/* Planes [p0, p1) of x [planes][H][W]: y[p][oh][ow] = max over the window's taps inside the image (padding never
 * wins; a window with none gives the type's lowest value). Values are compared as (x ^ mask): 0x80 for int8, so
 * the lowest value is 0 and padding is a run of zeros. Per output row: the column maxima of the window's rows
 * (contiguous), then the row maxima over the kernel width at every column (contiguous), then every sw-th of them.
 * `scratch` holds 2 * qconv_pool_scratch(g) bytes. */
int64_t qconv_pool_scratch(const int64_t *g) { return band_width(g); }

#if defined(__AVX512BW__)
static inline __mmask64 tail64(int64_t n) { return n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1); }
#endif

/* col[w] = max(col[w], row[w] ^ m8) for w < n */
static inline void max_into(uint8_t *col, const uint8_t *row, int64_t n, uint8_t m8) {
    int64_t w = 0;
#if defined(__AVX512BW__)
    const __m512i m = _mm512_set1_epi8((char)m8);
    for (; w < n; w += 64) {
        const __mmask64 k = tail64(n - w);
        __m512i v = _mm512_xor_si512(_mm512_maskz_loadu_epi8(k, row + w), m);
        _mm512_mask_storeu_epi8(col + w, k, _mm512_max_epu8(v, _mm512_maskz_loadu_epi8(k, col + w)));
    }
#endif
    for (; w < n; w++) {
        const uint8_t v = row[w] ^ m8;
        col[w] = v > col[w] ? v : col[w];
    }
}

/* dst[t] = (max_j column[t * sw + j * dw]) ^ m8 for t < count; `across` is scratch of span bytes */
static inline void row_max(const uint8_t *column, int64_t kw, int64_t dw, int64_t sw, int64_t count, uint8_t m8,
                           uint8_t *across, uint8_t *dst) {
    const int64_t span = (count - 1) * sw + 1;
    int64_t u = 0;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512i m = _mm512_set1_epi8((char)m8);
    if (sw <= 2) {
        for (; u < span; u += 64) {
            const __mmask64 k = tail64(span - u);
            __m512i best = _mm512_maskz_loadu_epi8(k, column + u);
            for (int64_t j = 1; j < kw; j++)
                best = _mm512_max_epu8(best, _mm512_maskz_loadu_epi8(k, column + u + j * dw));
            best = _mm512_xor_si512(best, m);
            if (sw == 1) {
                _mm512_mask_storeu_epi8(dst + u, k, best);
            } else { /* the even bytes: outputs u / 2 .. */
                const int64_t outs = (span - u + 1) / 2 < 32 ? (span - u + 1) / 2 : 32;
                __m256i even = _mm512_cvtepi16_epi8(_mm512_and_si512(best, _mm512_set1_epi16(0x00FF)));
                _mm256_mask_storeu_epi8(dst + u / 2, (__mmask32)tail64(outs), even);
            }
        }
        return;
    }
#endif
    for (; u < span; u++) {
        uint8_t best = column[u];
        for (int64_t j = 1; j < kw; j++) best = column[u + j * dw] > best ? column[u + j * dw] : best;
        across[u] = best;
    }
    for (int64_t t = 0; t < count; t++) dst[t] = across[t * sw] ^ m8;
}

void qconv_maxpool(const uint8_t *x, const int64_t *g, int64_t p0, int64_t p1, int32_t mask, uint8_t *scratch,
                   uint8_t *y) {
    const int64_t H = g[G_H], W = g[G_W], kh = g[G_KH], kw = g[G_KW], OH = g[G_OH], OW = g[G_OW];
    const int64_t sh = g[G_SH], sw = g[G_SW], dh = g[G_DH], dw = g[G_DW], pt = g[G_PT], pl = g[G_PL];
    const int64_t wp = band_width(g);
    const uint8_t m8 = (uint8_t)mask;
    uint8_t *column = scratch, *across = scratch + wp;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *plane = x + p * H * W;
        uint8_t *out = y + p * OH * OW;
        for (int64_t oh = 0; oh < OH; oh++) {
            memset(column, 0, (size_t)wp);
            for (int64_t i = 0; i < kh; i++) {
                const int64_t ih = oh * sh - pt + i * dh;
                if (ih >= 0 && ih < H) max_into(column + pl, plane + ih * W, W, m8);
            }
            row_max(column, kw, dw, sw, OW, m8, across, out + oh * OW);
        }
    }
}

/* -- the kernels over the thread pool: [begin, end) cut into `chunks` pieces run by up to `threads` threads;
 * scratch buffers are `stride` bytes apart, one per thread ------------------------------------------------------- */
CARRACK_POOL_CLIENT(qconv)

typedef struct {
    const uint8_t *x, *b;
    const int64_t *g;
    const int32_t *w, *bias;
    const float *multiplier;
    uint8_t *scratch, *y;
    int64_t stride, mult, lda, rows, cols, sld, dld, begin;
    int32_t x_zp, mask, y_zp, out_signed, in_signed;
    float ka, kb, offset;
} qconv_call_t;

static void depthwise_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const qconv_call_t *c = p;
    qconv_depthwise(c->x, c->g, c->mult, begin, end, c->w, c->bias, c->multiplier, c->x_zp, c->mask, c->y_zp,
                    c->out_signed, c->scratch + slot * c->stride, c->y);
}

void qconv_depthwise_threads(const uint8_t *x, const int64_t *g, int64_t mult, int64_t c0, int64_t c1,
                             const int32_t *w, const int32_t *bias, const float *multiplier, int32_t x_zp,
                             int32_t mask, int32_t y_zp, int32_t out_signed, uint8_t *scratch, int64_t stride,
                             uint8_t *y, int64_t chunks, int64_t threads) {
    qconv_call_t c = {.x = x, .g = g, .w = w, .bias = bias, .multiplier = multiplier, .scratch = scratch, .y = y,
                      .stride = stride, .mult = mult, .x_zp = x_zp, .mask = mask, .y_zp = y_zp,
                      .out_signed = out_signed};
    parallel_for(depthwise_piece, &c, c0, c1, chunks, threads);
}

static void add_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const qconv_call_t *c = p;
    (void)slot;
    qconv_qlinear_add(c->x + begin, c->b + begin, end - begin, c->ka, c->kb, c->offset, c->in_signed, c->out_signed,
                      c->y + begin);
}

void qconv_qlinear_add_threads(const uint8_t *a, const uint8_t *b, int64_t n, float ka, float kb, float offset,
                               int32_t in_signed, int32_t out_signed, uint8_t *y, int64_t chunks, int64_t threads) {
    qconv_call_t c = {.x = a, .b = b, .y = y, .ka = ka, .kb = kb, .offset = offset, .in_signed = in_signed,
                      .out_signed = out_signed};
    parallel_for(add_piece, &c, 0, n, chunks, threads);
}

static void maxpool_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const qconv_call_t *c = p;
    qconv_maxpool(c->x, c->g, begin, end, c->mask, c->scratch + slot * c->stride, c->y);
}

void qconv_maxpool_threads(const uint8_t *x, const int64_t *g, int64_t p0, int64_t p1, int32_t mask,
                           uint8_t *scratch, int64_t stride, uint8_t *y, int64_t chunks, int64_t threads) {
    qconv_call_t c = {.x = x, .g = g, .scratch = scratch, .y = y, .stride = stride, .mask = mask};
    parallel_for(maxpool_piece, &c, p0, p1, chunks, threads);
}

/* -- a whole GEMM convolution as one parallel region ------------------------------------------------------------- *
 * Items are (image, group, pixel tile, column tile), column tiles innermost. A piece builds its pixel tile's rows A
 * (im2col, or the transpose of a 1x1 stride-1 convolution) into its participant's scratch, multiplies them by the
 * group's packed weight with qgemm_run (requantizing into a [pixels, columns] block) and transposes the block into
 * the NCHW output: no hand-off between the steps, and each output element is written by exactly one item (the same
 * bytes for any split). A piece reuses its A while consecutive items share the pixel tile; a column split (small
 * maps) builds the same A once per piece. qgemm.c is a library of its own: the caller passes qgemm_run. */
typedef void (*qgemm_run_fn)(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t k, int64_t n, const uint8_t *a,
                             int64_t lda, const int8_t *packed, const int32_t *colsum, int32_t a_zero_point,
                             const int32_t *bias_i32, int32_t mode, void *out, int64_t ldc_m, int64_t ldc_n,
                             const float *scale, const float *bias_f32, int32_t y_zero_point);

#define CONV_PANEL 64 /* qgemm.c's QGEMM_NR: column tiles start on its panels */
#define CONV_ALIGN 64

typedef struct {
    const uint8_t *x;
    const int64_t *g;
    const int64_t *packed, *colsums; /* per group: addresses of the packed weight and of its column sums */
    const int32_t *bias;
    const float *multiplier;
    qgemm_run_fn gemm;
    uint8_t *y, *scratch;
    int64_t groups, m, k, lda, ldc, rows, pixel_tiles, column_tiles, column_width, slot_bytes, c_offset, band_offset;
    int32_t zp, mask, y_zp, mode, transpose_only;
} conv_call_t;

static inline int64_t align_up(int64_t bytes) { return (bytes + CONV_ALIGN - 1) / CONV_ALIGN * CONV_ALIGN; }

static void conv_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const conv_call_t *c = p;
    const int64_t *g = c->g;
    const int64_t pixels = g[G_OH] * g[G_OW], plane_in = g[G_H] * g[G_W], channels = g[G_C];
    uint8_t *a = c->scratch + slot * c->slot_bytes, *block = a + c->c_offset, *band = a + c->band_offset;
    int64_t built = -1;
    for (int64_t item = begin; item < end; item++) {
        const int64_t tile_id = item / c->column_tiles, unit = tile_id / c->pixel_tiles;
        const int64_t group = unit % c->groups;
        const int64_t p0 = tile_id % c->pixel_tiles * c->rows, p1 = p0 + c->rows < pixels ? p0 + c->rows : pixels;
        const int64_t n0 = item % c->column_tiles * c->column_width;
        const int64_t n1 = n0 + c->column_width < c->m ? n0 + c->column_width : c->m;
        if (n0 >= n1 || p0 >= p1) continue;
        if (tile_id != built) {
            const uint8_t *x = c->x + unit * channels * plane_in; /* images hold groups x channels planes */
            if (c->transpose_only)
                qconv_transpose(x + p0, channels, p1 - p0, plane_in, a, c->lda, c->mask);
            else
                qconv_im2col(x, g, p0, p1, c->zp, c->mask, band, a, c->lda);
            built = tile_id;
        }
        c->gemm(0, p1 - p0, n0, n1, c->k, c->m, a, c->lda, (const int8_t *)(intptr_t)c->packed[group],
                (const int32_t *)(intptr_t)c->colsums[group], c->zp, c->bias + group * c->m, c->mode, block, c->ldc,
                1, c->multiplier + group * c->m, NULL, c->y_zp);
        qconv_transpose(block + n0, p1 - p0, n1 - n0, c->ldc, c->y + (unit * c->m + n0) * pixels + p0, pixels, 0);
    }
}

/* The convolution of `images` images with `groups` groups of m output channels each (geometry g of one group),
 * requantized to 8 bits (mode: qgemm.c's QGEMM_REQUANT_U8 or _S8). depth: the packed weight's rows, kh * kw * C
 * or more (the rows past kh * kw * C zero: A's columns there are never written, and add nothing). Output pixels go
 * in tiles of `rows`, output columns in tiles of `column_width` (a multiple of 64); items are cut into `chunks`
 * pieces over `threads`. lda, ldc: row strides of A and of the GEMM's result block. Returns 1 when the scratch cannot be allocated (nothing
 * written), else 0. */
int64_t qconv_gemm_threads(const uint8_t *x, const int64_t *g, int64_t images, int64_t groups, int64_t m,
                           int64_t depth, const int64_t *packed, const int64_t *colsums, const int32_t *bias,
                           const float *multiplier,
                           int32_t zp, int32_t mask, int32_t y_zp, int32_t mode, int32_t transpose_only, int64_t lda,
                           int64_t ldc, int64_t rows, int64_t column_width, uint8_t *y, void *gemm, int64_t chunks,
                           int64_t threads) {
    const int64_t pixels = g[G_OH] * g[G_OW];
    const int64_t pixel_tiles = (pixels + rows - 1) / rows, column_tiles = (m + column_width - 1) / column_width;
    const int64_t items = images * groups * pixel_tiles * column_tiles;
    const int64_t c_offset = align_up(rows * lda), band_offset = c_offset + align_up(rows * ldc);
    const int64_t slot_bytes = band_offset + (transpose_only ? 0 : align_up(qconv_band_bytes(g, rows)));
    if (threads < 1) threads = 1;
    uint8_t *scratch = malloc((size_t)(slot_bytes * threads));
    if (scratch == NULL) return 1;
    conv_call_t c = {.x = x, .g = g, .packed = packed, .colsums = colsums, .bias = bias, .multiplier = multiplier,
                     .gemm = (qgemm_run_fn)gemm, .y = y, .scratch = scratch, .groups = groups, .m = m,
                     .k = depth, .lda = lda, .ldc = ldc, .rows = rows,
                     .pixel_tiles = pixel_tiles, .column_tiles = column_tiles, .column_width = column_width,
                     .slot_bytes = slot_bytes, .c_offset = c_offset, .band_offset = band_offset, .zp = zp,
                     .mask = mask, .y_zp = y_zp, .mode = mode, .transpose_only = transpose_only};
    parallel_for(conv_piece, &c, 0, items, chunks < items ? chunks : items, threads);
    free(scratch);
    return 0;
}

/* qconv_quantize and qconv_dequantize by ranges of elements (pieces of whole 64-byte lines of the 8-bit side) */
typedef struct {
    const void *x;
    void *y;
    float scale, zero_point;
    int32_t is_signed;
    int nan; /* set by any piece that met a NaN */
} convert_call_t;

static void quantize_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    convert_call_t *c = p;
    (void)slot;
    if (qconv_quantize((const float *)c->x + begin, end - begin, c->scale, c->zero_point, c->is_signed,
                       (uint8_t *)c->y + begin))
        __atomic_store_n(&c->nan, 1, __ATOMIC_RELAXED);
}

static void dequantize_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const convert_call_t *c = p;
    (void)slot;
    qconv_dequantize((const uint8_t *)c->x + begin, end - begin, c->zero_point, c->scale, c->is_signed,
                     (float *)c->y + begin);
}

int64_t qconv_quantize_threads(const float *x, int64_t n, float scale, float zero_point, int32_t out_signed,
                               uint8_t *y, int64_t chunks, int64_t threads) {
    convert_call_t c = {.x = x, .y = y, .scale = scale, .zero_point = zero_point, .is_signed = out_signed};
    parallel_for(quantize_piece, &c, 0, n, chunks, threads);
    return c.nan;
}

void qconv_dequantize_threads(const uint8_t *x, int64_t n, float zero_point, float scale, int32_t in_signed,
                              float *y, int64_t chunks, int64_t threads) {
    convert_call_t c = {.x = x, .y = y, .scale = scale, .zero_point = zero_point, .is_signed = in_signed};
    parallel_for(dequantize_piece, &c, 0, n, chunks, threads);
}
