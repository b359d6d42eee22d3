/* Row kernels of transformer models in float32: softmax, layer normalization (with an optional skip and bias added
 * first), and GELU (exact and tanh form, with an optional bias). One call handles a range of contiguous rows; each
 * row is read from memory once and its later passes hit the L1 cache, where numpy pays a memory pass per step.
 *
 * exp is computed here rather than taken from libm so that it vectorizes without -ffast-math: x = k ln2 + r with
 * |r| <= ln2/2 (Cody-Waite: ln2 split so that k * LN2_HI is exact), exp(r) by a degree-6 polynomial fitted for
 * relative error (4e-9 with float32 coefficients), and 2^k applied in two halves (or by vscalefps) so that results
 * in the subnormal range are rounded instead of flushed. Overall error: an ulp or two.
 *
 * Every output element is written after the inputs at that index are read, so y may be x itself. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "threadpool.h"
/* CARRACK_PORTABLE builds the plain C versions (auto-vectorized by the compiler) on any machine, for testing */
#if defined(__AVX512F__) && !defined(CARRACK_PORTABLE)
#define USE_AVX512 1
#include <immintrin.h>
#endif

#define LN2_HI 0.693359375f      /* 9 significant bits: k * LN2_HI is exact for |k| < 2^15 */
#define LN2_LO -2.12194440e-4f
#define LOG2E 1.44269504088896341f
#define EXP_MIN -110.0f          /* exp(EXP_MIN + 4) is below half the smallest subnormal: rounds to 0 */
#define EXP_MAX 88.8f            /* above log(FLT_MAX): overflows to inf */
#define ROUND_MAGIC 12582912.0f  /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
#define C2 4.999999404e-01f
#define C3 1.666652113e-01f
#define C4 4.166838899e-02f
#define C5 8.368710056e-03f
#define C6 1.381461276e-03f

/* GELU's Phi(x) for x < 0 is erfc(a) / 2 with a = |x| / sqrt 2, computed as t * exp(P(t) - a*a) with
 * t = 1 / (1 + a/2); P (highest power first) is log(erfc(a) / t) + a*a fitted on [0, 10] to 5e-8, with log(1/2)
 * folded into its constant (the same fit as carrack.ops.elementwise's float32 path). a*a is formed exactly as
 * x*x/2 plus an fma-recovered rounding error, which the exponent's range reduction takes in without rounding. */
#define ERFC_TERMS 10
static const float HALF_ERFC[ERFC_TERMS] = {
    1.421705037e-01f, -6.659398675e-01f, 1.122124314e+00f, -6.508961320e-01f, -1.170674041e-01f,
    2.033952810e-02f, 2.830968052e-02f, 3.879094422e-01f, 9.984914064e-01f, -1.958588600e+00f};
#define GELU_CLAMP 20.0f         /* Phi(-20) underflows: larger |x| only risks overflow in x*x */
#define TANH_K1 -1.5957691216057308f   /* -2 sqrt(2/pi) */
#define TANH_K2 -0.07135481627159881f  /* -2 sqrt(2/pi) * 0.044715 */

/* -- scalar (portable) versions ------------------------------------------------------------------------------- */
static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }

static inline float exp_poly(float r) {
    float p = C6;
    p = p * r + C5;
    p = p * r + C4;
    p = p * r + C3;
    p = p * r + C2;
    p = p * r + 1.0f;
    return p * r + 1.0f;
}

/* exp(u + v) for |v| < 4: v (small, exactly known) enters after u's range reduction, so u may be large. */
static inline float exp_sum(float u, float v) {
    u = u < EXP_MIN ? EXP_MIN : u;  /* comparisons keep NaN */
    u = u > EXP_MAX ? EXP_MAX : u;
    float shifted = (u + v) * LOG2E + ROUND_MAGIC;
    float k = shifted - ROUND_MAGIC;
    uint32_t ki = to_bits(shifted) - to_bits(ROUND_MAGIC);  /* k as a two's-complement integer */
    float r = ((u - k * LN2_HI) + v) - k * LN2_LO;
    uint32_t k1 = (uint32_t)((int32_t)ki / 2), k2 = ki - k1;
    return exp_poly(r) * from_bits((k1 + 127u) << 23) * from_bits((k2 + 127u) << 23);
}

