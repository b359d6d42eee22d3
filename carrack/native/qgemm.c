// carrack-cflags: -ffp-contract=off
/* Exact int8 GEMM: A (uint8 [M, K], row stride lda) times a packed int8 weight B [K, N], accumulated in int32 with
 * wrap-around (bit for bit what int64 accumulation wrapped to int32 gives), then a fused per-element epilogue:
 *
 *   acc = sum_k A[m,k] * B[k,n] - a_zero_point * colsum[n] (+ bias_i32[n])          (int32, wrapping)
 *   QGEMM_INT32:    out = acc
 *   QGEMM_FLOAT:    out = (float)acc * scale[n] (+ bias_f32[n])                         (float32, in this order)
 *   QGEMM_REQUANT_*: out = clamp(nearbyintf((float)acc * scale[n]) + (float)y_zero_point, lo, hi) as uint8/int8
 *
 * Packed B: panels of QGEMM_NR columns (the last one narrower: its width rounded up to 16, zero padded); panel p
 * starts at byte p * K4 * QGEMM_NR * 4 (K4 = K rounded up to 4, the extra rows zero). Inside a panel of width w,
 * group g (rows 4g..4g+3) takes w * 4 bytes: column c's four bytes at c * 4. So 16 columns of one group are one
 * 64-byte vector, the operand of VNNI's vpdpbusd (u8 x s8, groups of 4, into int32 lanes).
 *
 * On CPUs with AMX (checked at run time, CARRACK_AMX=0 to turn off) depths that are multiples of 64 run on AMX tiles,
 * whose B layout the packed panel already is (see run_amx); the results are the same bits.
 *
 * No -ffast-math here: the float epilogues must round exactly as the numpy path does (and no FMA contraction).
 */
#define _GNU_SOURCE /* syscall(), for the AMX permission */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "threadpool.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QGEMM_VNNI 1
#if defined(__linux__) && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define QGEMM_AMX 1 /* AMX tiles where the CPU has them and the kernel grants them (checked at run time) */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__AVX2__)
#define QGEMM_AVX2 1
#endif

#define QGEMM_NR 64
#define QGEMM_NV (QGEMM_NR / 16)
#define QGEMM_MR 6

enum { QGEMM_INT32 = 0, QGEMM_FLOAT = 1, QGEMM_REQUANT_U8 = 2, QGEMM_REQUANT_S8 = 3 };

typedef struct {
    int64_t k, n;
    const uint8_t *a;
    int64_t lda;
    const int8_t *packed;
    const int32_t *colsum;
    int32_t a_zp;
    const int32_t *bias_i32;
    int mode;
    void *out;
    int64_t ldc_m, ldc_n;
    const float *scale;
    const float *bias_f32;
    int32_t y_zp;
} job_t;

static inline int64_t groups_of(int64_t k) { return (k + 3) / 4; }

static inline int64_t panel_width(int64_t n, int64_t col0) {
    int64_t w = n - col0;
    if (w > QGEMM_NR) w = QGEMM_NR;
    return (w + 15) & ~(int64_t)15;
}

int64_t qgemm_panel_columns(void) { return QGEMM_NR; }

static inline const int8_t *packed_panel(const job_t *j, int64_t col0, int64_t k4) {
    return j->packed + (col0 / QGEMM_NR) * k4 * QGEMM_NR * 4;
}

int64_t qgemm_packed_bytes(int64_t k, int64_t n) { return groups_of(k) * 4 * ((n + 15) & ~(int64_t)15); }

/* 512: AVX-512 VNNI, 256: AVX2, 0: portable C */
#if !defined(QGEMM_AMX)
int64_t qgemm_amx(int64_t enable) {
    (void)enable;
    return 0;
}
#endif

