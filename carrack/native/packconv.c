/* Convolution on weights packed once, float32: 2-D convolutions of any kernel size, stride, dilation, padding and
 * group count (1x1 ones included) as an implicit matrix product
 *
 *     y[n, g * Mg + m, p] = act(bias[g * Mg + m] + sum_k wp[g, m, k] * cols[n, g, k, p] + z[n, g * Mg + m, p])
 *
 * where the depth k runs tap by tap (k = tap * Cg + c, tap = i * KW + j) and cols[k, p] is what tap (i, j) of input
 * channel c reads for output pixel p (0 in the padding). Nothing is materialized beyond one block of it:
 *
 * - the weights are packed once (packconv_pack_weights, at bind time) into panels of PR = 6 output rows, each
 *   panel's depth contiguous with its 6 rows side by side, zero rows past the group's last: the tile's 6
 *   broadcasts of a depth step come from one 24-byte run of memory;
 * - the depth goes in blocks of at most KC = 128 steps. For each pixel panel of PW = 64 outputs, a block's columns are
 *   gathered into a 32 KiB buffer that stays in the L1 cache (masked vector loads straight from the image where
 *   a vector's 16 outputs read 16 consecutive or every other input, a gather where they cross output rows), then
 *   every row panel runs over it: a 6 x 64 tile in 24 vector registers, started from the bias (first block) or
 *   from the partial sums stored by the previous block, finished with the residual and the activation in the
 *   last. A 1x1 convolution with unit strides and no padding reads its image in place (no buffer), or, over many
 *   row panels, copies its rows into the buffer (pointwise_copies: aligned loads, no L1 set conflicts);
 * - a panel's one pixel past its whole vectors (7x7 maps: 49 = 3 x 16 + 1) is a dot product instead (tail_dot);
 * - while a chunk's first pixel panel runs a row panel, the next row panel's weights are prefetched into the L2
 *   cache a few lines at a time (tile_next);
 * - pixel panels go in chunks whose output rows stay in the L2 cache across the depth blocks; with fewer pixel
 *   panels than 4 per thread (7x7 and 14x14 maps) the threads split the output rows too.
 *
 * Each output element sums its depth in the same order whatever the split over threads: results do not depend on
 * the thread count. AVX-512 only (packconv_vectorized); elsewhere carrack uses its other convolution paths.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "threadpool.h"

#include "activations.h"

#define PR 6             /* output rows per weight panel (a tile's rows) */
#define PW 64            /* output pixels per pixel panel (a tile's 4 vectors) */
#ifndef KC
#define KC 128 /* depth steps per block at most: a block's columns for one pixel panel are 32 KiB */
#endif
#ifndef CHUNK_BYTES
#define CHUNK_BYTES (512 * 1024) /* a chunk of pixel panels: its output rows (all row panels) stay in the L2 cache */
#endif

/* the floats of a packed weight for `groups` groups of mg rows and `depth` steps */
int64_t packconv_weights_size(int64_t groups, int64_t mg, int64_t depth) {
    return groups * ((mg + PR - 1) / PR) * PR * depth;
}

/* wp = w[G * Mg, Cg, KH, KW] packed (see the header): wp[g][panel][k][r] = w[g * Mg + panel * PR + r, c, i, j]
 * for k = (i * KW + j) * Cg + c, 0 for rows past Mg. */
void packconv_pack_weights(const float *w, float *wp, int64_t groups, int64_t mg, int64_t cg, int64_t taps) {
    const int64_t panels = (mg + PR - 1) / PR, depth = cg * taps;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t pn = 0; pn < panels; pn++) {
            float *dst = wp + (g * panels + pn) * depth * PR;
            for (int64_t tap = 0; tap < taps; tap++)
                for (int64_t c = 0; c < cg; c++, dst += PR)
                    for (int64_t r = 0; r < PR; r++) {
                        const int64_t m = pn * PR + r;
                        dst[r] = m < mg ? w[((g * mg + m) * cg + c) * taps + tap] : 0.0f;
                    }
        }
}

/* geometry: images, groups, output rows and input channels per group, input size, kernel, output size, strides,
 * dilations, leading pads */
typedef struct {
    int64_t n, groups, mg, cg, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl;
} geom_t;

/* Whether a 1x1 convolution that could read its image in place (unit strides, no padding) copies each pixel panel's
 * depth block into the aligned buffer instead, for a piece of `row_panels` weight panels. In place, a tile's loads
 * are unaligned wherever the plane is not a multiple of 16 floats (squeezenet's 13x13, 27x27 and 55x55 maps), and a
 * block's 128 rows, a plane apart, fall on few L1 sets where the plane is a multiple of 1 KiB (32x32, 64x64: half
 * the speed). The copy costs a store per vector once per pixel panel and block, paid back over the row panels: by
 * 24 of them on small maps (conv10's 1000 outputs on 169 pixels: 9-13 % faster; 96 outputs on 14x14: 4 % slower),
 * by 8 on maps of 512 pixels or more (resnet50's 1x1 layers on 56x56 and 28x28: 5-25 % faster); with fewer
 * (squeeze layers of 16 to 64 outputs) it cost up to a quarter more. */
