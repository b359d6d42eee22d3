/* Depthwise 2-D convolution and 2-D pools, float32 NCHW; the convolution applies its bias and activation before
 * the one store of each output.
 *
 * 3x3 kernels of stride 1 or 2 (MobileNet, ShuffleNet) and pools of column stride 1 or 2 read straight from the
 * image with AVX-512: masked loads read the padding as zeros (or -inf), the taps of a kernel row come from lane
 * shifts (stride 1) or even/odd lane permutes (stride 2) of the same few loads.
 *
 * Everything else (any kernel, stride and dilation, and builds without AVX-512) copies each input plane, a band
 * of rows at a time, into its stride phases with the padding written out (phase (a, b) holds padded pixel
 * (r * sh + a, t * sw + b) at row r, column t). Every kernel tap then reads one contiguous run of one phase per
 * output row: a unit-stride multiply-add over output columns with no bounds checks. Narrow outputs (7x7 maps) are
 * computed on the phase plane's full width, several rows per run, and cropped while copied out.
 *
 * Also here: scale_shift_act_f32 (BatchNormalization + activation in one pass) and bias_act_f32, the bias +
 * activation pass over a [planes, pixels] result (for outputs computed
 * elsewhere, e.g. by numpy).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threadpool.h"
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "activations.h"

/* geometry, in the order of dwconv2d_f32's arguments */
enum { G_C, G_MULT, G_H, G_W, G_KH, G_KW, G_OH, G_OW, G_SH, G_SW, G_DH, G_DW, G_PT, G_PL, G_COUNT };

#define BAND_FLOATS 65536 /* phase planes of one band: 256 KiB, inside the L2 cache */
#define FLAT_FLOATS 1024  /* outputs per run of the narrow-output path */
#define SLACK 160         /* readable floats past a phase plane's last row: the last vectors' overrun */
#define PREFETCH_ROWS_AHEAD 4 /* output rows */
#define FLAT_MAX_TAPS 64        /* the flat depthwise path: its masks and offsets, for all the planes */
#define FLAT_MAX_PIXELS 256 /* larger planes: the row kernels reuse each load for three taps */

static void act_row(float *restrict y, int64_t n, act_t f) {
    if (f.act == ACT_NONE) return;
    for (int64_t i = 0; i < n; i++) y[i] = act_scalar(y[i], f);
}

#if defined(__AVX512F__)
/* e^x for float32 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, then scale by 2^n */
static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x)); /* NaN stays NaN */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* the activation of 16 lanes; NaN stays NaN as in numpy (max/min return their second operand on NaN) */
static __m512 act512_any(__m512 v, act_t f) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    switch (f.act) {
    case ACT_RELU: return _mm512_max_ps(zero, v);
    case ACT_CLIP: return _mm512_min_ps(_mm512_set1_ps(f.b), _mm512_max_ps(_mm512_set1_ps(f.a), v));
    case ACT_LEAKY:
        return _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), v, _mm512_set1_ps(f.a));
    case ACT_HARDSIGMOID: {
        __m512 s = _mm512_fmadd_ps(v, _mm512_set1_ps(f.a), _mm512_set1_ps(f.b));
        return _mm512_min_ps(one, _mm512_max_ps(zero, s));
    }
    case ACT_HARDSWISH: {
        __m512 s = _mm512_fmadd_ps(v, _mm512_set1_ps(1.0f / 6.0f), _mm512_set1_ps(0.5f));
        return _mm512_mul_ps(v, _mm512_min_ps(one, _mm512_max_ps(zero, s)));
    }
    case ACT_SIGMOID:
        return _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, v))));
    default: return v;
    }
}

/* The same, inline for none / Relu / Clip (a clamp to [lo, hi]: -inf/inf, 0/inf, a/b), a call for the rest:
 * the stores of a small tile would otherwise spend as long in calls as in its multiply-adds. */
static inline __attribute__((always_inline)) __m512 act512(__m512 v, act_t f) {
    if (f.act > ACT_CLIP) return act512_any(v, f);
    const float lo = f.act == ACT_NONE ? -INFINITY : f.act == ACT_RELU ? 0.0f : f.a;
    const float hi = f.act == ACT_CLIP ? f.b : INFINITY;
    return _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), v));
}

static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* dst[r * dst_stride + i] = act(bias + sum_t w[t] * src[t][r * src_stride + i]) for r < rows, i < n; `taps` is
 * a constant where inlined for 3x3 kernels, so the weights and the tap pointers stay in registers */
static inline __attribute__((always_inline)) void taps_run(float *dst, int64_t dst_stride, const float *const *src,
                                                           int64_t src_stride, const float *w, int64_t taps,
                                                           int64_t rows, int64_t n, float bias, act_t f) {
    const float *s[64];
    float wt[64];
    for (int64_t t = 0; t < taps; t++) {
        s[t] = src[t];
        wt[t] = w[t];
    }
    const __m512 b = _mm512_set1_ps(bias);
    for (int64_t r = 0; r < rows; r++, dst += dst_stride) {
        const int64_t row = r * src_stride;
        for (int64_t i = 0; i < n; i += 64) {
            const __mmask16 m0 = tail_mask(n - i), m1 = tail_mask(n - i - 16), m2 = tail_mask(n - i - 32),
                            m3 = tail_mask(n - i - 48);
            __m512 a0 = b, a1 = b, a2 = b, a3 = b;
            for (int64_t t = 0; t < taps; t++) {
                const __m512 wv = _mm512_set1_ps(wt[t]);
                const float *p = s[t] + row + i;
                a0 = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m0, p), a0);
                a1 = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m1, p + 16), a1);
                a2 = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m2, p + 32), a2);
                a3 = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m3, p + 48), a3);
            }
            _mm512_mask_storeu_ps(dst + i, m0, act512(a0, f));
            _mm512_mask_storeu_ps(dst + i + 16, m1, act512(a1, f));
            _mm512_mask_storeu_ps(dst + i + 32, m2, act512(a2, f));
            _mm512_mask_storeu_ps(dst + i + 48, m3, act512(a3, f));
        }
    }
}

static void taps_run_any(float *dst, int64_t dst_stride, const float *const *src, int64_t src_stride,
                         const float *w, int64_t taps, int64_t rows, int64_t n, float bias, act_t f) {
    if (taps == 9) {
        taps_run(dst, dst_stride, src, src_stride, w, 9, rows, n, bias, f);
    } else if (taps <= 64) {
        taps_run(dst, dst_stride, src, src_stride, w, taps, rows, n, bias, f);
    } else { /* huge kernels: 64 taps at a time, then the rest through dst */
        taps_run(dst, dst_stride, src, src_stride, w, 64, rows, n, bias, (act_t){0.0f, 0.0f, ACT_NONE});
        for (int64_t r = 0; r < rows; r++) {
            float *d = dst + r * dst_stride;
            for (int64_t t = 64; t < taps; t++)
                for (int64_t i = 0; i < n; i++) d[i] += w[t] * src[t][r * src_stride + i];
            act_row(d, n, f);
        }
    }
}

static void act_run(float *y, int64_t n, const float bias, act_t f) {
    const __m512 b = _mm512_set1_ps(bias);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(y + i, m, act512(_mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i), b), f));
    }
}
#else
static void taps_run_any(float *dst, int64_t dst_stride, const float *const *src, int64_t src_stride,
                         const float *w, int64_t taps, int64_t rows, int64_t n, float bias, act_t f) {
    for (int64_t r = 0; r < rows; r++) {
        float *restrict d = dst + r * dst_stride;
        for (int64_t i = 0; i < n; i++) d[i] = bias;
        for (int64_t t = 0; t < taps; t++) {
            const float *restrict s = src[t] + r * src_stride;
            const float wt = w[t];
            for (int64_t i = 0; i < n; i++) d[i] += wt * s[i];
        }
        act_row(d, n, f);
    }
}

static void act_run(float *restrict y, int64_t n, const float bias, act_t f) {
    for (int64_t i = 0; i < n; i++) y[i] += bias;
    act_row(y, n, f);
}
#endif

