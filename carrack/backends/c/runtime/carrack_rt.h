/* carrack's portable C kernels for compiled models (`carrack compile`): float32, no allocation, no I/O.
 *
 * Every kernel writes its whole output from its inputs; the generated code places the buffers (inputs, outputs,
 * weights, arena). Loops are written so compilers vectorize the innermost one (contiguous output pixels or
 * columns): SSE/AVX on x86 with -O3 -march=native, SIMD128 on WebAssembly with -msimd128. An output may alias
 * an input only where the element it writes is the one it reads (elementwise ops, a residual). The only library
 * calls are <math.h> functions, so the same source builds for a shared library and a WebAssembly module with no
 * imports. C11 with GCC/Clang vector extensions (cr_v8) for the channel-vectorized convolution's register tile.
 */
#ifndef CARRACK_RT_H
#define CARRACK_RT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "activations.h"

#if defined(__SSE__) || defined(__AVX__)
#include <immintrin.h> /* the compiler's own: max/min instructions for cr_vclamp */
#elif defined(__wasm_simd128__)
#include <wasm_simd128.h>
#endif

#define CR_UNUSED __attribute__((unused))
#define CR_ALIGN 64

/* the activations (numbering and scalar definitions) are the native kernels' own */
enum cr_act { CR_ACT_NONE = ACT_NONE, CR_ACT_RELU = ACT_RELU, CR_ACT_CLIP = ACT_CLIP, CR_ACT_LEAKY = ACT_LEAKY,
              CR_ACT_SIGMOID = ACT_SIGMOID, CR_ACT_TANH = ACT_TANH, CR_ACT_HARDSIGMOID = ACT_HARDSIGMOID,
              CR_ACT_HARDSWISH = ACT_HARDSWISH, CR_ACT_GELU = ACT_GELU, CR_ACT_ELU = ACT_ELU, CR_ACT_EXP = ACT_EXP,
              CR_ACT_NEG = ACT_NEG, CR_ACT_SQRT = ACT_SQRT, CR_ACT_ABS = ACT_ABS };

enum cr_binop { CR_ADD, CR_SUB, CR_MUL, CR_DIV };

static inline int64_t cr_floordiv(int64_t a, int64_t b) {
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
static inline int64_t cr_mod(int64_t a, int64_t b) { return a - cr_floordiv(a, b) * b; }
static inline int64_t cr_min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t cr_max(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t cr_align(int64_t n) { return (n + CR_ALIGN - 1) / CR_ALIGN * CR_ALIGN; }

static inline float cr_act1(float v, int act, float a, float b) { return activation(v, act, a, b); }

/* y = act(x) over n elements; the common activations get their own loop so it vectorizes */
static CR_UNUSED void cr_unary(const float *x, float *y, int64_t n, int act, float a, float b) {
    if (act == CR_ACT_RELU) {
        for (int64_t i = 0; i < n; i++) y[i] = x[i] < 0.0f ? 0.0f : x[i];
    } else if (act == CR_ACT_CLIP) {
        for (int64_t i = 0; i < n; i++) {
            float v = x[i] < a ? a : x[i];
            y[i] = v > b ? b : v;
        }
    } else if (act == CR_ACT_NONE) {
        if (x != y) memmove(y, x, (size_t)n * sizeof(float));
    } else {
        for (int64_t i = 0; i < n; i++) y[i] = cr_act1(x[i], act, a, b);
    }
}

static inline float cr_binop1(int op, float a, float b) {
    switch (op) {
    case CR_ADD: return a + b;
    case CR_SUB: return a - b;
    case CR_MUL: return a * b;
    default: return a / b;
    }
}

#define CR_MAX_RANK 6

/* y = a op b with numpy broadcasting: `shape` is y's shape padded to CR_MAX_RANK dims in front, `sa`/`sb` the
 * strides (in elements) of a and b over those dims, 0 along a broadcast dim */
static CR_UNUSED void cr_binary(int op, const float *a, const int64_t *sa, const float *b, const int64_t *sb, float *y,
                                const int64_t *shape) {
    int64_t outer = 1;
    for (int d = 0; d < CR_MAX_RANK - 1; d++) outer *= shape[d];
    int64_t inner = shape[CR_MAX_RANK - 1], ia = sa[CR_MAX_RANK - 1], ib = sb[CR_MAX_RANK - 1];
    int64_t index[CR_MAX_RANK] = {0};
    for (int64_t o = 0; o < outer; o++) {
        int64_t oa = 0, ob = 0;
        for (int d = 0; d < CR_MAX_RANK - 1; d++) {
            oa += index[d] * sa[d];
            ob += index[d] * sb[d];
        }
        const float *pa = a + oa, *pb = b + ob;
        float *py = y + o * inner;
        if (ia == 1 && ib == 1) {
            switch (op) {
            case CR_ADD: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] + pb[i]; break;
            case CR_SUB: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] - pb[i]; break;
            case CR_MUL: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] * pb[i]; break;
            default: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] / pb[i]; break;
            }
        } else if (ia == 1 && ib == 0) {
            float vb = pb[0];
            switch (op) {
            case CR_ADD: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] + vb; break;
            case CR_SUB: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] - vb; break;
            case CR_MUL: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] * vb; break;
            default: for (int64_t i = 0; i < inner; i++) py[i] = pa[i] / vb; break;
            }
        } else {
            for (int64_t i = 0; i < inner; i++) py[i] = cr_binop1(op, pa[i * ia], pb[i * ib]);
        }
        for (int d = CR_MAX_RANK - 2; d >= 0; d--) {
            if (++index[d] < shape[d]) break;
            index[d] = 0;
        }
    }
}

#define CR_MR 4  /* output channels (or rows) accumulated together: each input load feeds CR_MR sums */
#define CR_NR 64 /* output columns per tile: CR_MR x CR_NR sums stay in L1 (or registers) */

/* 2-D convolution, NCHW, direct: y[n, m, oh, ow] = act(bias[m] + z[n, m, oh, ow]
 *     + sum_{c, i, j} w[m, c, i, j] x[n, g * cg + c, oh * sh - pt + i * dh, ow * sw - pl + j * dw])
 * for the output channels m of group g (cg = c_in / groups); padding reads zeros. bias and z may be NULL.
 * Tiles of CR_MR output channels by CR_NR columns of one output row are summed over every (c, i, j) tap. */
static CR_UNUSED void cr_conv2d(const float *x, const float *w, const float *bias, const float *z, float *y,
                                int64_t n, int64_t c_in, int64_t h, int64_t wd, int64_t m_out, int64_t oh, int64_t ow,
                                int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt,
                                int64_t pl, int64_t groups, int act, float a, float b) {
    int64_t cg = c_in / groups, mg = m_out / groups, plane = oh * ow, taps = kh * kw;
    float acc[CR_MR][CR_NR];
    for (int64_t img = 0; img < n; img++) {
        int64_t mr = CR_MR;
        for (int64_t m0 = 0; m0 < m_out; m0 += mr) {
            int64_t g = m0 / mg;
            mr = CR_MR;
            if (m0 + mr > (g + 1) * mg) mr = (g + 1) * mg - m0; /* a tile stays in its group */
            const float *xg = x + (img * c_in + g * cg) * h * wd;
            for (int64_t r = 0; r < oh; r++) {
                for (int64_t q0 = 0; q0 < ow; q0 += CR_NR) {
                    int64_t nq = ow - q0 < CR_NR ? ow - q0 : CR_NR;
                    for (int64_t t = 0; t < mr; t++) {
                        float b0 = bias ? bias[m0 + t] : 0.0f;
                        const float *zr = z ? z + (img * m_out + m0 + t) * plane + r * ow + q0 : NULL;
                        for (int64_t q = 0; q < nq; q++) acc[t][q] = b0 + (zr ? zr[q] : 0.0f);
                    }
                    for (int64_t c = 0; c < cg; c++) {
                        const float *xc = xg + c * h * wd;
                        const float *wc = w + (m0 * cg + c) * taps;
                        for (int64_t i = 0; i < kh; i++) {
                            int64_t row = r * sh - pt + i * dh;
                            if (row < 0 || row >= h) continue;
                            for (int64_t j = 0; j < kw; j++) {
                                int64_t col0 = j * dw - pl; /* input column of output column 0 */
                                int64_t lo = col0 >= 0 ? 0 : (-col0 + sw - 1) / sw;
                                int64_t hi = wd - col0 <= 0 ? 0 : (wd - col0 + sw - 1) / sw;
                                lo = lo > q0 ? lo - q0 : 0;
                                hi = (hi < q0 + nq ? hi : q0 + nq) - q0;
                                if (lo >= hi) continue;
                                const float *xr = xc + row * wd + col0 + q0 * sw;
                                for (int64_t t = 0; t < mr; t++) {
                                    float wv = wc[t * cg * taps + i * kw + j];
                                    float *at = acc[t];
                                    if (sw == 1) {
                                        for (int64_t q = lo; q < hi; q++) at[q] += wv * xr[q];
                                    } else {
                                        for (int64_t q = lo; q < hi; q++) at[q] += wv * xr[q * sw];
                                    }
                                }
                            }
                        }
                    }
                    for (int64_t t = 0; t < mr; t++) {
                        float *yr = y + (img * m_out + m0 + t) * plane + r * ow + q0;
                        cr_unary(acc[t], yr, nq, act, a, b);
                    }
                }
            }
        }
    }
}