static inline int pointwise_copies(int64_t plane, int64_t row_panels) {
    return row_panels >= 24 || (row_panels >= 8 && plane >= 512);
}

/* pointwise_copies, for tests */
int64_t packconv_pointwise_copies(int64_t plane, int64_t row_panels) { return pointwise_copies(plane, row_panels); }

#if defined(__AVX512F__)

int64_t packconv_vectorized(void) { return 1; }

enum { V_ZERO, V_RUN, V_EVEN, V_GATHER };

/* How one vector of a pixel panel reads one kernel tap from a plane: nothing (all padding), 16 consecutive floats
 * from `base` (masked), every other float of 32 from `base`, or a gather of `index` (masked). */
typedef struct {
    __m512i index;
    int32_t kind, base;
    __mmask16 lanes, lo, hi;
} vread_t;

static inline __mmask16 tail_mask(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* lanes l < 16 with lo <= l < hi */
static inline __mmask16 lanes_between(int64_t lo, int64_t hi) {
    return (__mmask16)(tail_mask(hi) & ~tail_mask(lo));
}

/* the reads of tap (i, j) by vector v of the panel whose output rows and columns per lane are row[v], col[v]
 * (valid[v]: the lanes that are outputs) */
static void tap_reads(const geom_t *G, const __m512i *row, const __m512i *col, const __mmask16 *valid, int64_t i,
                      int64_t j, vread_t *reads) {
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i zero = _mm512_setzero_si512(), h = _mm512_set1_epi32((int32_t)G->h);
    const __m512i wd = _mm512_set1_epi32((int32_t)G->w);
    const __m512i di = _mm512_set1_epi32((int32_t)(i * G->dh - G->pt));
    const __m512i dj = _mm512_set1_epi32((int32_t)(j * G->dw - G->pl));
    for (int v = 0; v < 4; v++) {
        const __m512i ih = _mm512_add_epi32(_mm512_mullo_epi32(row[v], _mm512_set1_epi32((int32_t)G->sh)), di);
        const __m512i iw = _mm512_add_epi32(_mm512_mullo_epi32(col[v], _mm512_set1_epi32((int32_t)G->sw)), dj);
        __mmask16 m = valid[v];
        m = _mm512_mask_cmpge_epi32_mask(m, ih, zero);
        m = _mm512_mask_cmplt_epi32_mask(m, ih, h);
        m = _mm512_mask_cmpge_epi32_mask(m, iw, zero);
        m = _mm512_mask_cmplt_epi32_mask(m, iw, wd);
        const __m512i off = _mm512_add_epi32(_mm512_mullo_epi32(ih, wd), iw);
        vread_t *r = reads + v;
        r->lanes = m, r->index = off, r->lo = r->hi = 0, r->base = 0;
        if (!m) {
            r->kind = V_ZERO;
            continue;
        }
        int32_t offs[16];
        _mm512_storeu_si512(offs, off);
        const int first = __builtin_ctz(m);
        const int32_t run = offs[first] - first, even = offs[first] - 2 * first;
        if (_mm512_mask_cmpneq_epi32_mask(m, _mm512_sub_epi32(off, lane), _mm512_set1_epi32(run)) == 0) {
            r->kind = V_RUN, r->base = run;
        } else if (_mm512_mask_cmpneq_epi32_mask(m, _mm512_sub_epi32(off, _mm512_add_epi32(lane, lane)),
                                                 _mm512_set1_epi32(even)) == 0) {
            r->kind = V_EVEN, r->base = even; /* lane l reads float 2 l of the 32 from base */
            r->lo = (__mmask16)_pdep_u32(m & 0xFFu, 0x5555u), r->hi = (__mmask16)_pdep_u32(m >> 8, 0x5555u);
        } else {
            r->kind = V_GATHER;
        }
    }
}

/* The lanes l of a vector whose input column iw0 + l * s is inside [0, w), for strides s of 1 or 2 (shifts: a
 * division here took a sixth of a stem layer's packing) */
static inline __mmask16 lanes_inside(int64_t iw0, int64_t s, int64_t w) {
    const int shift = s == 2;
    const int64_t lo = iw0 >= 0 ? 0 : (-iw0 + s - 1) >> shift, hi = iw0 >= w ? 0 : ((w - 1 - iw0) >> shift) + 1;
    return lanes_between(lo, hi);
}

/* tap_reads for a panel whose vectors each stay within one output row (row0[v], columns col0[v] + l) and strides of
 * 1 or 2, in scalar code: descriptors that read what tap_reads' read (a one-lane stride-2 read is V_EVEN here, a
 * run there: the same float), for a fraction of the cost. A 7x7 stem on 3 channels asks for them every 3 depth
 * steps. */
static void tap_reads_one_row(const geom_t *G, const int32_t *row0, const int32_t *col0, const __mmask16 *valid,
                              int64_t i, int64_t j, vread_t *reads) {
    for (int v = 0; v < 4; v++) {
        const int64_t ih = row0[v] * G->sh + i * G->dh - G->pt, iw0 = col0[v] * G->sw + j * G->dw - G->pl;
        const __mmask16 m = ih >= 0 && ih < G->h ? valid[v] & lanes_inside(iw0, G->sw, G->w) : 0;
        vread_t *r = reads + v;
        r->lanes = m, r->lo = r->hi = 0, r->base = 0;
        if (!m) {
            r->kind = V_ZERO;
        } else if (G->sw == 1) {
            r->kind = V_RUN, r->base = (int32_t)(ih * G->w + iw0);
        } else {
            r->kind = V_EVEN, r->base = (int32_t)(ih * G->w + iw0);
            r->lo = (__mmask16)_pdep_u32(m & 0xFFu, 0x5555u), r->hi = (__mmask16)_pdep_u32(m >> 8, 0x5555u);
        }
    }
}

static inline __m512 read_vector(const float *plane, const vread_t *r) {
    switch (r->kind) {
    case V_RUN: return _mm512_maskz_loadu_ps(r->lanes, plane + r->base);
    case V_EVEN: {
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        return _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(r->lo, plane + r->base), even,
                                      _mm512_maskz_loadu_ps(r->hi, plane + r->base + 16));
    }
    case V_GATHER: return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), r->lanes, r->index, plane, 4);
    default: return _mm512_setzero_ps();
    }
}

