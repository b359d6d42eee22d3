/* Row kernels of the GGUF decoder (carrack/llm/model.py) over carrack's thread pool: RMS normalization, SiLU(gate)
 * times up, rotary position embedding, and causal attention over the KV cache. Between the matrix products these
 * are what a prompt spends its remaining time on; numpy runs them on one core and pays a memory pass per step.
 *
 * Each kernel splits whole rows (attention: tiles of query rows of one KV head) over the pool; every output is
 * computed by one task in the same order whatever the split, so results do not depend on the thread count.
 *
 * Attention works on tiles of LANES query rows that share a KV head: the heads of a GQA group at one position side
 * by side, then the next position. A tile's queries are transposed (head_dim x LANES, scaled), so that a key's
 * scores for the whole tile are one vector (FMAs with the key's values broadcast), then the softmax runs across
 * keys with a lane per query row (causal and sliding-window limits per lane), and the weighted values accumulate
 * the same way (a vector per head_dim column). Only keys below the tile's last visible position are read.
 *
 * exp is a polynomial here (vectorizable without -ffast-math): x = k ln2 + r, |r| <= ln2/2, exp(r) by its Taylor
 * series to r^7 (relative error ~2e-7), times 2^k; arguments below -87 give 0 (no subnormal results). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threadpool.h"
/* CARRACK_PORTABLE builds the plain C versions on any machine, for testing */
#if defined(__AVX512F__) && !defined(CARRACK_PORTABLE)
#define USE_AVX512 1
#include <immintrin.h>
#endif

#define LANES 16
#define KEY_BLOCK 8
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO -2.12194440e-4f
#define EXP_LOW -87.0f
#define EXP_HIGH 88.0f

CARRACK_POOL_CLIENT(llmrows)

static inline float exp_approx(float x) {
    x = x < EXP_LOW ? EXP_LOW : x;  /* comparisons keep NaN */
    x = x > EXP_HIGH ? EXP_HIGH : x;
    float k = nearbyintf(x * LOG2E);
    float r = (x - k * LN2_HI) - k * LN2_LO;
    float p = 1.0f / 5040;
    p = p * r + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x == EXP_LOW ? 0.0f : p * scale;
}

#ifdef USE_AVX512
static inline __m512 exp16(__m512 x) {
    const __m512 low = _mm512_set1_ps(EXP_LOW);
    __mmask16 underflow = _mm512_cmp_ps_mask(x, low, _CMP_LE_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(EXP_HIGH), x);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT |
                                    _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps((__mmask16)~underflow, _mm512_scalef_ps(p, k));
}
#endif

/* -- RMS normalization: y = x * (1 / sqrt(mean(x^2) + eps)) * w, per row; with `residual`, x += residual first
 * (written back: the decoder's residual stream) ------------------------------------------------------------------ */
typedef struct {
    float *x;
    const float *w, *residual;
    float *y;
    int64_t n, x_stride, y_stride;
    float eps;
} rms_call_t;