static inline float gelu_erf1(float x) {
    float ax = fabsf(x);
    ax = ax > GELU_CLAMP ? GELU_CLAMP : ax;
    float t = 1.0f / (1.0f + ax * 0.35355339059327373f);  /* 1 / (1 + a/2) */
    float p = HALF_ERFC[0];
    for (int i = 1; i < ERFC_TERMS; i++) p = p * t + HALF_ERFC[i];
    float xx = ax * ax;
    float xx_err = fmaf(ax, ax, -xx);
    float h = t * exp_sum(-0.5f * xx, p - 0.5f * xx_err);
    return x * (x < 0.0f ? h : 1.0f - h);
}

static inline float gelu_tanh1(float x) {
    float z = x * (TANH_K1 + TANH_K2 * (x * x));  /* -2 sqrt(2/pi) (x + 0.044715 x^3) */
    return x / (1.0f + exp_sum(z, 0.0f));      /* 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)) */
}

static inline void softmax_row_scalar(float *y, int64_t n, float peak, int zero_masked) {
    if (zero_masked && peak == -INFINITY) peak = 0.0f;
    float lanes[16] = {0}, total = 0.0f;  /* 16 partial sums: vectorizable, and a shorter rounding chain */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) {
            y[i + j] = exp_sum(y[i + j] - peak, 0.0f);
            lanes[j] += y[i + j];
        }
    for (; i < n; i++) {
        y[i] = exp_sum(y[i] - peak, 0.0f);
        total += y[i];
    }
    for (int j = 0; j < 16; j++) total += lanes[j];
    float inv = (zero_masked && total == 0.0f) ? 0.0f : 1.0f / total;
    for (int64_t i = 0; i < n; i++) y[i] *= inv;
}

/* -- AVX-512 versions ----------------------------------------------------------------------------------------- */
#ifdef USE_AVX512
static inline __m512 exp_sum16(__m512 u, __m512 v) {
    u = _mm512_max_ps(_mm512_set1_ps(EXP_MIN), u);  /* max/min return their second operand for NaN: u stays NaN */
    u = _mm512_min_ps(_mm512_set1_ps(EXP_MAX), u);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_add_ps(u, v), _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_HI), u);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_LO), _mm512_add_ps(r, v));
    __m512 p = _mm512_set1_ps(C6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

static inline __m512 gelu_erf16(__m512 x) {
    __m512 ax = _mm512_abs_ps(x);
    ax = _mm512_min_ps(_mm512_set1_ps(GELU_CLAMP), ax);
    __m512 one = _mm512_set1_ps(1.0f);
    __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(ax, _mm512_set1_ps(0.35355339059327373f), one));
    __m512 p = _mm512_set1_ps(HALF_ERFC[0]);
    for (int i = 1; i < ERFC_TERMS; i++) p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(HALF_ERFC[i]));
    __m512 xx = _mm512_mul_ps(ax, ax);
    __m512 xx_err = _mm512_fmsub_ps(ax, ax, xx);
    __m512 half = _mm512_set1_ps(0.5f);
    __m512 h = _mm512_mul_ps(t, exp_sum16(_mm512_mul_ps(_mm512_set1_ps(-0.5f), xx), _mm512_fnmadd_ps(half, xx_err, p)));
    __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(x, _mm512_mask_blend_ps(negative, _mm512_sub_ps(one, h), h));
}

static inline __m512 gelu_tanh16(__m512 x) {
    __m512 z = _mm512_mul_ps(x, _mm512_fmadd_ps(_mm512_set1_ps(TANH_K2), _mm512_mul_ps(x, x),
                                                _mm512_set1_ps(TANH_K1)));
    return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_sum16(z, _mm512_setzero_ps())));
}