/* buf[kk][0..64) = the columns of depth steps [k0, k0 + kc) for pixel panel p0 of image plane set `img` (the
 * group's Cg planes) */
static void pack_columns(const geom_t *G, const float *img, int64_t p0, int64_t k0, int64_t kc, float *buf) {
    const int64_t pixels = G->oh * G->ow, plane = G->h * G->w;
    __m512i row[4], col[4];
    __mmask16 valid[4];
    int32_t row0[4], col0[4];
    int one_row = G->sw <= 2; /* every vector's outputs in one row: tap_reads_one_row */
    for (int v = 0; v < 4; v++) {
        const int64_t p = p0 + 16 * v;
        row0[v] = (int32_t)(p / G->ow), col0[v] = (int32_t)(p % G->ow);
        one_row &= col0[v] + (pixels - p < 16 ? pixels - p : 16) <= G->ow;
        valid[v] = tail_mask(pixels - p);
    }
    for (int v = 0; v < 4 && !one_row; v++) { /* each lane's output row and column, for tap_reads */
        int32_t r[16], c[16], ri = row0[v], ci = col0[v];
        for (int l = 0; l < 16; l++) {
            r[l] = ri, c[l] = ci;
            if (++ci == G->ow) ci = 0, ri++;
        }
        row[v] = _mm512_loadu_si512(r), col[v] = _mm512_loadu_si512(c);
    }
    vread_t reads[4];
    /* tap by tap: the depth steps [kk, end) read tap (i, j) of channels c.. (counted on, not divided: four
     * divisions a tap were a third of a stem's packing, whose taps are 3 channels deep) */
    int64_t c = k0 % G->cg, i = k0 / G->cg / G->kw, j = k0 / G->cg % G->kw;
    for (int64_t kk = 0; kk < kc; c = 0, j = j + 1 == G->kw ? 0 : j + 1, i += j == 0) {
        const int64_t end = kc < kk + G->cg - c ? kc : kk + G->cg - c;
        if (one_row)
            tap_reads_one_row(G, row0, col0, valid, i, j, reads);
        else
            tap_reads(G, row, col, valid, i, j, reads);
        const float *src = img + c * plane;
        float *dst = buf + kk * PW;
        if (reads[0].kind == V_RUN && reads[1].kind == V_RUN && reads[2].kind == V_RUN && reads[3].kind == V_RUN) {
            /* the common case (stride 1, outputs as wide as the input): 4 masked loads a channel */
            const __mmask16 m0 = reads[0].lanes, m1 = reads[1].lanes, m2 = reads[2].lanes, m3 = reads[3].lanes;
            const int32_t b0 = reads[0].base, b1 = reads[1].base, b2 = reads[2].base, b3 = reads[3].base;
            for (; kk < end; kk++, src += plane, dst += PW) {
                _mm512_store_ps(dst, _mm512_maskz_loadu_ps(m0, src + b0));
                _mm512_store_ps(dst + 16, _mm512_maskz_loadu_ps(m1, src + b1));
                _mm512_store_ps(dst + 32, _mm512_maskz_loadu_ps(m2, src + b2));
                _mm512_store_ps(dst + 48, _mm512_maskz_loadu_ps(m3, src + b3));
            }
            continue;
        }
        if (reads[0].kind == V_EVEN && reads[1].kind == V_EVEN && reads[2].kind == V_EVEN && reads[3].kind == V_EVEN) {
            /* stride 2 (a stem's): two masked loads and a permute a vector, without the per-vector dispatch */
            const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
            for (; kk < end; kk++, src += plane, dst += PW)
                for (int v = 0; v < 4; v++) {
                    const float *at = src + reads[v].base;
                    _mm512_store_ps(dst + 16 * v,
                                    _mm512_permutex2var_ps(_mm512_maskz_loadu_ps(reads[v].lo, at), even,
                                                           _mm512_maskz_loadu_ps(reads[v].hi, at + 16)));
                }
            continue;
        }
        for (; kk < end; kk++, src += plane, dst += PW)
            for (int v = 0; v < 4; v++) _mm512_store_ps(dst + 16 * v, read_vector(src, reads + v));
    }
}

