/* A linear layer for a few rows (1 to 4: batch-1 inference, a decoder's token): y[i, j] = act(x[i, :] . W[:, j] +
 * bias[j]) with W packed once (rowlinear.py) into panels of 16 output columns, each panel stored depth-major
 * (packed[p][k][l] = W[k, 16 p + l], the last panel padded with zero columns). The product then reads the weight as
 * one sequential stream, broadcasts one x value per depth step and adds it times 16 columns into a vector of
 * partial sums: no horizontal sums, no per-call transposition, one store per output.
 *
 * Summation: each output is s = 0, then s = s + x[i, k] * W[k, j] for k = 0, 1, ..., K - 1 in that order (one fused
 * multiply-add per step where the CPU has FMA: the AVX-512 and AVX2 builds give the same bits; the portable build
 * rounds the product and the sum separately), then y = act(s + bias[j]). Threads split the panels, so every output
 * is summed the same way whatever the thread count. */
#include <stdint.h>
#include "activations.h"
#include "threadpool.h"
#if (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))) && !defined(CARRACK_PORTABLE)
#include <immintrin.h>
#endif

CARRACK_POOL_CLIENT(carrack_rowlinear)

#define PANEL 16
#define MAX_ROWS 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* y[r, j] for the 16 columns of one panel from its partial sums `sums` (no bias yet); only `width` are stored.
 * (bias holds 16 values for every panel, the padding included.) */
ALWAYS_INLINE void finish_panel(const float *sums, const float *bias, float *y, int64_t width, act_t f) {
#if defined(__AVX512F__) && !defined(CARRACK_PORTABLE)
    if (f.act == ACT_NONE || f.act == ACT_RELU) {
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums), _mm512_loadu_ps(bias));
        /* max(0, v) returns its second operand for a NaN and for two zeros: v < 0 ? 0 : v, as activation() */
        if (f.act == ACT_RELU) v = _mm512_max_ps(_mm512_setzero_ps(), v);
        _mm512_mask_storeu_ps(y, (__mmask16)(width >= PANEL ? 0xffff : (1u << width) - 1), v);
        return;
    }
#endif
    for (int64_t l = 0; l < width; l++) y[l] = act_scalar(sums[l] + bias[l], f);
}