/* rows [r0, r0 + rows) of phase (a, b) of the padded image (padding = `pad`), each plane_w wide */
static int fill_phase(float *dst, const float *img, const int64_t *g, int64_t r0, int64_t rows, int64_t plane_w,
                      int64_t a, int64_t b, float pad) {
    int nan = 0;
    const int64_t h = g[G_H], w = g[G_W], sh = g[G_SH], sw = g[G_SW];
    const int64_t first = b - g[G_PL]; /* input column of phase column 0 */
    const int64_t lo = first >= 0 ? 0 : (-first + sw - 1) / sw;
    int64_t hi = w - 1 - first < 0 ? 0 : (w - 1 - first) / sw + 1;
    if (hi > plane_w) hi = plane_w;
    for (int64_t r = 0; r < rows; r++) {
        float *d = dst + r * plane_w;
        const int64_t ih = (r0 + r) * sh + a - g[G_PT];
        if (ih < 0 || ih >= h || hi <= lo) {
            for (int64_t t = 0; t < plane_w; t++) d[t] = pad;
            continue;
        }
        const float *s = img + ih * w + first;
        for (int64_t t = 0; t < lo; t++) d[t] = pad;
        if (sw == 1) {
            memcpy(d + lo, s + lo, (size_t)(hi - lo) * sizeof(float));
        } else {
            for (int64_t t = lo; t < hi; t++) d[t] = s[t * sw];
        }
        for (int64_t t = lo; t < hi; t++) nan |= d[t] != d[t];
        for (int64_t t = hi; t < plane_w; t++) d[t] = pad;
    }
    return nan;
}