int64_t qgemm_isa(void) {
#if defined(QGEMM_VNNI)
    return 512;
#elif defined(QGEMM_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* b: int8 [k, n] with row stride ldb (elements); packed: qgemm_packed_bytes(k, n) bytes; colsum: int32 [n]. */
void qgemm_pack_b(const int8_t *b, int64_t k, int64_t n, int64_t ldb, int8_t *packed, int32_t *colsum) {
    const int64_t k4 = groups_of(k);
    memset(packed, 0, (size_t)qgemm_packed_bytes(k, n));
    for (int64_t col0 = 0; col0 < n; col0 += QGEMM_NR) {
        const int64_t w = panel_width(n, col0), cols = n - col0 < QGEMM_NR ? n - col0 : QGEMM_NR;
        int8_t *panel = packed + (col0 / QGEMM_NR) * k4 * QGEMM_NR * 4;
        for (int64_t row = 0; row < k; row++) {
            const int8_t *src = b + row * ldb + col0;
            int8_t *dst = panel + (row / 4) * w * 4 + row % 4;
            for (int64_t c = 0; c < cols; c++) dst[c * 4] = src[c];
        }
    }
    uint32_t *sums = (uint32_t *)colsum; /* wrapping sums (int32 and uint32 may alias) */
    for (int64_t col = 0; col < n; col++) sums[col] = 0;
    for (int64_t row = 0; row < k; row++)
        for (int64_t col = 0; col < n; col++) sums[col] += (uint32_t)(int32_t)b[row * ldb + col];
}

/* -- epilogue ------------------------------------------------------------------------------------------------------ */
/* as vmaxps/vminps do (a NaN becomes lo) */
static inline float clamp_to(float f, float lo, float hi) {
    f = f > lo ? f : lo;
    return f < hi ? f : hi;
}

/* column col's offset of the accumulator: bias - a_zero_point * colsum (int32, wrapping) */
static inline int32_t column_offset(const job_t *j, int64_t col) {
    uint32_t u = (uint32_t)0 - (uint32_t)j->a_zp * (uint32_t)j->colsum[col];
    if (j->bias_i32) u += (uint32_t)j->bias_i32[col];
    return (int32_t)u;
}

/* the epilogue of one output element, acc being its dot product plus its column's offset */
static inline void finish_scalar(const job_t *j, int64_t row, int64_t col, int32_t acc) {
    int64_t at = row * j->ldc_m + col * j->ldc_n;
    if (j->mode == QGEMM_INT32) {
        ((int32_t *)j->out)[at] = acc;
    } else if (j->mode == QGEMM_FLOAT) {
        float f = (float)acc * j->scale[col];
        if (j->bias_f32) f = f + j->bias_f32[col];
        ((float *)j->out)[at] = f;
    } else {
        float f = nearbyintf((float)acc * j->scale[col]) + (float)j->y_zp;
        if (j->mode == QGEMM_REQUANT_U8)
            ((uint8_t *)j->out)[at] = (uint8_t)(int32_t)clamp_to(f, 0.0f, 255.0f);
        else
            ((int8_t *)j->out)[at] = (int8_t)(int32_t)clamp_to(f, -128.0f, 127.0f);
    }
}

/* dot: the raw dot product of one output element */
static inline void store_scalar(const job_t *j, int64_t row, int64_t col, int32_t dot) {
    finish_scalar(j, row, col, (int32_t)((uint32_t)dot + (uint32_t)column_offset(j, col)));
}

#if defined(QGEMM_VNNI)
/* one vector of 16 output columns (the first `cols` valid) of one row; v: their dot products plus their columns'
 * offsets (the tile starts its accumulators at the offsets: no per-element zero-point product here) */
static inline void store_vector(const job_t *j, int64_t row, int64_t col, __m512i v, int64_t cols) {
    if (j->ldc_n != 1) {
        int32_t tmp[16];
        _mm512_storeu_si512(tmp, v);
        for (int64_t c = 0; c < cols && c < 16; c++) finish_scalar(j, row, col + c, tmp[c]);
        return;
    }
    __mmask16 mask = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
    int64_t at = row * j->ldc_m + col;
    if (j->mode == QGEMM_INT32) {
        _mm512_mask_storeu_epi32((int32_t *)j->out + at, mask, v);
        return;
    }
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_maskz_loadu_ps(mask, j->scale + col));
    if (j->mode == QGEMM_FLOAT) {
        if (j->bias_f32) f = _mm512_add_ps(f, _mm512_maskz_loadu_ps(mask, j->bias_f32 + col));
        _mm512_mask_storeu_ps((float *)j->out + at, mask, f);
        return;
    }
    int is_u8 = j->mode == QGEMM_REQUANT_U8;
    f = _mm512_roundscale_ps(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    f = _mm512_add_ps(f, _mm512_set1_ps((float)j->y_zp));
    f = _mm512_max_ps(f, _mm512_set1_ps(is_u8 ? 0.0f : -128.0f));
    f = _mm512_min_ps(f, _mm512_set1_ps(is_u8 ? 255.0f : 127.0f));
    __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(f));
    _mm_mask_storeu_epi8((uint8_t *)j->out + at, mask, bytes);
}

