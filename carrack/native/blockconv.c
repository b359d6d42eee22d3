/* Float32 convolutions on channel-blocked tensors: [N, C/16, H, W, 16], each pixel's 16 channels of a block side
 * by side (one 64-byte line), as onnxruntime's NCHWc layout. The layout pass (carrack/passes/blocked_layout.py)
 * rewrites chains of convolutions whose channel counts are multiples of 16 to carrack.BlockedConv nodes, with
 * reorders only at the chain's ends, so no convolution of the chain packs its input and no map has a pixel tail.
 *
 *     y[n, ob, oh, ow, :] = act(bias + sum_{ib, kh, kw, ic} w[ob, ib, kh, kw, ic, :] * x[n, ib, ih, iw, ic] + z)
 *
 * - weights are packed once (carrack/native/blockconv.py) by groups of up to 4 output blocks, each group one
 *   contiguous stream read in order by its tiles: [group][IC/16][KH][KW][16 ic][blocks of the group x 16 oc];
 * - a tile is up to 4 output blocks (64 channels) x up to 6 pixels of one output row (fewer pixels where fewer
 *   blocks: 24 accumulators); for each input channel it loads one weight vector per output block and broadcasts the
 *   input channel of each pixel;
 * - a row's pixels whose window leaves the image on the left or right run alone over their own window columns;
 *   rows outside the image are skipped for the whole row;
 * - a 1x1 convolution of stride 1 without pads reads the map as one row of H * W pixels (cut in segments), so a
 *   14x14 map has no 2-pixel row remainders;
 * - threads take (row, output block group) items in contiguous pieces.
 * Every output sums its terms in one order (input block, kernel row, kernel column, input channel) whatever the tile,
 * the item order or the thread count: results are the same bits at any thread count.
 * The portable build runs the same loops in scalar C (blockconv_vectorized() says which).
 */
#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "activations.h"
#include "threadpool.h"

/* CARRACK_PORTABLE builds the plain C versions on any machine, for testing */
#if defined(__AVX512F__) && !defined(CARRACK_PORTABLE)
#define BLOCKCONV_AVX512 1
#include <immintrin.h>
#endif

#define BLOCK 16
#define MAX_BLOCKS 4 /* output blocks of a tile */
#define SEGMENT 96   /* pixels of a flat (1x1, stride 1) row segment: a multiple of every tile width */

CARRACK_POOL_CLIENT(blockconv)

typedef struct {
    const float *x; /* input of the tile's first pixel at its first tap, input block 0 */
    const float *w; /* weights of the tile's first output block at that tap, input block 0 */
    const float *b; /* bias of the first output block, or NULL */
    const float *z; /* residual at the first pixel, first output block, or NULL */
    float *y;       /* output at the first pixel, first output block */
    int64_t in_blocks, rows, cols;                     /* input blocks, kernel rows and columns to sum */
    int64_t x_block, x_row, x_col, x_pixel;            /* input strides in floats */
    int64_t w_ic, w_in_block, w_row, w_col;            /* weight strides in floats (output blocks are adjacent) */
    int64_t y_block;                                   /* floats between output blocks (z alike) */
    act_t act;
    const char *fetch;    /* weights of the next group to prefetch into L2 while this tile runs, or NULL */
    int64_t fetch_lines;  /* how many 64-byte lines of them */
} tile_t;

#if defined(BLOCKCONV_AVX512)

int64_t blockconv_vectorized(void) { return 1; }

static inline __m512 activate(__m512 v, act_t f) {
    switch (f.act) {
    case ACT_NONE: return v;
    case ACT_RELU: return _mm512_max_ps(v, _mm512_setzero_ps());
    case ACT_CLIP: return _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(f.a)), _mm512_set1_ps(f.b));
    case ACT_LEAKY: {
        __mmask16 negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
        return _mm512_mask_mul_ps(v, negative, v, _mm512_set1_ps(f.a));
    }
    default: {
        float lanes[BLOCK];
        _mm512_storeu_ps(lanes, v);
        for (int k = 0; k < BLOCK; k++) lanes[k] = act_scalar(lanes[k], f);
        return _mm512_loadu_ps(lanes);
    }
    }
}

/* The tile of `fb` output blocks x `pixels` pixels; always inlined into one function per (fb, pixels) so that the
 * accumulators are registers (named variables: gcc spills some of an array's). */