#if defined(__AVX512F__)
/* the lanes l of a 16-lane vector with lo <= l < hi */
static inline __mmask16 range_mask(int64_t lo, int64_t hi) {
    lo = lo < 0 ? 0 : lo;
    hi = hi > 16 ? 16 : hi;
    return hi <= lo ? (__mmask16)0 : (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* Row r of both column phases (column stride 1 or 2) in one pass, masked loads writing the padding: padded
 * column c = column c - pl of the input row (row NULL: a padding row). Returns whether the row holds a NaN. */
static int fill_row512(float *d0, float *d1, const float *row, int64_t w, int64_t pl, int64_t plane_w, int64_t sw,
                       float pad) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512 padding = _mm512_set1_ps(pad);
    __mmask16 nan = 0;
    for (int64_t t = 0; t < plane_w; t += 16) {
        const __mmask16 out = tail_mask(plane_w - t);
        if (!row) {
            _mm512_mask_storeu_ps(d0 + t, out, padding);
            if (d1) _mm512_mask_storeu_ps(d1 + t, out, padding);
            continue;
        }
        const int64_t c = sw * t - pl; /* input column of lane 0 */
        __m512 lo, hi;
        if (c >= 0 && c + 16 * sw <= w) { /* inside the row: no masks to work out */
            lo = _mm512_loadu_ps(row + c);
            hi = sw == 2 ? _mm512_loadu_ps(row + c + 16) : lo;
        } else {
            lo = _mm512_mask_loadu_ps(padding, range_mask(-c, w - c), row + c);
            hi = sw == 2 ? _mm512_mask_loadu_ps(padding, range_mask(-c - 16, w - c - 16), row + c + 16) : lo;
        }
        nan |= _mm512_cmp_ps_mask(lo, hi, _CMP_UNORD_Q);
        if (sw == 1) {
            _mm512_mask_storeu_ps(d0 + t, out, lo);
            continue;
        }
        _mm512_mask_storeu_ps(d0 + t, out, _mm512_permutex2var_ps(lo, even, hi));
        if (d1) _mm512_mask_storeu_ps(d1 + t, out, _mm512_permutex2var_ps(lo, odd, hi));
    }
    return nan != 0;
}
#endif

/* Where a plane's stride phases go in the scratch memory, and where each kernel tap reads them. */
typedef struct {
    int64_t g[G_COUNT];
    int64_t taps, ext_h, ext_w, plane_w, band, stride, flat, flat_floats;
    int64_t slot[64];   /* phase (a * sw + b) -> its place in the scratch, or -1 when no tap reads it */
    int64_t *offset;    /* per tap: offset of its first read from the scratch start */
    const float **src;  /* per tap: where it reads for the current rows */
    float *scratch;     /* the phase planes of one band of rows, then `tmp` */
    float *tmp;         /* the narrow-output path's rows */
} layout_t;

static void layout_free(layout_t *L) {
    free(L->scratch);
    free(L->src);
    free(L->offset);
}

/* the layout of geometry g; -1 when out of memory or the strides have over 64 phases (the caller keeps numpy) */
static int layout_init(layout_t *L, const int64_t *g) {
    const int64_t kh = g[G_KH], kw = g[G_KW], oh = g[G_OH], ow = g[G_OW], sh = g[G_SH], sw = g[G_SW];
    const int64_t dh = g[G_DH], dw = g[G_DW];
    int64_t phases = 0;
    memcpy(L->g, g, sizeof(L->g));
    L->taps = kh * kw;
    L->ext_h = (kh - 1) * dh / sh;
    L->ext_w = (kw - 1) * dw / sw;
    L->plane_w = ow + L->ext_w;
    L->scratch = NULL;
    L->src = NULL;
    L->offset = NULL;
    if (sh * sw > 64) return -1;
    for (int64_t p = 0; p < sh * sw; p++) L->slot[p] = -1;
    for (int64_t i = 0; i < kh; i++)
        for (int64_t j = 0; j < kw; j++) L->slot[(i * dh % sh) * sw + j * dw % sw] = 0;
    for (int64_t p = 0; p < sh * sw; p++)
        if (L->slot[p] == 0) L->slot[p] = ++phases;
    for (int64_t p = 0; p < sh * sw; p++) L->slot[p] -= 1;
    L->band = BAND_FLOATS / (phases * L->plane_w) - L->ext_h;
    L->band = L->band < 1 ? 1 : L->band > oh ? oh : L->band;
    L->stride = (L->band + L->ext_h) * L->plane_w + L->ext_w + SLACK;
    L->flat = (ow + 16 - 1) / 16 * 16 - ow > L->ext_w + ow / 8; /* narrow rows: run over the full width */
    L->flat_floats = L->plane_w > FLAT_FLOATS ? L->plane_w : FLAT_FLOATS;
    L->scratch = malloc(((size_t)(phases * L->stride) + (size_t)L->flat_floats + SLACK) * sizeof(float));
    L->src = malloc((size_t)L->taps * sizeof(float *));
    L->offset = malloc((size_t)L->taps * sizeof(int64_t));
    if (!L->scratch || !L->src || !L->offset) {
        layout_free(L);
        return -1;
    }
    L->tmp = L->scratch + phases * L->stride;
    for (int64_t p = 0; p < phases; p++) /* read (into lanes that are dropped) past the last row */
        memset(L->scratch + p * L->stride + L->stride - SLACK - L->ext_w, 0, (size_t)(SLACK + L->ext_w) * 4);
    for (int64_t i = 0; i < kh; i++)
        for (int64_t j = 0; j < kw; j++)
            L->offset[i * kw + j] = L->slot[(i * dh % sh) * sw + j * dw % sw] * L->stride
                                    + i * dh / sh * L->plane_w + j * dw / sw;
    return 0;
}

/* rows [r0, r0 + rows) of every phase the taps read, from the image img; whether they hold a NaN */
static int fill_band(layout_t *L, const float *img, int64_t r0, int64_t rows, float pad) {
    const int64_t *g = L->g;
    const int64_t sh = g[G_SH], sw = g[G_SW], plane_w = L->plane_w;
    int nan = 0;
#if defined(__AVX512F__)
    if (sw <= 2) {
        for (int64_t a = 0; a < sh; a++) {
            const int64_t s0 = L->slot[a * sw], s1 = sw == 2 ? L->slot[a * sw + 1] : -1;
            float *d0 = s0 >= 0 ? L->scratch + s0 * L->stride : NULL;
            float *d1 = s1 >= 0 ? L->scratch + s1 * L->stride : NULL;
            if (!d0 && !d1) continue;
            if (!d0) { /* only the odd columns: the shared pass writes both */
                nan |= fill_phase(d1, img, g, r0, rows, plane_w, a, 1, pad);
                continue;
            }
            for (int64_t r = 0; r < rows; r++) {
                const int64_t ih = (r0 + r) * sh + a - g[G_PT];
                const float *row = ih >= 0 && ih < g[G_H] ? img + ih * g[G_W] : NULL;
                nan |= fill_row512(d0 + r * plane_w, d1 ? d1 + r * plane_w : NULL, row, g[G_W], g[G_PL], plane_w,
                                   sw, pad);
            }
        }
        return nan;
    }
#endif
    for (int64_t p = 0; p < sh * sw; p++)
        if (L->slot[p] >= 0)
            nan |= fill_phase(L->scratch + L->slot[p] * L->stride, img, g, r0, rows, plane_w, p / sw, p % sw, pad);
    return nan;
}

#if defined(__AVX512F__)
/* lanes k.. of lo followed by the first k of hi */
#define ALIGNR(hi, lo, k) _mm512_castsi512_ps(_mm512_alignr_epi32(_mm512_castps_si512(hi), _mm512_castps_si512(lo), k))

/* Ask for the input rows [first, first + rows) of the plane ahead of their use: a plane that comes from the L3
 * cache or memory (the large output of the layer before) otherwise arrives at the latency of each miss, as the
 * few rows read per output row are too short a stream for the hardware prefetcher. */
static inline void prefetch_rows(const float *img, int64_t h, int64_t w, int64_t first, int64_t rows) {
    for (int64_t r = first < 0 ? 0 : first; r < first + rows && r < h; r++)
        for (int64_t c = 0; c < w; c += 16) _mm_prefetch((const char *)(img + r * w + c), _MM_HINT_T0);
}

/* One input row's three taps for two output vectors (columns c .. c + 31 from column c - 1 on): the left tap is
 * the row itself, the middle and right ones lane shifts across the next vector. */
typedef struct {
    __m512 left0, mid0, right0, left1, mid1, right1;
} dw3_taps_t;

static inline __attribute__((always_inline)) dw3_taps_t dw3_taps(const float *row, int64_t c, __mmask16 ma,
                                                                  __mmask16 mb, __mmask16 mc, int two) {
    dw3_taps_t t;
    const __m512 x0 = _mm512_maskz_loadu_ps(ma, row + c), x1 = _mm512_maskz_loadu_ps(mb, row + c + 16);
    t.left0 = x0;
    t.mid0 = ALIGNR(x1, x0, 1);
    t.right0 = ALIGNR(x1, x0, 2);
    if (two) {
        const __m512 x2 = _mm512_maskz_loadu_ps(mc, row + c + 32);
        t.left1 = x1;
        t.mid1 = ALIGNR(x2, x1, 1);
        t.right1 = ALIGNR(x2, x1, 2);
    } else {
        t.left1 = t.mid1 = t.right1 = x0;
    }
    return t;
}

/* a += the row's taps times one kernel row's weights (left, middle, right: in that order, as every path sums) */
#define DW3_FMA(a0, a1, t, wl, wm, wr, two)                                                                        \
    do {                                                                                                           \
        a0 = _mm512_fmadd_ps(wr, (t).right0, _mm512_fmadd_ps(wm, (t).mid0, _mm512_fmadd_ps(wl, (t).left0, a0))); \
        if (two)                                                                                                   \
            a1 = _mm512_fmadd_ps(wr, (t).right1,                                                                   \
                                 _mm512_fmadd_ps(wm, (t).mid1, _mm512_fmadd_ps(wl, (t).left1, a1)));              \
    } while (0)

/* One plane of a 3x3, stride 1, dilation 1 depthwise convolution straight from the image: no phase planes. Each
 * kernel row reads three vectors of its input row (masked loads read the padding as zeros; a row outside the
 * image reads `zero`), and the shifted taps come from lane shifts across them. Two output rows at a time: their
 * four input rows are loaded and shifted once (the middle two serve both), the column masks worked out once. */
static void dw3x3s1_plane(float *out, const float *img, const float *wt, float bias, int64_t h, int64_t w,
                          int64_t oh, int64_t ow, int64_t pt, int64_t pl, const float *zero, act_t f) {
    const __m512 w0 = _mm512_set1_ps(wt[0]), w1 = _mm512_set1_ps(wt[1]), w2 = _mm512_set1_ps(wt[2]);
    const __m512 w3 = _mm512_set1_ps(wt[3]), w4 = _mm512_set1_ps(wt[4]), w5 = _mm512_set1_ps(wt[5]);
    const __m512 w6 = _mm512_set1_ps(wt[6]), w7 = _mm512_set1_ps(wt[7]), w8 = _mm512_set1_ps(wt[8]);
    const __m512 b = _mm512_set1_ps(bias);
    for (int64_t o = 0; o < oh; o += 2, out += 2 * ow) {
        prefetch_rows(img, h, w, o - pt + PREFETCH_ROWS_AHEAD, 2);
        const int64_t i0 = o - pt;
        const int second = o + 1 < oh; /* the plane's last row may be alone */
        const float *r0 = i0 >= 0 && i0 < h ? img + i0 * w : zero;
        const float *r1 = i0 + 1 >= 0 && i0 + 1 < h ? img + (i0 + 1) * w : zero;
        const float *r2 = i0 + 2 >= 0 && i0 + 2 < h ? img + (i0 + 2) * w : zero;
        const float *r3 = second && i0 + 3 >= 0 && i0 + 3 < h ? img + (i0 + 3) * w : zero;
        for (int64_t c0 = 0; c0 < ow; c0 += 32) {
            const int64_t c = c0 - pl; /* input column of lane 0 */
            const __mmask16 ma = range_mask(-c, w - c), mb = range_mask(-c - 16, w - c - 16),
                            mc = range_mask(-c - 32, w - c - 32);
            const int two = ow - c0 > 16; /* else the last 16 columns or fewer: one vector */
            __m512 a0 = b, a1 = b, d0 = b, d1 = b; /* output rows o (a) and o + 1 (d) */
            dw3_taps_t t = dw3_taps(r0, c, ma, mb, mc, two);
            DW3_FMA(a0, a1, t, w0, w1, w2, two);
            t = dw3_taps(r1, c, ma, mb, mc, two);
            DW3_FMA(a0, a1, t, w3, w4, w5, two);
            DW3_FMA(d0, d1, t, w0, w1, w2, two);
            t = dw3_taps(r2, c, ma, mb, mc, two);
            DW3_FMA(a0, a1, t, w6, w7, w8, two);
            DW3_FMA(d0, d1, t, w3, w4, w5, two);
            const __mmask16 s0 = tail_mask(ow - c0), s1 = tail_mask(ow - c0 - 16);
            _mm512_mask_storeu_ps(out + c0, s0, act512(a0, f));
            if (two) _mm512_mask_storeu_ps(out + c0 + 16, s1, act512(a1, f));
            if (second) {
                t = dw3_taps(r3, c, ma, mb, mc, two);
                DW3_FMA(d0, d1, t, w6, w7, w8, two);
                _mm512_mask_storeu_ps(out + ow + c0, s0, act512(d0, f));
                if (two) _mm512_mask_storeu_ps(out + ow + c0 + 16, s1, act512(d1, f));
            }
        }
    }
}
#undef DW3_FMA

/* One input row's three taps for 16 outputs of stride 2 (input columns c .. c + 32): the even columns (left tap),
 * the odd ones (middle tap) and the even ones one further on (right tap), by lane permutes. */
static inline __attribute__((always_inline)) void dw3s2_taps(const float *row, int64_t c, __mmask16 ma, __mmask16 mb,
                                                             __mmask16 mc, __m512i even, __m512i odd, __m512 *left,
                                                             __m512 *mid, __m512 *right) {
    const __m512 x0 = _mm512_maskz_loadu_ps(ma, row + c), x1 = _mm512_maskz_loadu_ps(mb, row + c + 16);
    const __m512 x2 = _mm512_maskz_loadu_ps(mc, row + c + 32);
    *left = _mm512_permutex2var_ps(x0, even, x1);
    *mid = _mm512_permutex2var_ps(x0, odd, x1);
    *right = ALIGNR(x2, *left, 1);
}

/* The same for stride 2: a kernel row reads 33 input columns per 16 outputs. Two output rows at a time: the input
 * row between them (the last kernel row of the first, the first of the second) is loaded and permuted once. */
static void dw3x3s2_plane(float *out, const float *img, const float *wt, float bias, int64_t h, int64_t w,
                          int64_t oh, int64_t ow, int64_t pt, int64_t pl, const float *zero, act_t f) {
    const __m512 w0 = _mm512_set1_ps(wt[0]), w1 = _mm512_set1_ps(wt[1]), w2 = _mm512_set1_ps(wt[2]);
    const __m512 w3 = _mm512_set1_ps(wt[3]), w4 = _mm512_set1_ps(wt[4]), w5 = _mm512_set1_ps(wt[5]);
    const __m512 w6 = _mm512_set1_ps(wt[6]), w7 = _mm512_set1_ps(wt[7]), w8 = _mm512_set1_ps(wt[8]);
    const __m512 b = _mm512_set1_ps(bias), zeros = _mm512_setzero_ps();
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
#define DW3S2_ROW(a, wl, wm, wr) a = _mm512_fmadd_ps(wr, right, _mm512_fmadd_ps(wm, mid, _mm512_fmadd_ps(wl, left, a)))
    for (int64_t o = 0; o < oh; o += 2, out += 2 * ow) {
        prefetch_rows(img, h, w, 2 * o - pt + 2 * PREFETCH_ROWS_AHEAD, 4);
        const int64_t i0 = 2 * o - pt;
        const int second = o + 1 < oh; /* the plane's last row may be alone */
        const float *rows[5];
        for (int64_t k = 0; k < 5; k++)
            rows[k] = (k < 3 || second) && i0 + k >= 0 && i0 + k < h ? img + (i0 + k) * w : zero;
        for (int64_t c0 = 0; c0 < ow; c0 += 16) {
            const int64_t c = 2 * c0 - pl; /* input column of lane 0 */
            const __mmask16 ma = range_mask(-c, w - c), mb = range_mask(-c - 16, w - c - 16),
                            mc = range_mask(-c - 32, w - c - 32) & 1, s = tail_mask(ow - c0);
            __m512 left, mid, right;
            /* one partial sum per kernel row, added up as (row 0 + row 1) + row 2 */
            __m512 p = b, q = zeros, u = zeros, p2 = b, q2 = zeros, u2 = zeros;
            dw3s2_taps(rows[0], c, ma, mb, mc, even, odd, &left, &mid, &right);
            DW3S2_ROW(p, w0, w1, w2);
            dw3s2_taps(rows[1], c, ma, mb, mc, even, odd, &left, &mid, &right);
            DW3S2_ROW(q, w3, w4, w5);
            dw3s2_taps(rows[2], c, ma, mb, mc, even, odd, &left, &mid, &right);
            DW3S2_ROW(u, w6, w7, w8);
            _mm512_mask_storeu_ps(out + c0, s, act512(_mm512_add_ps(_mm512_add_ps(p, q), u), f));
            if (second) {
                DW3S2_ROW(p2, w0, w1, w2);
                dw3s2_taps(rows[3], c, ma, mb, mc, even, odd, &left, &mid, &right);
                DW3S2_ROW(q2, w3, w4, w5);
                dw3s2_taps(rows[4], c, ma, mb, mc, even, odd, &left, &mid, &right);
                DW3S2_ROW(u2, w6, w7, w8);
                _mm512_mask_storeu_ps(out + ow + c0, s, act512(_mm512_add_ps(_mm512_add_ps(p2, q2), u2), f));
            }
        }
    }
#undef DW3S2_ROW
}

/* Stride 2 with output rows of at most 7 (a 14x14 map to 7x7): two output rows share a vector, lanes 0-7 the
 * first and 8-15 the second, so fewer lanes idle. Each input row is one masked load of 16 columns from column -pl
 * (output j reads 2j .. 2j + 2 of them); permutes pick the taps of both rows at once. Sums in the row kernel's
 * order, so the bits are the same. */
static void dw3x3s2_narrow_plane(float *out, const float *img, const float *wt, float bias, int64_t h, int64_t w,
                                 int64_t oh, int64_t ow, int64_t pt, int64_t pl, act_t f) {
    const __m512 w0 = _mm512_set1_ps(wt[0]), w1 = _mm512_set1_ps(wt[1]), w2 = _mm512_set1_ps(wt[2]);
    const __m512 w3 = _mm512_set1_ps(wt[3]), w4 = _mm512_set1_ps(wt[4]), w5 = _mm512_set1_ps(wt[5]);
    const __m512 w6 = _mm512_set1_ps(wt[6]), w7 = _mm512_set1_ps(wt[7]), w8 = _mm512_set1_ps(wt[8]);
    const __m512 b = _mm512_set1_ps(bias), zeros = _mm512_setzero_ps();
    /* lane l < 8 reads column 2l (+1, +2) of the first row's load, lane l >= 8 column 2(l - 8) of the second's */
    const __m512i left_at = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i mid_at = _mm512_add_epi32(left_at, _mm512_set1_epi32(1));
    const __m512i right_at = _mm512_add_epi32(left_at, _mm512_set1_epi32(2));
    const __mmask16 columns = range_mask(pl, w + pl), first = tail_mask(ow), both = (__mmask16)(first | first << 8);
    __m512 x[5];
    for (int64_t o = 0; o < oh; o += 2, out += 2 * ow) {
        const int64_t i0 = 2 * o - pt;
        for (int64_t k = 0; k < 5; k++) /* input rows i0 .. i0 + 4: the first output row's three, the second's */
            x[k] = i0 + k >= 0 && i0 + k < h && (k < 3 || o + 1 < oh) ? _mm512_maskz_loadu_ps(columns, img + (i0 + k) * w - pl)
                                                                    : zeros;
        __m512 p = b, q = zeros, u = zeros;
#define DW3S2N_ROW(a, k, wl, wm, wr)                                                                               \
    a = _mm512_fmadd_ps(wr, _mm512_permutex2var_ps(x[k], right_at, x[(k) + 2]),                                    \
                        _mm512_fmadd_ps(wm, _mm512_permutex2var_ps(x[k], mid_at, x[(k) + 2]),                      \
                                        _mm512_fmadd_ps(wl, _mm512_permutex2var_ps(x[k], left_at, x[(k) + 2]), a)))
        DW3S2N_ROW(p, 0, w0, w1, w2);
        DW3S2N_ROW(q, 1, w3, w4, w5);
        DW3S2N_ROW(u, 2, w6, w7, w8);
#undef DW3S2N_ROW
        const __m512 y = act512(_mm512_add_ps(_mm512_add_ps(p, q), u), f);
        /* the second row's lanes 8 .. 8 + ow - 1 land at out + ow .. : a masked store from out + ow - 8 */
        _mm512_mask_storeu_ps(out, first, y);
        if (o + 1 < oh) _mm512_mask_storeu_ps(out + ow - 8, (__mmask16)(both & 0xFF00), y);
    }
}

/* Stride 1 with output rows as wide as the input's (a "same" padding), any kernel and dilation: the plane's
 * outputs go flat, 16 consecutive ones to a vector across output rows, and kernel tap t of vector v reads 16
 * consecutive inputs at one offset, masked per lane where that lane's own row or column lands in the padding.
 * No lane idles at the end of a short row (a 7x7 map fills 49 of 64 lanes instead of 7 of 16), and the masks and
 * offsets are worked out once for all the planes. */
typedef struct {
    int64_t vectors, taps;
    __mmask16 *mask; /* [vectors][taps]: the lanes of vector v that tap t reads inside the image */
    int64_t tap[FLAT_MAX_TAPS]; /* where tap t reads, from the vector's first output */
} flat_taps_t;

static int flat_taps_init(flat_taps_t *F, int64_t h, int64_t w, int64_t oh, int64_t kh, int64_t kw, int64_t dh,
                          int64_t dw, int64_t pt, int64_t pl) {
    const int64_t pixels = oh * w;
    F->vectors = (pixels + 15) / 16;
    F->taps = kh * kw;
    F->mask = malloc((size_t)(F->vectors * F->taps) * sizeof(__mmask16));
    if (!F->mask) return -1;
    for (int64_t i = 0; i < kh; i++)
        for (int64_t j = 0; j < kw; j++) F->tap[i * kw + j] = (i * dh - pt) * w + j * dw - pl;
    memset(F->mask, 0, (size_t)(F->vectors * F->taps) * sizeof(__mmask16));
    /* pixel by pixel, its row and column counted along (a division per lane and tap cost a third of a 14x14
     * layer's call) */
    for (int64_t p = 0, row = 0, col = 0; p < pixels; p++) {
        __mmask16 *m = F->mask + (p / 16) * F->taps;
        const __mmask16 lane = (__mmask16)(1u << (p % 16));
        for (int64_t i = 0; i < kh; i++) {
            const int64_t r = row + i * dh - pt;
            if (r < 0 || r >= h) continue;
            for (int64_t j = 0; j < kw; j++) {
                const int64_t c = col + j * dw - pl;
                if (c >= 0 && c < w) m[i * kw + j] |= lane;
            }
        }
        if (++col == w) col = 0, row++;
    }
    return 0;
}

/* `taps` is a constant where inlined (3x3), so the weights and tap offsets stay in registers */
static inline __attribute__((always_inline)) void dw_flat_plane_t(float *out, const float *img, const float *wt,
                                                                  float bias, int64_t pixels, const flat_taps_t *F,
                                                                  const int64_t taps, act_t f) {
    const __m512 b = _mm512_set1_ps(bias);
    for (int64_t v = 0; v < F->vectors; v++) {
        const __mmask16 *m = F->mask + v * taps;
        const float *at = img + 16 * v;
        __m512 a = b, c = _mm512_setzero_ps(); /* two chains: half the multiply-add latency per vector */
        int64_t t = 0;
        for (; t + 1 < taps; t += 2) {
            a = _mm512_fmadd_ps(_mm512_set1_ps(wt[t]), _mm512_maskz_loadu_ps(m[t], at + F->tap[t]), a);
            c = _mm512_fmadd_ps(_mm512_set1_ps(wt[t + 1]), _mm512_maskz_loadu_ps(m[t + 1], at + F->tap[t + 1]), c);
        }
        if (t < taps) a = _mm512_fmadd_ps(_mm512_set1_ps(wt[t]), _mm512_maskz_loadu_ps(m[t], at + F->tap[t]), a);
        _mm512_mask_storeu_ps(out + 16 * v, tail_mask(pixels - 16 * v), act512(_mm512_add_ps(a, c), f));
    }
}

/* Two planes at once (3x3, multiplier 1): the masks and tap offsets are loaded once for both; each plane sums as
 * dw_flat_plane_t does, so the bits are the same. */
static void dw_flat_plane_pair(float *out0, float *out1, const float *img0, const float *img1, const float *wt0,
                               const float *wt1, float bias0, float bias1, int64_t pixels, const flat_taps_t *F,
                               act_t f) {
    enum { TAPS = 9 };
    const __m512 b0 = _mm512_set1_ps(bias0), b1 = _mm512_set1_ps(bias1);
    for (int64_t v = 0; v < F->vectors; v++) {
        const __mmask16 *m = F->mask + v * TAPS;
        const float *at0 = img0 + 16 * v, *at1 = img1 + 16 * v;
        __m512 a0 = b0, c0 = _mm512_setzero_ps(), a1 = b1, c1 = _mm512_setzero_ps();
        for (int t = 0; t + 1 < TAPS; t += 2) {
            const __mmask16 m0 = m[t], m1 = m[t + 1];
            const int64_t o0 = F->tap[t], o1 = F->tap[t + 1];
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(wt0[t]), _mm512_maskz_loadu_ps(m0, at0 + o0), a0);
            c0 = _mm512_fmadd_ps(_mm512_set1_ps(wt0[t + 1]), _mm512_maskz_loadu_ps(m1, at0 + o1), c0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(wt1[t]), _mm512_maskz_loadu_ps(m0, at1 + o0), a1);
            c1 = _mm512_fmadd_ps(_mm512_set1_ps(wt1[t + 1]), _mm512_maskz_loadu_ps(m1, at1 + o1), c1);
        }
        const __mmask16 ml = m[TAPS - 1];
        const int64_t ol = F->tap[TAPS - 1];
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(wt0[TAPS - 1]), _mm512_maskz_loadu_ps(ml, at0 + ol), a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(wt1[TAPS - 1]), _mm512_maskz_loadu_ps(ml, at1 + ol), a1);
        const __mmask16 s = tail_mask(pixels - 16 * v);
        _mm512_mask_storeu_ps(out0 + 16 * v, s, act512(_mm512_add_ps(a0, c0), f));
        _mm512_mask_storeu_ps(out1 + 16 * v, s, act512(_mm512_add_ps(a1, c1), f));
    }
}