/* acc += a (u8) . b (s8) per 4-byte group. gcc 12 copies the accumulator around the intrinsic (spilling a tile's
 * worth of registers); the asm form keeps it in place. */
static inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
#if defined(__GNUC__)
    __asm__("vpdpbusd {%2, %1, %0|%0, %1, %2}" : "+v"(acc) : "v"(a), "vm"(b));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, a, b);
#endif
}

/* mr rows x nv 16-column vectors of one panel, the whole K in registers; the dot products go to `dot` (row stride
 * QGEMM_NR), from where the epilogue reads them (keeping it out of this loop's register budget) */
static inline __attribute__((always_inline)) void tile(const job_t *j, int64_t row, const int8_t *bp, int64_t width,
                                                       const int32_t *offsets, int32_t *dot, const int mr,
                                                       const int nv) {
    __m512i acc[QGEMM_MR][QGEMM_NV];
    const int64_t lda = j->lda, full = j->k / 4, rem = j->k % 4, stride = width * 4;
    const uint8_t *a = j->a + row * lda;
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[i][v] = _mm512_loadu_si512(offsets + 16 * v);
    for (int64_t g = 0; g < full; g++) {
        const int8_t *b = bp + g * stride;
        __m512i bv[QGEMM_NV];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) bv[v] = _mm512_loadu_si512(b + 64 * v);
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            int32_t x;
            memcpy(&x, a + i * lda + 4 * g, 4);
            __m512i av = _mm512_set1_epi32(x);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[i][v] = dpbusd(acc[i][v], av, bv[v]);
        }
    }
    if (rem) { /* the last group: only rem bytes of each A row may be read; B's padding rows are zero */
        const int8_t *b = bp + full * stride;
#pragma GCC unroll 8
        for (int i = 0; i < mr; i++) {
            int32_t x = 0;
            memcpy(&x, a + i * lda + 4 * full, (size_t)rem);
            __m512i av = _mm512_set1_epi32(x);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[i][v] = dpbusd(acc[i][v], av, _mm512_loadu_si512(b + 64 * v));
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) _mm512_storeu_si512(dot + i * QGEMM_NR + 16 * v, acc[i][v]);
}


#if defined(QGEMM_AMX)
/* -- AMX (Sapphire Rapids and later) ------------------------------------------------------------------------------ *
 * The packed panel is already AMX's B layout: a group of 4 depth rows is one 64-byte tile row holding 16 columns'
 * 4 bytes each. A block of 32 rows x 32 columns runs as four 16x16 int32 tiles (tdpbusd: u8 x s8 in groups of 4,
 * summed into int32 with wrap-around, as vpdpbusd), 64 bytes of depth per step, so only K a multiple of 64 takes
 * it; the rows past the last whole 32 go to the VNNI tiles. The results go through `dot` to store_vector. */
static int amx_state; /* 0: not checked yet, 1: usable, -1: not (no AMX, refused by the kernel, CARRACK_AMX=0) */

static int amx_check(void) {
    unsigned eax, ebx, ecx, edx;
    const char *env = getenv("CARRACK_AMX");
    if (env && env[0] == '0') return -1;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return -1;
    /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: a process must ask before its first tile instruction */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
}

static int amx_usable(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        state = amx_check();
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state > 0;
}

