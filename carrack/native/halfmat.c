/* Products of float32 activations with F16 or BF16 weights, read as 16-bit values (2 bytes a weight, half the
 * memory traffic of a float32 copy) and widened to float32 in registers.
 *
 * y[i, r] = sum_c x[i, c] * W[r, c] for the weight rows r in [row_start, row_end) and the m rows of x. Generation
 * (m = 1) is bound by how fast W streams from memory; each weight vector is loaded once and multiplied with up to
 * ROW_GROUP rows of x. Every sum keeps the same lanes and order whatever the row range, so results do not depend on
 * how the rows are split over threads.
 *
 * F16 is IEEE half precision (widened with F16C: _mm512_cvtph_ps / _mm256_cvtph_ps); BF16 is the upper half of a
 * float32 (widened by a 16-bit shift). Paths: AVX-512, AVX2 + F16C + FMA, and portable C (16 partial sums, which
 * the compiler may vectorize). `carrack_halfmat_decode` widens whole rows into a float32 buffer for the BLAS
 * product that prompts use. */
#include <stdint.h>
#include <string.h>
#include "threadpool.h"
#include "halffloat.h"
/* CARRACK_PORTABLE builds the plain C versions on any machine, for testing */
#if defined(__AVX512F__) && defined(__F16C__) && !defined(CARRACK_PORTABLE)
#define USE_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__) && !defined(CARRACK_PORTABLE)
#define USE_AVX2 1
#include <immintrin.h>
#endif

#define LANES 16
#define ROW_GROUP 4

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float widen(uint16_t h, int bf16) { return bf16 ? bf16_to_float(h) : half_bits_to_float(h); }

#ifdef USE_AVX512
static inline __m512 load16(const uint16_t *p, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}
#elif defined(USE_AVX2)
static inline __m256 load8(const uint16_t *p, int bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}
#endif

#ifdef USE_AVX512
/* weight rows generation streams at once */
#define STREAM_ROWS 8