static void dw_flat_plane(float *out, const float *img, const float *wt, float bias, int64_t pixels,
                          const flat_taps_t *F, act_t f) {
    if (F->taps == 9)
        dw_flat_plane_t(out, img, wt, bias, pixels, F, 9, f);
    else
        dw_flat_plane_t(out, img, wt, bias, pixels, F, F->taps, f);
}
#endif

/* Output planes of the input planes [begin, end) of x[N * C, H, W] (contiguous) into y[N * C * mult, OH, OW];
 * w[C * mult, KH * KW], bias[C * mult] or NULL; the geometry in the order of the G_ names. Returns 0, or -1 when
 * out of memory. */
int64_t dwconv2d_f32(const float *x, const float *w, const float *bias, float *y, int64_t channels,
                     int64_t mult, int64_t h, int64_t w_, int64_t kh, int64_t kw, int64_t oh, int64_t ow,
                     int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t begin,
                     int64_t end, int64_t act, float alpha, float beta) {
    const int64_t g[G_COUNT] = {channels, mult, h, w_, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl};
    const act_t f = {alpha, beta, (int)act};
    layout_t L;
    if (end <= begin || oh <= 0 || ow <= 0) return 0;
#if defined(__AVX512F__)
    if (sh == 1 && sw == 1 && ow == w_ && kh * kw <= FLAT_MAX_TAPS && oh * ow <= FLAT_MAX_PIXELS) {
        flat_taps_t F;
        if (flat_taps_init(&F, h, w_, oh, kh, kw, dh, dw, pt, pl)) return -1;
        int64_t q = begin;
        if (mult == 1 && kh * kw == 9) /* plane q writes output plane q with weights q % channels */
            for (; q + 1 < end; q += 2) {
                const int64_t m0 = q % channels, m1 = (q + 1) % channels;
                dw_flat_plane_pair(y + q * oh * ow, y + (q + 1) * oh * ow, x + q * h * w_, x + (q + 1) * h * w_,
                                   w + m0 * 9, w + m1 * 9, bias ? bias[m0] : 0.0f, bias ? bias[m1] : 0.0f, oh * ow,
                                   &F, f);
            }
        for (; q < end; q++) {
            const int64_t first_out = (q / channels) * channels * mult + (q % channels) * mult;
            for (int64_t k = 0; k < mult; k++) {
                const int64_t m = (first_out + k) % (channels * mult);
                dw_flat_plane(y + (first_out + k) * oh * ow, x + q * h * w_, w + m * kh * kw, bias ? bias[m] : 0.0f,
                              oh * ow, &F, f);
            }
        }
        free(F.mask);
        return 0;
    }
    if (kh == 3 && kw == 3 && sh == sw && (sh == 1 || sh == 2) && dh == 1 && dw == 1) {
        float *zero = calloc((size_t)(w_ + 64), sizeof(float));
        if (!zero) return -1;
        for (int64_t q = begin; q < end; q++) {
            const int64_t first_out = (q / channels) * channels * mult + (q % channels) * mult;
            for (int64_t k = 0; k < mult; k++) {
                const int64_t m = (first_out + k) % (channels * mult);
                float *plane = y + (first_out + k) * oh * ow;
                if (sh == 2 && ow <= 7)
                    dw3x3s2_narrow_plane(plane, x + q * h * w_, w + m * 9, bias ? bias[m] : 0.0f, h, w_, oh, ow, pt,
                                         pl, f);
                else
                    (sh == 1 ? dw3x3s1_plane : dw3x3s2_plane)(plane, x + q * h * w_, w + m * 9, bias ? bias[m] : 0.0f,
                                                              h, w_, oh, ow, pt, pl, zero, f);
            }
        }
        free(zero);
        return 0;
    }
#endif
    if (layout_init(&L, g)) return -1;
    const int64_t taps = L.taps, plane_w = L.plane_w, rows_per_run = L.flat_floats / plane_w;
    for (int64_t q = begin; q < end; q++) {
        const int64_t first_out = (q / channels) * channels * mult + (q % channels) * mult;
        for (int64_t o0 = 0; o0 < oh; o0 += L.band) {
            const int64_t rows = oh - o0 < L.band ? oh - o0 : L.band;
            fill_band(&L, x + q * h * w_, o0, rows + L.ext_h, 0.0f);
            for (int64_t k = 0; k < mult; k++) {
                const int64_t m = first_out + k;
                const float *wm = w + (m % (channels * mult)) * taps;
                const float b = bias ? bias[m % (channels * mult)] : 0.0f;
                float *out = y + m * oh * ow + o0 * ow;
                if (!L.flat) {
                    for (int64_t t = 0; t < taps; t++) L.src[t] = L.scratch + L.offset[t];
                    taps_run_any(out, ow, L.src, plane_w, wm, taps, rows, ow, b, f);
                    continue;
                }
                for (int64_t r = 0; r < rows; r += rows_per_run) {
                    const int64_t n = rows - r < rows_per_run ? rows - r : rows_per_run;
                    for (int64_t t = 0; t < taps; t++) L.src[t] = L.scratch + L.offset[t] + r * plane_w;
                    taps_run_any(L.tmp, 0, L.src, 0, wm, taps, 1, n * plane_w, b, f);
                    for (int64_t i = 0; i < n; i++)
                        memcpy(out + (r + i) * ow, L.tmp + i * plane_w, (size_t)ow * sizeof(float));
                }
            }
        }
    }
    layout_free(&L);
    return 0;
}