#define CR_PB 4  /* output pixels per tile of the channel-vectorized convolution */
#define CR_MB 16 /* output channels per tile of the channel-vectorized convolution */

typedef float cr_v8 __attribute__((vector_size(32))); /* 8 lanes: AVX, or two SIMD128 vectors on wasm */

static inline cr_v8 cr_load8(const float *p) {
    cr_v8 v;
    memcpy(&v, p, sizeof v); /* any alignment */
    return v;
}

/* one output tile of the channel-vectorized convolution: CR_PB pixels from p0 by `mb` channels from m0 of group
 * g, summed over every tap; the full tile (CR_PB x CR_MB) keeps its 8 sums in vector registers */
static inline void cr_cm_tile(const float *xg, const float *wg, const float *bias, const float *z, float *y,
                              int64_t first, int64_t plane, int64_t p0, int64_t pb, int64_t m0, int64_t mb,
                              int64_t mg, int64_t cg, int64_t h, int64_t wd, int64_t ow, int64_t kh, int64_t kw,
                              int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int act, float a,
                              float b) {
    float sums[CR_PB][CR_MB];
    int64_t rows[CR_PB], cols[CR_PB];
    for (int64_t pp = 0; pp < CR_PB; pp++) {
        int64_t p = p0 + (pp < pb ? pp : 0);
        rows[pp] = p / ow * sh - pt;
        cols[pp] = p % ow * sw - pl;
    }
    if (pb == CR_PB && mb == CR_MB) {
        cr_v8 zero = {0};
        cr_v8 b0 = bias ? cr_load8(bias + m0) : zero, b1 = bias ? cr_load8(bias + m0 + 8) : zero;
        cr_v8 s00 = b0, s01 = b1, s10 = b0, s11 = b1, s20 = b0, s21 = b1, s30 = b0, s31 = b1;
        for (int64_t c = 0; c < cg; c++) {
            const float *xc = xg + c * h * wd;
            for (int64_t i = 0; i < kh; i++) {
                for (int64_t j = 0; j < kw; j++) {
                    const float *wrow = wg + ((c * kh + i) * kw + j) * mg + m0;
                    cr_v8 w0 = cr_load8(wrow), w1 = cr_load8(wrow + 8);
                    float xv[CR_PB];
                    for (int pp = 0; pp < CR_PB; pp++) {
                        int64_t row = rows[pp] + i * dh, col = cols[pp] + j * dw;
                        xv[pp] = row >= 0 && row < h && col >= 0 && col < wd ? xc[row * wd + col] : 0.0f;
                    }
                    s00 += xv[0] * w0; s01 += xv[0] * w1;
                    s10 += xv[1] * w0; s11 += xv[1] * w1;
                    s20 += xv[2] * w0; s21 += xv[2] * w1;
                    s30 += xv[3] * w0; s31 += xv[3] * w1;
                }
            }
        }
        memcpy(sums[0], &s00, 32); memcpy(sums[0] + 8, &s01, 32);
        memcpy(sums[1], &s10, 32); memcpy(sums[1] + 8, &s11, 32);
        memcpy(sums[2], &s20, 32); memcpy(sums[2] + 8, &s21, 32);
        memcpy(sums[3], &s30, 32); memcpy(sums[3] + 8, &s31, 32);
    } else { /* a partial tile at the plane's or the group's end */
        for (int64_t pp = 0; pp < pb; pp++) {
            for (int64_t m = 0; m < mb; m++) sums[pp][m] = bias ? bias[m0 + m] : 0.0f;
            for (int64_t c = 0; c < cg; c++) {
                const float *xc = xg + c * h * wd;
                for (int64_t i = 0; i < kh; i++) {
                    int64_t row = rows[pp] + i * dh;
                    if (row < 0 || row >= h) continue;
                    for (int64_t j = 0; j < kw; j++) {
                        int64_t col = cols[pp] + j * dw;
                        if (col < 0 || col >= wd) continue;
                        float xv = xc[row * wd + col];
                        const float *wrow = wg + ((c * kh + i) * kw + j) * mg + m0;
                        for (int64_t m = 0; m < mb; m++) sums[pp][m] += xv * wrow[m];
                    }
                }
            }
        }
    }
    for (int64_t pp = 0; pp < pb; pp++) {
        if (z)
            for (int64_t m = 0; m < mb; m++) sums[pp][m] += z[(first + m) * plane + p0 + pp];
        cr_unary(sums[pp], sums[pp], mb, act, a, b);
        for (int64_t m = 0; m < mb; m++) y[(first + m) * plane + p0 + pp] = sums[pp][m];
    }
}

/* The same convolution vectorized over output channels, for layers with many channels per group (wide 1x1 and
 * KxK layers, whose output rows are often too short or strided to vectorize): the weights come reordered as
 * wt[g, c, i, j, m] (the output channels of a group contiguous), and tiles of CR_PB output pixels by CR_MB
 * output channels are summed over every (c, i, j) tap, each input value broadcast over the channels. */
static CR_UNUSED void cr_conv2d_cm(const float *x, const float *wt, const float *bias, const float *z, float *y,
                                   int64_t n, int64_t c_in, int64_t h, int64_t wd, int64_t m_out, int64_t oh,
                                   int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                                   int64_t pt, int64_t pl, int64_t groups, int act, float a, float b) {
    int64_t cg = c_in / groups, mg = m_out / groups, plane = oh * ow;
    for (int64_t img = 0; img < n; img++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + (img * c_in + g * cg) * h * wd;
            const float *wg = wt + g * cg * kh * kw * mg;
            for (int64_t m0 = 0; m0 < mg; m0 += CR_MB) {
                int64_t mb = mg - m0 < CR_MB ? mg - m0 : CR_MB;
                int64_t first = img * m_out + g * mg + m0; /* y's channel index of the tile's first channel */
                for (int64_t p0 = 0; p0 < plane; p0 += CR_PB) {
                    int64_t pb = plane - p0 < CR_PB ? plane - p0 : CR_PB;
                    cr_cm_tile(xg, wg, bias ? bias + g * mg : NULL, z, y, first, plane, p0, pb, m0, mb, mg, cg, h,
                               wd, ow, kh, kw, sh, sw, dh, dw, pt, pl, act, a, b);
                }
            }
        }
    }
}

/* y[bt, i, j] = act(alpha * sum_k a[bt, i, k] b[bt, k, j] + beta * c[i, j]) with element strides:
 * a's rows lda, columns a_col (1, or lda's transpose), b likewise; the c term is added through its
 * strides (cs_row, cs_col: 0 along a broadcast dim) when c is not NULL. Batches step a by a_batch and b by b_batch.
 * Tiles of CR_MR rows by CR_NR columns are summed over the whole depth. */