/* out[r] = dot(w + r * k, x) for `rows` (a constant once inlined, <= STREAM_ROWS) consecutive weight rows, each
 * sum in two accumulators of 16 lanes (32 values a step) and the same order whatever `rows` is, so a row's result
 * does not depend on which rows it is read with. Several memory streams in flight lift one core's bandwidth, and
 * `ahead` (NULL: none) is the next `rows` rows this thread reads (k apart, as w's), prefetched at the same column:
 * a row of F16 with k = 2048 is one 4 KiB page, where the hardware prefetchers stop, so without it every pass
 * starts with cold misses (a prefetch past the mapping is dropped, never a fault). One core from memory
 * (notes-f16gen19e): 4 rows a pass 14.5 GB/s, with the prefetch 15.7, 8 rows a pass ~5 % more; a pure read loop
 * 16.9. */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t *w, int bf16, int64_t k, const float *x,
                                                           float *out, const uint16_t *ahead, const int rows) {
    int64_t c = 0;
    __m512 acc[STREAM_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (; c + 32 <= k; c += 32) {
        if (ahead != NULL)
            for (int r = 0; r < rows; r++) _mm_prefetch((const char *)(ahead + r * k + c), _MM_HINT_T0);
        const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
        for (int r = 0; r < rows; r++) {
            acc[r][0] = _mm512_fmadd_ps(load16(w + r * k + c, bf16), x0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(load16(w + r * k + c + 16, bf16), x1, acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
        for (int64_t t = c; t < k; t++) s += widen(w[r * k + t], bf16) * x[t];
        out[r] = s;
    }
}

static void dot_stream(const uint16_t *w, int bf16, int64_t k, const float *x, float *out, const uint16_t *ahead) {
    dot_rows(w, bf16, k, x, out, ahead, STREAM_ROWS);
}

static float dot_one(const uint16_t *w, int bf16, int64_t k, const float *x) {
    float sum;
    dot_rows(w, bf16, k, x, &sum, NULL, 1);
    return sum;
}
#endif

/* y[i * ldy] = dot(w, x[i * k]) for the rows i < rows (<= ROW_GROUP) of x */
static void dot_group(const uint16_t *w, int bf16, int64_t k, const float *x, int64_t rows, float *y, int64_t ldy) {
    int64_t c = 0;
    float sums[ROW_GROUP] = {0};
#ifdef USE_AVX512
    __m512 acc[ROW_GROUP][2];
    for (int i = 0; i < ROW_GROUP; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (; c + 32 <= k; c += 32) {
        const __m512 w0 = load16(w + c, bf16), w1 = load16(w + c + 16, bf16);
        for (int64_t i = 0; i < rows; i++) {
            acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + i * k + c), acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + i * k + c + 16), acc[i][1]);
        }
    }
    for (int64_t i = 0; i < rows; i++) sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
#elif defined(USE_AVX2)
    __m256 acc[ROW_GROUP][2];
    for (int i = 0; i < ROW_GROUP; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (; c + 16 <= k; c += 16) {
        const __m256 w0 = load8(w + c, bf16), w1 = load8(w + c + 8, bf16);
        for (int64_t i = 0; i < rows; i++) {
            acc[i][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + i * k + c), acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + i * k + c + 8), acc[i][1]);
        }
    }
    for (int64_t i = 0; i < rows; i++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, _mm256_add_ps(acc[i][0], acc[i][1]));
        for (int l = 0; l < 8; l++) sums[i] += lanes[l];
    }
#else
    float wide[LANES];
    float part[ROW_GROUP][LANES] = {{0}};
    for (; c + LANES <= k; c += LANES) {
        for (int l = 0; l < LANES; l++) wide[l] = widen(w[c + l], bf16);
        for (int64_t i = 0; i < rows; i++)
            for (int l = 0; l < LANES; l++) part[i][l] += wide[l] * x[i * k + c + l];
    }
    for (int64_t i = 0; i < rows; i++)
        for (int l = 0; l < LANES; l++) sums[i] += part[i][l];
#endif
    for (; c < k; c++) {
        const float wc = widen(w[c], bf16);
        for (int64_t i = 0; i < rows; i++) sums[i] += wc * x[i * k + c];
    }
    for (int64_t i = 0; i < rows; i++) y[i * ldy] = sums[i];
}

/* rows [row_start, row_end) of y (m, n) = x (m, k) @ W.T; `then` (may be NULL) is the next weight row this thread
 * reads after row_end - 1 (another matrix of a group), prefetched while the last rows stream */
static void halfmat_rows(const uint16_t *w, int bf16, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                         int64_t row_start, int64_t row_end, const uint16_t *then) {
#ifdef USE_AVX512
    if (m == 1) {
        int64_t r = row_start;
        for (; r + STREAM_ROWS <= row_end; r += STREAM_ROWS) {
            const uint16_t *ahead = r + 2 * STREAM_ROWS <= row_end ? w + (r + STREAM_ROWS) * k : then;
            dot_stream(w + r * k, bf16, k, x, y + r, ahead);
        }
        for (; r < row_end; r++) y[r] = dot_one(w + r * k, bf16, k, x);
        return;
    }
#else
    (void)then;
#endif
    for (int64_t r = row_start; r < row_end; r++)
        for (int64_t i = 0; i < m; i += ROW_GROUP)
            dot_group(w + r * k, bf16, k, x + i * k, m - i < ROW_GROUP ? m - i : ROW_GROUP, y + i * n + r, n);
}

void carrack_halfmat(const uint16_t *w, int bf16, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                     int64_t row_start, int64_t row_end) {
    halfmat_rows(w, bf16, n, k, x, m, y, row_start, row_end, NULL);
}