static inline __mmask16 tail_mask(int64_t left) { return (__mmask16)((1u << left) - 1u); }

/* y holds the (scaled, biased) scores; peak is their maximum */
static void softmax_row16(float *y, int64_t n, float peak, int zero_masked) {
    if (zero_masked && peak == -INFINITY) peak = 0.0f;
    __m512 m = _mm512_set1_ps(peak), zero = _mm512_setzero_ps(), acc = zero;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp_sum16(_mm512_sub_ps(_mm512_loadu_ps(y + i), m), zero);
        _mm512_storeu_ps(y + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (i < n) {
        __mmask16 k = tail_mask(n - i);
        __m512 e = _mm512_maskz_mov_ps(k, exp_sum16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, y + i), m), zero));
        _mm512_mask_storeu_ps(y + i, k, e);
        acc = _mm512_add_ps(acc, e);
    }
    float total = _mm512_reduce_add_ps(acc);
    __m512 inv = _mm512_set1_ps((zero_masked && total == 0.0f) ? 0.0f : 1.0f / total);
    for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_loadu_ps(y + i), inv));
    if (i < n) {
        __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(y + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, y + i), inv));
    }
}

/* max of a row where NaN wins (as numpy's max), so a NaN score makes the whole row NaN in any mode */
static float scale_bias_max16(const float *x, const float *b, float *y, int64_t n, float scale) {
    __m512 s = _mm512_set1_ps(scale), best = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    int64_t i = 0;
    for (; i < n; i += 16) {
        __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : tail_mask(n - i);
        __m512 z = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), s);
        if (b) z = _mm512_add_ps(z, _mm512_maskz_loadu_ps(k, b + i));
        _mm512_mask_storeu_ps(y + i, k, z);
        nan |= _mm512_mask_cmp_ps_mask(k, z, z, _CMP_UNORD_Q);
        best = _mm512_mask_max_ps(best, k, z, best);
    }
    return nan ? NAN : _mm512_reduce_max_ps(best);
}
#endif

/* -- softmax -------------------------------------------------------------------------------------------------- */
static float scale_bias_max(const float *x, const float *b, float *y, int64_t n, float scale) {
#ifdef USE_AVX512
    return scale_bias_max16(x, b, y, n, scale);
#else
    float best = -INFINITY;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        float z = x[i] * scale;
        if (b) z += b[i];
        y[i] = z;
        nan |= z != z;
        best = z > best ? z : best;
    }
    return nan ? NAN : best;
#endif
}

/* y[r] = softmax(x[r] * scale + bias[r]) over rows r in [row0, row0 + count) of n elements. Row r is
 * (i0, i1, i2) in a (., d1, d2) grid and reads bias + i0*bs0 + i1*bs1 + i2*bs2 (strides in elements, 0 where the
 * bias is broadcast; bias may be NULL). zero_masked: a row whose every score is -inf gives zeros (attention);
 * else it gives NaN, as exp(x - max(x)) does. */
void carrack_softmax(const float *x, float *y, int64_t row0, int64_t count, int64_t n, float scale,
                     const float *bias, int64_t d1, int64_t d2, int64_t bs0, int64_t bs1, int64_t bs2,
                     int zero_masked) {
    /* the row's grid position, divided out once and then stepped: three 64-bit divisions a row cost more than a
     * short row's softmax (attention over 16 keys) */
    int64_t i2 = d2 > 0 ? row0 % d2 : 0, i1 = d2 > 0 && d1 > 0 ? (row0 / d2) % d1 : 0;
    int64_t i0 = d2 > 0 && d1 > 0 ? row0 / (d2 * d1) : 0;
    for (int64_t r = row0; r < row0 + count; r++) {
        const float *b = bias ? bias + i0 * bs0 + i1 * bs1 + i2 * bs2 : NULL;
        if (++i2 == d2) {
            i2 = 0;
            if (++i1 == d1) {
                i1 = 0;
                i0++;
            }
        }
        float peak = scale_bias_max(x + r * n, b, y + r * n, n, scale);
#ifdef USE_AVX512
        softmax_row16(y + r * n, n, peak, zero_masked);
#else
        softmax_row_scalar(y + r * n, n, peak, zero_masked);
#endif
    }
}