static CR_UNUSED void cr_gemm(const float *a, const float *b, const float *c, float *y, int64_t batch, int64_t m,
                              int64_t k, int64_t n, int64_t a_row, int64_t a_col, int64_t b_row, int64_t b_col,
                              int64_t a_batch, int64_t b_batch, int64_t cs_row, int64_t cs_col, float alpha,
                              float beta, int act, float act_a, float act_b) {
    float acc[CR_MR][CR_NR];
    for (int64_t bt = 0; bt < batch; bt++) {
        const float *ab = a + bt * a_batch, *bb = b + bt * b_batch;
        float *yb = y + bt * m * n;
        for (int64_t i0 = 0; i0 < m; i0 += CR_MR) {
            int64_t mr = m - i0 < CR_MR ? m - i0 : CR_MR;
            for (int64_t j0 = 0; j0 < n; j0 += CR_NR) {
                int64_t nq = n - j0 < CR_NR ? n - j0 : CR_NR;
                for (int64_t t = 0; t < mr; t++)
                    for (int64_t q = 0; q < nq; q++) acc[t][q] = 0.0f;
                for (int64_t kk = 0; kk < k; kk++) {
                    const float *br = bb + kk * b_row + j0 * b_col;
                    for (int64_t t = 0; t < mr; t++) {
                        float av = ab[(i0 + t) * a_row + kk * a_col];
                        float *at = acc[t];
                        if (b_col == 1) {
                            for (int64_t q = 0; q < nq; q++) at[q] += av * br[q];
                        } else {
                            for (int64_t q = 0; q < nq; q++) at[q] += av * br[q * b_col];
                        }
                    }
                }
                for (int64_t t = 0; t < mr; t++) {
                    float *yr = yb + (i0 + t) * n + j0;
                    float *at = acc[t];
                    if (alpha != 1.0f)
                        for (int64_t q = 0; q < nq; q++) at[q] *= alpha;
                    if (c) {
                        const float *cr = c + (i0 + t) * cs_row + j0 * cs_col;
                        for (int64_t q = 0; q < nq; q++) at[q] += beta * cr[q * cs_col];
                    }
                    cr_unary(at, yr, nq, act, act_a, act_b);
                }
            }
        }
    }
}

/* ---- the packed matrix product: per-target register tiles over GCC/Clang vector extensions ------------------------
 * CR_VW float lanes per vector: 16 with AVX-512, 8 with AVX/AVX2, else 4 (SSE, WebAssembly SIMD128 with -msimd128,
 * NEON, or plain C where the compiler splits the vectors). A tile of CR_GM rows by CR_GN = CR_GNV * CR_VW columns keeps
 * its sums in registers; B is packed (zero-padded) into CR_GN-wide panels of CR_KC rows that stay in L1/L2 while
 * every row tile of A streams past them (the blocking of carrack/native/convgemm.c). */
#if defined(__AVX512F__)
#define CR_VW 16
#elif defined(__AVX__)
#define CR_VW 8
#else
#define CR_VW 4
#endif
/* tile shapes measured per target (gcc on x86, node for SIMD128): 4 x 2 vectors on 4 lanes (the 16 registers of
 * SSE/SIMD128: 6 rows or 3-4 vectors measured slower in node), 6 x 2 on AVX2 (12 accumulators of 16 registers),
 * 6 x 4 on AVX-512 (24 of 32); -DCR_GM/-DCR_GNV override them for experiments */
#ifndef CR_GM
#if CR_VW == 4
#define CR_GM 4
#else
#define CR_GM 6
#endif
#endif
#ifndef CR_GNV
#if CR_VW == 16
#define CR_GNV 4
#else
#define CR_GNV 2
#endif
#endif
#define CR_GN (CR_GNV * CR_VW) /* columns per tile */
#ifndef CR_KC
#define CR_KC 256 /* depth per packed panel */
#endif
#ifndef CR_NC
#define CR_NC (CR_VW == 16 ? 256 : 128) /* columns per packed block (a multiple of CR_GN) */
#endif

typedef float cr_vf __attribute__((vector_size(CR_VW * 4)));

static inline cr_vf cr_vload(const float *p) {
    cr_vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void cr_vstore(float *p, cr_vf v) { memcpy(p, &v, sizeof v); }

typedef int32_t cr_vi __attribute__((vector_size(CR_VW * 4)));

/* lanes of a where `take` is set, else of b (max and min by compare and select: C has no vector ?:) */
static inline cr_vf cr_vselect(cr_vi take, cr_vf a, cr_vf b) {
    return (cr_vf)((take & (cr_vi)a) | (~take & (cr_vi)b));
}

/* the activations a tile applies in registers: relu and clip (mobilenet's relu6); others go through cr_unary */
static inline cr_vf cr_vclamp(cr_vf v, float lo, float hi) {
    /* (v < lo ? lo : v), then (v > hi ? hi : v): NaN stays NaN. One max and one min instruction where the target
     * has them with these semantics (x86 maxps(lo, v) = lo > v ? lo : v; wasm pmax(v, lo) = v < lo ? lo : v),
     * else a compare and a select each */
#if CR_VW == 16 && defined(__AVX512F__)
    return (cr_vf)_mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), (__m512)v));
#elif CR_VW == 8 && defined(__AVX__)
    return (cr_vf)_mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), (__m256)v));
#elif CR_VW == 4 && defined(__SSE__)
    return (cr_vf)_mm_min_ps(_mm_set1_ps(hi), _mm_max_ps(_mm_set1_ps(lo), (__m128)v));
#elif CR_VW == 4 && defined(__wasm_simd128__)
    return (cr_vf)wasm_f32x4_pmin(wasm_f32x4_pmax((v128_t)v, wasm_f32x4_splat(lo)), wasm_f32x4_splat(hi));
#else
    cr_vf vlo = (cr_vf){0} + lo, vhi = (cr_vf){0} + hi;
    v = cr_vselect(v < vlo, vlo, v);
    return cr_vselect(v > vhi, vhi, v);
#endif
}

/* where B's elements come from: a strided matrix (B(k, j) = b[k * row + j * col]), the im2col of a
 * convolution's input group (k = (c, i, j) tap, column = output pixel), or panels written at compile time
 * (`panel` > 0: B(k, j) = b[((j / panel) * depth + k) * panel + j % panel], zero-padded to whole panels) */
typedef struct {
    const float *b;
    int64_t row, col;
    int conv;
    int64_t h, wd, ow, kh, kw, sh, sw, dh, dw, pt, pl;
    int64_t panel, depth;
} cr_bsrc;

#define CR_PACK_FLOATS (CR_KC * CR_NC)
static cr_vf cr_pack_buffer[CR_PACK_FLOATS / CR_VW]; /* aligned as a vector; the model is single-threaded */

/* packs B's rows k0..k0+kc, columns j0..j0+nc into panels of CR_GN columns: panel t holds kc rows of CR_GN */
/* row k of an im2col B, columns j0..j0+nc (output pixels), into line: one output row's run of pixels at a time
 * (a contiguous or strided piece of an input row, zeros where it reads padding) */
static void cr_im2col_line(const cr_bsrc *s, int64_t k, int64_t j0, int64_t nc, float *line) {
    int64_t taps = s->kh * s->kw, c = k / taps, i = k % taps / s->kw, j = k % s->kw;
    const float *xc = s->b + c * s->h * s->wd;
    int64_t r = j0 / s->ow, q = j0 % s->ow;
    for (int64_t p = 0; p < nc;) {
        int64_t run = s->ow - q < nc - p ? s->ow - q : nc - p;
        int64_t row = r * s->sh - s->pt + i * s->dh, col0 = q * s->sw - s->pl + j * s->dw;
        float *o = line + p;
        if (row < 0 || row >= s->h) {
            memset(o, 0, (size_t)run * sizeof(float));
        } else { /* the pixels whose column is inside the row, zeros around them */
            int64_t lo = col0 < 0 ? (-col0 + s->sw - 1) / s->sw : 0;
            int64_t hi = s->wd - col0 <= 0 ? 0 : (s->wd - col0 + s->sw - 1) / s->sw;
            lo = lo < run ? lo : run;
            hi = hi < lo ? lo : hi > run ? run : hi;
            const float *xr = xc + row * s->wd + col0;
            memset(o, 0, (size_t)lo * sizeof(float));
            if (s->sw == 1) memcpy(o + lo, xr + lo, (size_t)(hi - lo) * sizeof(float));
            else
                for (int64_t t = lo; t < hi; t++) o[t] = xr[t * s->sw];
            memset(o + hi, 0, (size_t)(run - hi) * sizeof(float));
        }
        p += run;
        q = 0;
        r++;
    }
}