/* how many taps of a window starting at `start` (stride apart by `dilation`) fall in [lo, hi) */
static int64_t taps_inside(int64_t start, int64_t taps, int64_t dilation, int64_t lo, int64_t hi) {
    int64_t count = 0;
    for (int64_t t = 0; t < taps; t++) count += start + t * dilation >= lo && start + t * dilation < hi;
    return count;
}

enum { POOL_MAX = 0, POOL_AVERAGE = 1, POOL_AVERAGE_PADS = 2, POOL_MAX_NAN = 3 /* max over a plane with NaN */ };

#if defined(__AVX512F__)
/* Up to 4 vectors of one output row of a pool: the maximum (with `nan`, NaN where a tap is NaN, as numpy's
 * maximum: max_ps alone drops it) or the mean; `taps`, `mode` and `nan` are constants where inlined. */
static inline __attribute__((always_inline)) void pool_block(float *dst, const float *const *src, int64_t at,
                                                             int64_t taps, int64_t n, const int mode, const int nan,
                                                             __m512 rows_in, const float *cols_in) {
    const __mmask16 m0 = tail_mask(n), m1 = tail_mask(n - 16), m2 = tail_mask(n - 32), m3 = tail_mask(n - 48);
    const __m512 init = _mm512_set1_ps(mode == POOL_MAX ? -INFINITY : 0.0f);
    __m512 a0 = init, a1 = init, a2 = init, a3 = init;
    __mmask16 n0 = 0, n1 = 0, n2 = 0, n3 = 0;
    for (int64_t t = 0; t < taps; t++) {
        const float *p = src[t] + at;
        const __m512 v0 = _mm512_maskz_loadu_ps(m0, p), v1 = _mm512_maskz_loadu_ps(m1, p + 16);
        const __m512 v2 = _mm512_maskz_loadu_ps(m2, p + 32), v3 = _mm512_maskz_loadu_ps(m3, p + 48);
        if (mode == POOL_MAX) {
            a0 = _mm512_max_ps(a0, v0), a1 = _mm512_max_ps(a1, v1);
            a2 = _mm512_max_ps(a2, v2), a3 = _mm512_max_ps(a3, v3);
            if (nan) {
                n0 |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q), n1 |= _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
                n2 |= _mm512_cmp_ps_mask(v2, v2, _CMP_UNORD_Q), n3 |= _mm512_cmp_ps_mask(v3, v3, _CMP_UNORD_Q);
            }
        } else {
            a0 = _mm512_add_ps(a0, v0), a1 = _mm512_add_ps(a1, v1);
            a2 = _mm512_add_ps(a2, v2), a3 = _mm512_add_ps(a3, v3);
        }
    }
    if (mode == POOL_MAX && nan) {
        const __m512 q = _mm512_set1_ps(NAN);
        a0 = _mm512_mask_mov_ps(a0, n0, q), a1 = _mm512_mask_mov_ps(a1, n1, q);
        a2 = _mm512_mask_mov_ps(a2, n2, q), a3 = _mm512_mask_mov_ps(a3, n3, q);
    } else if (mode != POOL_MAX) {
        a0 = _mm512_div_ps(a0, _mm512_mul_ps(rows_in, _mm512_maskz_loadu_ps(m0, cols_in)));
        a1 = _mm512_div_ps(a1, _mm512_mul_ps(rows_in, _mm512_maskz_loadu_ps(m1, cols_in + 16)));
        a2 = _mm512_div_ps(a2, _mm512_mul_ps(rows_in, _mm512_maskz_loadu_ps(m2, cols_in + 32)));
        a3 = _mm512_div_ps(a3, _mm512_mul_ps(rows_in, _mm512_maskz_loadu_ps(m3, cols_in + 48)));
    }
    _mm512_mask_storeu_ps(dst, m0, a0);
    _mm512_mask_storeu_ps(dst + 16, m1, a1);
    _mm512_mask_storeu_ps(dst + 32, m2, a2);
    _mm512_mask_storeu_ps(dst + 48, m3, a3);
}