/* -- layer normalization -------------------------------------------------------------------------------------- */
/* sum and sum of squared deviations of a row, in double */
static double row_sum(const float *s, int64_t n) {
    int64_t i = 0;
    double total = 0.0;
#ifdef USE_AVX512
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(s + i);
        a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
    }
    total = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#else
    double acc[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += s[i + j];
    for (int j = 0; j < 8; j++) total += acc[j];
#endif
    for (; i < n; i++) total += s[i];
    return total;
}

static double row_deviation(const float *s, int64_t n, double mean) {
    int64_t i = 0;
    double total = 0.0;
#ifdef USE_AVX512
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd(), m = _mm512_set1_pd(mean);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(s + i);
        __m512d lo = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)), m);
        __m512d hi = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))), m);
        a0 = _mm512_fmadd_pd(lo, lo, a0);
        a1 = _mm512_fmadd_pd(hi, hi, a1);
    }
    total = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
#else
    double acc[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            double d = (double)s[i + j] - mean;
            acc[j] += d * d;
        }
    for (int j = 0; j < 8; j++) total += acc[j];
#endif
    for (; i < n; i++) {
        double d = (double)s[i] - mean;
        total += d * d;
    }
    return total;
}

/* Rows [row0, row0 + count) of n elements: s = x (+ skip) (+ bias), y = (s - mean) / sqrt(var + eps) * gamma
 * (+ beta). skip, bias, beta may be NULL; so may mean_out, inv_std_out (one float per row) and sum_out (s). */
void carrack_layer_norm(const float *x, const float *skip, const float *bias, const float *gamma, const float *beta,
                        float *y, float *mean_out, float *inv_std_out, float *sum_out, int64_t row0, int64_t count,
                        int64_t n, float eps) {
    for (int64_t r = row0; r < row0 + count; r++) {
        const float *s = x + r * n;
        float *out = y + r * n;
        if (skip || bias) {
            float *dst = sum_out ? sum_out + r * n : out;
            const float *k = skip ? skip + r * n : NULL;
            for (int64_t i = 0; i < n; i++) {
                float v = s[i];
                if (k) v += k[i];
                if (bias) v += bias[i];
                dst[i] = v;
            }
            s = dst;
        } else if (sum_out) {
            memmove(sum_out + r * n, s, (size_t)n * sizeof(float));
        }
        double mean = n ? row_sum(s, n) / (double)n : NAN;
        double var = n ? row_deviation(s, n, mean) / (double)n : NAN;
        float m = (float)mean, inv = (float)(1.0 / sqrt(var + (double)eps));
        if (mean_out) mean_out[r] = m;
        if (inv_std_out) inv_std_out[r] = inv;
        if (beta) {
            for (int64_t i = 0; i < n; i++) out[i] = (s[i] - m) * inv * gamma[i] + beta[i];
        } else {
            for (int64_t i = 0; i < n; i++) out[i] = (s[i] - m) * inv * gamma[i];
        }
    }
}

/* -- GELU ----------------------------------------------------------------------------------------------------- */
/* y = gelu(x (+ bias)) on rows [row0, row0 + count) of n elements; bias (n floats) may be NULL.
 * approximate: 0 = exact (erf), 1 = tanh form. */