/* 1 when products of depth K take the AMX tiles (for tests: `enable` 0 turns them off, 1 back on where usable) */
int64_t qgemm_amx(int64_t enable) {
    if (enable == 0) __atomic_store_n(&amx_state, -1, __ATOMIC_RELEASE);
    else if (enable == 1) __atomic_store_n(&amx_state, 0, __ATOMIC_RELEASE);
    return amx_usable();
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config_t;

__attribute__((target("amx-tile"))) static void amx_configure(void) {
    tile_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16; /* 0-3: C, 4-5: A, 6-7: B */
    _tile_loadconfig(&cfg);
}

/* rows [row, row + 32) x the panel's 16 (two = 0) or 32 columns at bp; dot: int32 [32][QGEMM_NR] */
__attribute__((target("amx-tile,amx-int8"))) static void amx_block(const job_t *j, int64_t row, const int8_t *bp,
                                                                    int64_t stride, int two, int32_t *dot) {
    const int64_t lda = j->lda, steps = j->k / 64;
    const uint8_t *a = j->a + row * lda;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        const int8_t *b = bp + 16 * s * stride;
        _tile_loadd(4, a + 64 * s, lda);
        _tile_loadd(5, a + 16 * lda + 64 * s, lda);
        _tile_loadd(6, b, stride);
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(2, 5, 6);
        if (two) {
            _tile_loadd(7, b + 64, stride);
            _tile_dpbusd(1, 4, 7);
            _tile_dpbusd(3, 5, 7);
        }
    }
    _tile_stored(0, dot, QGEMM_NR * 4);
    _tile_stored(2, dot + 16 * QGEMM_NR, QGEMM_NR * 4);
    if (two) {
        _tile_stored(1, dot + 16, QGEMM_NR * 4);
        _tile_stored(3, dot + 16 * QGEMM_NR + 16, QGEMM_NR * 4);
    }
}

static void run_tile(const job_t *j, int64_t row, int64_t col0, const int8_t *bp, int64_t width, int64_t cols,
                     int mr, const int32_t *offsets);

/* qgemm_run's loops with 32-row AMX blocks (rows per L2 block a multiple of 32) */
__attribute__((target("amx-tile,amx-int8"))) static void run_amx(const job_t *j, int64_t m0, int64_t m1, int64_t n0,
                                                                  int64_t n1) {
    const int64_t k4 = groups_of(j->k);
    int32_t dot[32 * QGEMM_NR];
    int64_t block = (int64_t)(1 << 18) / j->k;
    block = block < 32 ? 32 : block - block % 32;
    amx_configure();
    for (int64_t mb = m0; mb < m1; mb += block) {
        int64_t me = mb + block < m1 ? mb + block : m1;
        for (int64_t col0 = n0; col0 < n1; col0 += QGEMM_NR) {
            int64_t width = panel_width(j->n, col0);
            int64_t cols = (n1 < col0 + QGEMM_NR ? n1 : col0 + QGEMM_NR) - col0;
            const int8_t *bp = packed_panel(j, col0, k4);
            int32_t offsets[QGEMM_NR] = {0};
            for (int64_t c = 0; c < cols; c++) offsets[c] = column_offset(j, col0 + c);
            int64_t row = mb;
            for (; row + 32 <= me; row += 32)
                for (int64_t c = 0; c < cols; c += 32) {
                    amx_block(j, row, bp + 4 * c, width * 4, cols - c > 16, dot);
                    for (int64_t i = 0; i < 32; i++)
                        for (int64_t v = c; v < cols && v < c + 32; v += 16)
                            store_vector(j, row + i, col0 + v,
                                         _mm512_add_epi32(_mm512_loadu_si512(dot + i * QGEMM_NR + v - c),
                                                          _mm512_loadu_si512(offsets + v)), cols - v);
                }
            for (; row < me; row += QGEMM_MR)
                run_tile(j, row, col0, bp, width, cols, (int)(me - row < QGEMM_MR ? me - row : QGEMM_MR), offsets);
        }
    }
    _tile_release();
}
#endif

#define TILE_CASE(m, v) \
    case (m) * 8 + (v): tile(j, row, bp, width, offsets, dot, m, v); break;
#define TILE_ROWS(m) TILE_CASE(m, 1) TILE_CASE(m, 2) TILE_CASE(m, 3) TILE_CASE(m, 4)