/* the activation of 16 lanes past Clip's code (none, Relu and Clip are a clamp, inline in the tile's store); NaN
 * stays NaN (max/min return their second operand on NaN) */
static __attribute__((noinline)) __m512 act512_any(__m512 v, act_t f) {
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    switch (f.act) {
    case ACT_LEAKY: return _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, zero, _CMP_LT_OQ), v, _mm512_set1_ps(f.a));
    case ACT_HARDSIGMOID:
        return _mm512_min_ps(one, _mm512_max_ps(zero, _mm512_fmadd_ps(v, _mm512_set1_ps(f.a), _mm512_set1_ps(f.b))));
    case ACT_HARDSWISH: {
        const __m512 s = _mm512_fmadd_ps(v, _mm512_set1_ps(1.0f / 6.0f), _mm512_set1_ps(0.5f));
        return _mm512_mul_ps(v, _mm512_min_ps(one, _mm512_max_ps(zero, s)));
    }
    default: { /* the rest (Sigmoid) lane by lane: rare in the fused convolutions */
        float lanes[16];
        _mm512_storeu_ps(lanes, v);
        for (int l = 0; l < 16; l++) lanes[l] = act_scalar(lanes[l], f);
        return _mm512_loadu_ps(lanes);
    }
    }
}

/* What a tile does besides its product: where it starts (the bias, or the partial sums in y), and, in the last
 * depth block, the residual and the activation. */
typedef struct {
    const float *bias, *z; /* at the tile's first row; NULL for none */
    int first, last, rows;
    act_t f;
    const float *z_next; /* the next tile's residual (same pixels, the next 6 rows), prefetched in the last block */
} finish_t;

#define ACC_INIT(i)                                                                                                \
    __m512 a##i##0, a##i##1, a##i##2, a##i##3;                                                                     \
    if (F->first) {                                                                                                \
        a##i##0 = a##i##1 = a##i##2 = a##i##3 = _mm512_set1_ps(F->bias && F->rows > i ? F->bias[i] : 0.0f);        \
    } else if (F->rows > i) {                                                                                      \
        a##i##0 = load_lanes(y + i * ldy, m[0], full);                                                             \
        a##i##1 = nv > 1 ? load_lanes(y + i * ldy + 16, m[1], full) : a##i##0;                                     \
        a##i##2 = nv > 2 ? load_lanes(y + i * ldy + 32, m[2], full) : a##i##0;                                     \
        a##i##3 = nv > 3 ? load_lanes(y + i * ldy + 48, m[3], full) : a##i##0;                                     \
    } else {                                                                                                       \
        a##i##0 = a##i##1 = a##i##2 = a##i##3 = _mm512_setzero_ps();                                               \
    }
#define ACC_FMA(i)                                                                                                 \
    {                                                                                                              \
        const __m512 wb = _mm512_set1_ps(wk[i]);                                                                   \
        a##i##0 = _mm512_fmadd_ps(wb, x0, a##i##0);                                                                \
        if (nv > 1) a##i##1 = _mm512_fmadd_ps(wb, x1, a##i##1);                                                    \
        if (nv > 2) a##i##2 = _mm512_fmadd_ps(wb, x2, a##i##2);                                                    \
        if (nv > 3) a##i##3 = _mm512_fmadd_ps(wb, x3, a##i##3);                                                    \
    }