/* packs B's rows k0..k0+kc, columns j0..j0+nc into panels of CR_GN columns: panel t holds kc rows of CR_GN. An
 * im2col row is first built whole (long runs, one division per row), then cut into the panels a vector at a
 * time. */
static void cr_pack_b(const cr_bsrc *s, int64_t k0, int64_t kc, int64_t j0, int64_t nc, float *panel) {
    int64_t panels = (nc + CR_GN - 1) / CR_GN;
    if (s->conv) {
        float line[CR_NC + CR_GN];
        for (int64_t kk = 0; kk < kc; kk++) {
            cr_im2col_line(s, k0 + kk, j0, nc, line);
            for (int64_t q = nc; q < panels * CR_GN; q++) line[q] = 0.0f;
            for (int64_t t = 0; t < panels; t++)
                for (int v = 0; v < CR_GNV; v++)
                    cr_vstore(panel + (t * kc + kk) * CR_GN + v * CR_VW, cr_vload(line + t * CR_GN + v * CR_VW));
        }
        return;
    }
    for (int64_t t = 0; t < panels; t++) {
        int64_t first = j0 + t * CR_GN, count = nc - t * CR_GN < CR_GN ? nc - t * CR_GN : CR_GN;
        float *out = panel + t * kc * CR_GN;
        for (int64_t kk = 0; kk < kc; kk++) {
            float *o = out + kk * CR_GN;
            const float *src = s->b + (k0 + kk) * s->row + first * s->col;
            if (s->panel) { /* panels of another width than this target's tile */
                for (int64_t q = 0; q < count; q++) {
                    int64_t j = first + q;
                    o[q] = s->b[(j / s->panel * s->depth + k0 + kk) * s->panel + j % s->panel];
                }
            } else if (s->col == 1) {
                memcpy(o, src, (size_t)count * sizeof(float));
            } else {
                for (int64_t q = 0; q < count; q++) o[q] = src[q * s->col];
            }
            for (int64_t q = count; q < CR_GN; q++) o[q] = 0.0f;
        }
    }
}

/* what a tile adds on its last panel, before it is stored: per-row and per-column biases and an activation */
typedef struct {
    const float *row_bias, *col_bias; /* at the tile's first row / column; NULL for none */
    int act;
    float a, b;
} cr_epilogue;

/* c[t, 0:nq] = prev[t, 0:nq] + sum_kk a[t * sa_m + kk * sa_k] * panel[kk * ldp + 0:CR_GN] for the tile's mr rows
 * (prev: NULL for zeros, else c itself or a residual laid out like c, which c may alias); `last`: the epilogue
 * is applied while the tile is in registers and L1. `rows` is a constant where it is inlined (CR_GM, or 1 for a
 * matrix-vector product), so the sums stay in registers. */
static inline __attribute__((always_inline)) void cr_gemm_tile(
    const int rows, const int nv, const float *a, int64_t sa_m, int64_t sa_k, const float *panel, int64_t ldp,
    int64_t kc, float *c, int64_t ldc, int64_t mr, int64_t nq, const float *prev, const cr_epilogue *last) {
    const float *row[CR_GM];
    for (int t = 0; t < rows; t++) row[t] = a + (t < mr ? t : mr - 1) * sa_m; /* spare rows repeat the last */
    cr_vf acc[CR_GM][CR_GNV];
    for (int t = 0; t < rows; t++)
        for (int v = 0; v < nv; v++) acc[t][v] = (cr_vf){0};
    for (int64_t kk = 0; kk < kc; kk++) {
        cr_vf bv[CR_GNV];
        for (int v = 0; v < nv; v++) bv[v] = cr_vload(panel + kk * ldp + v * CR_VW);
        for (int t = 0; t < rows; t++) {
            float av = row[t][kk * sa_k]; /* scalar x vector: a broadcast load, not an add and a shuffle */
            for (int v = 0; v < nv; v++) acc[t][v] += av * bv[v];
        }
    }
    int full = nq == nv * CR_VW;
    for (int64_t t = 0; t < mr && t < rows; t++) {
        float *ct = c + t * ldc;
        const float *pt = prev ? prev + t * ldc : NULL;
        float tile[CR_GN];
        if (pt && full)
            for (int v = 0; v < nv; v++) acc[t][v] += cr_vload(pt + v * CR_VW);
        if (last && last->row_bias)
            for (int v = 0; v < nv; v++) acc[t][v] += last->row_bias[t];
        int in_registers = !last || (!last->col_bias && (last->act == CR_ACT_NONE || last->act == CR_ACT_RELU
                                                         || last->act == CR_ACT_CLIP));
        if (full && in_registers) {
            if (last && last->act != CR_ACT_NONE) {
                float lo = last->act == CR_ACT_RELU ? 0.0f : last->a;
                float hi = last->act == CR_ACT_RELU ? INFINITY : last->b;
                for (int v = 0; v < nv; v++) acc[t][v] = cr_vclamp(acc[t][v], lo, hi);
            }
            for (int v = 0; v < nv; v++) cr_vstore(ct + v * CR_VW, acc[t][v]);
            continue;
        }
        for (int v = 0; v < nv; v++) cr_vstore(tile + v * CR_VW, acc[t][v]);
        if (pt && !full)
            for (int64_t q = 0; q < nq; q++) tile[q] += pt[q];
        if (last) {
            if (last->col_bias)
                for (int64_t q = 0; q < nq; q++) tile[q] += last->col_bias[q];
            if (last->act != CR_ACT_NONE) cr_unary(tile, tile, nq, last->act, last->a, last->b);
        }
        memcpy(ct, tile, (size_t)nq * sizeof(float));
    }
}

/* a panel's last, narrower tile: only the vectors that hold its nq columns (a 14x14 plane's last 4 columns of 196
 * would otherwise cost a whole 64-column AVX-512 tile) */
static void cr_gemm_tile_narrow(int rows, const float *a, int64_t sa_m, int64_t sa_k, const float *panel, int64_t ldp,
                                int64_t kc, float *c, int64_t ldc, int64_t mr, int64_t nq, const float *prev,
                                const cr_epilogue *last) {
    int nv = (int)((nq + CR_VW - 1) / CR_VW);
#define CR_NARROW(NV)                                                                                                 \
    if (rows == 1) cr_gemm_tile(1, NV, a, sa_m, sa_k, panel, ldp, kc, c, ldc, mr, nq, prev, last);                   \
    else cr_gemm_tile(CR_GM, NV, a, sa_m, sa_k, panel, ldp, kc, c, ldc, mr, nq, prev, last);
    if (nv == 1) {
        CR_NARROW(1)
    } else if (nv == 2 || CR_GNV <= 2) {
        CR_NARROW(2 < CR_GNV ? 2 : CR_GNV)
    } else {
        CR_NARROW(3 < CR_GNV ? 3 : CR_GNV)
    }
#undef CR_NARROW
}

/* c[i, j] = act(sum_k a[i * sa_m + k * sa_k] B(k, j) + row_bias[i] + col_bias[j] + z[i * ldc + j]) for i < m,
 * j < n; row_bias, col_bias and z may be NULL, and z may be c itself (a residual added in place). B in panels of this
 * target's tile width (constant weights, packed at compile time) and a strided B with contiguous rows are read
 * where they lie (the latter copies only a last, partial column tile); an im2col, transposed or other-width
 * panelled B is packed panel by panel. */
