/* Products of float32 activations with ggml block-quantized weights, read straight from the blocks: Q8_0, Q4_0,
 * Q4_K and Q6_K. y[i, r] = sum_k x[i, k] * W[r, k] for the weight rows r in [row_start, row_end) and the m rows of x.
 *
 * Each weight row is decoded once into a float buffer that stays in L1 (K floats), then multiplied with the m
 * activation rows (m is 1 while generating; a few for small batches). The activations stay float32: unlike
 * llama.cpp, which quantizes them to 8 bits per block for its integer dot products, the only difference from
 * dequantize-then-matmul is the order of the float additions. The dot products keep 16 independent partial sums,
 * so the compiler vectorizes them (AVX-512, AVX2 or whatever -march=native offers) without -ffast-math.
 *
 * Block layouts and decoding are ggml's (ggml-common.h, dequantize_row_*): every weight row holds K / block_size
 * blocks; fp16 scales are little-endian IEEE half floats. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threadpool.h"
#include "halffloat.h"
/* CARRACK_PORTABLE builds the plain C versions on any machine, for testing */
#if defined(__AVX512F__) && defined(__F16C__) && !defined(CARRACK_PORTABLE)
#define USE_AVX512 1
#include <immintrin.h>
#endif

enum { TYPE_Q4_0 = 2, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q6_K = 14 };
#define LANES 16

/* -- row decoders: one weight row of k values into out -------------------------------------------------------- */
static void decode_q8_0(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; b++, row += 34, out += 32) {
        const float d = half_to_float(row);
        const int8_t *q = (const int8_t *)(row + 2);
        for (int j = 0; j < 32; j++) out[j] = d * (float)q[j];
    }
}

static void decode_q4_0(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 32; b++, row += 18, out += 32) {
        const float d = half_to_float(row);
        const uint8_t *q = row + 2;
        for (int j = 0; j < 16; j++) {
            out[j] = d * (float)((int)(q[j] & 0x0f) - 8);
            out[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
        }
    }
}

static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *scale, uint8_t *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (uint8_t)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *min = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* block_q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (256 values) */
static void decode_q4_k(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; b++, row += 144) {
        const float d = half_to_float(row), dmin = half_to_float(row + 2);
        const uint8_t *scales = row + 4, *q = row + 16;
        for (int part = 0; part < 4; part++, q += 32, out += 64) {
            uint8_t s1, m1, s2, m2;
            scale_min_k4(2 * part, scales, &s1, &m1);
            scale_min_k4(2 * part + 1, scales, &s2, &m2);
            const float d1 = d * s1, c1 = dmin * m1, d2 = d * s2, c2 = dmin * m2;
            for (int l = 0; l < 32; l++) {
                out[l] = d1 * (float)(q[l] & 0x0f) - c1;
                out[l + 32] = d2 * (float)(q[l] >> 4) - c2;
            }
        }
    }
}

/* block_q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales, fp16 d (256 values) */
static void decode_q6_k(const uint8_t *row, int64_t k, float *out) {
    for (int64_t b = 0; b < k / 256; b++, row += 210) {
        const uint8_t *ql = row, *qh = row + 128;
        const int8_t *sc = (const int8_t *)(row + 192);
        const float d = half_to_float(row + 208);
        for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, out += 128) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[l] = d * sc[is] * (float)q1;
                out[l + 32] = d * sc[is + 2] * (float)q2;
                out[l + 64] = d * sc[is + 4] * (float)q3;
                out[l + 96] = d * sc[is + 6] * (float)q4;
            }
        }
    }
}

typedef void (*row_decoder)(const uint8_t *, int64_t, float *);

static row_decoder decoder_for(int type, int64_t *block_values, int64_t *block_bytes) {
    switch (type) {
        case TYPE_Q8_0: *block_values = 32; *block_bytes = 34; return decode_q8_0;
        case TYPE_Q4_0: *block_values = 32; *block_bytes = 18; return decode_q4_0;
        case TYPE_Q4_K: *block_values = 256; *block_bytes = 144; return decode_q4_k;
        case TYPE_Q6_K: *block_values = 256; *block_bytes = 210; return decode_q6_k;
        default: return NULL;
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float total = 0.0f;
    for (; i < n; i++) total += a[i] * b[i];
    for (int j = 0; j < LANES; j++) total += acc[j];
    return total;
}

#ifdef USE_AVX512
/* Weights are one long sequential stream read once per token: asking for the bytes this far ahead keeps more
 * cache-line requests in flight than the hardware prefetcher alone (which stops at 4 KiB page boundaries). */
#define PREFETCH_BYTES 2048

/* One row of Q8_0 / Q4_0 times one activation row, decoded in registers: per block, the 32 codes become two
 * vectors of 16 floats, multiplied with x, and the block's sum is scaled by its d into the row's accumulator. */
static float dot_q8_0(const uint8_t *row, int64_t blocks, const float *x) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, row += 34, x += 32) {
        _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T0);
        const __m512 d = _mm512_set1_ps(half_to_float(row));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(row + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(row + 18));
        __m512 sum = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_loadu_ps(x));
        sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_loadu_ps(x + 16), sum);
        acc = _mm512_fmadd_ps(d, sum, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Q4_0 codes are q - 8 with q in 0..15: sum((q - 8) x) = sum(q x) - 8 sum(x), and the block sums of x (x_sums,
 * one per block, made once per activation row) take the -8 out of the inner loop. */
static float dot_q4_0(const uint8_t *row, int64_t blocks, const float *x, const float *x_sums) {
    __m512 acc = _mm512_setzero_ps();
    const __m512i low_mask = _mm512_set1_epi32(0x0f);
    float offset = 0.0f;
    for (int64_t b = 0; b < blocks; b++, row += 18, x += 32) {
        _mm_prefetch((const char *)row + PREFETCH_BYTES, _MM_HINT_T0);
        const float d = half_to_float(row);
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 2)));
        const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, low_mask));
        const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
        __m512 sum = _mm512_mul_ps(low, _mm512_loadu_ps(x));
        sum = _mm512_fmadd_ps(high, _mm512_loadu_ps(x + 16), sum);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), sum, acc);
        offset += d * x_sums[b];
    }
    return _mm512_reduce_add_ps(acc) - 8.0f * offset;
}
#endif