/* offsets: column_offset of the panel's columns col0.. (QGEMM_NR of them, zero past the last) */
static void run_tile(const job_t *j, int64_t row, int64_t col0, const int8_t *bp, int64_t width, int64_t cols,
                     int mr, const int32_t *offsets) {
    int32_t dot[QGEMM_MR * QGEMM_NR];
    switch (mr * 8 + (int)(width / 16)) {
        TILE_ROWS(1) TILE_ROWS(2) TILE_ROWS(3) TILE_ROWS(4) TILE_ROWS(5) TILE_ROWS(6)
        default: return;
    }
    for (int i = 0; i < mr; i++)
        for (int64_t c = 0; c < cols; c += 16)
            store_vector(j, row + i, col0 + c, _mm512_loadu_si512(dot + i * QGEMM_NR + c), cols - c);
}

#elif defined(QGEMM_AVX2)
/* up to 2 rows x 16 columns: the bytes are widened to int16 and multiplied pairwise by vpmaddwd, which is exact
 * here (|a * b| <= 255 * 128, a pair's sum fits int32); each lane holds half of a column's 4-group, the halves are
 * added at the end. (vpmaddubsw would saturate: never used.) */
static void tile16(const job_t *j, int64_t row, int64_t col, const int8_t *bp, int64_t stride, int64_t cols, int mr) {
    __m256i acc[2][4];
    const int64_t lda = j->lda, full = j->k / 4, rem = j->k % 4;
    for (int i = 0; i < 2; i++)
        for (int q = 0; q < 4; q++) acc[i][q] = _mm256_setzero_si256();
    for (int64_t g = 0; g < groups_of(j->k); g++) {
        const int8_t *b = bp + g * stride;
        __m256i bv[4];
        for (int q = 0; q < 4; q++) bv[q] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 16 * q)));
        for (int i = 0; i < mr; i++) {
            int32_t x = 0;
            memcpy(&x, j->a + (row + i) * lda + 4 * g, g < full ? 4 : (size_t)rem);
            __m256i av = _mm256_cvtepu8_epi16(_mm_set1_epi32(x));
            for (int q = 0; q < 4; q++) acc[i][q] = _mm256_add_epi32(acc[i][q], _mm256_madd_epi16(av, bv[q]));
        }
    }
    for (int i = 0; i < mr; i++) {
        int32_t dot[16];
        for (int h = 0; h < 2; h++) {
            __m256i s = _mm256_hadd_epi32(acc[i][2 * h], acc[i][2 * h + 1]);
            _mm256_storeu_si256((__m256i *)(dot + 8 * h), _mm256_permute4x64_epi64(s, 0xD8));
        }
        for (int64_t c = 0; c < cols && c < 16; c++) store_scalar(j, row + i, col + c, dot[c]);
    }
}

static void run_tile(const job_t *j, int64_t row, int64_t col0, const int8_t *bp, int64_t width, int64_t cols,
                     int mr, const int32_t *offsets) {
    (void)offsets; /* store_scalar adds them */
    for (int i = 0; i < mr; i += 2) {
        for (int64_t v = 0; v * 16 < cols; v++)
            tile16(j, row + i, col0 + 16 * v, bp + 64 * v, width * 4, cols - 16 * v, mr - i < 2 ? mr - i : 2);
    }
}

#else
/* portable C: the compiler may vectorize the column loop */
static void run_tile(const job_t *j, int64_t row, int64_t col0, const int8_t *bp, int64_t width, int64_t cols,
                     int mr, const int32_t *offsets) {
    uint32_t acc[QGEMM_NR];
    (void)offsets; /* store_scalar adds them */
    const int64_t k4 = groups_of(j->k);
    for (int i = 0; i < mr; i++) {
        const uint8_t *a = j->a + (row + i) * j->lda;
        for (int64_t c = 0; c < width; c++) acc[c] = 0;
        for (int64_t g = 0; g < k4; g++) {
            int32_t a0 = a[4 * g], a1 = 0, a2 = 0, a3 = 0;
            if (4 * g + 3 < j->k) {
                a1 = a[4 * g + 1], a2 = a[4 * g + 2], a3 = a[4 * g + 3];
            } else {
                a1 = 4 * g + 1 < j->k ? a[4 * g + 1] : 0;
                a2 = 4 * g + 2 < j->k ? a[4 * g + 2] : 0;
            }
            const int8_t *b = bp + g * width * 4;
            for (int64_t c = 0; c < width; c++)
                acc[c] += (uint32_t)(a0 * b[4 * c] + a1 * b[4 * c + 1] + a2 * b[4 * c + 2] + a3 * b[4 * c + 3]);
        }
        for (int64_t c = 0; c < cols; c++) store_scalar(j, row + i, col0 + c, (int32_t)acc[c]);
    }
}
#endif