#define ACC_STORE_ONE(i, q)                                                                                        \
    if (nv > q) {                                                                                                  \
        __m512 v = a##i##q;                                                                                        \
        if (F->last) {                                                                                             \
            if (F->z) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m[q], F->z + i * ldy + 16 * q));                  \
            v = F->f.act > ACT_CLIP ? act512_any(v, F->f) : _mm512_min_ps(hi, _mm512_max_ps(lo, v));               \
        }                                                                                                          \
        _mm512_mask_storeu_ps(y + i * ldy + 16 * q, m[q], v);                                                      \
    }
#define ACC_STORE(i)                                                                                               \
    if (F->rows > i) {                                                                                             \
        ACC_STORE_ONE(i, 0) ACC_STORE_ONE(i, 1) ACC_STORE_ONE(i, 2) ACC_STORE_ONE(i, 3)                            \
    }

/* One 6-row tile over `depth` steps: wp the panel's packed weights at the block's first step, b the columns
 * (ldb floats from one step to the next), y the tile's first output (rows ldy apart), m the lanes of its nv
 * vectors that are outputs. */
static inline __attribute__((always_inline)) __m512 load_lanes(const float *p, __mmask16 m, const int full) {
    return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p); /* a masked load costs an ALU slot too */
}

#define TILE_STEP(k)                                                                                               \
    {                                                                                                              \
        const float *xr = b + (k) * ldb, *wk = wp + (k) * PR;                                                      \
        const __m512 x0 = load_lanes(xr, m[0], full);                                                              \
        const __m512 x1 = nv > 1 ? load_lanes(xr + 16, m[1], full) : x0;                                           \
        const __m512 x2 = nv > 2 ? load_lanes(xr + 32, m[2], full) : x0;                                           \
        const __m512 x3 = nv > 3 ? load_lanes(xr + 48, m[3], full) : x0;                                           \
        ACC_FMA(0) ACC_FMA(1) ACC_FMA(2) ACC_FMA(3) ACC_FMA(4) ACC_FMA(5)                                          \
    }

/* the three lines of the next row panel's weights for depth steps k .. k + 7 (into L2) */
#define PREFETCH_NEXT_WEIGHTS(k)                                                                                      \
    do {                                                                                                             \
        const char *line = (const char *)(next + (k) * PR);                                                          \
        _mm_prefetch(line, _MM_HINT_T1), _mm_prefetch(line + 64, _MM_HINT_T1);                                       \
        _mm_prefetch(line + 128, _MM_HINT_T1);                                                                       \
    } while (0)

/* full: every lane of the nv vectors is an output (plain loads). next: NULL, or the next row panel's weights for
 * the same depth steps, fetched into the L2 cache while this tile runs: 3 lines (8 depth steps of a panel) every 8
 * steps. A burst of those prefetches before the tile (a model's weights come from memory) stalled on the line fill
 * buffers: 9-15 % of a 1x1 layer on 14x14 and 7x7 maps, whose weights are large and pixels few. In the last depth
 * block, the next tile's residual lines (F->z_next) come into L1 the same way, one every depth / (6 nv) steps: a
 * residual read in the finish waited for memory (a 64->256 1x1 layer on 56x56 took a third longer with it). Maps
 * of 4 pixel panels or fewer (14x14, 7x7) do not: their residual stays in L2 and the prefetches cost 3-5 %. */
static inline __attribute__((always_inline)) void tile_next(const float *wp, const float *b, int64_t ldb,
                                                            int64_t depth, float *y, int64_t ldy, const __mmask16 *m,
                                                            const int nv, const int full, const finish_t *F,
                                                            const float *next) {
    ACC_INIT(0) ACC_INIT(1) ACC_INIT(2) ACC_INIT(3) ACC_INIT(4) ACC_INIT(5)
    const float *z_next = F->last ? F->z_next : NULL;
    if (z_next) {
        const int64_t z_lines = PR * nv, every = depth > z_lines ? depth / z_lines : 1;
        int64_t z_line = 0, z_row = 0, z_vector = 0, wait = 0;
        for (int64_t k = 0; k < depth; k++) {
            if (next && (k & 7) == 0) PREFETCH_NEXT_WEIGHTS(k);
            if (wait-- == 0 && z_line < z_lines) {
                _mm_prefetch((const char *)(z_next + z_row * ldy + 16 * z_vector), _MM_HINT_T0);
                z_line++, wait = every - 1;
                if (++z_vector == nv) z_vector = 0, z_row++;
            }
            TILE_STEP(k)
        }
    } else if (next) {
        for (int64_t k = 0; k < depth; k++) {
            if ((k & 7) == 0) PREFETCH_NEXT_WEIGHTS(k);
            TILE_STEP(k)
        }
    } else {
        for (int64_t k = 0; k < depth; k++) TILE_STEP(k)
    }
    /* none, Relu and Clip as a clamp to [lo, hi]: -inf/inf, 0/inf, a/b */
    const __m512 lo = _mm512_set1_ps(F->f.act == ACT_NONE ? -INFINITY : F->f.act == ACT_RELU ? 0.0f : F->f.a);
    const __m512 hi = _mm512_set1_ps(F->f.act == ACT_CLIP ? F->f.b : INFINITY);
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5)
}