static void rms_rows(void *p, int64_t begin, int64_t end, int64_t slot) {
    const rms_call_t *c = p;
    (void)slot;
    for (int64_t row = begin; row < end; row++) {
        float *x = c->x + row * c->x_stride;
        float *y = c->y + row * c->y_stride;
        if (c->residual)
            for (int64_t i = 0; i < c->n; i++) x[i] += c->residual[row * c->n + i];
        float lanes[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= c->n; i += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += x[i + l] * x[i + l];
        float total = 0.0f;
        for (; i < c->n; i++) total += x[i] * x[i];
        for (int l = 0; l < LANES; l++) total += lanes[l];
        const float inverse = 1.0f / sqrtf(total / (float)c->n + c->eps);
        for (i = 0; i < c->n; i++) y[i] = x[i] * inverse * c->w[i];
    }
}

void carrack_llm_rms_norm(float *x, int64_t x_stride, const float *residual, const float *w, float *y,
                          int64_t y_stride, int64_t rows, int64_t n, float eps, int64_t threads) {
    rms_call_t c = {x, w, residual, y, n, x_stride, y_stride, eps};
    parallel_for(rms_rows, &c, 0, rows, pieces_for(rows, threads), threads);
}

/* -- SiLU(gate) * up: y = gate / (1 + exp(-gate)) * up ---------------------------------------------------------- */
typedef struct {
    const float *gate, *up;
    float *y;
    int64_t n, gate_stride, up_stride;
} silu_call_t;

static void silu_rows(void *p, int64_t begin, int64_t end, int64_t slot) {
    const silu_call_t *c = p;
    (void)slot;
    for (int64_t row = begin; row < end; row++) {
        const float *g = c->gate + row * c->gate_stride, *u = c->up + row * c->up_stride;
        float *y = c->y + row * c->n;
        int64_t i = 0;
#ifdef USE_AVX512
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + LANES <= c->n; i += LANES) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < c->n; i++) y[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

void carrack_llm_silu_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *y,
                          int64_t rows, int64_t n, int64_t threads) {
    silu_call_t c = {gate, up, y, n, gate_stride, up_stride};
    parallel_for(silu_rows, &c, 0, rows, pieces_for(rows, threads), threads);
}

/* -- rotary position embedding, in place ------------------------------------------------------------------------
 * x holds `rows` positions of `heads` heads of head_dim values (a row every x_stride values); row i is rotated by
 * cos[i], sin[i] (rope_dim / 2 values each): pairs (2j, 2j+1) when adjacent, (j, j + rope_dim/2) for NeoX. */
typedef struct {
    float *x;
    const float *cos, *sin;
    int64_t x_stride, heads, head_dim, rope_dim;
    int neox;
} rope_call_t;

static void rope_rows(void *p, int64_t begin, int64_t end, int64_t slot) {
    const rope_call_t *c = p;
    (void)slot;
    const int64_t half = c->rope_dim / 2;
    for (int64_t row = begin; row < end; row++) {
        const float *cs = c->cos + row * half, *sn = c->sin + row * half;
        for (int64_t h = 0; h < c->heads; h++) {
            float *x = c->x + row * c->x_stride + h * c->head_dim;
            for (int64_t j = 0; j < half; j++) {
                float *pa = c->neox ? x + j : x + 2 * j, *pb = c->neox ? x + j + half : x + 2 * j + 1;
                const float a = *pa, b = *pb;
                *pa = a * cs[j] - b * sn[j];
                *pb = b * cs[j] + a * sn[j];
            }
        }
    }
}

void carrack_llm_rope(float *x, int64_t x_stride, int64_t rows, int64_t heads, int64_t head_dim, int64_t rope_dim,
                      const float *cos, const float *sin, int neox, int64_t threads) {
    rope_call_t c = {x, cos, sin, x_stride, heads, head_dim, rope_dim, neox};
    parallel_for(rope_rows, &c, 0, rows, pieces_for(rows, threads), threads);
}

/* -- causal attention over the KV cache -------------------------------------------------------------------------- */
typedef struct {
    const float *q, *k, *v;
    float *out;
    int64_t q_stride, n, start, n_head, n_head_kv, head_dim, cache_len, window, tiles_per_head;
    float scale, softcap;
    atomic_int status;
} attention_call_t;

/* scores[j][l] = sum_c qt[c][l] * keys[j][c] for the keys [lo, hi) */
static void tile_scores(const float *qt, const float *keys, int64_t d, int64_t lo, int64_t hi, float *scores) {
    int64_t j = lo;
#ifdef USE_AVX512
    for (; j + KEY_BLOCK <= hi; j += KEY_BLOCK) {
        __m512 acc[KEY_BLOCK];
        for (int b = 0; b < KEY_BLOCK; b++) acc[b] = _mm512_setzero_ps();
        const float *kj = keys + j * d;
        for (int64_t c = 0; c < d; c++) {
            const __m512 qv = _mm512_load_ps(qt + c * LANES);
            for (int b = 0; b < KEY_BLOCK; b++) acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(kj[b * d + c]), qv, acc[b]);
        }
        for (int b = 0; b < KEY_BLOCK; b++) _mm512_store_ps(scores + (j - lo + b) * LANES, acc[b]);
    }
    for (; j < hi; j++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; c++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(keys[j * d + c]), _mm512_load_ps(qt + c * LANES), acc);
        _mm512_store_ps(scores + (j - lo) * LANES, acc);
    }