void carrack_gelu(const float *x, const float *bias, float *y, int64_t row0, int64_t count, int64_t n,
                  int approximate) {
    for (int64_t r = row0; r < row0 + count; r++) {
        const float *src = x + r * n;
        float *dst = y + r * n;
        int64_t i = 0;
#ifdef USE_AVX512
        for (; i < n; i += 16) {
            __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : tail_mask(n - i);
            __m512 v = _mm512_maskz_loadu_ps(k, src + i);
            if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, bias + i));
            _mm512_mask_storeu_ps(dst + i, k, approximate ? gelu_tanh16(v) : gelu_erf16(v));
        }
#else
        if (approximate) {
            for (; i < n; i++) dst[i] = gelu_tanh1(bias ? src[i] + bias[i] : src[i]);
        } else {
            for (; i < n; i++) dst[i] = gelu_erf1(bias ? src[i] + bias[i] : src[i]);
        }
#endif
    }
}

/* float16 <-> float32 over n contiguous elements (IEEE binary16, round to nearest even, NaN kept NaN). Numpy's own
 * conversions take a few ns an element; float16 models convert every convolution's and product's operands. */
static inline float half_to_float1(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: normalize */
        int shift = 0;
        while (!(mantissa & 0x400)) { mantissa <<= 1; shift++; }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_half1(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000);
    uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude >= 0x7F800000u) /* inf, or NaN (kept quiet and non-zero) */
        return sign | 0x7C00 | (magnitude > 0x7F800000u ? 0x200 | ((magnitude >> 13) & 0x3FF) : 0);
    if (magnitude >= 0x477FF000u) return sign | 0x7C00; /* rounds past 65504 */
    if (magnitude < 0x38800000u) { /* below 2^-14: a subnormal half, or zero */
        if (magnitude < 0x33000000u) return sign; /* below half the smallest subnormal */
        uint32_t exponent = magnitude >> 23, mantissa = (magnitude & 0x7FFFFF) | 0x800000;
        uint32_t shift = 126 - exponent; /* 14..24 */
        uint32_t half = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), midpoint = 1u << (shift - 1);
        if (rest > midpoint || (rest == midpoint && (half & 1))) half++;
        return sign | (uint16_t)half;
    }
    uint32_t rounded = magnitude + 0xFFF + ((magnitude >> 13) & 1); /* to nearest even at bit 13 */
    return sign | (uint16_t)((rounded - 0x38000000u) >> 13);
}

void carrack_half_to_float(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
#ifdef USE_AVX512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))));
#endif
    for (; i < n; i++) y[i] = half_to_float1(x[i]);
}

void carrack_float_to_half(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
#ifdef USE_AVX512
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; i++) y[i] = float_to_half1(x[i]);
}

/* -- the row kernels over the thread pool: the same arguments, rows [row0, row0 + count) split over `threads` --- */
CARRACK_POOL_CLIENT(rowops)

typedef struct {
    const float *x, *skip, *bias, *gamma, *beta;
    float *y, *mean_out, *inv_std_out, *sum_out;
    int64_t n, d1, d2, bs0, bs1, bs2;
    float scale;
    int flag;
} rows_call_t;

static void softmax_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const rows_call_t *c = p;
    (void)slot;
    carrack_softmax(c->x, c->y, begin, end - begin, c->n, c->scale, c->bias, c->d1, c->d2, c->bs0, c->bs1, c->bs2,
                    c->flag);
}

void carrack_softmax_threads(const float *x, float *y, int64_t row0, int64_t count, int64_t n, float scale,
                             const float *bias, int64_t d1, int64_t d2, int64_t bs0, int64_t bs1, int64_t bs2,
                             int zero_masked, int64_t threads) {
    rows_call_t c = {x, NULL, bias, NULL, NULL, y, NULL, NULL, NULL, n, d1, d2, bs0, bs1, bs2, scale, zero_masked};
    parallel_for(softmax_piece, &c, row0, row0 + count, pieces_for(count, threads), threads);
}