static inline __attribute__((always_inline)) void tile(const float *wp, const float *b, int64_t ldb, int64_t depth,
                                                       float *y, int64_t ldy, const __mmask16 *m, const int nv,
                                                       const int full, const finish_t *F) {
    tile_next(wp, b, ldb, depth, y, ldy, m, nv, full, F, NULL);
}

/* tile_nv with the next row panel's weights prefetched (see tile_next; next may be NULL) */
static void tile_nv_next(const float *wp, const float *b, int64_t ldb, int64_t depth, float *y, int64_t ldy,
                         const __mmask16 *m, int nv, const finish_t *F, const float *next) {
    if (m[nv - 1] == 0xFFFF) {
        switch (nv) {
        case 1: tile_next(wp, b, ldb, depth, y, ldy, m, 1, 1, F, next); break;
        case 2: tile_next(wp, b, ldb, depth, y, ldy, m, 2, 1, F, next); break;
        case 3: tile_next(wp, b, ldb, depth, y, ldy, m, 3, 1, F, next); break;
        default: tile_next(wp, b, ldb, depth, y, ldy, m, 4, 1, F, next); break;
        }
        return;
    }
    switch (nv) {
    case 1: tile_next(wp, b, ldb, depth, y, ldy, m, 1, 0, F, next); break;
    case 2: tile_next(wp, b, ldb, depth, y, ldy, m, 2, 0, F, next); break;
    case 3: tile_next(wp, b, ldb, depth, y, ldy, m, 3, 0, F, next); break;
    default: tile_next(wp, b, ldb, depth, y, ldy, m, 4, 0, F, next); break;
    }
}

static __attribute__((unused)) void tile_nv(const float *wp, const float *b, int64_t ldb, int64_t depth, float *y,
                                            int64_t ldy, const __mmask16 *m, int nv, const finish_t *F) {
    tile_nv_next(wp, b, ldb, depth, y, ldy, m, nv, F, NULL);
}

/* A panel's last pixel past its whole vectors (the 49th of a 7x7 map) is a dot product along the depth instead of a
 * vector of its own that would idle 15 of its 16 lanes through the whole depth: 8 depth steps of a weight panel are
 * 48 contiguous floats (3 vectors), multiplied by the pixel's 8 column values each repeated 6 times. It costs
 * about half a 16-lane vector's work (the permutes share the FMA ports, the 48 lanes are summed at the end), so it
 * pays for one pixel, not for two (measured the same at 1, 2 and 4 on 7x7 and 14x14 maps). */
#ifndef TAIL_MAX
#define TAIL_MAX 1
#endif

/* sums[r] = sum over k < kc of wp[k * PR + r] * column[k], r < PR, in a fixed order */
static void tail_dot(const float *wp, const float *column, int64_t kc, float *sums) {
    const __m512i i0 = _mm512_set_epi32(2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0);
    const __m512i i1 = _mm512_set_epi32(5, 5, 4, 4, 4, 4, 4, 4, 3, 3, 3, 3, 3, 3, 2, 2);
    const __m512i i2 = _mm512_set_epi32(7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 5, 5, 5, 5);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= kc; k += 8) {
        const __m512 xv = _mm512_castps256_ps512(_mm256_loadu_ps(column + k));
        const float *w = wp + k * PR;
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w), _mm512_permutexvar_ps(i0, xv), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 16), _mm512_permutexvar_ps(i1, xv), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + 32), _mm512_permutexvar_ps(i2, xv), a2);
    }
    float lanes[48];
    _mm512_storeu_ps(lanes, a0), _mm512_storeu_ps(lanes + 16, a1), _mm512_storeu_ps(lanes + 32, a2);
    for (int r = 0; r < PR; r++) {
        float total = 0.0f;
        for (int q = r; q < 48; q += PR) total += lanes[q];
        for (int64_t j = k; j < kc; j++) total += wp[j * PR + r] * column[j];
        sums[r] = total;
    }
}

/* The tail pixels of a tile: columns[j] the depth block's values of tail pixel j (tails of them, at y[.., j], the
 * residual at z[.., j]) */
