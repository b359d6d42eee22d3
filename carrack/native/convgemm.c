/* Convolution as a matrix product, float32, with the bias and the activation applied before the one store:
 *
 *     y[n, g * Mg + m, p] = act(bias[g * Mg + m] + sum_k w[g * Mg + m, k] * x[n, g * Kg + k, p])
 *
 * for 1x1 convolutions (x is the image, p its pixels) and for im2col columns (x the columns). The output is cut
 * into tiles of up to 6 rows by 64 pixels, each accumulated in 24 vector registers over the whole depth (the
 * 6 weights of a depth step are broadcast, the 64 pixels loaded once) and finished in registers: no pass over the
 * output besides its store. A residual z (NULL for none, laid out like y) is added there too, before the activation:
 * y = act(w x + bias + z), onnxruntime's FusedConv with its Z input.
 *
 * dconv_f32 is the same product for a KxK convolution without columns: a depth step is one (kernel tap, input
 * channel), its 64 pixels loaded straight from the image (masked where they read padding). im2col_f32 builds
 * the columns of a block of output rows for the product, for convolutions with few input channels.
 */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "threadpool.h"

#include "activations.h"

/* geometry, in the order of convgemm_f32's arguments: images, groups, output rows and depth per group,
 * pixels, and the strides (in floats) of x's images and depth rows, y's images and rows, and w's rows */
enum { G_N, G_GROUPS, G_MG, G_KG, G_P, G_XN, G_XK, G_YN, G_YM, G_WM, G_COUNT };

#define MR 6  /* output rows per tile */
#define NR 64 /* pixels per tile */
#ifndef ROWS_OUTER_BYTES
#define ROWS_OUTER_BYTES (512 * 1024)
#endif
#define TAP_CACHE_BYTES (256 * 1024) /* a direct convolution's taps kept for all its pixel groups */

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