/* Output rows [m0, m1) and columns [n0, n1) (n0 a multiple of qgemm_panel_columns()). out element (m, n) is at
 * out + m * ldc_m + n * ldc_n (elements of the mode's type). scale: float32 [n] for every mode but INT32 (the
 * multiplier when requantizing); bias_i32, bias_f32: optional [n]. */
void qgemm_run(int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t k, int64_t n, const uint8_t *a, int64_t lda,
               const int8_t *packed, const int32_t *colsum, int32_t a_zero_point, const int32_t *bias_i32,
               int32_t mode, void *out, int64_t ldc_m, int64_t ldc_n, const float *scale, const float *bias_f32,
               int32_t y_zero_point) {
    job_t job = {k, n, a, lda, packed, colsum, a_zero_point, bias_i32, mode, out, ldc_m, ldc_n, scale, bias_f32,
                 y_zero_point};
    const job_t *j = &job;
    const int64_t k4 = groups_of(k);
    if (n1 > n) n1 = n;
#if defined(QGEMM_AMX)
    if (k > 0 && k % 64 == 0 && m1 - m0 >= 32 && amx_usable()) {
        run_amx(j, m0, m1, n0, n1);
        return;
    }
#endif
    /* rows per block: A's block (about 256 KiB) stays in L2 while every panel of B passes over it */
    int64_t block = (int64_t)(1 << 18) / (k > 0 ? k : 1);
    block = block < QGEMM_MR ? QGEMM_MR : block - block % QGEMM_MR;
    for (int64_t mb = m0; mb < m1; mb += block) {
        int64_t me = mb + block < m1 ? mb + block : m1;
        for (int64_t col0 = n0; col0 < n1; col0 += QGEMM_NR) {
            int64_t width = panel_width(n, col0);
            int64_t cols = (n1 < col0 + QGEMM_NR ? n1 : col0 + QGEMM_NR) - col0;
            const int8_t *bp = packed + (col0 / QGEMM_NR) * k4 * QGEMM_NR * 4;
            int32_t offsets[QGEMM_NR] = {0};
            for (int64_t c = 0; c < cols; c++) offsets[c] = column_offset(j, col0 + c);
            for (int64_t row = mb; row < me; row += QGEMM_MR) {
                int mr = (int)(me - row < QGEMM_MR ? me - row : QGEMM_MR);
                run_tile(j, row, col0, bp, width, cols, mr, offsets);
            }
        }
    }
}

/* -- qgemm_run over the thread pool ------------------------------------------------------------------------------ */
CARRACK_POOL_CLIENT(qgemm)

typedef struct {
    job_t job;
    int64_t m, by_panels;
} qgemm_call_t;

static void qgemm_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const qgemm_call_t *c = p;
    const job_t *j = &c->job;
    (void)slot;
    if (c->by_panels)
        qgemm_run(0, c->m, begin * QGEMM_NR, end * QGEMM_NR, j->k, j->n, j->a, j->lda, j->packed, j->colsum, j->a_zp,
                  j->bias_i32, j->mode, j->out, j->ldc_m, j->ldc_n, j->scale, j->bias_f32, j->y_zp);
    else
        qgemm_run(begin, end, 0, j->n, j->k, j->n, j->a, j->lda, j->packed, j->colsum, j->a_zp, j->bias_i32, j->mode,
                  j->out, j->ldc_m, j->ldc_n, j->scale, j->bias_f32, j->y_zp);
}

/* qgemm_run of all M rows and N columns over `threads`: whole column panels when there are enough of them, else
 * row ranges (integer sums: the same result for any split). */