static __attribute__((noinline)) void tail_pixels(const float *wp, const float *columns, int64_t kc, int64_t tails,
                                                  float *y, const float *z, int64_t ldy, const finish_t *F) {
    for (int64_t j = 0; j < tails; j++) {
        float sums[PR];
        tail_dot(wp, columns + j * KC, kc, sums);
        for (int r = 0; r < F->rows; r++) {
            float v = sums[r] + (F->first ? (F->bias ? F->bias[r] : 0.0f) : y[r * ldy + j]);
            if (F->last) {
                if (z) v += z[r * ldy + j];
                v = act_scalar(v, F->f);
            }
            y[r * ldy + j] = v;
        }
    }
}

static inline void prefetch_l2(const float *p, int64_t count) {
    for (int64_t i = 0; i < count; i += 16) _mm_prefetch((const char *)(p + i), _MM_HINT_T1);
}

/* buf[kk][0..64) = src[kk * plane + 0..pixels) for kk < kc, pixels <= PW (0 past them): a 1x1 convolution's columns,
 * which are rows of its image */
static void copy_pointwise_columns(const float *src, int64_t plane, int64_t kc, int64_t pixels, float *buf) {
    const __mmask16 m0 = tail_mask(pixels), m1 = tail_mask(pixels - 16), m2 = tail_mask(pixels - 32);
    const __mmask16 m3 = tail_mask(pixels - 48);
    for (int64_t kk = 0; kk < kc; kk++, src += plane, buf += PW) {
        _mm512_store_ps(buf, _mm512_maskz_loadu_ps(m0, src));
        _mm512_store_ps(buf + 16, _mm512_maskz_loadu_ps(m1, src + 16));
        _mm512_store_ps(buf + 32, _mm512_maskz_loadu_ps(m2, src + 32));
        _mm512_store_ps(buf + 48, _mm512_maskz_loadu_ps(m3, src + 48));
    }
}

/* Pixel panels [pa, pb) of image n, group g, row panels [ta, tb): every depth block, panel by panel, all the row
 * panels over it. */
static void run_panels(const geom_t *G, const float *x, const float *wp, const float *bias, float *y,
                       const float *z, int64_t n, int64_t g, int64_t pa, int64_t pb, int64_t ta, int64_t tb,
                       act_t f, float *buf) {
    const int64_t pixels = G->oh * G->ow, plane = G->h * G->w, depth = G->cg * G->kh * G->kw;
    const int64_t row_panels = (G->mg + PR - 1) / PR;
    const int in_place = G->kh == 1 && G->kw == 1 && G->sh == 1 && G->sw == 1 && G->pt == 0 && G->pl == 0
                         && G->oh == G->h && G->ow == G->w;
    const int copy_pointwise = in_place && pointwise_copies(plane, tb - ta);
    const float *img = x + (n * G->groups + g) * G->cg * plane;
    const int64_t out0 = (n * G->groups * G->mg + g * G->mg) * pixels;
    float *tail_columns = buf + KC * PW; /* TAIL_MAX columns of KC */
    /* blocks of near-equal depth (147 = 74 + 73, not 128 + 19): a block's start and finish cost the same however
     * short it is */
    const int64_t blocks = (depth + KC - 1) / KC, step = (depth + blocks - 1) / blocks;
    for (int64_t k0 = 0; k0 < depth; k0 += step) {
        const int64_t kc = depth - k0 < step ? depth - k0 : step;
        for (int64_t pn = pa; pn < pb; pn++) {
            const int64_t p0 = pn * PW, all = pixels - p0 < PW ? pixels - p0 : PW;
            const int64_t tails = all % 16 <= TAIL_MAX ? all % 16 : 0, count = all - tails;
            const int nv = (int)((count + 15) / 16);
            const __mmask16 m[4] = {tail_mask(count), tail_mask(count - 16), tail_mask(count - 32),
                                    tail_mask(count - 48)};
            const float *cols = buf;
            int64_t ldb = PW;
            if (in_place && !copy_pointwise)
                cols = img + k0 * plane + p0, ldb = plane;
            else if (in_place)
                copy_pointwise_columns(img + k0 * plane + p0, plane, kc, all, buf);
            else
                pack_columns(G, img, p0, k0, kc, buf);
            for (int64_t j = 0; j < tails; j++)
                for (int64_t kk = 0; kk < kc; kk++) tail_columns[j * KC + kk] = cols[kk * ldb + count + j];
            for (int64_t t = ta; t < tb; t++) {
                const int64_t row = t * PR, at = out0 + row * pixels + p0;
                /* the next panel's weights of this block, on the chunk's first pixel panel (a model's weights come
                 * from memory; the chunk's later pixel panels find them in L2) */
                const float *next = pn == pa && t + 1 < tb ? wp + ((g * row_panels + t + 1) * depth + k0) * PR : NULL;
                const finish_t F = {bias ? bias + g * G->mg + row : NULL, z ? z + at : NULL, k0 == 0,
                                    k0 + kc == depth, (int)(G->mg - row < PR ? G->mg - row : PR), f,
                                    z && t + 1 < tb && pixels > 4 * PW ? z + at + PR * pixels : NULL};
                const float *panel = wp + ((g * row_panels + t) * depth + k0) * PR;
                if (nv)
                    tile_nv_next(panel, cols, ldb, kc, y + at, pixels, m, nv, &F, next);
                else if (next)
                    prefetch_l2(next, kc * PR);
                if (tails)
                    tail_pixels(panel, tail_columns, kc, tails, y + at + count, F.z ? F.z + count : NULL, pixels, &F);
            }
        }
    }
}