#else
    for (; j < hi; j++) {
        float acc[LANES] = {0};
        for (int64_t c = 0; c < d; c++)
            for (int l = 0; l < LANES; l++) acc[l] += keys[j * d + c] * qt[c * LANES + l];
        memcpy(scores + (j - lo) * LANES, acc, sizeof acc);
    }
#endif
}

/* scores -> exp(score - lane max) with keys outside a lane's [lo_l, hi_l) set to 0; sums the lanes' weights */
static void tile_softmax(float *scores, int64_t lo, int64_t hi, const int32_t *lane_lo, const int32_t *lane_hi,
                         float *sums) {
    float peak[LANES], total[LANES];
    for (int l = 0; l < LANES; l++) peak[l] = -INFINITY, total[l] = 0.0f;
    for (int64_t j = lo; j < hi; j++) {
        const float *s = scores + (j - lo) * LANES;
        for (int l = 0; l < LANES; l++)
            if (j >= lane_lo[l] && j < lane_hi[l] && !(s[l] <= peak[l])) peak[l] = s[l];  /* NaN wins */
    }
    for (int64_t j = lo; j < hi; j++) {
        float *s = scores + (j - lo) * LANES;
        int64_t l = 0;
#ifdef USE_AVX512
        const __m512i jv = _mm512_set1_epi32((int32_t)j);
        const __mmask16 visible = _mm512_cmp_epi32_mask(_mm512_loadu_si512(lane_lo), jv, _MM_CMPINT_LE) &
                                  _mm512_cmp_epi32_mask(jv, _mm512_loadu_si512(lane_hi), _MM_CMPINT_LT);
        const __m512 e = _mm512_maskz_mov_ps(visible, exp16(_mm512_sub_ps(_mm512_load_ps(s),
                                                                          _mm512_loadu_ps(peak))));
        _mm512_store_ps(s, e);
        _mm512_storeu_ps(total, _mm512_add_ps(_mm512_loadu_ps(total), e));
        l = LANES;
#endif
        for (; l < LANES; l++) {
            s[l] = (j >= lane_lo[l] && j < lane_hi[l]) ? exp_approx(s[l] - peak[l]) : 0.0f;
            total[l] += s[l];
        }
    }
    memcpy(sums, total, sizeof total);
}

/* ot[c][l] = sum_j weights[j][l] * values[j][c] for the keys [lo, hi) */
static void tile_values(const float *weights, const float *values, int64_t d, int64_t lo, int64_t hi, float *ot) {
#ifdef USE_AVX512
    enum { COLUMNS = 16 };
    int64_t c0 = 0;
    for (; c0 + COLUMNS <= d; c0 += COLUMNS) {
        __m512 acc[COLUMNS];
        for (int b = 0; b < COLUMNS; b++) acc[b] = _mm512_setzero_ps();
        for (int64_t j = lo; j < hi; j++) {
            const __m512 w = _mm512_load_ps(weights + (j - lo) * LANES);
            const float *vj = values + j * d + c0;
            for (int b = 0; b < COLUMNS; b++) acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(vj[b]), w, acc[b]);
        }
        for (int b = 0; b < COLUMNS; b++) _mm512_store_ps(ot + (c0 + b) * LANES, acc[b]);
    }
    for (; c0 < d; c0++) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = lo; j < hi; j++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(values[j * d + c0]), _mm512_load_ps(weights + (j - lo) * LANES), acc);
        _mm512_store_ps(ot + c0 * LANES, acc);
    }
#else
    for (int64_t c = 0; c < d; c++) {
        float acc[LANES] = {0};
        for (int64_t j = lo; j < hi; j++)
            for (int l = 0; l < LANES; l++) acc[l] += weights[(j - lo) * LANES + l] * values[j * d + c];
        memcpy(ot + c * LANES, acc, sizeof acc);
    }
#endif
}