/* lanes l of a 16-lane vector with lo <= l < hi */
static inline __mmask16 range_mask(int64_t lo, int64_t hi) {
    lo = lo < 0 ? 0 : lo;
    hi = hi > 16 ? 16 : hi;
    return hi <= lo ? (__mmask16)0 : (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* Per row i of a tile: its accumulators a<i>0..a<i>3 (named variables, not an array, so that they stay in
 * registers), initialised to the bias, updated, and stored through the activation. */
#define ROW_INIT(i)                                                                                                \
    __m512 a##i##0, a##i##1, a##i##2, a##i##3;                                                                     \
    a##i##0 = a##i##1 = a##i##2 = a##i##3 = _mm512_set1_ps(bias && mr > i ? bias[i] : 0.0f);
#define ROW_FMA(i)                                                                                                 \
    if (mr > i) {                                                                                                  \
        const __m512 wb = _mm512_set1_ps(w[i * ldw + wk]);                                                         \
        a##i##0 = _mm512_fmadd_ps(wb, x0, a##i##0);                                                                \
        if (nv > 1) a##i##1 = _mm512_fmadd_ps(wb, x1, a##i##1);                                                    \
        if (nv > 2) a##i##2 = _mm512_fmadd_ps(wb, x2, a##i##2);                                                    \
        if (nv > 3) a##i##3 = _mm512_fmadd_ps(wb, x3, a##i##3);                                                    \
    }
#define ROW_STORE(i)                                                                                               \
    if (mr > i) {                                                                                                  \
        float *yr = y + i * ldy;                                                                                   \
        if (z) {                                                                                                   \
            const float *zr = z + i * ldy;                                                                         \
            a##i##0 = _mm512_add_ps(a##i##0, _mm512_maskz_loadu_ps(m0, zr));                                      \
            if (nv > 1) a##i##1 = _mm512_add_ps(a##i##1, _mm512_maskz_loadu_ps(m1, zr + 16));                      \
            if (nv > 2) a##i##2 = _mm512_add_ps(a##i##2, _mm512_maskz_loadu_ps(m2, zr + 32));                      \
            if (nv > 3) a##i##3 = _mm512_add_ps(a##i##3, _mm512_maskz_loadu_ps(last, zr + 48));                    \
        }                                                                                                          \
        _mm512_mask_storeu_ps(yr, m0, act512(a##i##0, f));                                                         \
        if (nv > 1) _mm512_mask_storeu_ps(yr + 16, m1, act512(a##i##1, f));                                        \
        if (nv > 2) _mm512_mask_storeu_ps(yr + 32, m2, act512(a##i##2, f));                                        \
        if (nv > 3) _mm512_mask_storeu_ps(yr + 48, last, act512(a##i##3, f));                                      \
    }

/* one tile of mr rows by nv vectors of pixels (the last one `last` lanes wide); mr and nv are constants where
 * inlined */
static inline __attribute__((always_inline)) void tile(const float *w, int64_t ldw, const float *x, int64_t ldx,
                                                       float *y, const float *z, int64_t ldy, const float *bias,
                                                       int64_t depth,
                                                       const int mr, const int nv, __mmask16 last, act_t f) {
    ROW_INIT(0) ROW_INIT(1) ROW_INIT(2) ROW_INIT(3) ROW_INIT(4) ROW_INIT(5)
    const __mmask16 m0 = nv == 1 ? last : 0xFFFF, m1 = nv == 2 ? last : 0xFFFF, m2 = nv == 3 ? last : 0xFFFF;
    for (int64_t k = 0; k < depth; k++) {
        const float *xr = x + k * ldx;
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, xr);
        const __m512 x1 = nv > 1 ? _mm512_maskz_loadu_ps(m1, xr + 16) : x0;
        const __m512 x2 = nv > 2 ? _mm512_maskz_loadu_ps(m2, xr + 32) : x0;
        const __m512 x3 = nv > 3 ? _mm512_maskz_loadu_ps(last, xr + 48) : x0;
        const int64_t wk = k;
        ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
    }
    ROW_STORE(0) ROW_STORE(1) ROW_STORE(2) ROW_STORE(3) ROW_STORE(4) ROW_STORE(5)
}

/* The last few pixels of a row of pixels (fewer than TAIL_MAX past a whole vector): a 7x7 map has 49, and a
 * vector of its own would idle 15 of its 16 lanes through the whole depth. Each such pixel is instead a dot
 * product along the depth with each of the tile's weight rows: 16 depth steps at a time, the pixel's column of x
 * gathered once for all the rows. */
#define TAIL_MAX 2
static void tail_pixels(const float *w, int64_t ldw, const float *x, int64_t ldx, float *y, const float *z,
                        int64_t ldy, const float *bias, int64_t depth, int64_t rows, int64_t cols, act_t f) {
    const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int32_t)ldx));
    for (int64_t j = 0; j < cols; j++) {
        __m512 acc[MR];
        for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < depth; k += 16) {
            const __mmask16 m = tail_mask(depth - k);
            const __m512 xv = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, index, x + k * ldx + j, 4);
            for (int64_t i = 0; i < rows; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + i * ldw + k), xv, acc[i]);
        }
        for (int64_t i = 0; i < rows; i++) {
            float v = _mm512_reduce_add_ps(acc[i]) + (bias ? bias[i] : 0.0f);
            if (z) v += z[i * ldy + j];
            y[i * ldy + j] = act_scalar(v, f);
        }
    }
}

#define TILE_NV(mr)                                                                                                \
    switch (nv) {                                                                                                  \
    case 1: tile(w, ldw, x, ldx, y, z, ldy, bias, depth, mr, 1, last, f); break;                                      \
    case 2: tile(w, ldw, x, ldx, y, z, ldy, bias, depth, mr, 2, last, f); break;                                      \
    case 3: tile(w, ldw, x, ldx, y, z, ldy, bias, depth, mr, 3, last, f); break;                                      \
    default: tile(w, ldw, x, ldx, y, z, ldy, bias, depth, mr, 4, last, f); break;                                     \
    }

static void tile_any(const float *w, int64_t ldw, const float *x, int64_t ldx, float *y, const float *z,
                     int64_t ldy, const float *bias, int64_t depth, int64_t rows, int64_t cols, act_t f) {
    const int nv = (int)((cols + 15) / 16);
    const __mmask16 last = tail_mask(cols - 16 * (nv - 1));
    switch (rows) {
    case 1: TILE_NV(1) break;
    case 2: TILE_NV(2) break;
    case 3: TILE_NV(3) break;
    case 4: TILE_NV(4) break;
    case 5: TILE_NV(5) break;
    default: TILE_NV(6) break;
    }
}

/* Direct convolution (column stride 1 or 2): a tile's 4 vectors each cover up to 16 outputs of one output row
 * (pos[v]: where its tap (0, 0) reads in a plane, row[v] / col[v]: its input row and column, lanes[v]: its
 * outputs, 0 for none, out[v]: where they go in an output plane). Each (kernel tap, input channel) is one depth
 * step of the product: the 4 vectors are loaded straight from the image, masked where they read padding. */
typedef struct {
    int64_t h, w, cg, kh, kw, dh, dw;
    int64_t pos[4], row[4], col[4], out[4];
    __mmask16 lanes[4];
} dtile_t;

#define DROW_STORE(i)                                                                                              \
    if (mr > i) {                                                                                                  \
        float *yr = y + i * ldy;                                                                                   \
        if (z) {                                                                                                   \
            const float *zr = z + i * ldy;                                                                         \
            a##i##0 = _mm512_add_ps(a##i##0, _mm512_maskz_loadu_ps(T->lanes[0], zr + T->out[0]));                 \
            if (nv > 1) a##i##1 = _mm512_add_ps(a##i##1, _mm512_maskz_loadu_ps(T->lanes[1], zr + T->out[1]));     \
            if (nv > 2) a##i##2 = _mm512_add_ps(a##i##2, _mm512_maskz_loadu_ps(T->lanes[2], zr + T->out[2]));     \
            if (nv > 3) a##i##3 = _mm512_add_ps(a##i##3, _mm512_maskz_loadu_ps(T->lanes[3], zr + T->out[3]));     \
        }                                                                                                          \
        _mm512_mask_storeu_ps(yr + T->out[0], T->lanes[0], act512(a##i##0, f));                                   \
        if (nv > 1) _mm512_mask_storeu_ps(yr + T->out[1], T->lanes[1], act512(a##i##1, f));                       \
        if (nv > 2) _mm512_mask_storeu_ps(yr + T->out[2], T->lanes[2], act512(a##i##2, f));                       \
        if (nv > 3) _mm512_mask_storeu_ps(yr + T->out[3], T->lanes[3], act512(a##i##3, f));                       \
    }

/* one vector of a direct tile: 16 columns (stride 1) or the even ones of 32 (stride 2), 0 in the padding */
static inline __attribute__((always_inline)) __m512 dload(const float *p, __mmask16 lo, __mmask16 hi,
                                                          const int sw) {
    if (sw == 1) return _mm512_maskz_loadu_ps(lo, p);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(lo, p), even, _mm512_maskz_loadu_ps(hi, p + 16));
}

/* Where each (kernel tap, vector) of a pixel group reads, and which lanes: worked out once per pixel group (for all
 * the row tiles that share it) */
typedef struct {
    __mmask16 lo[4], hi[4];
    int64_t off[4];
    int any;
} dtap_t;

static void dtaps(const dtile_t *T, int64_t sw, dtap_t *taps) {
    for (int64_t i = 0; i < T->kh; i++)
        for (int64_t j = 0; j < T->kw; j++) {
            dtap_t *tp = taps + i * T->kw + j;
            tp->any = 0;
            for (int v = 0; v < 4; v++) {
                const int64_t r = T->row[v] + i * T->dh, c = T->col[v] + j * T->dw;
                const int inside = r >= 0 && r < T->h && T->lanes[v];
                tp->lo[v] = inside ? range_mask(-c, T->w - c) : 0;
                tp->hi[v] = inside && sw == 2 ? range_mask(-c - 16, T->w - c - 16) : 0;
                tp->off[v] = inside ? T->pos[v] + i * T->dh * T->w + j * T->dw : 0;
                tp->any |= tp->lo[v] | tp->hi[v];
            }
        }
}

/* The same for a flat pixel group (stride 1, output rows as wide as the input's): vector v covers the 16 outputs
 * from flat index T->out[v], which may span output rows; tap (i, j) reads them at one offset from the image (the
 * input row width equals the output's), each lane masked where its own row or column lands in the padding. */
static void dtaps_flat(const dtile_t *T, int64_t ow, int64_t pt, int64_t pl, dtap_t *taps) {
    __m512i row[4], col[4]; /* each lane's output row and column */
    for (int v = 0; v < 4; v++) {
        int32_t r[16], c[16];
        int64_t p = T->out[v];
        int32_t ri = (int32_t)(p / ow), ci = (int32_t)(p % ow);
        for (int l = 0; l < 16; l++) {
            r[l] = ri, c[l] = ci;
            if (++ci == ow) ci = 0, ri++;
        }
        row[v] = _mm512_loadu_si512(r), col[v] = _mm512_loadu_si512(c);
    }
    const __m512i h = _mm512_set1_epi32((int32_t)T->h), w = _mm512_set1_epi32((int32_t)T->w);
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t i = 0; i < T->kh; i++)
        for (int64_t j = 0; j < T->kw; j++) {
            dtap_t *tp = taps + i * T->kw + j;
            const int64_t di = i * T->dh - pt, dj = j * T->dw - pl;
            const __m512i vdi = _mm512_set1_epi32((int32_t)di), vdj = _mm512_set1_epi32((int32_t)dj);
            tp->any = 0;
            for (int v = 0; v < 4; v++) {
                const __m512i r = _mm512_add_epi32(row[v], vdi), c = _mm512_add_epi32(col[v], vdj);
                __mmask16 m = T->lanes[v];
                m = _mm512_mask_cmpge_epi32_mask(m, r, zero);
                m = _mm512_mask_cmplt_epi32_mask(m, r, h);
                m = _mm512_mask_cmpge_epi32_mask(m, c, zero);
                m = _mm512_mask_cmplt_epi32_mask(m, c, w);
                tp->lo[v] = m;
                tp->hi[v] = 0;
                tp->off[v] = m ? T->out[v] + di * T->w + dj : 0;
                tp->any |= m;
            }
        }
}

/* nv: the vectors in use (the last pixel group of a plane may fill fewer than 4; their lanes are 0 past nv) */
static inline __attribute__((always_inline)) void dtile(const float *w, int64_t ldw, const float *img,
                                                        const dtile_t *T, const dtap_t *taps, float *y,
                                                        const float *z, int64_t ldy, const float *bias,
                                                        const int mr, const int sw, const int nv, act_t f) {
    ROW_INIT(0) ROW_INIT(1) ROW_INIT(2) ROW_INIT(3) ROW_INIT(4) ROW_INIT(5)
    const int64_t plane = T->h * T->w, count = T->kh * T->kw;
    for (int64_t tap = 0; tap < count; tap++) {
        const dtap_t *tp = taps + tap;
        if (!tp->any) continue;
        const __mmask16 l0 = tp->lo[0], l1 = tp->lo[1], l2 = tp->lo[2], l3 = tp->lo[3];
        const __mmask16 h0 = tp->hi[0], h1 = tp->hi[1], h2 = tp->hi[2], h3 = tp->hi[3];
        const float *xc = img;
        for (int64_t ci = 0; ci < T->cg; ci++, xc += plane) {
            const __m512 x0 = dload(xc + tp->off[0], l0, h0, sw);
            const __m512 x1 = nv > 1 ? dload(xc + tp->off[1], l1, h1, sw) : x0;
            const __m512 x2 = nv > 2 ? dload(xc + tp->off[2], l2, h2, sw) : x0;
            const __m512 x3 = nv > 3 ? dload(xc + tp->off[3], l3, h3, sw) : x0;
            const int64_t wk = ci * count + tap;
            ROW_FMA(0) ROW_FMA(1) ROW_FMA(2) ROW_FMA(3) ROW_FMA(4) ROW_FMA(5)
        }
    }
    DROW_STORE(0) DROW_STORE(1) DROW_STORE(2) DROW_STORE(3) DROW_STORE(4) DROW_STORE(5)
}

#define DTILE_NV(mr, sw_)                                                                                          \
    switch (nv) {                                                                                                  \
    case 1: dtile(w, ldw, img, T, taps, y, z, ldy, bias, mr, sw_, 1, f); break;                                    \
    case 2: dtile(w, ldw, img, T, taps, y, z, ldy, bias, mr, sw_, 2, f); break;                                    \
    case 3: dtile(w, ldw, img, T, taps, y, z, ldy, bias, mr, sw_, 3, f); break;                                    \
    default: dtile(w, ldw, img, T, taps, y, z, ldy, bias, mr, sw_, 4, f); break;                                   \
    }
#define DTILE_SW(mr)                                                                                               \
    if (sw == 1) {                                                                                                 \
        DTILE_NV(mr, 1)                                                                                            \
    } else {                                                                                                       \
        DTILE_NV(mr, 2)                                                                                            \
    }

static void dtile_any(const float *w, int64_t ldw, const float *img, const dtile_t *T, const dtap_t *taps,
                      float *y, const float *z, int64_t ldy, const float *bias, int64_t rows, int64_t sw, act_t f) {
    const int nv = T->lanes[3] ? 4 : T->lanes[2] ? 3 : T->lanes[1] ? 2 : 1;
    switch (rows) {
    case 1: DTILE_SW(1); break;
    case 2: DTILE_SW(2); break;
    case 3: DTILE_SW(3); break;
    case 4: DTILE_SW(4); break;
    case 5: DTILE_SW(5); break;
    default: DTILE_SW(6); break;
    }
}

#else
static void tile_any(const float *w, int64_t ldw, const float *x, int64_t ldx, float *y, const float *z,
                     int64_t ldy, const float *bias, int64_t depth, int64_t rows, int64_t cols, act_t f) {
    for (int64_t i = 0; i < rows; i++) {
        float acc[NR]; /* z may be y itself (matmul_f32's depth blocks) */
        const float b = bias ? bias[i] : 0.0f;
        for (int64_t p = 0; p < cols; p++) acc[p] = b;
        for (int64_t k = 0; k < depth; k++) {
            const float *restrict xr = x + k * ldx;
            const float wk = w[i * ldw + k];
            for (int64_t p = 0; p < cols; p++) acc[p] += wk * xr[p];
        }
        float *yr = y + i * ldy;
        for (int64_t p = 0; p < cols; p++) {
            const float v = z ? acc[p] + z[i * ldy + p] : acc[p];
            yr[p] = f.act == ACT_NONE ? v : act_scalar(v, f);
        }
    }
}
#endif

#if !defined(__AVX512F__)
typedef struct {
    int64_t h, w, cg, kh, kw, dh, dw;
    int64_t pos[4], row[4], col[4], out[4];
    int64_t lanes[4]; /* outputs of each vector */
} dtile_t;

static inline int64_t tail_mask(int64_t n) { return n < 0 ? 0 : n > 16 ? 16 : n; }

typedef int dtap_t; /* the vector code's per-tap masks: not needed here */

static void dtaps(const dtile_t *T, int64_t sw, dtap_t *taps) {
    (void)T, (void)sw, (void)taps;
}

static void dtaps_flat(const dtile_t *T, int64_t ow, int64_t pt, int64_t pl, dtap_t *taps) {
    (void)T, (void)ow, (void)pt, (void)pl, (void)taps;
}

static void dtile_any(const float *w, int64_t ldw, const float *img, const dtile_t *T, const dtap_t *taps,
                      float *y, const float *z, int64_t ldy, const float *bias, int64_t rows, int64_t sw, act_t f) {
    (void)taps;
    const int64_t plane = T->h * T->w;
    for (int64_t r = 0; r < rows; r++)
        for (int v = 0; v < 4; v++)
            for (int64_t l = 0; l < T->lanes[v]; l++) {
                float acc = bias ? bias[r] : 0.0f;
                for (int64_t ci = 0; ci < T->cg; ci++)
                    for (int64_t i = 0; i < T->kh; i++) {
                        const int64_t ih = T->row[v] + i * T->dh;
                        if (ih < 0 || ih >= T->h) continue;
                        for (int64_t j = 0; j < T->kw; j++) {
                            const int64_t iw = T->col[v] + l * sw + j * T->dw;
                            if (iw >= 0 && iw < T->w)
                                acc += w[r * ldw + (ci * T->kh + i) * T->kw + j] * img[ci * plane + ih * T->w + iw];
                        }
                    }
                if (z) acc += z[r * ldy + T->out[v] + l];
                y[r * ldy + T->out[v] + l] = f.act == ACT_NONE ? acc : act_scalar(acc, f);
            }
}
#endif

/* How the output pixels are cut into tiles of 4 vectors: output rows of up to 16 pixels go 4 rows to a tile,
 * rows of up to 32 go 2 to a tile, longer rows 64 pixels at a time. */
static int64_t dgroups(int64_t oh, int64_t ow, int64_t *rows_per, int64_t *chunks) {
    *rows_per = ow <= 16 ? 4 : ow <= 32 ? 2 : 1;
    *chunks = *rows_per == 1 ? (ow + 63) / 64 : 1;
    return (oh + *rows_per - 1) / *rows_per * *chunks;
}

/* Whether the output pixels go flat, 64 at a time across output rows, so that no lane idles at the end of a short
 * row: for stride 1 with output rows as wide as the input's (a "same" padding), where a vector of consecutive
 * outputs reads consecutive inputs. The portable code keeps rows. */
static int dflat(int64_t ow, int64_t wd, int64_t sh, int64_t sw) {
#if defined(__AVX512F__)
    return sh == 1 && sw == 1 && ow == wd;
#else
    (void)ow, (void)wd, (void)sh, (void)sw;
    return 0;
#endif
}

/* rows [0, rows) of `count` floats each, `ld` apart, asked into the L2 cache */
static inline void prefetch_rows_l2(const float *p, int64_t ld, int64_t rows, int64_t count) {
#if defined(__AVX512F__)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < count; c += 16) _mm_prefetch((const char *)(p + r * ld + c), _MM_HINT_T1);
#else
    (void)p, (void)ld, (void)rows, (void)count;
#endif
}

int64_t dconv_tiles_f32(int64_t oh, int64_t ow, int64_t wd, int64_t sh, int64_t sw) {
    int64_t rows_per, chunks;
    return dflat(ow, wd, sh, sw) ? (oh * ow + 63) / 64 : dgroups(oh, ow, &rows_per, &chunks);
}

/* Tiles [begin, end) of a direct convolution (column stride sw 1 or 2) of x[N, G * Cg, H, W] by
 * w[G * Mg, Cg, KH, KW] into y[N, G * Mg, OH, OW]: tiles go image by image, group by group, pixel group by
 * pixel group (dconv_tiles_f32 of them) and down the output rows. bias may be NULL. Returns 0, or -1 when out of
 * memory. */
int64_t dconv_f32(const float *x, const float *w, const float *bias, float *y, const float *z, int64_t n_,
               int64_t groups,
               int64_t mg, int64_t cg, int64_t h, int64_t wd, int64_t kh, int64_t kw, int64_t oh, int64_t ow,
               int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t begin, int64_t end,
               int64_t act, float alpha, float beta) {
    (void)n_;
    const act_t f = {alpha, beta, (int)act};
    int64_t rows_per, chunks;
    const int flat = dflat(ow, wd, sh, sw);
    const int64_t pixel_groups = flat ? (oh * ow + 63) / 64 : dgroups(oh, ow, &rows_per, &chunks);
    const int64_t row_tiles = (mg + MR - 1) / MR;
    const int64_t ldw = cg * kh * kw, plane = h * wd;
    dtile_t T = {h, wd, cg, kh, kw, dh, dw, {0}, {0}, {0}, {0}, {0}};
    /* An image that fits the L2 cache is read there again by each band of weight rows, which then goes through
     * every pixel group while its weights stay in the L1 cache: the weights are read from memory once. A larger
     * image goes pixel group by pixel group, each kept in the cache for every band of rows. In the first order
     * every tile moves to another pixel group, so each group's taps are worked out once and kept. */
    const int64_t count = kh * kw;
    const int rows_outer = cg * plane * (int64_t)sizeof(float) <= ROWS_OUTER_BYTES
                           && pixel_groups * count * (int64_t)sizeof(dtap_t) <= TAP_CACHE_BYTES;
    dtap_t *taps = malloc((size_t)((rows_outer ? pixel_groups : 1) * count) * sizeof(dtap_t));
    unsigned char *known = rows_outer ? calloc((size_t)pixel_groups, 1) : NULL;
    if (!taps || (rows_outer && !known)) {
        free(taps), free(known);
        return -1;
    }
    int64_t tapped = -1; /* the pixel group `taps` describes (the other order) */
    for (int64_t t = begin; t < end; t++) {
        int64_t rt = t % row_tiles, pg = t / row_tiles % pixel_groups;
        if (rows_outer) rt = t / pixel_groups % row_tiles, pg = t % pixel_groups;
        const int64_t gi = t / (row_tiles * pixel_groups) % groups, n = t / (row_tiles * pixel_groups * groups);
        const int64_t m = gi * mg + rt * MR, rows = mg - rt * MR < MR ? mg - rt * MR : MR;
        for (int v = 0; v < 4 && flat; v++) { /* flat outputs pg * 64 + 16 v .. + 15 */
            const int64_t p = pg * 64 + 16 * v, count = oh * ow - p < 16 ? oh * ow - p : 16;
            T.lanes[v] = count > 0 ? tail_mask(count) : 0;
            T.out[v] = count > 0 ? p : 0;
        }
        for (int v = 0; v < 4 && !flat; v++) { /* the vectors' outputs: row o, pixels p .. p + 15 */
            const int64_t o = pg / chunks * rows_per + (rows_per == 1 ? 0 : rows_per == 4 ? v : v / 2);
            const int64_t p = (pg % chunks) * 64 + (rows_per == 1 ? 16 * v : rows_per == 2 ? 16 * (v % 2) : 0);
            const int64_t count = o < oh ? (ow - p < 16 ? ow - p : 16) : 0;
            T.lanes[v] = count > 0 ? tail_mask(count) : 0;
            T.row[v] = o * sh - pt;
            T.col[v] = p * sw - pl;
            T.pos[v] = T.row[v] * wd + T.col[v];
            T.out[v] = count > 0 ? o * ow + p : 0;
        }
        dtap_t *tp = rows_outer ? taps + pg * count : taps;
        if (rows_outer ? !known[pg] : pg != tapped) {
            if (flat)
                dtaps_flat(&T, ow, pt, pl, tp);
            else
                dtaps(&T, sw, tp);
            if (rows_outer)
                known[pg] = 1;
            else
                tapped = pg;
        }
        if (rt + 1 < row_tiles) /* the next band's weight rows (a large layer's weights come from memory) */
            prefetch_rows_l2(w + (m + MR) * ldw, ldw, mg - rt * MR - MR < MR ? mg - rt * MR - MR : MR, ldw);
        const int64_t at = (n * groups * mg + m) * oh * ow;
        dtile_any(w + m * ldw, ldw, x + (n * groups + gi) * cg * plane, &T, tp, y + at, z ? z + at : NULL,
                  oh * ow, bias ? bias + m : NULL, rows, sw, f);
    }
    free(taps);
    free(known);
    return 0;
}

/* Tiles [begin, end) of the output (see the header): tiles go image by image, group by group, pixel panel by
 * panel, and down the output rows within a panel. bias may be NULL. */
void convgemm_f32(const float *x, const float *w, const float *bias, float *y, const float *z, int64_t n_,
                  int64_t groups_,
                  int64_t mg_, int64_t kg_, int64_t p_, int64_t xn, int64_t xk, int64_t yn, int64_t ym, int64_t wm,
                  int64_t begin, int64_t end, int64_t act, float alpha, float beta) {
    const int64_t g[G_COUNT] = {n_, groups_, mg_, kg_, p_, xn, xk, yn, ym, wm};
    const int64_t groups = g[G_GROUPS], mg = g[G_MG], kg = g[G_KG], pixels = g[G_P];
    const int64_t row_tiles = (mg + MR - 1) / MR, panels = (pixels + NR - 1) / NR;
    const act_t f = {alpha, beta, (int)act};
    /* a group's x that fits in the L2 cache is read there again by each band of rows, which then writes its
     * rows from left to right (few store streams); a larger x goes panel by panel, each panel kept in cache for
     * every band of rows */
    const int rows_outer = kg * pixels * (int64_t)sizeof(float) <= ROWS_OUTER_BYTES;
    for (int64_t t = begin; t < end; t++) {
        int64_t rt = t % row_tiles, panel = t / row_tiles % panels;
        if (rows_outer) rt = t / panels % row_tiles, panel = t % panels;
        const int64_t gi = t / (row_tiles * panels) % groups, n = t / (row_tiles * panels * groups);
        const int64_t m = gi * mg + rt * MR, p = panel * NR;
        const int64_t rows = mg - rt * MR < MR ? mg - rt * MR : MR, cols = pixels - p < NR ? pixels - p : NR;
        const int64_t at = n * g[G_YN] + m * g[G_YM] + p;
        const float *xt = x + n * g[G_XN] + gi * kg * g[G_XK] + p;
        if (panel == 0 && rt + 1 < row_tiles) /* the next band's weight rows: read once, from memory */
            prefetch_rows_l2(w + (m + MR) * g[G_WM], g[G_WM], mg - rt * MR - MR < MR ? mg - rt * MR - MR : MR, kg);
        int64_t tail = 0;
#if defined(__AVX512F__)
        if (p + cols == pixels && pixels > 16 && pixels % 16 <= TAIL_MAX && g[G_XK] <= INT32_MAX / 16)
            tail = pixels % 16;
#endif
        if (cols > tail)
            tile_any(w + m * g[G_WM], g[G_WM], xt, g[G_XK], y + at, z ? z + at : NULL, g[G_YM],
                     bias ? bias + m : NULL, kg, rows, cols - tail, f);
#if defined(__AVX512F__)
        if (tail)
            tail_pixels(w + m * g[G_WM], g[G_WM], xt + cols - tail, g[G_XK], y + at + cols - tail,
                        z ? z + at + cols - tail : NULL, g[G_YM], bias ? bias + m : NULL, kg, rows, tail, f);
#endif
    }
}


/* whether matmul_f32 runs vector code here (else numpy's BLAS is the better choice) */
int64_t matmul_f32_vectorized(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* Tiles [begin, end) of y[T, N] = a[T, K] @ b[K, N] (row strides lda, ldb, ldy in floats): a MatMul by a weight
 * read in place, no packed copy. The tile's broadcast operand is a (tokens), its loaded one b (64 weight columns
 * at a time). K goes in blocks of `kblock` weight rows (contiguous memory: a stream the prefetcher follows), each
 * block's product added to the last (the tile's residual input is y itself); within a block, tiles go panel by
 * panel of b, down all the row tiles of a panel, each of which asks a share of the next panel's rows into L2
 * (a weight read once per inference comes from memory, its panel rows too short a stream for the hardware).
 * The tiles of the range's last panel ask for its first panel's rows of the next block instead: a range of a few
 * panels (one thread's piece) would otherwise start every block on rows that come straight from memory (8 pieces
 * of 128x3072 @ 3072x768 on one thread took 23 % longer than one call before). */
void matmul_f32(const float *a, const float *b, float *y, int64_t t, int64_t k, int64_t n, int64_t lda, int64_t ldb,
                int64_t ldy, int64_t kblock, int64_t begin, int64_t end) {
    const int64_t row_tiles = (t + MR - 1) / MR;
    const act_t none = {0.0f, 0.0f, ACT_NONE};
    if (kblock <= 0 || kblock > k) kblock = k;
    const int64_t first_panel = begin / row_tiles * NR, last_panel = (end - 1) / row_tiles * NR;
    const int64_t first_width = n - first_panel < NR ? n - first_panel : NR;
    int64_t k0 = 0;
    do { /* once even for k == 0: y = 0 */
        const int64_t depth = k - k0 < kblock ? k - k0 : kblock;
        const int64_t next_depth = k - k0 - kblock < kblock ? k - k0 - kblock : kblock; /* <= 0 for none */
        for (int64_t i = begin; i < end; i++) {
            const int64_t rt = i % row_tiles, m = rt * MR, p = i / row_tiles * NR;
            const int64_t rows = t - m < MR ? t - m : MR, cols = n - p < NR ? n - p : NR;
            const int64_t next = n - p - NR < NR ? n - p - NR : NR; /* the next panel's width, <= 0 for none */
            if (p == last_panel && next_depth > 0)
                prefetch_rows_l2(b + (k0 + kblock + rt * next_depth / row_tiles) * ldb + first_panel, ldb,
                                 (rt + 1) * next_depth / row_tiles - rt * next_depth / row_tiles, first_width);
            else if (p != last_panel && next > 0)
                prefetch_rows_l2(b + (k0 + rt * depth / row_tiles) * ldb + p + NR, ldb,
                                 (rt + 1) * depth / row_tiles - rt * depth / row_tiles, next);
            float *yt = y + m * ldy + p;
            tile_any(a + m * lda + k0, lda, b + k0 * ldb + p, ldb, yt, k0 > 0 ? yt : NULL, ldy, NULL, depth, rows,
                     cols, none);
        }
        k0 += kblock;
    } while (k0 < k);
}

/* dst[o] = row[first + o * stride] where that lies in [0, w), else 0, for o < n */
static void gather_row(float *dst, const float *row, int64_t w, int64_t first, int64_t stride, int64_t n) {
#if defined(__AVX512F__)
    if (stride <= 2) {
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        for (int64_t o = 0; o < n; o += 16) {
            const int64_t c = first + o * stride; /* input column of lane 0 */
            __m512 v;
            if (stride == 1) {
                v = c >= 0 && c + 16 <= w ? _mm512_loadu_ps(row + c)
                                          : _mm512_maskz_loadu_ps(range_mask(-c, w - c), row + c);
            } else {
                __m512 lo, hi;
                if (c >= 0 && c + 32 <= w) {
                    lo = _mm512_loadu_ps(row + c);
                    hi = _mm512_loadu_ps(row + c + 16);
                } else {
                    lo = _mm512_maskz_loadu_ps(range_mask(-c, w - c), row + c);
                    hi = _mm512_maskz_loadu_ps(range_mask(-c - 16, w - c - 16), row + c + 16);
                }
                v = _mm512_permutex2var_ps(lo, even, hi);
            }
            _mm512_mask_storeu_ps(dst + o, tail_mask(n - o), v);
        }
        return;
    }
#endif
    for (int64_t o = 0; o < n; o++) {
        const int64_t c = first + o * stride;
        dst[o] = c >= 0 && c < w ? row[c] : 0.0f;
    }
}

/* Rows [begin, end) of the columns of output rows [r0, r1) of image x[C, H, W]: column row (c, i, j) holds, for
 * each output (r, o), x[c, r * sh - pt + i * dh, o * sw - pl + j * dw] (0 in the padding), at
 * cols[(c * KH + i) * KW + j][(r - r0) * OW + o]. */
void im2col_f32(const float *x, float *cols, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t ow,
                int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t r0, int64_t r1,
                int64_t begin, int64_t end) {
    const int64_t rows = r1 - r0;
    for (int64_t k = begin; k < end; k++) {
        const int64_t ci = k / (kh * kw), i = k / kw % kh, j = k % kw;
        const float *image = x + ci * h * w;
        if (i == 0 && j == 0 && ci + 1 < c) { /* the next plane's rows of this block, from memory for a large image */
            int64_t lo = r0 * sh - pt, hi = (r1 - 1) * sh - pt + (kh - 1) * dh;
            lo = lo < 0 ? 0 : lo, hi = hi >= h ? h - 1 : hi;
            prefetch_rows_l2(image + h * w + lo * w, w, hi - lo + 1, w);
        }
        float *dst = cols + k * rows * ow;
        for (int64_t r = r0; r < r1; r++, dst += ow) {
            const int64_t ih = r * sh - pt + i * dh;
            if (ih < 0 || ih >= h)
                memset(dst, 0, (size_t)ow * sizeof(float));
            else
                gather_row(dst, image + ih * w, w, j * dw - pl, sw, ow);
        }
    }
}

/* -- the kernels over the thread pool: the same arguments, the tiles [begin, end) split over `threads` ---------- */
CARRACK_POOL_CLIENT(convgemm)

typedef struct {
    const float *x, *w, *bias, *z;
    float *y;
    int64_t g[21];
    int64_t act;
    float alpha, beta;
    _Atomic int64_t failed;
} conv_call_t;

static void convgemm_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const conv_call_t *c = p;
    const int64_t *g = c->g;
    (void)slot;
    convgemm_f32(c->x, c->w, c->bias, c->y, c->z, g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], begin,
                 end, c->act, c->alpha, c->beta);
}

void convgemm_f32_threads(const float *x, const float *w, const float *bias, float *y, const float *z, int64_t n_,
                          int64_t groups_, int64_t mg_, int64_t kg_, int64_t p_, int64_t xn, int64_t xk, int64_t yn,
                          int64_t ym, int64_t wm, int64_t begin, int64_t end, int64_t act, float alpha, float beta,
                          int64_t threads) {
    conv_call_t c = {x, w, bias, z, y, {n_, groups_, mg_, kg_, p_, xn, xk, yn, ym, wm}, act, alpha, beta, 0};
    parallel_for(convgemm_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
}

static void dconv_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    conv_call_t *c = p;
    const int64_t *g = c->g;
    (void)slot;
    if (dconv_f32(c->x, c->w, c->bias, c->y, c->z, g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9],
                  g[10], g[11], g[12], g[13], g[14], g[15], begin, end, c->act, c->alpha, c->beta))
        atomic_store(&c->failed, 1);
}

/* Returns 0, or -1 when a piece ran out of memory. */
int64_t dconv_f32_threads(const float *x, const float *w, const float *bias, float *y, const float *z, int64_t n_,
                          int64_t groups, int64_t mg, int64_t cg, int64_t h, int64_t wd, int64_t kh, int64_t kw,
                          int64_t oh, int64_t ow, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt,
                          int64_t pl, int64_t begin, int64_t end, int64_t act, float alpha, float beta,
                          int64_t threads) {
    conv_call_t c = {x, w, bias, z, y, {n_, groups, mg, cg, h, wd, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl}, act,
                     alpha, beta, 0};
    parallel_for(dconv_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
    return atomic_load(&c.failed) ? -1 : 0;
}

typedef struct {
    const float *a, *b;
    float *y;
    int64_t t, k, n, lda, ldb, ldy, kblock;
} matmul_call_t;

static void matmul_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const matmul_call_t *c = p;
    (void)slot;
    matmul_f32(c->a, c->b, c->y, c->t, c->k, c->n, c->lda, c->ldb, c->ldy, c->kblock, begin, end);
}

/* A deep, narrow product (K at least DEEP_MIN and DEEP_RATIO x N: a transformer's FFN-down, 3072 -> 768) sums its
 * depth in two halves, y = (blocks of the first half) + (blocks of the second), whatever the thread count, so that
 * results do not depend on it: at two threads each thread runs one half over every output tile. Split by output
 * columns instead, each thread reads all of the activations and half of every weight row, and the two halves at
 * once took 8-15 % more CPU than the whole product on one thread (64x3072 @ 3072x768 and 128x3072 @ 3072x768 in
 * GPT-2 and BERT-base; the depth halves 0-4 % with their final addition). On one thread the halves and their sum
 * cost 2-4 % more than one sum; at K = 1536 (ViT-small's 1536 -> 384) 7 %, more than they saved: hence DEEP_MIN.
 * Measured on 64-197 rows; products of more than DEEP_MAX_ROWS rows keep one sum (and the buffer stays small). */
#define DEEP_RATIO 4
#define DEEP_MIN 2048
#define DEEP_MAX_ROWS 256

/* Where the second depth half starts (a whole number of blocks), or 0 for one sum over the whole depth. */
static int64_t deep_split(int64_t t, int64_t k, int64_t n, int64_t kblock) {
    if (kblock <= 0 || kblock > k) kblock = k;
    const int64_t blocks = (k + kblock - 1) / kblock;
    return t <= DEEP_MAX_ROWS && k >= DEEP_MIN && k >= DEEP_RATIO * n && blocks >= 2 ? blocks / 2 * kblock : 0;
}

/* The calling thread's buffer for a deep product's second half (kept for its next calls), NULL when it cannot
 * have `count` floats. */
static float *deep_scratch(int64_t count) {
    static _Thread_local float *buffer;
    static _Thread_local int64_t capacity;
    if (count > capacity) {
        float *bigger = malloc((size_t)count * sizeof *bigger);
        if (bigger == NULL) return NULL;
        free(buffer);
        buffer = bigger, capacity = count;
    }
    return buffer;
}

/* Items [begin, end) of (group, tile) pairs, group-major with `tiles` tiles a group: the group of the first item
 * and its tiles [*first, returned) that the items cover (a piece's run within one group). */
static inline int64_t group_tiles(int64_t begin, int64_t end, int64_t tiles, int64_t *group, int64_t *first) {
    *group = begin / tiles, *first = begin % tiles;
    const int64_t left = end - *group * tiles;
    return left < tiles ? left : tiles;
}

typedef struct {
    matmul_call_t m;
    float *second;        /* the second half's sums, [t, n] */
    int64_t tiles, split; /* tiles of the output; where the second half of the depth starts */
} deep_call_t;

/* Items are (half, tile) pairs, half-major: the first half's tiles write y, the second's `second`. */
static void deep_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const deep_call_t *c = p;
    const matmul_call_t *m = &c->m;
    (void)slot;
    while (begin < end) {
        int64_t half, first;
        const int64_t last = group_tiles(begin, end, c->tiles, &half, &first);
        const int64_t k0 = half ? c->split : 0, depth = half ? m->k - c->split : c->split;
        matmul_f32(m->a + k0, m->b + k0 * m->ldb, half ? c->second : m->y, m->t, depth, m->n, m->lda, m->ldb,
                   half ? m->n : m->ldy, m->kblock, first, last);
        begin = half * c->tiles + last;
    }
}

/* rows [begin, end) of y += second */
static void deep_sum_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const deep_call_t *c = p;
    const matmul_call_t *m = &c->m;
    (void)slot;
    for (int64_t r = begin; r < end; r++) {
        float *yr = m->y + r * m->ldy;
        const float *sr = c->second + r * m->n;
        for (int64_t j = 0; j < m->n; j++) yr[j] += sr[j];
    }
}

/* The whole product as two depth halves (deep_split), then their sum; 0 when its buffer cannot be had. */
static int matmul_deep(const matmul_call_t *m, int64_t tiles, int64_t split, int64_t threads) {
    float *second = deep_scratch(m->t * m->n);
    if (second == NULL) return 0;
    deep_call_t c = {*m, second, tiles, split};
    const int64_t items = 2 * tiles;
    parallel_for(deep_piece, &c, 0, items, threads < items ? threads : items, threads);
    parallel_for(deep_sum_piece, &c, 0, m->t, pieces_for(m->t, threads), threads);
    return 1;
}

void matmul_f32_threads(const float *a, const float *b, float *y, int64_t t, int64_t k, int64_t n, int64_t lda,
                        int64_t ldb, int64_t ldy, int64_t kblock, int64_t begin, int64_t end, int64_t threads) {
    matmul_call_t c = {a, b, y, t, k, n, lda, ldb, ldy, kblock};
    const int64_t tiles = ((t + MR - 1) / MR) * ((n + NR - 1) / NR);
    const int64_t split = begin == 0 && end == tiles ? deep_split(t, k, n, kblock) : 0;
    if (split > 0 && matmul_deep(&c, tiles, split, threads)) return;
    /* one piece per thread: every piece reads all of `a` again, block by block (from L3 once it has left the L2
     * to the weight's stream), so finer pieces cost more than the balance they buy (on one thread, 128x3072 @
     * 3072x768 in 8 pieces took 16 % longer than in 2) */
    const int64_t pieces = threads < end - begin ? threads : end - begin;
    parallel_for(matmul_piece, &c, begin, end, pieces, threads);
}

typedef struct {
    matmul_call_t m;
    int64_t tiles, inner, sa0, sa1, sb0, sb1, sy0, sy1;
} batched_call_t;

/* Items are (product, tile) pairs, product-major: a piece's items of one product go to one matmul_f32 call. */
static void batched_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const batched_call_t *c = p;
    const matmul_call_t *m = &c->m;
    (void)slot;
    while (begin < end) {
        int64_t product, first;
        const int64_t last = group_tiles(begin, end, c->tiles, &product, &first);
        const int64_t outer = product / c->inner, inner = product % c->inner;
        matmul_f32(m->a + outer * c->sa0 + inner * c->sa1, m->b + outer * c->sb0 + inner * c->sb1,
                   m->y + outer * c->sy0 + inner * c->sy1, m->t, m->k, m->n, m->lda, m->ldb, m->ldy, m->kblock, first,
                   last);
        begin = product * c->tiles + last;
    }
}

/* y[o, i] = a[o, i] @ b[o, i] for o < outer, i < inner: products of [T, K] by [K, N] (rows strided by lda, ldb,
 * ldy floats; the products sa*, sb*, sy* floats apart), e.g. attention's scores and context over (batch, head). */
void matmul_f32_batched_threads(const float *a, const float *b, float *y, int64_t outer, int64_t inner, int64_t t,
                                int64_t k, int64_t n, int64_t lda, int64_t ldb, int64_t ldy, int64_t kblock,
                                int64_t sa0, int64_t sa1, int64_t sb0, int64_t sb1, int64_t sy0, int64_t sy1,
                                int64_t threads) {
    const int64_t tiles = ((t + MR - 1) / MR) * ((n + NR - 1) / NR), items = outer * inner * tiles;
    batched_call_t c = {{a, b, y, t, k, n, lda, ldb, ldy, kblock}, tiles, inner, sa0, sa1, sb0, sb1, sy0, sy1};
    parallel_for(batched_piece, &c, 0, items, pieces_for(items, threads), threads);
}

/* y[i, j] = dot(a[i, :], b[j, :]) for rows i < t and columns j in [begin, end): a product by a transposed weight
 * (Gemm's transB) for a few rows, where each weight row is read once, straight from memory. Each dot product
 * sums in 16 lanes, then the lanes in a fixed order: the same result whatever range a column falls in. */
void matmul_bt_f32(const float *a, const float *b, float *y, int64_t t, int64_t k, int64_t lda, int64_t ldb,
                   int64_t ldy, int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; j++) {
        const float *w = b + j * ldb;
        for (int64_t i = 0; i < t; i++) {
            const float *x = a + i * lda;
            float lanes[16] = {0};
            int64_t p = 0;
            for (; p + 16 <= k; p += 16)
                for (int l = 0; l < 16; l++) lanes[l] += x[p + l] * w[p + l];
            float total = 0.0f;
            for (int l = 0; l < 16; l++) total += lanes[l];
            for (; p < k; p++) total += x[p] * w[p];
            y[i * ldy + j] = total;
        }
    }
}

typedef struct {
    const float *a, *b;
    float *y;
    int64_t t, k, lda, ldb, ldy;
} bt_call_t;

static void bt_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const bt_call_t *c = p;
    (void)slot;
    matmul_bt_f32(c->a, c->b, c->y, c->t, c->k, c->lda, c->ldb, c->ldy, begin, end);
}