static inline __attribute__((always_inline)) void cr_gemm_blocks(
    const float *a, int64_t sa_m, int64_t sa_k, const cr_bsrc *b, float *c, int64_t ldc, int64_t m, int64_t k,
    int64_t n, const float *row_bias, const float *col_bias, const float *z, int act, float act_a, float act_b) {
    float *panel = (float *)cr_pack_buffer;
    int prepacked = b->panel == CR_GN, direct = !b->conv && !b->panel && b->col == 1;
    if (k == 0) {
        for (int64_t i = 0; i < m; i++) {
            float *ci = c + i * ldc;
            if (z) memmove(ci, z + i * ldc, (size_t)n * sizeof(float));
            else memset(ci, 0, (size_t)n * sizeof(float));
            for (int64_t q = 0; q < n; q++) ci[q] += (row_bias ? row_bias[i] : 0.0f) + (col_bias ? col_bias[q] : 0.0f);
            if (act != CR_ACT_NONE) cr_unary(ci, ci, n, act, act_a, act_b);
        }
        return;
    }
    for (int64_t j0 = 0; j0 < n; j0 += CR_NC) {
        int64_t nc = n - j0 < CR_NC ? n - j0 : CR_NC;
        for (int64_t k0 = 0; k0 < k; k0 += CR_KC) {
            int64_t kc = k - k0 < CR_KC ? k - k0 : CR_KC, full = nc / CR_GN * CR_GN;
            if (prepacked) {
            } else if (!direct) cr_pack_b(b, k0, kc, j0, nc, panel);
            else if (full < nc) cr_pack_b(b, k0, kc, j0 + full, nc - full, panel); /* only the partial tile */
            int is_last = k0 + kc >= k;
            for (int64_t i0 = 0; i0 < m; i0 += CR_GM) {
                int64_t mr = m - i0 < CR_GM ? m - i0 : CR_GM;
                cr_epilogue epilogue = {row_bias ? row_bias + i0 : NULL, NULL, act, act_a, act_b};
                for (int64_t t = 0; t * CR_GN < nc; t++) {
                    int64_t nq = nc - t * CR_GN < CR_GN ? nc - t * CR_GN : CR_GN, at = i0 * ldc + j0 + t * CR_GN;
                    const float *p = panel + t * kc * CR_GN;
                    int64_t ldp = CR_GN;
                    if (prepacked) {
                        p = b->b + ((j0 / CR_GN + t) * k + k0) * CR_GN;
                    } else if (direct && nq == CR_GN) {
                        p = b->b + k0 * b->row + j0 + t * CR_GN;
                        ldp = b->row;
                    } else if (direct) {
                        p = panel;
                    }
                    epilogue.col_bias = col_bias ? col_bias + j0 + t * CR_GN : NULL;
                    const float *prev = k0 > 0 ? c + at : z ? z + at : NULL;
                    const float *ai = a + i0 * sa_m + k0 * sa_k;
                    const cr_epilogue *last = is_last ? &epilogue : NULL;
                    if (nq <= CR_GN - CR_VW)
                        cr_gemm_tile_narrow(mr == 1 ? 1 : CR_GM, ai, sa_m, sa_k, p, ldp, kc, c + at, ldc, mr, nq, prev,
                                            last);
                    else if (mr == 1)
                        cr_gemm_tile(1, CR_GNV, ai, sa_m, sa_k, p, ldp, kc, c + at, ldc, mr, nq, prev, last);
                    else
                        cr_gemm_tile(CR_GM, CR_GNV, ai, sa_m, sa_k, p, ldp, kc, c + at, ldc, mr, nq, prev, last);
                }
            }
        }
    }
}

static CR_UNUSED void cr_gemm_packed(const float *a, int64_t sa_m, int64_t sa_k, const cr_bsrc *b, float *c,
                                     int64_t ldc, int64_t m, int64_t k, int64_t n, const float *row_bias,
                                     const float *col_bias, const float *z, int act, float act_a, float act_b) {
    cr_gemm_blocks(a, sa_m, sa_k, b, c, ldc, m, k, n, row_bias, col_bias, z, act, act_a, act_b);
}

/* the same for B in this target's panels: its own copy of the blocking, compiled for that layout alone (the panels'
 * stride a constant, no packing code); the generic copy measured ~20% slower on BERT's products in node */
static CR_UNUSED void cr_gemm_prepacked(const float *a, int64_t sa_m, int64_t sa_k, const float *panels, float *c,
                                        int64_t ldc, int64_t m, int64_t k, int64_t n, const float *col_bias,
                                        const float *z, int act, float act_a, float act_b) {
    const cr_bsrc src = {.b = panels, .panel = CR_GN, .depth = k};
    cr_gemm_blocks(a, sa_m, sa_k, &src, c, ldc, m, k, n, NULL, col_bias, z, act, act_a, act_b);
}

/* a 2-D convolution (cr_conv2d's arguments) as one packed product per image and group: A = the group's weights
 * [mg, cg * kh * kw] as stored, B = the im2col of its input channels (packed panel by panel, never whole). The
 * blocking is inlined here, a copy of its own: V8 ran the shared out-of-line copy 22-27% slower on 1x1 and 3x3
 * layers (node, relaxed build) */
static CR_UNUSED void cr_conv2d_gemm(const float *x, const float *w, const float *bias, const float *z, float *y,
                                     int64_t n, int64_t c_in, int64_t h, int64_t wd, int64_t m_out, int64_t oh,
                                     int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh,
                                     int64_t dw, int64_t pt, int64_t pl, int64_t groups, int act, float a, float b) {
    int64_t cg = c_in / groups, mg = m_out / groups, plane = oh * ow, depth = cg * kh * kw;
    int pointwise = kh == 1 && kw == 1 && sh == 1 && sw == 1 && pt == 0 && pl == 0 && oh == h && ow == wd;
    for (int64_t img = 0; img < n; img++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + (img * c_in + g * cg) * h * wd;
            cr_bsrc src = {xg, plane, 1, !pointwise, h, wd, ow, kh, kw, sh, sw, dh, dw, pt, pl};
            int64_t first = (img * m_out + g * mg) * plane;
            cr_gemm_blocks(w + g * mg * depth, depth, 1, &src, y + first, plane, mg, depth, plane,
                           bias ? bias + g * mg : NULL, NULL, z ? z + first : NULL, act, a, b);
        }
    }
}

/* one output pixel of a depthwise convolution, with the bounds checked (the plane's edges) */
static inline float cr_dw_pixel(const float *xc, const float *wc, float start, int64_t r, int64_t q, int64_t h,
                                int64_t wd, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                                int64_t pt, int64_t pl) {
    float sum = start;
    for (int64_t i = 0; i < kh; i++) {
        int64_t row = r * sh - pt + i * dh;
        if (row < 0 || row >= h) continue;
        for (int64_t j = 0; j < kw; j++) {
            int64_t col = q * sw - pl + j * dw;
            if (col >= 0 && col < wd) sum += wc[i * kw + j] * xc[row * wd + col];
        }
    }
    return sum;
}

/* the activations a depthwise tile applies in registers (others go through cr_act1 per column) */
static inline int cr_dw_fast_act(int act) { return act == CR_ACT_NONE || act == CR_ACT_RELU || act == CR_ACT_CLIP; }

/* acc plus a 3x3 depthwise window of CR_VW outputs: rows x0..x2 (at the first output), tap j at x + at[j],
 * weights splatted in w[0..8]; summed in the order of the general loop (row by row, tap by tap) */
static inline __attribute__((always_inline)) cr_vf cr_dw3x3(cr_vf acc, const float *x0, const float *x1,
                                                            const float *x2, const int64_t *at, const cr_vf *w) {
    acc += w[0] * cr_vload(x0 + at[0]);
    acc += w[1] * cr_vload(x0 + at[1]);
    acc += w[2] * cr_vload(x0 + at[2]);
    acc += w[3] * cr_vload(x1 + at[0]);
    acc += w[4] * cr_vload(x1 + at[1]);
    acc += w[5] * cr_vload(x1 + at[2]);
    acc += w[6] * cr_vload(x2 + at[0]);
    acc += w[7] * cr_vload(x2 + at[1]);
    acc += w[8] * cr_vload(x2 + at[2]);
    return acc;
}

/* One channel of a depthwise convolution from a buffer of its input rows, zero-padded and split into sw column
 * phases (padded column pc of input row `row` at split[(row - first) * sw * phase + pc % sw * phase + pc / sw]):
 * output rows r0..r1, every column CR_VW at a time with no bounds check (the last, partial vector through a
 * copy). Tap j of output column q reads phase j*dw % sw at q + j*dw / sw. */