#else

int64_t packconv_vectorized(void) { return 0; }

#endif

typedef struct {
    const float *x, *wp, *bias, *z;
    float *y;
    geom_t G;
    act_t f;
    int64_t row_chunks; /* pieces of the row panels per pixel panel (1: a piece goes over whole panels) */
    int64_t chunk;      /* pixel panels a piece takes at a time */
} pconv_call_t;

#if defined(__AVX512F__)
/* Items: pixel panels over (image, group, panel), times row_chunks when those are split too. */
static void pconv_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    (void)slot;
    const pconv_call_t *c = p;
    const geom_t *G = &c->G;
    const int64_t panels = (G->oh * G->ow + PW - 1) / PW, row_panels = (G->mg + PR - 1) / PR;
    _Alignas(64) float buf[KC * PW + TAIL_MAX * KC];
    if (c->row_chunks > 1) {
        for (int64_t item = begin; item < end; item++) {
            const int64_t q = item % c->row_chunks, cell = item / c->row_chunks;
            const int64_t pn = cell % panels, g = cell / panels % G->groups, n = cell / panels / G->groups;
            run_panels(G, c->x, c->wp, c->bias, c->y, c->z, n, g, pn, pn + 1, q * row_panels / c->row_chunks,
                       (q + 1) * row_panels / c->row_chunks, c->f, buf);
        }
        return;
    }
    while (begin < end) {
        const int64_t cell = begin / panels, pn = begin % panels;
        const int64_t stop = end - cell * panels < panels ? end - cell * panels : panels;
        for (int64_t pa = pn; pa < stop; pa += c->chunk) {
            const int64_t pb = pa + c->chunk < stop ? pa + c->chunk : stop;
            run_panels(G, c->x, c->wp, c->bias, c->y, c->z, cell / G->groups, cell % G->groups, pa, pb, 0,
                       row_panels, c->f, buf);
        }
        begin = cell * panels + stop;
    }
}
#endif

/* The pixel panels of a convolution (dconv-like geometry, see geom_t) over the packed weights wp, items
 * [begin, end) of n * groups * panels, split over `threads`. bias and z may be NULL. Returns 0, or -1 without
 * vector code (nothing written). */
int64_t packconv_f32_threads(const float *x, const float *wp, const float *bias, float *y, const float *z, int64_t n,
                             int64_t groups, int64_t mg, int64_t cg, int64_t h, int64_t w, int64_t kh, int64_t kw,
                             int64_t oh, int64_t ow, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt,
                             int64_t pl, int64_t begin, int64_t end, int64_t act, float alpha, float beta,
                             int64_t threads) {
#if defined(__AVX512F__)
    const int64_t row_panels = (mg + PR - 1) / PR, count = end - begin;
    int64_t chunk = CHUNK_BYTES / (row_panels * PR * PW * (int64_t)sizeof(float));
    chunk = chunk < 1 ? 1 : chunk;
    pconv_call_t c = {x, wp, bias, z, y, {n, groups, mg, cg, h, w, kh, kw, oh, ow, sh, sw, dh, dw, pt, pl},
                      {alpha, beta, (int)act}, 1, chunk};
    if (threads > 1 && count < 4 * threads && row_panels > 1) { /* few pixel panels: split the rows too */
        c.row_chunks = (4 * threads + count - 1) / count;
        c.row_chunks = c.row_chunks < row_panels ? c.row_chunks : row_panels;
        parallel_for(pconv_piece, &c, begin * c.row_chunks, end * c.row_chunks, count * c.row_chunks, threads);
        return 0;
    }
    int64_t pieces = (count + chunk - 1) / chunk;
    if (threads > 1) pieces = pieces > pieces_for(count, threads) ? pieces : pieces_for(count, threads);
    parallel_for(pconv_piece, &c, begin, end, pieces, threads);
    return 0;
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)z, (void)n, (void)groups, (void)mg, (void)cg, (void)h, (void)w;
    (void)kh, (void)kw, (void)oh, (void)ow, (void)sh, (void)sw, (void)dh, (void)dw, (void)pt, (void)pl;
    (void)begin, (void)end, (void)act, (void)alpha, (void)beta, (void)threads;
    return -1;
#endif
}

CARRACK_POOL_CLIENT(packconv)