static inline __attribute__((always_inline)) void pool_row_t(float *dst, const float *const *src, int64_t taps,
                                                             int64_t n, const int mode, const int nan,
                                                             float rows_in, const float *cols_in) {
    const __m512 r = _mm512_set1_ps(rows_in);
    for (int64_t i = 0; i < n; i += 64) pool_block(dst + i, src, i, taps, n - i, mode, nan, r, cols_in + i);
}

/* one output row of a pool: the maximum (NaN if any tap is NaN, as numpy's maximum) or the mean */
static void pool_row(float *dst, const float *const *src, int64_t taps, int64_t n, int64_t mode, int nan,
                     float rows_in, const float *cols_in) {
    if (mode != POOL_MAX)
        taps == 9 ? pool_row_t(dst, src, 9, n, POOL_AVERAGE, 0, rows_in, cols_in)
                  : pool_row_t(dst, src, taps, n, POOL_AVERAGE, 0, rows_in, cols_in);
    else if (nan)
        pool_row_t(dst, src, taps, n, POOL_MAX, 1, rows_in, cols_in);
    else
        taps == 9 ? pool_row_t(dst, src, 9, n, POOL_MAX, 0, rows_in, cols_in)
                  : pool_row_t(dst, src, taps, n, POOL_MAX, 0, rows_in, cols_in);
}
#else
/* one output row of a pool: the maximum (NaN if any tap is NaN, as numpy's maximum) or the mean */
static void pool_row(float *dst, const float *const *src, int64_t taps, int64_t n, int64_t mode, int nan,
                     float rows_in, const float *cols_in) {
    (void)nan;
    for (int64_t i = 0; i < n; i++) dst[i] = mode == POOL_MAX ? -INFINITY : 0.0f;
    for (int64_t t = 0; t < taps; t++) {
        const float *s = src[t];
        if (mode == POOL_MAX)
            for (int64_t i = 0; i < n; i++) dst[i] = s[i] > dst[i] || s[i] != s[i] ? s[i] : dst[i]; /* NaN sticks */
        else
            for (int64_t i = 0; i < n; i++) dst[i] += s[i];
    }
    if (mode != POOL_MAX)
        for (int64_t i = 0; i < n; i++) dst[i] /= rows_in * cols_in[i];
}
#endif

#if defined(__AVX512F__)
/* max(a, b), NaN when either is NaN (numpy's maximum; max_ps alone returns b when a is NaN) */
static inline __m512 max_nan512(__m512 a, __m512 b) {
    return _mm512_mask_mov_ps(_mm512_max_ps(a, b), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
}

/* whether x[:n] may hold a NaN: x * 0 is NaN for NaN (and for infinities, which only cost the slower path) */
static int has_nan(const float *x, int64_t n) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 a = zero, b = zero;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), zero, a);
        b = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), zero, b);
    }
    for (; i < n; i += 16) a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask(n - i), x + i), zero, a);
    a = _mm512_add_ps(a, b);
    return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0;
}

/* One plane of a pool with column stride 1 or 2 straight from the image: per output vector and kernel tap, a
 * masked load (two and a lane permute for stride 2) of the input row, the padding read as -inf (max) or 0 (sum);
 * rows outside the image are skipped. masks[v * kw + j]: the lanes tap column j reads for output vector v (lo
 * and hi halves). */