/* rows [row_start, row_end) of W widened into out, a (row_end - row_start, k) float32 array */
void carrack_halfmat_decode(const uint16_t *w, int bf16, int64_t k, int64_t row_start, int64_t row_end, float *out) {
    const uint16_t *src = w + row_start * k;
    const int64_t count = (row_end - row_start) * k;
    int64_t c = 0;
#ifdef USE_AVX512
    for (; c + 16 <= count; c += 16) _mm512_storeu_ps(out + c, load16(src + c, bf16));
#elif defined(USE_AVX2)
    for (; c + 8 <= count; c += 8) _mm256_storeu_ps(out + c, load8(src + c, bf16));
#endif
    for (; c < count; c++) out[c] = widen(src[c], bf16);
}

/* -- over the thread pool: whole weight rows per piece ---------------------------------------------------------- */
CARRACK_POOL_CLIENT(halfmat)

/* matrices that share x (a layer's q, k, v or gate, up): their rows are one range [0, sum of n) split over the
 * threads in one region; each output row is computed as a call for its matrix alone computes it */
#define MAX_GROUP 8

typedef struct {
    const uint16_t *w[MAX_GROUP];
    float *y[MAX_GROUP];
    int64_t n[MAX_GROUP], first_row[MAX_GROUP + 1];
    int bf16[MAX_GROUP];
    int count;
    const float *x;
    int64_t k, m;
} halfmat_group_t;

static void group_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const halfmat_group_t *g = p;
    (void)slot;
    for (int i = 0; i < g->count; i++) {
        const int64_t lo = begin > g->first_row[i] ? begin : g->first_row[i];
        const int64_t hi = end < g->first_row[i + 1] ? end : g->first_row[i + 1];
        if (lo >= hi) continue;
        const uint16_t *then = hi < end ? g->w[i + 1] : NULL;  /* this piece goes on into the next matrix */
        halfmat_rows(g->w[i], g->bf16[i], g->n[i], g->k, g->x, g->m, g->y[i], lo - g->first_row[i],
                     hi - g->first_row[i], then);
    }
}

/* y[i] (m, n[i]) = x (m, k) @ W[i].T for `count` (<= MAX_GROUP) matrices of k columns on up to `threads` threads;
 * returns 0, or -1 for a count out of range */
int carrack_halfmat_group(int count, const uint16_t *const *w, const int *bf16, const int64_t *n, int64_t k,
                          const float *x, int64_t m, float *const *y, int64_t threads) {
    if (count < 1 || count > MAX_GROUP) return -1;
    halfmat_group_t g;
    g.count = count, g.x = x, g.k = k, g.m = m;
    g.first_row[0] = 0;
    for (int i = 0; i < count; i++) {
        g.w[i] = w[i], g.y[i] = y[i], g.n[i] = n[i], g.bf16[i] = bf16[i];
        g.first_row[i + 1] = g.first_row[i] + n[i];
    }
    const int64_t rows = g.first_row[count];
    parallel_for(group_piece, &g, 0, rows, pieces_for(rows, threads), threads);
    return 0;
}

void carrack_halfmat_threads(const uint16_t *w, int bf16, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                             int64_t threads) {
    carrack_halfmat_group(1, &w, &bf16, &n, k, x, m, &y, threads);
}

typedef struct {
    const uint16_t *w;
    float *out;
    int64_t k, row_start;
    int bf16;
} decode_call_t;

static void decode_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const decode_call_t *c = p;
    (void)slot;
    carrack_halfmat_decode(c->w, c->bf16, c->k, begin, end, c->out + (begin - c->row_start) * c->k);
}

void carrack_halfmat_decode_threads(const uint16_t *w, int bf16, int64_t k, int64_t row_start, int64_t row_end,
                                    float *out, int64_t threads) {
    decode_call_t c = {w, out, k, row_start, bf16};
    parallel_for(decode_piece, &c, row_start, row_end, pieces_for(row_end - row_start, threads), threads);
}