void matmul_bt_f32_threads(const float *a, const float *b, float *y, int64_t t, int64_t k, int64_t lda, int64_t ldb,
                           int64_t ldy, int64_t begin, int64_t end, int64_t threads) {
    bt_call_t c = {a, b, y, t, k, lda, ldb, ldy};
    parallel_for(bt_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
}

typedef struct {
    const float *x;
    float *cols;
    int64_t g[14];
} im2col_call_t;

static void im2col_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const im2col_call_t *c = p;
    const int64_t *g = c->g;
    (void)slot;
    im2col_f32(c->x, c->cols, g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13],
               begin, end);
}

void im2col_f32_threads(const float *x, float *cols, int64_t c, int64_t h, int64_t w, int64_t kh, int64_t kw,
                        int64_t ow, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t r0,
                        int64_t r1, int64_t begin, int64_t end, int64_t threads) {
    im2col_call_t call = {x, cols, {c, h, w, kh, kw, ow, sh, sw, dh, dw, pt, pl, r0, r1}};
    parallel_for(im2col_piece, &call, begin, end, pieces_for(end - begin, threads), threads);
}

/* Items [begin, end) of a transposing copy: dst[o, i, c, r] = src[o * so + i * si + r * sr + c] for r < rows,
 * c < cols, dst contiguous, e.g. attention's keys (B, N, L, H) as (B, N, H, L) for the scores product. An item is a
 * band of TRANSPOSE_BAND columns (destination rows) of one matrix, copied in square blocks that stay in L1. */