void qgemm_run_threads(int64_t m, int64_t k, int64_t n, const uint8_t *a, int64_t lda, const int8_t *packed,
                       const int32_t *colsum, int32_t a_zero_point, const int32_t *bias_i32, int32_t mode, void *out,
                       int64_t ldc_m, int64_t ldc_n, const float *scale, const float *bias_f32, int32_t y_zero_point,
                       int64_t threads) {
    const int64_t panels = (n + QGEMM_NR - 1) / QGEMM_NR;
    qgemm_call_t c = {{k, n, a, lda, packed, colsum, a_zero_point, bias_i32, mode, out, ldc_m, ldc_n, scale, bias_f32,
                       y_zero_point}, m, panels >= threads};
    if (c.by_panels)
        parallel_for(qgemm_piece, &c, 0, panels, pieces_for(panels, threads), threads);
    else
        parallel_for(qgemm_piece, &c, 0, m, pieces_for((m + QGEMM_MR - 1) / QGEMM_MR, threads), threads);
}

/* -- DynamicQuantizeLinear to uint8 ------------------------------------------------------------------------------ */
/* Like ONNX DynamicQuantizeLinear (and carrack's numpy version): range [min(0, min x), max(0, max x)],
 * scale = (hi - lo) / 255, zero_point = clamp(nearbyint(0 - lo / scale), 0, 255),
 * q = clamp(nearbyint(x / scale), -zp, 255 - zp) + zp with a true division. Rows of q get ldq bytes, those past k
 * set to 0. Returns 1 (and writes nothing) when x holds a NaN or an infinity: the caller's numpy path decides. */
/* The range of rows [r0, r1) of x: lo = min(0, min x), hi = max(0, max x); *bad set when one is a NaN or an
 * infinity. Minimum and maximum do not depend on the order they are taken in: any split of the rows gives the
 * same range. */
static void rows_range(const float *x, int64_t r0, int64_t r1, int64_t k, int64_t ldx, float *lo_out, float *hi_out,
                       int *bad_out) {
    float lo = 0.0f, hi = 0.0f;
    int bad = 0;
    for (int64_t r = r0; r < r1; r++) {
        const float *row = x + r * ldx;
        int64_t c = 0;
#if defined(__AVX512F__)
        __m512 vlo = _mm512_setzero_ps(), vhi = _mm512_setzero_ps();
        __mmask16 vbad = 0;
        for (; c < k; c += 16) {
            __mmask16 mask = k - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - c)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(mask, row + c);  /* masked lanes read 0: neutral for the range */
            vlo = _mm512_min_ps(vlo, v);
            vhi = _mm512_max_ps(vhi, v);
            vbad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);
        }
        float rlo = _mm512_reduce_min_ps(vlo), rhi = _mm512_reduce_max_ps(vhi);
        lo = rlo < lo ? rlo : lo;
        hi = rhi > hi ? rhi : hi;
        bad |= vbad != 0;
#endif
        for (; c < k; c++) {
            float v = row[c];
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
            bad |= !(v - v == 0.0f);
        }
    }
    *lo_out = lo, *hi_out = hi, *bad_out = bad;
}

/* Rows [r0, r1) of q from x with the scale and zero point (scale 0: all zero). */
static void rows_quantize(const float *x, int64_t r0, int64_t r1, int64_t k, int64_t ldx, uint8_t *q, int64_t ldq,
                          float scale, int32_t zp) {
    if (scale == 0.0f) {
        for (int64_t r = r0; r < r1; r++) memset(q + r * ldq, 0, (size_t)ldq);
        return;
    }
    const float qlo = (float)-zp, qhi = (float)(255 - zp), fzp = (float)zp;
    for (int64_t r = r0; r < r1; r++) {
        const float *row = x + r * ldx;
        uint8_t *dst = q + r * ldq;
        int64_t c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        const __m512 vs = _mm512_set1_ps(scale), vqlo = _mm512_set1_ps(qlo), vqhi = _mm512_set1_ps(qhi);
        const __m512 vzp = _mm512_set1_ps(fzp);
        for (; c < k; c += 16) {
            __mmask16 mask = k - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - c)) - 1);
            __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(mask, row + c), vs);
            v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(v, vqlo), vqhi), vzp);
            _mm_mask_storeu_epi8(dst + c, mask, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
        }