static void layer_norm_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const rows_call_t *c = p;
    (void)slot;
    carrack_layer_norm(c->x, c->skip, c->bias, c->gamma, c->beta, c->y, c->mean_out, c->inv_std_out, c->sum_out,
                       begin, end - begin, c->n, c->scale);
}

void carrack_layer_norm_threads(const float *x, const float *skip, const float *bias, const float *gamma,
                                const float *beta, float *y, float *mean_out, float *inv_std_out, float *sum_out,
                                int64_t row0, int64_t count, int64_t n, float eps, int64_t threads) {
    rows_call_t c = {x, skip, bias, gamma, beta, y, mean_out, inv_std_out, sum_out, n, 0, 0, 0, 0, 0, eps, 0};
    parallel_for(layer_norm_piece, &c, row0, row0 + count, pieces_for(count, threads), threads);
}

static void gelu_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const rows_call_t *c = p;
    (void)slot;
    carrack_gelu(c->x, c->bias, c->y, begin, end - begin, c->n, c->flag);
}

void carrack_gelu_threads(const float *x, const float *bias, float *y, int64_t row0, int64_t count, int64_t n,
                          int approximate, int64_t threads) {
    rows_call_t c = {x, NULL, bias, NULL, NULL, y, NULL, NULL, NULL, n, 0, 0, 0, 0, 0, 0.0f, approximate};
    parallel_for(gelu_piece, &c, row0, row0 + count, pieces_for(count, threads), threads);
}

/* -- elementwise arithmetic: y = a op b over the flat elements [begin, end) of y, a as long as y, b repeating with
 * `period` elements (y's size for the same shape, a row of the last dims for a bias, 1 for a scalar); `swap` puts
 * b on the left. One IEEE operation per element, as numpy's: the same bits whatever the split. ------------------- */
enum { BINARY_ADD, BINARY_SUB, BINARY_MUL, BINARY_DIV };

#define BINARY_LOOP(expr)                                                                                          \
    for (int64_t j = 0; j < len; j++) {                                                                            \
        const float u = a[i + j], v = b[c + j];                                                                    \
        y[i + j] = (expr);                                                                                         \
    }

void carrack_binary(int op, int swap, const float *a, const float *b, float *y, int64_t period, int64_t begin,
                    int64_t end) {
    for (int64_t i = begin; i < end;) {
        const int64_t c = i % period, len = end - i < period - c ? end - i : period - c;
        switch (op * 2 + (swap != 0)) {
        case BINARY_ADD * 2: case BINARY_ADD * 2 + 1: BINARY_LOOP(u + v) break;
        case BINARY_SUB * 2: BINARY_LOOP(u - v) break;
        case BINARY_SUB * 2 + 1: BINARY_LOOP(v - u) break;
        case BINARY_MUL * 2: case BINARY_MUL * 2 + 1: BINARY_LOOP(u * v) break;
        case BINARY_DIV * 2: BINARY_LOOP(u / v) break;
        case BINARY_DIV * 2 + 1: BINARY_LOOP(v / u) break;
        default: return;
        }
        i += len;
    }
}

#define BINARY_BLOCK 4096 /* elements per item: a piece is whole blocks, so pieces start on cache lines */

typedef struct {
    const float *a, *b;
    float *y;
    int64_t period, size;
    int op, swap;
} binary_call_t;

static void binary_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const binary_call_t *c = p;
    (void)slot;
    const int64_t last = end * BINARY_BLOCK < c->size ? end * BINARY_BLOCK : c->size;
    carrack_binary(c->op, c->swap, c->a, c->b, c->y, c->period, begin * BINARY_BLOCK, last);
}

void carrack_binary_threads(int op, int swap, const float *a, const float *b, float *y, int64_t period, int64_t size,
                            int64_t threads) {
    binary_call_t c = {a, b, y, period, size, op, swap};
    const int64_t blocks = (size + BINARY_BLOCK - 1) / BINARY_BLOCK;
    parallel_for(binary_piece, &c, 0, blocks, pieces_for(blocks, threads), threads);
}