static void cr_dw_split_rows(const float *split, int64_t first, int64_t phase, const float *wc, float start,
                             const float *zc, float *yc, int64_t r0, int64_t r1, int64_t h, int64_t ow, int64_t kh,
                             int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int act,
                             float a, float b) {
    int64_t tap_at[kw > 0 ? kw : 1];
    for (int64_t j = 0; j < kw; j++) tap_at[j] = j * dw % sw * phase + j * dw / sw;
    float act_lo = act == CR_ACT_CLIP ? a : act == CR_ACT_RELU ? 0.0f : -INFINITY;
    float act_hi = act == CR_ACT_CLIP ? b : INFINITY;
    cr_vf taps[9];
    if (kh == 3 && kw == 3)
        for (int t = 0; t < 9; t++) taps[t] = (cr_vf){0} + wc[t];
    for (int64_t r = r0; r < r1; r++) {
        int64_t top = r * sh - pt;
        int inside = kh == 3 && kw == 3 && top >= 0 && top + 2 * dh < h; /* the common 3x3 case, unrolled */
        const float *x0 = split + (top - first) * sw * phase, *x1 = x0 + dh * sw * phase, *x2 = x1 + dh * sw * phase;
        for (int64_t q = 0; q < ow; q += CR_VW) {
            cr_vf acc = (cr_vf){0} + start;
            if (inside) {
                acc = cr_dw3x3(acc, x0 + q, x1 + q, x2 + q, tap_at, taps);
            } else {
                for (int64_t i = 0; i < kh; i++) {
                    int64_t row = top + i * dh;
                    if (row < 0 || row >= h) continue;
                    const float *xr = split + (row - first) * sw * phase + q;
                    for (int64_t j = 0; j < kw; j++) acc += wc[i * kw + j] * cr_vload(xr + tap_at[j]);
                }
            }
            float lanes[CR_VW];
            int64_t count = ow - q < CR_VW ? ow - q : CR_VW;
            if (zc && count == CR_VW) {
                acc += cr_vload(zc + r * ow + q);
            } else if (zc) {
                memcpy(lanes, zc + r * ow + q, (size_t)count * sizeof(float));
                for (int64_t l = count; l < CR_VW; l++) lanes[l] = 0.0f;
                acc += cr_vload(lanes);
            }
            if (cr_dw_fast_act(act)) {
                if (act != CR_ACT_NONE) acc = cr_vclamp(acc, act_lo, act_hi);
                if (count == CR_VW) {
                    cr_vstore(yc + r * ow + q, acc);
                    continue;
                }
                cr_vstore(lanes, acc);
            } else {
                cr_vstore(lanes, acc);
                for (int64_t l = 0; l < count; l++) lanes[l] = cr_act1(lanes[l], act, a, b);
            }
            memcpy(yc + r * ow + q, lanes, (size_t)count * sizeof(float));
        }
    }
}

/* one input row into the split buffer: phase ph holds padded columns ph, ph + sw, ... (input column pc - pl, zero
 * outside the row), `phase` of them */
static inline void cr_dw_split_row(const float *xr, float *out, int64_t wd, int64_t sw, int64_t pl, int64_t phase) {
    for (int64_t ph = 0; ph < sw; ph++, out += phase) {
        int64_t lo = pl - ph <= 0 ? 0 : (pl - ph + sw - 1) / sw, hi = (wd + pl - ph + sw - 1) / sw; /* in the row */
        lo = lo < phase ? lo : phase;
        hi = hi < lo ? lo : hi > phase ? phase : hi;
        memset(out, 0, (size_t)lo * sizeof(float));
        const float *from = xr + lo * sw + ph - pl;
        if (sw == 1) memcpy(out + lo, from, (size_t)(hi - lo) * sizeof(float));
        else
            for (int64_t t = 0; t < hi - lo; t++) out[lo + t] = from[t * sw];
        memset(out + hi, 0, (size_t)(phase - hi) * sizeof(float));
    }
}

/* depthwise convolution (groups = input channels = output channels), cr_conv2d's arguments. Wide rows at column
 * stride 1 are read in place: the columns whose taps are all inside the row are summed CR_VW at a time in
 * registers over every tap, the few at the padded edges one by one. Narrow rows (7 or 14 columns would leave a
 * 16-lane vector's columns to the one-by-one path) and column strides > 1 first copy the input rows a band of
 * output rows reads into the packing buffer, zero-padded and split into column phases, so that every tap reads
 * CR_VW contiguous columns of one phase (cr_dw_split_rows); rows too wide for the buffer go one by one. */
static CR_UNUSED void cr_dwconv2d(const float *x, const float *w, const float *bias, const float *z, float *y,
                                  int64_t n, int64_t c_in, int64_t h, int64_t wd, int64_t m_out, int64_t oh,
                                  int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                                  int64_t pt, int64_t pl, int64_t groups, int act, float a, float b) {
    (void)m_out, (void)groups; /* groups == m_out == c_in: the emitter's choice */
    int direct = sw == 1 && ow >= 4 * CR_VW;
    int64_t reach = wd - 1 + pl - (kw - 1) * dw; /* in place, columns [lo, hi) read no padding */
    int64_t lo = pl < ow ? pl : ow, hi = reach < 0 ? 0 : reach + 1;
    hi = !direct || hi < lo ? lo : hi > ow ? ow : hi;
    /* the split rows: phases long enough for every vector of output columns and every tap */
    int64_t phase = (ow + CR_VW - 1) / CR_VW * CR_VW + (kw - 1) * dw / sw + 1, row_floats = sw * phase;
    int64_t fit = CR_PACK_FLOATS / row_floats - (kh - 1) * dh - 1;
    int64_t band = direct ? oh : fit < 0 ? 0 : fit / sh + 1; /* output rows per band; 0: none fits */
    float *split = (float *)cr_pack_buffer;
    float act_lo = act == CR_ACT_CLIP ? a : act == CR_ACT_RELU ? 0.0f : -INFINITY;
    float act_hi = act == CR_ACT_CLIP ? b : INFINITY;
    int64_t tap_at[3] = {0, dw, 2 * dw}; /* the in-place 3x3 path's taps */
    cr_vf taps[9];
    for (int64_t img = 0; img < n; img++) {
        for (int64_t ch = 0; ch < c_in; ch++) {
            const float *xc = x + (img * c_in + ch) * h * wd, *wc = w + ch * kh * kw;
            const float *zc = z ? z + (img * c_in + ch) * oh * ow : NULL;
            float *yc = y + (img * c_in + ch) * oh * ow, start = bias ? bias[ch] : 0.0f;
            if (kh == 3 && kw == 3)
                for (int t = 0; t < 9; t++) taps[t] = (cr_vf){0} + wc[t];
            if (!direct && band > 0) {
                for (int64_t r0 = 0; r0 < oh; r0 += band) {
                    int64_t r1 = r0 + band < oh ? r0 + band : oh, first = r0 * sh - pt;
                    int64_t last = (r1 - 1) * sh - pt + (kh - 1) * dh;
                    for (int64_t row = first < 0 ? 0 : first; row <= last && row < h; row++) {
                        cr_dw_split_row(xc + row * wd, split + (row - first) * row_floats, wd, sw, pl, phase);
                    }
                    cr_dw_split_rows(split, first, phase, wc, start, zc, yc, r0, r1, h, ow, kh, kw, sh, sw, dh, dw,
                                     pt, act, a, b);
                }
                continue;
            }
            for (int64_t r = 0; r < oh; r++) {
                float *yr = yc + r * ow;
                const float *zr = zc ? zc + r * ow : NULL;
                int64_t q = lo, top = r * sh - pt;
                if (cr_dw_fast_act(act) && kh == 3 && kw == 3 && top >= 0 && top + 2 * dh < h) {
                    const float *x0 = xc + top * wd - pl, *x1 = x0 + dh * wd, *x2 = x1 + dh * wd;
                    for (; q + CR_VW <= hi; q += CR_VW) {
                        cr_vf acc = cr_dw3x3((cr_vf){0} + start, x0 + q, x1 + q, x2 + q, tap_at, taps);
                        if (zr) acc += cr_vload(zr + q);
                        cr_vstore(yr + q, act == CR_ACT_NONE ? acc : cr_vclamp(acc, act_lo, act_hi));
                    }
                }
                if (cr_dw_fast_act(act)) {
                    for (; q + CR_VW <= hi; q += CR_VW) {
                        cr_vf acc = (cr_vf){0} + start;
                        for (int64_t i = 0; i < kh; i++) {
                            int64_t row = r * sh - pt + i * dh;
                            if (row < 0 || row >= h) continue;
                            const float *xr = xc + row * wd + q - pl;
                            for (int64_t j = 0; j < kw; j++) acc += wc[i * kw + j] * cr_vload(xr + j * dw);
                        }
                        if (zr) acc += cr_vload(zr + q);
                        cr_vstore(yr + q, act == CR_ACT_NONE ? acc : cr_vclamp(acc, act_lo, act_hi));
                    }
                }
                for (int64_t k = 0; k < ow; k++) {
                    if (k >= lo && k < q) k = q; /* the columns done in registers */
                    if (k >= ow) break;
                    float v = cr_dw_pixel(xc, wc, start, r, k, h, wd, kh, kw, sh, sw, dh, dw, pt, pl);
                    yr[k] = cr_act1(v + (zr ? zr[k] : 0.0f), act, a, b);
                }
            }
        }
    }
}