/* 1 when `type` is one this file decodes */
int carrack_qmatvec_supports(int type) {
    int64_t values, bytes;
    return decoder_for(type, &values, &bytes) != NULL;
}

/* y (m, n) = x (m, k) @ W.T for the rows [row_start, row_end) of W (n rows of `row_bytes` bytes each).
 * Returns 0, or -1 for an unknown type or a k that is not a whole number of blocks, -2 when out of memory. */
int carrack_qmatvec(const uint8_t *w, int type, int64_t row_bytes, int64_t n, int64_t k, const float *x, int64_t m,
                    float *y, int64_t row_start, int64_t row_end) {
    int64_t block_values, block_bytes;
    row_decoder decode = decoder_for(type, &block_values, &block_bytes);
    if (decode == NULL || k % block_values != 0 || row_bytes != k / block_values * block_bytes) return -1;
#ifdef USE_AVX512
    if (type == TYPE_Q8_0) {
        for (int64_t r = row_start; r < row_end; r++)
            for (int64_t i = 0; i < m; i++) y[i * n + r] = dot_q8_0(w + r * row_bytes, k / 32, x + i * k);
        return 0;
    }
    if (type == TYPE_Q4_0) {
        float *x_sums = (float *)malloc((size_t)(m * (k / 32)) * sizeof(float));
        if (x_sums == NULL) return -2;
        for (int64_t j = 0; j < m * (k / 32); j++) {
            float total = 0.0f;
            for (int l = 0; l < 32; l++) total += x[j * 32 + l];
            x_sums[j] = total;
        }
        for (int64_t r = row_start; r < row_end; r++)
            for (int64_t i = 0; i < m; i++)
                y[i * n + r] = dot_q4_0(w + r * row_bytes, k / 32, x + i * k, x_sums + i * (k / 32));
        free(x_sums);
        return 0;
    }
#endif
    float *row = (float *)aligned_alloc(64, (size_t)((k * sizeof(float) + 63) / 64 * 64));
    if (row == NULL) return -2;
    for (int64_t r = row_start; r < row_end; r++) {
        decode(w + r * row_bytes, k, row);
        for (int64_t i = 0; i < m; i++) y[i * n + r] = dot(row, x + i * k, k);
    }
    free(row);
    return 0;
}

/* Decode the weight rows [row_start, row_end) into out (float32, (row_end - row_start) x k): the float panel a
 * batch's BLAS product reads. Returns 0, or -1 as carrack_qmatvec. */
int carrack_qdecode(const uint8_t *w, int type, int64_t row_bytes, int64_t k, int64_t row_start, int64_t row_end,
                    float *out) {
    int64_t block_values, block_bytes;
    row_decoder decode = decoder_for(type, &block_values, &block_bytes);
    if (decode == NULL || k % block_values != 0 || row_bytes != k / block_values * block_bytes) return -1;
    for (int64_t r = row_start; r < row_end; r++) decode(w + r * row_bytes, k, out + (r - row_start) * k);
    return 0;
}

/* -- over the thread pool: the rows of W split over `threads` (each output element is one row's dot products, so
 * the split changes no sum); the first failing piece's status is returned --------------------------------------- */
CARRACK_POOL_CLIENT(qmatvec)

typedef struct {
    const uint8_t *w;
    const float *x;
    float *y;
    int64_t row_bytes, n, k, m;
    int type;
    _Atomic int status;
} qmatvec_call_t;

static void qmatvec_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    qmatvec_call_t *c = p;
    (void)slot;
    int status = carrack_qmatvec(c->w, c->type, c->row_bytes, c->n, c->k, c->x, c->m, c->y, begin, end);
    if (status) atomic_store(&c->status, status);
}

int carrack_qmatvec_threads(const uint8_t *w, int type, int64_t row_bytes, int64_t n, int64_t k, const float *x,
                            int64_t m, float *y, int64_t threads) {
    qmatvec_call_t c = {w, x, y, row_bytes, n, k, m, type, 0};
    parallel_for(qmatvec_piece, &c, 0, n, pieces_for(n, threads), threads);
    return atomic_load(&c.status);
}