#if defined(__AVX512F__) && !defined(CARRACK_PORTABLE)
/* `count` panels (compile-time constant after inlining) for `rows` rows: rows * count independent 16-lane sums */
ALWAYS_INLINE void panels_product(const float *x, int64_t ldx, const int rows, const float *w, int64_t k,
                                  const int count, float *sums) {
    __m512 acc[MAX_ROWS][8];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < count; g++) acc[r][g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < k; d++) {
        __m512 xv[MAX_ROWS];
        for (int r = 0; r < rows; r++) xv[r] = _mm512_set1_ps(x[r * ldx + d]);
        for (int g = 0; g < count; g++) {
            const __m512 wv = _mm512_loadu_ps(w + g * k * PANEL + d * PANEL);
            for (int r = 0; r < rows; r++) acc[r][g] = _mm512_fmadd_ps(xv[r], wv, acc[r][g]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < count; g++) _mm512_storeu_ps(sums + (r * count + g) * PANEL, acc[r][g]);
}
#define GROUP(rows) ((rows) == 1 ? 8 : (rows) == 2 ? 4 : 2)
#elif defined(__AVX2__) && defined(__FMA__) && !defined(CARRACK_PORTABLE)
ALWAYS_INLINE void panels_product(const float *x, int64_t ldx, const int rows, const float *w, int64_t k,
                                  const int count, float *sums) {
    __m256 acc[MAX_ROWS][4][2];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < count; g++) acc[r][g][0] = acc[r][g][1] = _mm256_setzero_ps();
    for (int64_t d = 0; d < k; d++) {
        __m256 xv[MAX_ROWS];
        for (int r = 0; r < rows; r++) xv[r] = _mm256_set1_ps(x[r * ldx + d]);
        for (int g = 0; g < count; g++) {
            const float *wp = w + g * k * PANEL + d * PANEL;
            const __m256 w0 = _mm256_loadu_ps(wp), w1 = _mm256_loadu_ps(wp + 8);
            for (int r = 0; r < rows; r++) {
                acc[r][g][0] = _mm256_fmadd_ps(xv[r], w0, acc[r][g][0]);
                acc[r][g][1] = _mm256_fmadd_ps(xv[r], w1, acc[r][g][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < count; g++) {
            _mm256_storeu_ps(sums + (r * count + g) * PANEL, acc[r][g][0]);
            _mm256_storeu_ps(sums + (r * count + g) * PANEL + 8, acc[r][g][1]);
        }
}
#define GROUP(rows) ((rows) == 1 ? 4 : (rows) == 2 ? 2 : 1)
#else
ALWAYS_INLINE void panels_product(const float *x, int64_t ldx, const int rows, const float *w, int64_t k,
                                  const int count, float *sums) {
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < count; g++) {
            float *s = sums + (r * count + g) * PANEL;
            const float *wp = w + g * k * PANEL;
            for (int l = 0; l < PANEL; l++) s[l] = 0.0f;
            for (int64_t d = 0; d < k; d++) {
                const float xd = x[r * ldx + d];
                for (int l = 0; l < PANEL; l++) s[l] += xd * wp[d * PANEL + l];
            }
        }
}
#define GROUP(rows) 1
#endif

/* panels [begin, end) for `rows` (a constant after inlining) rows, `count` panels at a time */
ALWAYS_INLINE void rows_panels(const float *x, int64_t ldx, const int rows, const float *packed, const float *bias,
                               float *y, int64_t ldy, int64_t k, int64_t n, act_t f, int64_t begin, int64_t end,
                               const int count) {
    float sums[MAX_ROWS * 8 * PANEL];
    int64_t p = begin;
    for (; p + count <= end; p += count) {
        panels_product(x, ldx, rows, packed + p * k * PANEL, k, count, sums);
        for (int r = 0; r < rows; r++)
            for (int g = 0; g < count; g++) {
                const int64_t j = (p + g) * PANEL, width = n - j < PANEL ? n - j : PANEL;
                finish_panel(sums + (r * count + g) * PANEL, bias + j, y + r * ldy + j, width, f);
            }
    }
    for (; p < end; p++) {
        panels_product(x, ldx, rows, packed + p * k * PANEL, k, 1, sums);
        for (int r = 0; r < rows; r++) {
            const int64_t j = p * PANEL, width = n - j < PANEL ? n - j : PANEL;
            finish_panel(sums + r * PANEL, bias + j, y + r * ldy + j, width, f);
        }
    }
}

/* the panels [begin, end) of y[rows, n] = act(x[rows, k] @ W + bias); bias holds a value per packed column */
void carrack_rowlinear(const float *x, int64_t ldx, int64_t rows, const float *packed, const float *bias, float *y,
                       int64_t ldy, int64_t k, int64_t n, act_t f, int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS) {
        const int64_t left = rows - r0;
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        switch (left < MAX_ROWS ? left : MAX_ROWS) {
        case 1: rows_panels(xr, ldx, 1, packed, bias, yr, ldy, k, n, f, begin, end, GROUP(1)); break;
        case 2: rows_panels(xr, ldx, 2, packed, bias, yr, ldy, k, n, f, begin, end, GROUP(2)); break;
        case 3: rows_panels(xr, ldx, 3, packed, bias, yr, ldy, k, n, f, begin, end, GROUP(3)); break;
        default: rows_panels(xr, ldx, 4, packed, bias, yr, ldy, k, n, f, begin, end, GROUP(4)); break;
        }
    }
}

typedef struct {
    const float *x, *packed, *bias;
    float *y;
    int64_t ldx, rows, ldy, k, n;
    act_t f;
} rowlinear_call_t;

static void rowlinear_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const rowlinear_call_t *c = p;
    (void)slot;
    carrack_rowlinear(c->x, c->ldx, c->rows, c->packed, c->bias, c->y, c->ldy, c->k, c->n, c->f, begin, end);
}

/* The whole layer over the pool: panels split over `threads`. `activation` points at (alpha, beta) floats, the
 * activation's parameters (clip's bounds, leaky relu's alpha...). Only pointers and int64_t: callpack calls it by
 * count. */
void carrack_rowlinear_threads(const float *x, int64_t ldx, int64_t rows, const float *packed, const float *bias,
                               float *y, int64_t ldy, int64_t k, int64_t n, int64_t act, const float *params,
                               int64_t threads) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    rowlinear_call_t c = {x, packed, bias, y, ldx, rows, ldy, k, n, {params[0], params[1], (int)act}};
    parallel_for(rowlinear_piece, &c, 0, panels, pieces_for(panels, threads), threads);
}

int64_t carrack_rowlinear_panel(void) { return PANEL; }