/* multi-head attention (com.microsoft MultiHeadAttention with 3-D query, key and value): for each batch b, head h
 * and query row i, y[b, i, h * hv:] = softmax_j(scale * q[b, i, h * hd:] . k[b, j, h * hd:] + bias[b, h, i, j])
 * v[b, j, h * hv:]; `bias` (an additive attention bias, may be NULL) steps bias_b per batch and bias_h per head
 * (0 where it is broadcast) and `l` per query row. Scores of a block of query rows (CR_ATTENTION_SCORES floats,
 * or one row where that is longer) on the stack. */
#ifndef CR_ATTENTION_SCORES
#define CR_ATTENTION_SCORES 16384
#endif
static CR_UNUSED void cr_attention(const float *q, const float *k, const float *v, const float *bias, int64_t bias_b,
                                   int64_t bias_h, float *y, int64_t batch, int64_t s, int64_t l, int64_t heads,
                                   int64_t hd, int64_t hv, float scale) {
    /* per head and block of query rows: scores = q k^T and y = p v are packed products (k^T packed per block,
     * v's rows read in place), the softmax runs on each row between them */
    const int64_t width = l > 0 ? l : 1, most = CR_ATTENTION_SCORES / width, rows = most < 1 ? 1 : most < s ? most : s > 0 ? s : 1;
    float scores[rows * width];
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < heads; h++) {
            const float *kb = k + b * l * heads * hd + h * hd, *vb = v + b * l * heads * hv + h * hv;
            const cr_bsrc keys = {.b = kb, .row = 1, .col = heads * hd}; /* B(e, j) = k[b, j, h * hd + e] */
            const cr_bsrc values = {.b = vb, .row = heads * hv, .col = 1};
            for (int64_t i0 = 0; i0 < s; i0 += rows) {
                const int64_t count = s - i0 < rows ? s - i0 : rows;
                cr_gemm_packed(q + (b * s + i0) * heads * hd + h * hd, heads * hd, 1, &keys, scores, l, count, hd, l,
                               NULL, NULL, NULL, CR_ACT_NONE, 0.0f, 0.0f);
                for (int64_t r = 0; r < count; r++) {
                    float *row = scores + r * l;
                    const float *bi = bias ? bias + b * bias_b + h * bias_h + (i0 + r) * l : NULL;
                    float top = -INFINITY;
                    for (int64_t j = 0; j < l; j++) {
                        row[j] = scale * row[j] + (bi ? bi[j] : 0.0f);
                        top = row[j] > top ? row[j] : top;
                    }
                    float total = 0.0f;
                    if (top == -INFINITY) top = 0.0f; /* every key masked: zeros, as the session's masked softmax */
                    for (int64_t j = 0; j < l; j++) {
                        row[j] = expf(row[j] - top);
                        total += row[j];
                    }
                    const float inv = total == 0.0f ? 1.0f : 1.0f / total;
                    for (int64_t j = 0; j < l; j++) row[j] *= inv;
                }
                cr_gemm_packed(scores, l, 1, &values, y + (b * s + i0) * heads * hv + h * hv, heads * hv, count, l,
                               hv, NULL, NULL, NULL, CR_ACT_NONE, 0.0f, 0.0f);
            }
        }
    }
}

/* y[bt] = act(a[bt] b[bt] + col_bias + z[bt]) through the packed product, for batches of [m, k] x [k, n] with
 * element strides (a's rows a_row, columns a_col; b likewise); y and z are [batch, m, n] */
static CR_UNUSED void cr_matmul_packed(const float *a, const float *b, const float *col_bias, const float *z, float *y,
                                       int64_t batch, int64_t m, int64_t k, int64_t n, int64_t a_row, int64_t a_col,
                                       int64_t b_row, int64_t b_col, int64_t a_batch, int64_t b_batch, int act,
                                       float act_a, float act_b) {
    for (int64_t bt = 0; bt < batch; bt++) {
        cr_bsrc src = {.b = b + bt * b_batch, .row = b_row, .col = b_col};
        cr_gemm_packed(a + bt * a_batch, a_row, a_col, &src, y + bt * m * n, n, m, k, n, NULL, col_bias,
                       z ? z + bt * m * n : NULL, act, act_a, act_b);
    }
}

/* y = act(a b + col_bias + z) for a [m, k] (rows a_row, columns a_col apart) and a constant b [k, n] that the
 * compiler wrote as panels of `panel` columns (see cr_bsrc); y and z are [m, n]. Read in place where `panel` is
 * this target's tile width, repacked otherwise. */
static CR_UNUSED void cr_matmul_prepacked(const float *a, const float *panels, int64_t panel, const float *col_bias,
                                          const float *z, float *y, int64_t m, int64_t k, int64_t n, int64_t a_row,
                                          int64_t a_col, int act, float act_a, float act_b) {
    if (panel == CR_GN) {
        cr_gemm_prepacked(a, a_row, a_col, panels, y, n, m, k, n, col_bias, z, act, act_a, act_b);
        return;
    }
    cr_bsrc src = {.b = panels, .panel = panel, .depth = k};
    cr_gemm_packed(a, a_row, a_col, &src, y, n, m, k, n, NULL, col_bias, z, act, act_a, act_b);
}

/* y[o, c, i] = act(x[o, c, i] * scale[c] + shift[c]) (inference BatchNormalization folded at compile time) */
static CR_UNUSED void cr_affine(const float *x, const float *scale, const float *shift, float *y, int64_t outer,
                                int64_t channels, int64_t inner, int act, float a, float b) {
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t c = 0; c < channels; c++) {
            const float *xp = x + (o * channels + c) * inner;
            float *yp = y + (o * channels + c) * inner;
            float s = scale[c], t = shift[c];
            for (int64_t i = 0; i < inner; i++) yp[i] = xp[i] * s + t;
            if (act != CR_ACT_NONE) cr_unary(yp, yp, inner, act, a, b);
        }
    }
}

/* layer normalization over the last axis of `rows` rows of `hidden`: t = x + skip + bias (skip, bias may be NULL),
 * y = (t - mean) / sqrt(var + eps) * gamma + beta (beta may be NULL), and t itself into `total` when not NULL
 * (SkipLayerNormalization's fourth output). Statistics are summed in double; y and total may alias x or skip. */
static CR_UNUSED void cr_layer_norm(const float *x, const float *skip, const float *bias, const float *gamma,
                                    const float *beta, float *y, float *total, int64_t rows, int64_t hidden,
                                    float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * hidden, *sr = skip ? skip + r * hidden : NULL;
        double sum = 0.0, squares = 0.0;
        for (int64_t i = 0; i < hidden; i++) {
            float t = xr[i] + (sr ? sr[i] : 0.0f) + (bias ? bias[i] : 0.0f);
            sum += t;
        }
        double mean = hidden ? sum / (double)hidden : 0.0;
        for (int64_t i = 0; i < hidden; i++) {
            double d = (double)(xr[i] + (sr ? sr[i] : 0.0f) + (bias ? bias[i] : 0.0f)) - mean;
            squares += d * d;
        }
        float inv = (float)(1.0 / sqrt(squares / (double)(hidden ? hidden : 1) + (double)eps)), m = (float)mean;
        float *yr = y + r * hidden, *tr = total ? total + r * hidden : NULL;
        for (int64_t i = 0; i < hidden; i++) {
            float t = xr[i] + (sr ? sr[i] : 0.0f) + (bias ? bias[i] : 0.0f);
            yr[i] = (t - m) * inv * gamma[i] + (beta ? beta[i] : 0.0f);
            if (tr) tr[i] = t;
        }
    }
}