static inline __attribute__((always_inline)) void pool_plane(float *out, const float *img, int64_t h, int64_t w,
                                                             int64_t kh, int64_t kw, int64_t oh, int64_t ow,
                                                             int64_t sh, int64_t dh, int64_t dw, int64_t pt,
                                                             int64_t pl, const __mmask16 *masks, const int sw,
                                                             const int mode, int64_t pb, const float *cols_in) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512 pad = _mm512_set1_ps(mode == POOL_MAX || mode == POOL_MAX_NAN ? -INFINITY : 0.0f);
    const int pads_count = mode == POOL_AVERAGE_PADS;
    for (int64_t o = 0; o < oh; o++, out += ow) {
        const int64_t top = o * sh - pt;
        prefetch_rows(img, h, w, top + (kh - 1) * dh + 1 + (PREFETCH_ROWS_AHEAD - 1) * sh, sh);
        int64_t count = taps_inside(top, kh, dh, pads_count ? -pt : 0, pads_count ? h + pb : h);
        const __m512 rows_in = _mm512_set1_ps((float)(count > 0 ? count : 1));
        for (int64_t c0 = 0; c0 < ow; c0 += 64) { /* 4 vectors at a time: 4 independent chains */
            const int64_t v0 = c0 / 16, nv = (ow - c0 + 15) / 16 < 4 ? (ow - c0 + 15) / 16 : 4;
            __m512 a0 = pad, a1 = pad, a2 = pad, a3 = pad;
            for (int64_t i = 0; i < kh; i++) {
                const int64_t ih = top + i * dh;
                if (ih < 0 || ih >= h) continue;
                const float *row = img + ih * w + c0 * sw - pl;
                for (int64_t j = 0; j < kw; j++) {
                    const __mmask16 *mk = masks + 2 * (v0 * kw + j);
#define POOL_TAP(a, v)                                                                                             \
    if (v < nv) {                                                                                                  \
        const float *p = row + 16 * sw * v + j * dw;                                                               \
        __m512 x = _mm512_mask_loadu_ps(pad, mk[2 * v * kw], p);                                                   \
        if (sw == 2) x = _mm512_permutex2var_ps(x, even, _mm512_mask_loadu_ps(pad, mk[2 * v * kw + 1], p + 16));   \
        a = mode == POOL_MAX_NAN ? max_nan512(a, x) : mode == POOL_MAX ? _mm512_max_ps(a, x) : _mm512_add_ps(a, x); \
    }
                    POOL_TAP(a0, 0) POOL_TAP(a1, 1) POOL_TAP(a2, 2) POOL_TAP(a3, 3)
#undef POOL_TAP
                }
            }
#define POOL_STORE(a, v)                                                                                           \
    if (v < nv) {                                                                                                  \
        const __mmask16 m = tail_mask(ow - c0 - 16 * v);                                                           \
        if (mode == POOL_AVERAGE || mode == POOL_AVERAGE_PADS)                                                     \
            a = _mm512_div_ps(a, _mm512_mul_ps(rows_in, _mm512_maskz_loadu_ps(m, cols_in + c0 + 16 * v)));         \
        _mm512_mask_storeu_ps(out + c0 + 16 * v, m, a);                                                            \
    }
            POOL_STORE(a0, 0) POOL_STORE(a1, 1) POOL_STORE(a2, 2) POOL_STORE(a3, 3)
#undef POOL_STORE
        }
    }
}

/* dst[j] = max(row[2j], row[2j + 1], row[2j + 2]) for j < ow (rounded up to whole vectors: lanes past ow read
 * -inf past the row's end, and are never stored out) */
static __mmask16 max3s2_row(float *dst, const float *row, int64_t w, int64_t ow) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (int64_t j = 0; j < ow; j += 16) {
        const int64_t c = 2 * j;
        const float *p = row + c;
        const __m512 l0 = _mm512_mask_loadu_ps(ninf, tail_mask(w - c), p);
        const __m512 l1 = _mm512_mask_loadu_ps(ninf, tail_mask(w - c - 16), p + 16);
        const __m512 l2 = _mm512_mask_loadu_ps(ninf, tail_mask(w - c - 2), p + 2);
        const __m512 l3 = _mm512_mask_loadu_ps(ninf, tail_mask(w - c - 18), p + 18);
        nan |= _mm512_cmp_ps_mask(l0, l1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(l2, l3, _CMP_UNORD_Q);
        const __m512 m = _mm512_max_ps(_mm512_permutex2var_ps(l0, even, l1), _mm512_permutex2var_ps(l0, odd, l1));
        _mm512_storeu_ps(dst + j, _mm512_max_ps(m, _mm512_permutex2var_ps(l2, even, l3)));
    }
    return nan;
}

/* A 3x3 stride-2 max pool without pads or dilation whose windows all lie inside the plane: each input row's
 * horizontal maxima once, then the maximum of three of them per output row (the shared row reused). `rows`:
 * scratch of 3 * ow16 floats, ow16 = ow rounded up to 16. Returns whether an input the windows read is NaN (the
 * result is then wrong: max_ps drops NaN, and the caller redoes the plane). */
static int max3s2_plane(float *out, const float *img, int64_t w, int64_t oh, int64_t ow, float *rows, int64_t ow16) {
    float *a = rows, *b = rows + ow16, *c = rows + 2 * ow16;
    __mmask16 nan = max3s2_row(a, img, w, ow);
    for (int64_t o = 0; o < oh; o++, out += ow) {
        prefetch_rows(img, 2 * oh + 1, w, 2 * (o + PREFETCH_ROWS_AHEAD) + 1, 2);
        nan |= max3s2_row(b, img + (2 * o + 1) * w, w, ow);
        nan |= max3s2_row(c, img + (2 * o + 2) * w, w, ow);
        for (int64_t j = 0; j < ow; j += 16) {
            const __m512 m = _mm512_max_ps(_mm512_loadu_ps(a + j), _mm512_max_ps(_mm512_loadu_ps(b + j),
                                                                                _mm512_loadu_ps(c + j)));
            _mm512_mask_storeu_ps(out + j, tail_mask(ow - j), m);
        }
        float *t = a;
        a = c;
        c = t;
    }
    return nan != 0;
}

#define POOL_PLANE(sw_, mode_)                                                                                     \
    pool_plane(y + q * oh * ow, x + q * h * w, h, w, kh, kw, oh, ow, sh, dh, dw, pt, pl, masks, sw_, mode_, pb,     \
               cols_in)
#endif

/* 2-D max or average pool of the planes [begin, end) of x[planes, H, W] into y[planes, OH, OW]: pt, pl, pb, pr
 * are the explicit pads, and OH, OW may reach past the end ones (ceil_mode); an average divides by the taps inside
 * the image (POOL_AVERAGE) or inside the image and its explicit pads (POOL_AVERAGE_PADS), at least 1. Returns 0,
 * or -1 when out of memory. */