static void attention_tiles(void *p, int64_t begin, int64_t end, int64_t slot) {
    attention_call_t *c = p;
    (void)slot;
    const int64_t d = c->head_dim, group = c->n_head / c->n_head_kv, rows = c->n * group;
    const int64_t keys_max = c->start + c->n;
    float *qt = aligned_alloc(64, (size_t)(d * LANES) * sizeof(float));
    float *ot = aligned_alloc(64, (size_t)(d * LANES) * sizeof(float));
    float *scores = aligned_alloc(64, (size_t)(keys_max * LANES) * sizeof(float));
    if (qt == NULL || ot == NULL || scores == NULL) {
        atomic_store(&c->status, -2);
        free(qt), free(ot), free(scores);
        return;
    }
    for (int64_t item = begin; item < end; item++) {
        const int64_t kv_head = item / c->tiles_per_head, first = (item % c->tiles_per_head) * LANES;
        const float *keys = c->k + kv_head * c->cache_len * d, *values = c->v + kv_head * c->cache_len * d;
        int32_t lane_lo[LANES], lane_hi[LANES];
        int64_t lo = keys_max, hi = 0;
        for (int l = 0; l < LANES; l++) {
            const int64_t r = first + l;
            if (r >= rows) {
                lane_lo[l] = lane_hi[l] = 0;
                for (int64_t i = 0; i < d; i++) qt[i * LANES + l] = 0.0f;
                continue;
            }
            const int64_t position = c->start + r / group, head = kv_head * group + r % group;
            const float *q = c->q + (r / group) * c->q_stride + head * d;
            for (int64_t i = 0; i < d; i++) qt[i * LANES + l] = q[i] * c->scale;
            lane_hi[l] = (int32_t)(position + 1);
            lane_lo[l] = (int32_t)(c->window > 0 && position + 1 > c->window ? position + 1 - c->window : 0);
            lo = lane_lo[l] < lo ? lane_lo[l] : lo;
            hi = lane_hi[l] > hi ? lane_hi[l] : hi;
        }
        float sums[LANES];
        tile_scores(qt, keys, d, lo, hi, scores);
        if (c->softcap > 0.0f)  /* gemma2: scores = tanh(scores / cap) * cap */
            for (int64_t i = 0; i < (hi - lo) * LANES; i++) scores[i] = tanhf(scores[i] / c->softcap) * c->softcap;
        tile_softmax(scores, lo, hi, lane_lo, lane_hi, sums);
        tile_values(scores, values, d, lo, hi, ot);
        for (int l = 0; l < LANES && first + l < rows; l++) {
            const int64_t r = first + l, head = kv_head * group + r % group;
            float *o = c->out + (r / group) * c->n_head * d + head * d;
            for (int64_t i = 0; i < d; i++) o[i] = ot[i * LANES + l] / sums[l];
        }
    }
    free(qt), free(ot), free(scores);
}

/* out (n, n_head * head_dim) = softmax(q k^T * scale + causal mask) v for the n query positions start.. (q: a row
 * of n_head heads every q_stride values), keys and values at positions [0, start + n) of the layer's cache
 * (n_head_kv, cache_len, head_dim). window > 0 hides keys window or more positions back; softcap > 0 caps the
 * scores as tanh(score / softcap) * softcap. 0, or -2 out of memory. */
int carrack_llm_attention(const float *q, int64_t q_stride, const float *k, const float *v, int64_t cache_len,
                          float *out, int64_t n, int64_t start, int64_t n_head, int64_t n_head_kv, int64_t head_dim,
                          float scale, float softcap, int64_t window, int64_t threads) {
    if (n_head_kv <= 0 || n_head % n_head_kv != 0 || start + n > cache_len) return -1;
    const int64_t rows = n * (n_head / n_head_kv), tiles = (rows + LANES - 1) / LANES;
    attention_call_t c = {q, k, v, out, q_stride, n, start, n_head, n_head_kv, head_dim, cache_len, window, tiles,
                          scale, softcap, 0};
    atomic_init(&c.status, 0);
    const int64_t items = n_head_kv * tiles;
    parallel_for(attention_tiles, &c, 0, items, pieces_for(items, threads), threads);
    return atomic_load(&c.status);
}