#endif
        for (; c < k; c++) dst[c] = (uint8_t)(int32_t)(clamp_to(nearbyintf(row[c] / scale), qlo, qhi) + fzp);
        if (ldq > k) memset(dst + k, 0, (size_t)(ldq - k));
    }
}

/* The scale and zero point of the range [lo, hi] (scale 0 when the range is empty: all of x is 0). */
static void range_parameters(float lo, float hi, float *scale_out, int32_t *zp_out) {
    const float scale = (hi - lo) / 255.0f;
    *scale_out = scale;
    *zp_out = scale == 0.0f ? 0 : (int32_t)clamp_to(nearbyintf(0.0f - lo / scale), 0.0f, 255.0f);
}

int64_t qgemm_dynamic_quantize_u8(const float *x, int64_t m, int64_t k, int64_t ldx, uint8_t *q, int64_t ldq,
                                  float *scale_out, int32_t *zero_point_out) {
    float lo, hi, scale;
    int32_t zp;
    int bad;
    rows_range(x, 0, m, k, ldx, &lo, &hi, &bad);
    if (bad) return 1;
    range_parameters(lo, hi, &scale, &zp);
    rows_quantize(x, 0, m, k, ldx, q, ldq, scale, zp);
    *scale_out = scale == 0.0f ? 1.0f : scale;
    *zero_point_out = zp;
    return 0;
}

/* -- DynamicQuantizeLinear over the thread pool: the range by row ranges (one partial range per participant, then
 * combined: minimum and maximum are exact in any order), then the rows quantized; the same bytes at any count -- */
#define QUANTIZE_MAX_SLOTS 256

typedef struct {
    const float *x;
    uint8_t *q;
    int64_t k, ldx, ldq;
    float scale;
    int32_t zp;
    float lo[QUANTIZE_MAX_SLOTS], hi[QUANTIZE_MAX_SLOTS];
    int bad[QUANTIZE_MAX_SLOTS];
} quantize_call_t;

static void range_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    quantize_call_t *c = p;
    float lo, hi;
    int bad;
    rows_range(c->x, begin, end, c->k, c->ldx, &lo, &hi, &bad);
    c->lo[slot] = lo < c->lo[slot] ? lo : c->lo[slot];
    c->hi[slot] = hi > c->hi[slot] ? hi : c->hi[slot];
    c->bad[slot] |= bad;
}

static void quantize_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const quantize_call_t *c = p;
    (void)slot;
    rows_quantize(c->x, begin, end, c->k, c->ldx, c->q, c->ldq, c->scale, c->zp);
}

int64_t qgemm_dynamic_quantize_u8_threads(const float *x, int64_t m, int64_t k, int64_t ldx, uint8_t *q, int64_t ldq,
                                          float *scale_out, int32_t *zero_point_out, int64_t threads) {
    if (threads > QUANTIZE_MAX_SLOTS) threads = QUANTIZE_MAX_SLOTS;
    if (threads <= 1 || m < 2) return qgemm_dynamic_quantize_u8(x, m, k, ldx, q, ldq, scale_out, zero_point_out);
    quantize_call_t *c = malloc(sizeof *c);
    if (c == NULL) return qgemm_dynamic_quantize_u8(x, m, k, ldx, q, ldq, scale_out, zero_point_out);
    c->x = x, c->q = q, c->k = k, c->ldx = ldx, c->ldq = ldq;
    for (int64_t i = 0; i < threads; i++) c->lo[i] = 0.0f, c->hi[i] = 0.0f, c->bad[i] = 0;
    parallel_for(range_piece, c, 0, m, pieces_for(m, threads), threads);
    float lo = 0.0f, hi = 0.0f;
    int bad = 0;
    for (int64_t i = 0; i < threads; i++) {
        lo = c->lo[i] < lo ? c->lo[i] : lo;
        hi = c->hi[i] > hi ? c->hi[i] : hi;
        bad |= c->bad[i];
    }
    if (!bad) {
        range_parameters(lo, hi, &c->scale, &c->zp);
        parallel_for(quantize_piece, c, 0, m, pieces_for(m, threads), threads);
        *scale_out = c->scale == 0.0f ? 1.0f : c->scale;
        *zero_point_out = c->zp;
    }
    free(c);
    return bad ? 1 : 0;
}