int64_t pool2d_f32(const float *x, float *y, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t oh, int64_t ow,
                   int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t pb, int64_t pr,
                   int64_t begin, int64_t end, int64_t mode) {
    const int64_t g[G_COUNT] = {1, 1, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl};
    layout_t L;
    if (end <= begin || oh <= 0 || ow <= 0) return 0;
    float *cols_in = malloc((size_t)ow * sizeof(float));
    if (!cols_in) return -1;
    const int pads_count = mode == POOL_AVERAGE_PADS;
    for (int64_t j = 0; j < ow; j++) {
        const int64_t count = taps_inside(j * sw - pl, kw, dw, pads_count ? -pl : 0, pads_count ? w + pr : w);
        cols_in[j] = (float)(count > 0 ? count : 1);
    }
#if defined(__AVX512F__)
    if (sw <= 2) { /* straight from the image */
        const int64_t vectors = (ow + 15) / 16;
        __mmask16 *masks = malloc((size_t)(2 * vectors * kw) * sizeof(__mmask16));
        if (!masks) {
            free(cols_in);
            return -1;
        }
        for (int64_t v = 0; v < vectors; v++)
            for (int64_t j = 0; j < kw; j++) {
                const int64_t c = v * 16 * sw - pl + j * dw; /* input column of lane 0 */
                masks[2 * (v * kw + j)] = range_mask(-c, w - c);
                masks[2 * (v * kw + j) + 1] = range_mask(-c - 16, w - c - 16);
            }
        const int64_t ow16 = (ow + 15) / 16 * 16;
        float *rows = NULL;
        if (mode == POOL_MAX && kh == 3 && kw == 3 && sh == 2 && sw == 2 && dh == 1 && dw == 1 && pt == 0 && pl == 0
            && 2 * oh + 1 <= h && 2 * ow + 1 <= w)
            rows = malloc((size_t)(3 * ow16) * sizeof(float)); /* NULL (also when out of memory): the general path */
        for (int64_t q = begin; q < end; q++) {
            if (rows && !max3s2_plane(y + q * oh * ow, x + q * h * w, w, oh, ow, rows, ow16))
                continue;
            if (mode == POOL_MAX && (rows || has_nan(x + q * h * w, h * w))) /* max_ps alone would drop it */
                sw == 1 ? POOL_PLANE(1, POOL_MAX_NAN) : POOL_PLANE(2, POOL_MAX_NAN);
            else if (mode == POOL_MAX)
                sw == 1 ? POOL_PLANE(1, POOL_MAX) : POOL_PLANE(2, POOL_MAX);
            else if (mode == POOL_AVERAGE)
                sw == 1 ? POOL_PLANE(1, POOL_AVERAGE) : POOL_PLANE(2, POOL_AVERAGE);
            else
                sw == 1 ? POOL_PLANE(1, POOL_AVERAGE_PADS) : POOL_PLANE(2, POOL_AVERAGE_PADS);
        }
        free(rows);
        free(masks);
        free(cols_in);
        return 0;
    }
#endif
    if (layout_init(&L, g)) {
        free(cols_in);
        return -1;
    }
    const float pad = mode == POOL_MAX ? -INFINITY : 0.0f;
    for (int64_t q = begin; q < end; q++) {
        for (int64_t o0 = 0; o0 < oh; o0 += L.band) {
            const int64_t rows = oh - o0 < L.band ? oh - o0 : L.band;
            const int nan = fill_band(&L, x + q * h * w, o0, rows + L.ext_h, pad);
            for (int64_t r = 0; r < rows; r++) {
                const int64_t o = o0 + r;
                int64_t count = taps_inside(o * sh - pt, kh, dh, pads_count ? -pt : 0, pads_count ? h + pb : h);
                count = count > 0 ? count : 1;
                for (int64_t t = 0; t < L.taps; t++) L.src[t] = L.scratch + L.offset[t] + r * L.plane_w;
                pool_row(y + (q * oh + o) * ow, L.src, L.taps, ow, mode, nan, (float)count, cols_in);
            }
        }
    }
    free(cols_in);
    layout_free(&L);
    return 0;
}

/* y[p, :] = act(y[p, :] + bias[p % channels]) for planes p in [begin, end) of `size` values each (bias may be
 * NULL) */
void bias_act_f32(float *y, const float *bias, int64_t channels, int64_t size, int64_t begin, int64_t end,
                  int64_t act, float alpha, float beta) {
    const act_t f = {alpha, beta, (int)act};
    for (int64_t p = begin; p < end; p++) act_run(y + p * size, size, bias ? bias[p % channels] : 0.0f, f);
}

/* y[p, :] = act(x[p, :] * scale[c] + shift[c]), c = p % channels, for planes p in [begin, end) of `size` values
 * each: inference BatchNormalization (+ activation) in one pass; y may be x */
void scale_shift_act_f32(const float *x, float *y, const float *scale, const float *shift, int64_t channels,
                         int64_t size, int64_t begin, int64_t end, int64_t act, float alpha, float beta) {
    const act_t f = {alpha, beta, (int)act};
    for (int64_t p = begin; p < end; p++) {
        const float *src = x + p * size;
        float *dst = y + p * size;
        const float s = scale[p % channels], t = shift[p % channels];
#if defined(__AVX512F__)
        const __m512 vs = _mm512_set1_ps(s), vt = _mm512_set1_ps(t);
        int64_t i = 0;
        for (; i + 16 <= size; i += 16)
            _mm512_storeu_ps(dst + i, act512(_mm512_fmadd_ps(_mm512_loadu_ps(src + i), vs, vt), f));
        if (i < size) {
            const __mmask16 m = tail_mask(size - i);
            _mm512_mask_storeu_ps(dst + i, m, act512(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, src + i), vs, vt), f));
        }
#else
        for (int64_t i = 0; i < size; i++) dst[i] = src[i] * s + t;
        act_row(dst, size, f);
#endif
    }
}

/* y[p] = mean of x[p, :size] for planes p in [begin, end) (global average pooling) */
void plane_mean_f32(const float *x, float *y, int64_t size, int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
        const float *row = x + p * size;
#if defined(__AVX512F__)
        __m512 a = _mm512_setzero_ps(), b = a;
        int64_t i = 0;
        for (; i + 32 <= size; i += 32) {
            a = _mm512_add_ps(a, _mm512_loadu_ps(row + i));
            b = _mm512_add_ps(b, _mm512_loadu_ps(row + i + 16));
        }
        for (; i < size; i += 16) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(tail_mask(size - i), row + i));
        const float total = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
#else
        float total = 0.0f;
        for (int64_t i = 0; i < size; i++) total += row[i];
#endif
        y[p] = total / (float)size;
    }
}

/* -- the kernels over the thread pool: the same arguments, the planes [begin, end) split over `threads` --------- */
CARRACK_POOL_CLIENT(dwconv)

typedef struct {
    const float *x, *w, *bias, *scale, *shift;
    float *y;
    int64_t g[16];
    int64_t act;
    float alpha, beta;
    _Atomic int64_t failed;
} plane_call_t;

static void dwconv_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    plane_call_t *c = p;
    const int64_t *g = c->g;
    (void)slot;
    if (dwconv2d_f32(c->x, c->w, c->bias, c->y, g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10],
                     g[11], g[12], g[13], begin, end, c->act, c->alpha, c->beta))
        atomic_store(&c->failed, 1);
}

/* Returns 0, or -1 when a piece ran out of memory. */
int64_t dwconv2d_f32_threads(const float *x, const float *w, const float *bias, float *y, int64_t channels,
                             int64_t mult, int64_t h, int64_t w_, int64_t kh, int64_t kw, int64_t oh, int64_t ow,
                             int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t begin,
                             int64_t end, int64_t act, float alpha, float beta, int64_t threads) {
    plane_call_t c = {x, w, bias, NULL, NULL, y, {channels, mult, h, w_, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl},
                      act, alpha, beta, 0};
    parallel_for(dwconv_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
    return atomic_load(&c.failed) ? -1 : 0;
}

static void pool_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    plane_call_t *c = p;
    const int64_t *g = c->g;
    (void)slot;
    if (pool2d_f32(c->x, c->y, g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13],
                   begin, end, c->act))
        atomic_store(&c->failed, 1);
}

/* Returns 0, or -1 when a piece ran out of memory. */
int64_t pool2d_f32_threads(const float *x, float *y, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t oh,
                           int64_t ow, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl,
                           int64_t pb, int64_t pr, int64_t begin, int64_t end, int64_t mode, int64_t threads) {
    plane_call_t c = {x, NULL, NULL, NULL, NULL, y, {h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl, pb, pr}, mode,
                      0.0f, 0.0f, 0};
    parallel_for(pool_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
    return atomic_load(&c.failed) ? -1 : 0;
}

static void bias_act_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const plane_call_t *c = p;
    (void)slot;
    bias_act_f32(c->y, c->bias, c->g[0], c->g[1], begin, end, c->act, c->alpha, c->beta);
}

void bias_act_f32_threads(float *y, const float *bias, int64_t channels, int64_t size, int64_t begin, int64_t end,
                          int64_t act, float alpha, float beta, int64_t threads) {
    plane_call_t c = {NULL, NULL, bias, NULL, NULL, y, {channels, size}, act, alpha, beta, 0};
    parallel_for(bias_act_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
}

static void scale_shift_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const plane_call_t *c = p;
    (void)slot;
    scale_shift_act_f32(c->x, c->y, c->scale, c->shift, c->g[0], c->g[1], begin, end, c->act, c->alpha, c->beta);
}

void scale_shift_act_f32_threads(const float *x, float *y, const float *scale, const float *shift, int64_t channels,
                                 int64_t size, int64_t begin, int64_t end, int64_t act, float alpha, float beta,
                                 int64_t threads) {
    plane_call_t c = {x, NULL, NULL, scale, shift, y, {channels, size}, act, alpha, beta, 0};
    parallel_for(scale_shift_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
}

static void plane_mean_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const plane_call_t *c = p;
    (void)slot;
    plane_mean_f32(c->x, c->y, c->g[0], begin, end);
}

void plane_mean_f32_threads(const float *x, float *y, int64_t size, int64_t begin, int64_t end, int64_t threads) {
    plane_call_t c = {x, NULL, NULL, NULL, NULL, y, {size}, 0, 0.0f, 0.0f, 0};
    parallel_for(plane_mean_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
}