#define FOR_PIXELS(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15)
#define DECLARE(p) __m512 a0_##p, a1_##p, a2_##p, a3_##p;
#define INIT(p)                                                                                                     \
    if (pixels > p) { a0_##p = b0; a1_##p = b1; a2_##p = b2; a3_##p = b3; }
#define STEP(p)                                                                                                     \
    if (pixels > p) {                                                                                               \
        const __m512 v = _mm512_set1_ps(xc[p * x_pixel + ic]);                                                      \
        a0_##p = _mm512_fmadd_ps(w0, v, a0_##p);                                                                    \
        if (fb > 1) a1_##p = _mm512_fmadd_ps(w1, v, a1_##p);                                                        \
        if (fb > 2) a2_##p = _mm512_fmadd_ps(w2, v, a2_##p);                                                        \
        if (fb > 3) a3_##p = _mm512_fmadd_ps(w3, v, a3_##p);                                                        \
    }
#define FINISH_ONE(f, p, ACT)                                                                                       \
    {                                                                                                               \
        __m512 v = a##f##_##p;                                                                                      \
        if (t->z) v = _mm512_add_ps(v, _mm512_loadu_ps(t->z + f * t->y_block + p * BLOCK));                         \
        _mm512_storeu_ps(t->y + f * t->y_block + p * BLOCK, ACT(v));                                                \
    }
#define FINISH(p, ACT)                                                                                              \
    if (pixels > p) {                                                                                               \
        FINISH_ONE(0, p, ACT)                                                                                       \
        if (fb > 1) FINISH_ONE(1, p, ACT)                                                                           \
        if (fb > 2) FINISH_ONE(2, p, ACT)                                                                           \
        if (fb > 3) FINISH_ONE(3, p, ACT)                                                                           \
    }
/* the finish for each activation (one switch a tile, not one a store) */
#define AS_IS(v) (v)
#define RELU(v) _mm512_max_ps(v, zero)
#define ANY(v) activate(v, t->act)
#define FINISH_AS_IS(p) FINISH(p, AS_IS)
#define FINISH_RELU(p) FINISH(p, RELU)
#define FINISH_ANY(p) FINISH(p, ANY)

static inline __attribute__((always_inline)) void tile_body(const tile_t *t, const int fb, const int pixels) {
    FOR_PIXELS(DECLARE)
    const __m512 zero = _mm512_setzero_ps();
    const __m512 b0 = t->b ? _mm512_loadu_ps(t->b) : zero;
    const __m512 b1 = t->b && fb > 1 ? _mm512_loadu_ps(t->b + BLOCK) : zero;
    const __m512 b2 = t->b && fb > 2 ? _mm512_loadu_ps(t->b + 2 * BLOCK) : zero;
    const __m512 b3 = t->b && fb > 3 ? _mm512_loadu_ps(t->b + 3 * BLOCK) : zero;
    FOR_PIXELS(INIT)
    const int64_t x_pixel = t->x_pixel, w_ic = t->w_ic;
    const char *fetch = t->fetch;
    int64_t fetch_left = fetch ? t->fetch_lines : 0;
    const int64_t taps = t->in_blocks * t->rows * t->cols;
    const int64_t fetch_per_tap = taps > 0 ? (fetch_left + taps - 1) / taps : 0;
    if (t->z) /* the residual lines, while the sums run */
        for (int f = 0; f < fb; f++)
            for (int p = 0; p < pixels; p++) _mm_prefetch((const char *)(t->z + f * t->y_block + p * BLOCK), _MM_HINT_T0);
    for (int64_t ib = 0; ib < t->in_blocks; ib++) {
        const float *xb = t->x + ib * t->x_block;
        const float *wb = t->w + ib * t->w_in_block;
        for (int64_t r = 0; r < t->rows; r++) {
            const float *xr = xb + r * t->x_row;
            const float *wr = wb + r * t->w_row;
            for (int64_t c = 0; c < t->cols; c++) {
                const float *xc = xr + c * t->x_col;
                const float *wc = wr + c * t->w_col;
                for (int64_t k = fetch_left < fetch_per_tap ? fetch_left : fetch_per_tap; k > 0; k--) {
                    _mm_prefetch(fetch, _MM_HINT_T1);
                    fetch += 64;
                    fetch_left--;
                }
                for (int ic = 0; ic < BLOCK; ic++) {
                    const float *wi = wc + ic * w_ic;
                    const __m512 w0 = _mm512_loadu_ps(wi);
                    const __m512 w1 = fb > 1 ? _mm512_loadu_ps(wi + BLOCK) : zero;
                    const __m512 w2 = fb > 2 ? _mm512_loadu_ps(wi + 2 * BLOCK) : zero;
                    const __m512 w3 = fb > 3 ? _mm512_loadu_ps(wi + 3 * BLOCK) : zero;
                    FOR_PIXELS(STEP)
                }
            }
        }
    }
    switch (t->act.act) {
    case ACT_NONE: FOR_PIXELS(FINISH_AS_IS) break;
    case ACT_RELU: FOR_PIXELS(FINISH_RELU) break;
    default: FOR_PIXELS(FINISH_ANY) break;
    }
}

#else

int64_t blockconv_vectorized(void) { return 0; }

static inline void tile_body(const tile_t *t, const int fb, const int pixels) {
    float acc[MAX_BLOCKS][16][BLOCK];
    for (int f = 0; f < fb; f++)
        for (int p = 0; p < pixels; p++)
            for (int o = 0; o < BLOCK; o++) acc[f][p][o] = t->b ? t->b[f * BLOCK + o] : 0.0f;
    for (int64_t ib = 0; ib < t->in_blocks; ib++)
        for (int64_t r = 0; r < t->rows; r++)
            for (int64_t c = 0; c < t->cols; c++) {
                const float *xc = t->x + ib * t->x_block + r * t->x_row + c * t->x_col;
                const float *wc = t->w + ib * t->w_in_block + r * t->w_row + c * t->w_col;
                for (int ic = 0; ic < BLOCK; ic++)
                    for (int p = 0; p < pixels; p++) {
                        const float v = xc[p * t->x_pixel + ic];
                        for (int f = 0; f < fb; f++)
                            for (int o = 0; o < BLOCK; o++)
                                acc[f][p][o] += wc[ic * t->w_ic + f * BLOCK + o] * v;
                    }
            }
    for (int f = 0; f < fb; f++)
        for (int p = 0; p < pixels; p++)
            for (int o = 0; o < BLOCK; o++) {
                float v = acc[f][p][o];
                if (t->z) v += t->z[f * t->y_block + p * BLOCK + o];
                t->y[f * t->y_block + p * BLOCK + o] = act_scalar(v, t->act);
            }
}

#endif

/* widest tile (pixels) for a number of output blocks: fb * pixels accumulators, at most 24 */
static const int TILE_PIXELS[MAX_BLOCKS + 1] = {0, 16, 12, 8, 6};

typedef void (*tile_fn)(const tile_t *);

#define TILE(FB, P) static void tile_##FB##_##P(const tile_t *t) { tile_body(t, FB, P); }
#define TILES_1_6(FB) TILE(FB, 1) TILE(FB, 2) TILE(FB, 3) TILE(FB, 4) TILE(FB, 5) TILE(FB, 6)
#define TILES_7_8(FB) TILE(FB, 7) TILE(FB, 8)
#define TILES_9_12(FB) TILE(FB, 9) TILE(FB, 10) TILE(FB, 11) TILE(FB, 12)
#define TILES_13_16(FB) TILE(FB, 13) TILE(FB, 14) TILE(FB, 15) TILE(FB, 16)
TILES_1_6(1) TILES_7_8(1) TILES_9_12(1) TILES_13_16(1)
TILES_1_6(2) TILES_7_8(2) TILES_9_12(2)
TILES_1_6(3) TILES_7_8(3)
TILES_1_6(4)

#define ROW6(FB) tile_##FB##_1, tile_##FB##_2, tile_##FB##_3, tile_##FB##_4, tile_##FB##_5, tile_##FB##_6
static const tile_fn TILES[MAX_BLOCKS + 1][17] = {
    {0},
    {0, ROW6(1), tile_1_7, tile_1_8, tile_1_9, tile_1_10, tile_1_11, tile_1_12, tile_1_13, tile_1_14, tile_1_15,
     tile_1_16},
    {0, ROW6(2), tile_2_7, tile_2_8, tile_2_9, tile_2_10, tile_2_11, tile_2_12},
    {0, ROW6(3), tile_3_7, tile_3_8},
    {0, ROW6(4)},
};

typedef struct {
    const float *x, *w, *b, *z;
    float *y;
    int64_t n, in_blocks, h, w_in, out_blocks, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw;
    int64_t groups;      /* output block groups of MAX_BLOCKS (the last may have fewer) */
    int64_t rows;        /* rows an image: output rows, or flat segments */
    int64_t flat;        /* 1x1 stride 1 without pads: rows are segments of the flattened map */
    int64_t group_major; /* items go group by group (rows inner): the group's weights stay in the cache */
    act_t act;
} conv_t;

/* output pixels [first, last) of a row that one tile call may cover: widest tiles first */
static void run_pixels(const conv_t *c, tile_t *t, int fb, int64_t first, int64_t last, const float *x_first) {
    const int widest = TILE_PIXELS[fb];
    float *y0 = t->y;
    const float *z0 = t->z;
    const char *fetch = t->fetch;
    const int64_t tiles = (last - first + widest - 1) / widest, fetch_lines = t->fetch_lines;
    const int64_t per_tile = fetch ? (fetch_lines + tiles - 1) / tiles : 0;
    int64_t fetched = 0;
    for (int64_t p = first; p < last;) {
        const int count = (int)(last - p < widest ? last - p : widest);
        t->x = x_first + (p - first) * t->x_pixel;
        t->y = y0 + (p - first) * BLOCK;
        t->z = z0 ? z0 + (p - first) * BLOCK : NULL;
        t->fetch = fetch && fetched < fetch_lines ? fetch + 64 * fetched : NULL;
        t->fetch_lines = fetch_lines - fetched < per_tile ? fetch_lines - fetched : per_tile;
        fetched += t->fetch_lines;
        TILES[fb][count](t);
        p += count;
    }
    t->y = y0;
    t->z = z0;
    t->fetch = NULL;
}

/* one item: output row (or flat segment) `row` of image `image`, output blocks [group * 4, +fb) */
static void run_item(const conv_t *c, int64_t image, int64_t row, int64_t group) {
    const int64_t ob = group * MAX_BLOCKS;
    const int fb = (int)(c->out_blocks - ob < MAX_BLOCKS ? c->out_blocks - ob : MAX_BLOCKS);
    const int64_t in_plane = c->h * c->w_in * BLOCK, out_plane = c->oh * c->ow * BLOCK;
    /* the group's weights start after the full groups before it (each MAX_BLOCKS blocks wide) */
    const int64_t w_tap = BLOCK * BLOCK * fb, w_row = c->kw * w_tap, w_in_block = c->kh * w_row;
    tile_t t = {
        .w = c->w + ob * c->in_blocks * c->kh * c->kw * BLOCK * BLOCK,
        .b = c->b ? c->b + ob * BLOCK : NULL,
        .in_blocks = c->in_blocks,
        .x_block = in_plane,
        .w_ic = fb * BLOCK,
        .w_in_block = w_in_block,
        .w_row = w_row,
        .w_col = w_tap,
        .y_block = out_plane,
        .act = c->act,
    };
    /* the next group's weights come from memory while this group's tiles run: in group-major order each row of
     * the group fetches its share, in row-major order the image's first row fetches them */
    const int64_t group_floats = MAX_BLOCKS * BLOCK * c->in_blocks * BLOCK * c->kh * c->kw;
    if (group + 1 < c->groups) {
        const int64_t next_floats = (group + 2 < c->groups ? MAX_BLOCKS : c->out_blocks - ob - MAX_BLOCKS) * BLOCK
                                    * c->in_blocks * BLOCK * c->kh * c->kw;
        const int64_t lines = next_floats / 16;
        const char *next = (const char *)(c->w + (group + 1) * group_floats);
        if (c->group_major) {
            const int64_t share = (lines + c->rows - 1) / c->rows, start = row * share;
            if (start < lines) {
                t.fetch = next + 64 * start;
                t.fetch_lines = start + share < lines ? share : lines - start;
            }
        } else if (row == 0) {
            t.fetch = next;
            t.fetch_lines = lines;
        }
    }
    const float *x_image = c->x + image * c->in_blocks * in_plane;
    const int64_t y_image = (image * c->out_blocks + ob) * out_plane;
    if (c->flat) {
        const int64_t first = row * SEGMENT, pixels = c->oh * c->ow;
        const int64_t last = first + SEGMENT < pixels ? first + SEGMENT : pixels;
        t.rows = t.cols = 1;
        t.x_row = t.x_col = 0;
        t.x_pixel = BLOCK;
        t.y = c->y + y_image + first * BLOCK;
        t.z = c->z ? c->z + y_image + first * BLOCK : NULL;
        run_pixels(c, &t, fb, first, last, x_image + first * BLOCK);
        return;
    }
    /* kernel rows inside the image for this output row */
    const int64_t top = row * c->sh - c->ph;
    int64_t r0 = 0, r1 = c->kh;
    while (r0 < r1 && top + r0 * c->dh < 0) r0++;
    while (r1 > r0 && top + (r1 - 1) * c->dh >= c->h) r1--;
    t.rows = r1 - r0;
    t.x_row = c->dh * c->w_in * BLOCK;
    t.x_col = c->dw * BLOCK;
    t.x_pixel = c->sw * BLOCK;
    const float *x_row = x_image + (top + r0 * c->dh) * c->w_in * BLOCK;
    const float *w_rows = t.w + r0 * w_row;
    float *y_row = c->y + y_image + row * c->ow * BLOCK;
    const float *z_row = c->z ? c->z + y_image + row * c->ow * BLOCK : NULL;
    const char *fetch = t.fetch; /* the interior's tiles fetch */
    const int64_t fetch_lines = t.fetch_lines;
    /* interior pixels [inner0, inner1): every kernel column inside the image */
    const int64_t span = (c->kw - 1) * c->dw;
    int64_t inner0 = (c->pw + c->sw - 1) / c->sw;
    int64_t inner1 = c->w_in - 1 - span + c->pw >= 0 ? (c->w_in - 1 - span + c->pw) / c->sw + 1 : 0;
    if (inner0 > c->ow) inner0 = c->ow;
    if (inner1 > c->ow) inner1 = c->ow;
    if (inner1 < inner0) inner1 = inner0;
    for (int64_t p = 0; p < c->ow; p++) {
        if (p == inner0 && inner1 > inner0) {
            t.fetch = fetch;
            t.fetch_lines = fetch_lines;
            t.cols = c->kw;
            t.w = w_rows;
            t.y = y_row + p * BLOCK;
            t.z = z_row ? z_row + p * BLOCK : NULL;
            run_pixels(c, &t, fb, inner0, inner1, x_row + (p * c->sw - c->pw) * BLOCK);
            p = inner1 - 1;
            continue;
        }
        const int64_t left = p * c->sw - c->pw;
        int64_t k0 = 0, k1 = c->kw;
        while (k0 < k1 && left + k0 * c->dw < 0) k0++;
        while (k1 > k0 && left + (k1 - 1) * c->dw >= c->w_in) k1--;
        t.fetch = NULL;
        t.cols = k1 - k0;
        t.w = w_rows + k0 * w_tap;
        t.x = x_row + (left + k0 * c->dw) * BLOCK;
        t.y = y_row + p * BLOCK;
        t.z = z_row ? z_row + p * BLOCK : NULL;
        TILES[fb][1](&t);
    }
}

static void conv_task(void *context, int64_t begin, int64_t end, int64_t slot) {
    (void)slot;
    const conv_t *c = (const conv_t *)context;
    for (int64_t item = begin; item < end; item++) {
        int64_t image, row, group;
        if (c->group_major) {
            image = item / (c->groups * c->rows);
            group = item / c->rows % c->groups;
            row = item % c->rows;
        } else {
            image = item / (c->groups * c->rows);
            row = item / c->groups % c->rows;
            group = item % c->groups;
        }
        run_item(c, image, row, group);
    }
}

/* Bytes of one output block group's weights above which items go group by group. */
#define GROUP_MAJOR_BYTES (128 * 1024)

/* y = act(conv(x, w) + b + z) on blocked tensors: x [n, ic/16, h, w, 16], y and z [n, oc/16, oh, ow, 16], w packed
 * by pack_weights' groups; b (oc floats) and z may be NULL. Pads: top ph and left pw (the bottom and right
 * ones follow from oh and ow). Returns 0, or -1 for sizes it does not take. */
int64_t blockconv_f32_threads(const float *x, const float *w, const float *b, const float *z, float *y, int64_t n,
                              int64_t in_channels, int64_t h, int64_t w_in, int64_t out_channels, int64_t oh,
                              int64_t ow, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                              int64_t dh, int64_t dw, int64_t act, float alpha, float beta, int64_t threads) {
    if (n <= 0 || in_channels <= 0 || in_channels % BLOCK || out_channels <= 0 || out_channels % BLOCK || h <= 0
        || w_in <= 0 || oh <= 0 || ow <= 0 || kh <= 0 || kw <= 0 || sh <= 0 || sw <= 0 || dh <= 0 || dw <= 0
        || ph < 0 || pw < 0)
        return -1;
    conv_t c = {
        .x = x, .w = w, .b = b, .z = z, .y = y,
        .n = n, .in_blocks = in_channels / BLOCK, .h = h, .w_in = w_in, .out_blocks = out_channels / BLOCK,
        .oh = oh, .ow = ow, .kh = kh, .kw = kw, .sh = sh, .sw = sw, .ph = ph, .pw = pw, .dh = dh, .dw = dw,
        .act = {alpha, beta, (int)act},
    };
    c.groups = (c.out_blocks + MAX_BLOCKS - 1) / MAX_BLOCKS;
    c.flat = kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0 && oh == h && ow == w_in;
    c.rows = c.flat ? (oh * ow + SEGMENT - 1) / SEGMENT : oh;
    const int64_t group_bytes = (int64_t)sizeof(float) * MAX_BLOCKS * BLOCK * in_channels * kh * kw;
    c.group_major = group_bytes > GROUP_MAJOR_BYTES;
    const int64_t items = n * c.groups * c.rows;
    if (threads > items) threads = items;
    parallel_for(conv_task, &c, 0, items, pieces_for(items, threads), threads);
    return 0;
}

typedef struct {
    const float *src;
    float *dst;
    int64_t channels, pixels, to_blocked;
} reorder_t;

static void reorder_task(void *context, int64_t begin, int64_t end, int64_t slot) {
    (void)slot;
    const reorder_t *r = (const reorder_t *)context;
    const int64_t blocks = r->channels / BLOCK;
    for (int64_t item = begin; item < end; item++) { /* item: (image, channel block) */
        const int64_t image = item / blocks, block = item % blocks;
        const int64_t plain = (image * r->channels + block * BLOCK) * r->pixels;
        const int64_t blocked = (image * blocks + block) * r->pixels * BLOCK;
        /* 16 x 16 tiles (16 pixels x the block's 16 channels) through a local buffer: both sides read and written
         * a 64-byte line at a time */
        float tile[BLOCK][BLOCK];
        const int64_t n = r->pixels;
        for (int64_t p0 = 0; p0 < n; p0 += BLOCK) {
            const int64_t count = n - p0 < BLOCK ? n - p0 : BLOCK;
            if (r->to_blocked) {
                const float *s = r->src + plain + p0;
                float *d = r->dst + blocked + p0 * BLOCK;
                int64_t q = 0;
#if defined(BLOCKCONV_AVX512)
                if (n * BLOCK <= INT32_MAX) { /* one gather a pixel: its 16 channels, n floats apart */
                    const __m512i across = _mm512_mullo_epi32(
                        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)n));
                    for (; q < count; q++) _mm512_storeu_ps(d + q * BLOCK, _mm512_i32gather_ps(across, s + q, 4));
                }
#endif
                for (int k = 0; k < BLOCK; k++)
                    for (int64_t p = q; p < count; p++) tile[p][k] = s[k * n + p];
                if (q < count) memcpy(d + q * BLOCK, tile[q], (size_t)(count - q) * BLOCK * sizeof(float));
            } else {
                const float *s = r->src + blocked + p0 * BLOCK;
                for (int64_t q = 0; q < count; q++)
                    for (int k = 0; k < BLOCK; k++) tile[k][q] = s[q * BLOCK + k];
                for (int k = 0; k < BLOCK; k++)
                    memcpy(r->dst + plain + k * n + p0, tile[k], (size_t)count * sizeof(float));
            }
        }
    }
}

/* dst = src reordered between [n, channels, pixels] and [n, channels/16, pixels, 16] (to_blocked: plain ->
 * blocked). Returns 0, or -1 when channels is not a multiple of 16. */
int64_t blockconv_reorder_threads(const float *src, float *dst, int64_t n, int64_t channels, int64_t pixels,
                                  int64_t to_blocked, int64_t threads) {
    if (n < 0 || channels <= 0 || channels % BLOCK || pixels < 0) return -1;
    reorder_t r = {src, dst, channels, pixels, to_blocked};
    const int64_t items = n * (channels / BLOCK);
    if (threads > items) threads = items;
    parallel_for(reorder_task, &r, 0, items, pieces_for(items, threads), threads);
    return 0;
}