static inline float cr_max1(float acc, float v) { return v > acc || v != v ? v : acc; } /* NaN sticks */

/* 2-D max or average pooling over planes (n * c of them); padding is skipped by max and by average without
 * count_include_pad; with it, the window counts the pads inside the padded image (onnx's rule). Separable: per
 * output row, the window's valid input rows are first reduced column by column (contiguous, CR_VW lanes at a
 * time) into `cols`, then each output reduces its window's columns of that row; the counts are per row and
 * column range. Max gives the same values as a window-at-a-time loop (and NaN propagates); average sums in
 * another order (float32 rounding). */
static CR_UNUSED void cr_pool2d(const float *x, float *y, int64_t planes, int64_t h, int64_t wd, int64_t oh, int64_t ow,
                                int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt,
                                int64_t pl, int64_t pb, int64_t pr, int is_max, int count_pad) {
    float cols[wd > 0 ? wd : 1];
    const float start = is_max ? -INFINITY : 0.0f;
    for (int64_t p = 0; p < planes; p++) {
        const float *xp = x + p * h * wd;
        float *yp = y + p * oh * ow;
        for (int64_t r = 0; r < oh; r++) {
            int64_t rows = 0, padded_rows = 0, whole = wd / CR_VW * CR_VW; /* columns in whole vectors */
            for (int64_t c = 0; c < whole; c += CR_VW) cr_vstore(cols + c, (cr_vf){0} + start);
            for (int64_t c = whole; c < wd; c++) cols[c] = start;
            for (int64_t i = 0; i < kh; i++) {
                int64_t row = r * sh - pt + i * dh;
                if (row >= -pt && row < h + pb) padded_rows++;
                if (row < 0 || row >= h) continue;
                rows++;
                const float *xr = xp + row * wd;
                for (int64_t c = 0; c < whole; c += CR_VW) {
                    cr_vf acc = cr_vload(cols + c), v = cr_vload(xr + c);
                    acc = is_max ? cr_vselect((v > acc) | (v != v), v, acc) : acc + v;
                    cr_vstore(cols + c, acc);
                }
                for (int64_t c = whole; c < wd; c++) cols[c] = is_max ? cr_max1(cols[c], xr[c]) : cols[c] + xr[c];
            }
            float inner = (float)(kw * (count_pad ? padded_rows : rows)); /* a window inside the row's divisor */
            for (int64_t q = 0; q < ow; q++) {
                float acc = start;
                int64_t count = 0, padded = 0, left = q * sw - pl;
                if (left >= 0 && left + (kw - 1) * dw < wd) { /* every column inside: no checks */
                    const float *window = cols + left;
                    if (is_max)
                        for (int64_t j = 0; j < kw; j++) acc = cr_max1(acc, window[j * dw]);
                    else
                        for (int64_t j = 0; j < kw; j++) acc += window[j * dw];
                    yp[r * ow + q] = is_max ? acc : acc / inner;
                    continue;
                }
                for (int64_t j = 0; j < kw; j++) {
                    int64_t col = q * sw - pl + j * dw;
                    if (col >= -pl && col < wd + pr) padded++;
                    if (col < 0 || col >= wd) continue;
                    acc = is_max ? cr_max1(acc, cols[col]) : acc + cols[col];
                    count++;
                }
                if (!is_max) acc /= (float)(count_pad ? padded * padded_rows : count * rows);
                yp[r * ow + q] = acc;
            }
        }
    }
}

/* y[p] = mean or max of the `size` elements of plane p */
static CR_UNUSED void cr_global_pool(const float *x, float *y, int64_t planes, int64_t size, int is_max) {
    for (int64_t p = 0; p < planes; p++) {
        const float *xp = x + p * size;
        float acc = is_max ? -INFINITY : 0.0f;
        for (int64_t i = 0; i < size; i++) acc = is_max ? (xp[i] > acc || xp[i] != xp[i] ? xp[i] : acc) : acc + xp[i];
        y[p] = is_max ? acc : acc / (float)size;
    }
}

/* softmax (or log-softmax) along an axis of `axis_size` elements spaced `inner` apart, for each of outer x inner */
static CR_UNUSED void cr_softmax(const float *x, float *y, int64_t outer, int64_t axis_size, int64_t inner, int log) {
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t i = 0; i < inner; i++) {
            const float *xp = x + o * axis_size * inner + i;
            float *yp = y + o * axis_size * inner + i;
            float top = -INFINITY;
            for (int64_t k = 0; k < axis_size; k++) top = xp[k * inner] > top ? xp[k * inner] : top;
            float sum = 0.0f;
            for (int64_t k = 0; k < axis_size; k++) {
                float e = expf(xp[k * inner] - top);
                sum += e;
                if (!log) yp[k * inner] = e;
            }
            if (log) {
                float shift = top + logf(sum);
                for (int64_t k = 0; k < axis_size; k++) yp[k * inner] = xp[k * inner] - shift;
            } else {
                float inv = 1.0f / sum;
                for (int64_t k = 0; k < axis_size; k++) yp[k * inner] *= inv;
            }
        }
    }
}

/* one input of a Concat: its outer blocks of `part` elements go to y at `offset` within blocks of `whole` */
static CR_UNUSED void cr_concat_part(const float *x, float *y, int64_t outer, int64_t part, int64_t whole,
                                     int64_t offset) {
    for (int64_t o = 0; o < outer; o++) memcpy(y + o * whole + offset, x + o * part, (size_t)part * sizeof(float));
}

/* y = x transposed: y's index (i0..i5) reads x at sum i_d * strides[d] (x's strides permuted, y's shape padded).
 * Trailing dims that stay contiguous in x (a channel shuffle's rows) merge into one run, copied whole; the other
 * dims step an offset, not a per-element index sum. */
static CR_UNUSED void cr_transpose(const float *x, float *y, const int64_t *shape, const int64_t *strides) {
    int64_t run = shape[CR_MAX_RANK - 1], step = strides[CR_MAX_RANK - 1];
    int last = CR_MAX_RANK - 2; /* the innermost dim that is not part of the run */
    if (step == 1)
        for (; last >= 0 && strides[last] == run; last--) run *= shape[last];
    int64_t outer = 1;
    for (int d = 0; d <= last; d++) outer *= shape[d];
    if (run == 0 || outer == 0) return;
    int64_t index[CR_MAX_RANK] = {0}, at = 0;
    for (int64_t o = 0; o < outer; o++) {
        float *yo = y + o * run;
        if (step == 1) memcpy(yo, x + at, (size_t)run * sizeof(float));
        else
            for (int64_t i = 0; i < run; i++) yo[i] = x[at + i * step];
        for (int d = last; d >= 0; d--) {
            at += strides[d];
            if (++index[d] < shape[d]) break;
            at -= index[d] * strides[d];
            index[d] = 0;
        }
    }
}

/* local response normalization across channels (NCHW):
 * y = x / (bias + alpha / size * sum of x^2 over channels c - (size - 1) / 2 .. c + size / 2) ^ beta */
static CR_UNUSED void cr_lrn(const float *x, float *y, int64_t n, int64_t c, int64_t inner, int64_t size, float alpha,
                             float beta, float bias) {
    int64_t before = (size - 1) / 2, after = size / 2;
    for (int64_t img = 0; img < n; img++) {
        const float *xi = x + img * c * inner;
        float *yi = y + img * c * inner;
        for (int64_t ch = 0; ch < c; ch++) {
            int64_t lo = ch - before < 0 ? 0 : ch - before, hi = ch + after >= c ? c - 1 : ch + after;
            for (int64_t i = 0; i < inner; i++) {
                float sum = 0.0f;
                for (int64_t k = lo; k <= hi; k++) sum += xi[k * inner + i] * xi[k * inner + i];
                yi[ch * inner + i] = xi[ch * inner + i] / powf(bias + alpha / (float)size * sum, beta);
            }
        }
    }
}

#endif