#define TRANSPOSE_BAND 16
void transpose_f32(const float *src, float *dst, int64_t inner, int64_t rows, int64_t cols, int64_t so, int64_t si,
                   int64_t sr, int64_t begin, int64_t end) {
    const int64_t bands = (cols + TRANSPOSE_BAND - 1) / TRANSPOSE_BAND;
    for (int64_t item = begin; item < end; item++) {
        const int64_t matrix = item / bands, c0 = item % bands * TRANSPOSE_BAND;
        const int64_t c1 = c0 + TRANSPOSE_BAND < cols ? c0 + TRANSPOSE_BAND : cols;
        const float *s = src + matrix / inner * so + matrix % inner * si;
        float *d = dst + matrix * rows * cols;
        for (int64_t r0 = 0; r0 < rows; r0 += TRANSPOSE_BAND) {
            const int64_t r1 = r0 + TRANSPOSE_BAND < rows ? r0 + TRANSPOSE_BAND : rows;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++) d[c * rows + r] = s[r * sr + c];
        }
    }
}

typedef struct {
    const float *src;
    float *dst;
    int64_t inner, rows, cols, so, si, sr;
} transpose_call_t;

static void transpose_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const transpose_call_t *c = p;
    (void)slot;
    transpose_f32(c->src, c->dst, c->inner, c->rows, c->cols, c->so, c->si, c->sr, begin, end);
}

void transpose_f32_threads(const float *src, float *dst, int64_t inner, int64_t rows, int64_t cols, int64_t so,
                           int64_t si, int64_t sr, int64_t begin, int64_t end, int64_t threads) {
    transpose_call_t c = {src, dst, inner, rows, cols, so, si, sr};
    parallel_for(transpose_piece, &c, begin, end, pieces_for(end - begin, threads), threads);
}
