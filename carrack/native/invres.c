/* MobileNetV2's inverted-residual block as one call, float32:
 *
 *     e = act_e(expand_1x1(x) + be)           [N, CE, H, W]
 *     d = act_d(depthwise_3x3_s(e) + bd)      [N, CE, OH, OW]   (pads 1, stride s = 1 or 2)
 *     y = act_p(project_1x1(d) + bp [+ x])    [N, CO, OH, OW]   (the residual only for s = 1, CO = C)
 *
 * without e and d ever existing whole: the output rows go in bands, and a band's expanded input rows (e) and
 * depthwise rows (d) live in a per-thread scratch that stays in the L2 cache, instead of the two intermediate
 * maps (4.8 MB and 1.2 MB for the first 112x112 block) going out to memory and back.
 *
 * - the two 1x1 products run packconv.c's 6 x 64 tile (this file includes packconv.c for it) over weights packed
 *   once in its panels (packconv_pack_weights): the expansion reads the band's input rows in place, the projection
 *   reads d from the scratch and adds the residual and the activation as it stores;
 * - the depthwise 3x3 reads e with masked loads (columns outside the image read as 0), rows outside the image are
 *   skipped;
 * - a thread takes consecutive bands of an image; the expanded rows the next band shares with the last one (the
 *   3x3 window's halo) are moved to the front of the scratch instead of computed again;
 * - small output maps (SMALL_MAP_PIXELS) are not banded: chunks of expanded channels, then groups of projection
 *   rows, each over the whole map;
 * - a block without expansion (we NULL) runs the depthwise on x itself.
 *
 * Each output element is computed whole by one thread, every sum in one fixed order (a product's depth in
 * packconv's fixed blocks, the depthwise taps row by row, left to right; packconv's tail-pixel dot product only
 * where a product covers the whole map): the results are the same bits whatever the band size or the thread
 * count. AVX-512 only (invres_vectorized); elsewhere carrack runs the convolutions.
 */
#include "packconv.c"

/* vectors of 16 output columns a row may have (the entry point refuses wider maps) */
#define MAX_VECTORS 64
/* Output maps of at most this many pixels (mobilenetv2's 14x14 and 7x7) are not cut in bands: a band of a few rows
 * would give the products a few pixels per weight load. Threads there take chunks of at most CHUNK expanded channels
 * (expansion and depthwise over the whole map), then the projection's row panels, the depthwise maps shared. */
#define SMALL_MAP_PIXELS 256
#define CHUNK (8 * PR)
#define PROJECT_ROWS (4 * PR) /* projection rows an item of the second pass takes at most */

#if defined(__AVX512F__)

int64_t invres_vectorized(void) { return 1; }

typedef struct {
    const float *x, *we, *be, *wd, *bd, *wp, *bp;
    const float *we_end, *wp_end; /* the ends of the packed weights */
    float *y, *scratch;
    int64_t c, ce, co, h, w, oh, ow, s, residual, band, bands, ecap, dcap, slot_floats;
    int64_t shared_at;    /* small maps: where the depthwise maps start in the scratch */
    int64_t chunk, group; /* small maps: the expanded channels and projection rows of an item */
    act_t fe, fd, fp;
} invres_t;

/* y[r, p] (rows ldy apart, r < rows, p < pixels) = finish(bias[r] + sum_k wp-panels[r, k] * cols[k * ldb + p]):
 * packconv's tile over pixel panels of PW and row panels of PR, the depth in packconv's blocks of at most KC steps
 * (the partial sums wait in y between blocks: same order of sums as one pass); z (rows ldy apart) is added before
 * the activation. */
static void product(const float *wp, const float *wp_end, const float *bias, const float *cols, int64_t ldb,
                    int64_t depth, float *y, int64_t ldy, int64_t rows, int64_t pixels, const float *z, act_t f,
                    int tails_ok) {
    const int64_t row_panels = (rows + PR - 1) / PR;
    const int64_t blocks = (depth + KC - 1) / KC, step = (depth + blocks - 1) / blocks;
    float tail_columns[TAIL_MAX * KC];
    for (int64_t k0 = 0; k0 < depth; k0 += step) {
        const int64_t kc = depth - k0 < step ? depth - k0 : step;
        for (int64_t p0 = 0; p0 < pixels; p0 += PW) {
            const int64_t all = pixels - p0 < PW ? pixels - p0 : PW;
            /* a last pixel past whole vectors (7x7 maps: 49 = 3 x 16 + 1) is packconv's dot product, which sums in
             * another order: only where the pixel range is the whole map whatever the thread count (tails_ok) */
            const int64_t tails = tails_ok && all % 16 <= TAIL_MAX ? all % 16 : 0, count = all - tails;
            const int nv = (int)((count + 15) / 16);
            const __mmask16 m[4] = {tail_mask(count), tail_mask(count - 16), tail_mask(count - 32),
                                    tail_mask(count - 48)};
            for (int64_t j = 0; j < tails; j++)
                for (int64_t kk = 0; kk < kc; kk++) tail_columns[j * KC + kk] = cols[(k0 + kk) * ldb + p0 + count + j];
            for (int64_t t = 0; t < row_panels; t++) {
                const int64_t row = t * PR;
                const finish_t F = {bias + row, z ? z + row * ldy + p0 : NULL, k0 == 0, k0 + kc == depth,
                                    (int)(rows - row < PR ? rows - row : PR), f};
                const float *panel = wp + (t * depth + k0) * PR, *next = panel + depth * PR;
                if (p0 == 0 && next + kc * PR <= wp_end) /* the next panel's weights of this block (a model's
                                                          * weights come from memory), as packconv does */
                    prefetch_l2(next, kc * PR);
                float *at = y + row * ldy + p0;
                if (nv) tile_nv(panel, cols + k0 * ldb + p0, ldb, kc, at, ldy, m, nv, &F);
                if (tails)
                    tail_pixels(panel, tail_columns, kc, tails, at + count, F.z ? F.z + count : NULL, ldy, &F);
            }
        }
    }
}

static inline __m512 act16(__m512 v, act_t f) {
    if (f.act > ACT_CLIP) return act512_any(v, f);
    const __m512 lo = _mm512_set1_ps(f.act == ACT_NONE ? -INFINITY : f.act == ACT_RELU ? 0.0f : f.a);
    const __m512 hi = _mm512_set1_ps(f.act == ACT_CLIP ? f.b : INFINITY);
    return _mm512_min_ps(hi, _mm512_max_ps(lo, v));
}

/* The lane masks of one vector of 16 output columns from c0 on: which lanes of each load are inside the image
 * (stride 1: the left, middle and right taps' loads; stride 2: the two loads from column 2 c0 - 1 and the two from
 * 2 c0) and which are outputs. */
typedef struct {
    __mmask16 load[4], store;
} dw_masks_t;

static void depthwise_masks(const invres_t *c, dw_masks_t *masks) {
    const int64_t w = c->w, ow = c->ow;
    for (int64_t c0 = 0, v = 0; c0 < ow; c0 += 16, v++) {
        dw_masks_t *m = masks + v;
        m->store = tail_mask(ow - c0);
        if (c->s == 1) {
            m->load[0] = lanes_between(1 - c0, w + 1 - c0);
            m->load[1] = lanes_between(-c0, w - c0);
            m->load[2] = lanes_between(-c0 - 1, w - c0 - 1);
        } else {
            const int64_t a = 2 * c0 - 1, b = 2 * c0;
            m->load[0] = lanes_between(-a, w - a), m->load[1] = lanes_between(-a - 16, w - a - 16);
            m->load[2] = lanes_between(-b, w - b), m->load[3] = lanes_between(-b - 16, w - b - 16);
        }
    }
}

/* One input row's three taps (left, middle, right) for the 16 outputs from column c0 */
static inline __attribute__((always_inline)) void load_taps(__m512 *taps, const float *row, int64_t c0, int s,
                                                            const dw_masks_t *m) {
    if (s == 1) { /* lane l reads columns c0 + l - 1, c0 + l, c0 + l + 1 */
        taps[0] = _mm512_maskz_loadu_ps(m->load[0], row + c0 - 1);
        taps[1] = _mm512_maskz_loadu_ps(m->load[1], row + c0);
        taps[2] = _mm512_maskz_loadu_ps(m->load[2], row + c0 + 1);
    } else { /* lane l reads columns 2 (c0 + l) - 1, 2 (c0 + l), 2 (c0 + l) + 1 */
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        const __m512 a0 = _mm512_maskz_loadu_ps(m->load[0], row + 2 * c0 - 1);
        const __m512 a1 = _mm512_maskz_loadu_ps(m->load[1], row + 2 * c0 + 15);
        const __m512 b0 = _mm512_maskz_loadu_ps(m->load[2], row + 2 * c0);
        const __m512 b1 = _mm512_maskz_loadu_ps(m->load[3], row + 2 * c0 + 16);
        taps[0] = _mm512_permutex2var_ps(a0, even, a1);
        taps[1] = _mm512_permutex2var_ps(b0, even, b1);
        taps[2] = _mm512_permutex2var_ps(b0, odd, b1);
    }
}

/* acc + one input row's taps: left, middle, right, in that order */
static inline __attribute__((always_inline)) __m512 add_taps(__m512 acc, const __m512 *taps, __m512 wl, __m512 wm,
                                                             __m512 wr) {
    return _mm512_fmadd_ps(wr, taps[2], _mm512_fmadd_ps(wm, taps[1], _mm512_fmadd_ps(wl, taps[0], acc)));
}

/* Output rows [o0, o1) of one depthwise plane: e holds input rows [i0, ...) of the plane (w floats each), out gets
 * the rows (ow floats each). Output (o, c) sums the bias, then kernel rows 0..2 (those inside the image), each left
 * to right. Two output rows at a time: the input rows they share (two for stride 1, one for stride 2) are loaded
 * once; each output's sums keep their order. */
static inline __attribute__((always_inline)) void depthwise_rows_s(const invres_t *c, const dw_masks_t *masks,
                                                                   const float *e, int64_t i0, const float *wt,
                                                                   float bias, float *out, int64_t o0, int64_t o1,
                                                                   const int s) {
    const int64_t w = c->w, ow = c->ow;
    const __m512 w0 = _mm512_set1_ps(wt[0]), w1 = _mm512_set1_ps(wt[1]), w2 = _mm512_set1_ps(wt[2]);
    const __m512 w3 = _mm512_set1_ps(wt[3]), w4 = _mm512_set1_ps(wt[4]), w5 = _mm512_set1_ps(wt[5]);
    const __m512 w6 = _mm512_set1_ps(wt[6]), w7 = _mm512_set1_ps(wt[7]), w8 = _mm512_set1_ps(wt[8]);
    const __m512 b = _mm512_set1_ps(bias);
    int64_t o = o0;
    /* outputs o and o + 1 read input rows r .. r + 2 and r + s .. r + s + 2 (r = o s - 1): rows r + 1 .. r + s + 1
     * are inside the image whenever o + 1 is an output row */
    for (; o + 1 < o1; o += 2, out += 2 * ow) {
        const int64_t r = o * s - 1, last = r + s + 2;
        const float *top = r >= 0 ? e + (r - i0) * w : NULL, *row1 = e + (r + 1 - i0) * w, *row2 = row1 + w;
        const float *row3 = row2 + w, *bottom = last < c->h ? e + (last - i0) * w : NULL;
        for (int64_t c0 = 0, v = 0; c0 < ow; c0 += 16, v++) {
            const dw_masks_t *m = masks + v;
            __m512 taps[3], first = b, second = b;
            if (top) {
                load_taps(taps, top, c0, s, m);
                first = add_taps(first, taps, w0, w1, w2);
            }
            load_taps(taps, row1, c0, s, m);
            first = add_taps(first, taps, w3, w4, w5);
            if (s == 1) second = add_taps(second, taps, w0, w1, w2);
            load_taps(taps, row2, c0, s, m);
            first = add_taps(first, taps, w6, w7, w8);
            second = s == 1 ? add_taps(second, taps, w3, w4, w5) : add_taps(second, taps, w0, w1, w2);
            if (s == 2) {
                load_taps(taps, row3, c0, s, m);
                second = add_taps(second, taps, w3, w4, w5);
            }
            if (bottom) {
                load_taps(taps, bottom, c0, s, m);
                second = add_taps(second, taps, w6, w7, w8);
            }
            _mm512_mask_storeu_ps(out + c0, m->store, act16(first, c->fd));
            _mm512_mask_storeu_ps(out + ow + c0, m->store, act16(second, c->fd));
        }
    }
    for (; o < o1; o++, out += ow) {
        const int64_t r = o * s - 1; /* the kernel's first input row; its middle one is always inside */
        const float *top = r >= 0 ? e + (r - i0) * w : NULL, *middle = e + (r + 1 - i0) * w;
        const float *bottom = r + 2 < c->h ? e + (r + 2 - i0) * w : NULL;
        for (int64_t c0 = 0, v = 0; c0 < ow; c0 += 16, v++) {
            const dw_masks_t *m = masks + v;
            __m512 taps[3], acc = b;
            if (top) {
                load_taps(taps, top, c0, s, m);
                acc = add_taps(acc, taps, w0, w1, w2);
            }
            load_taps(taps, middle, c0, s, m);
            acc = add_taps(acc, taps, w3, w4, w5);
            if (bottom) {
                load_taps(taps, bottom, c0, s, m);
                acc = add_taps(acc, taps, w6, w7, w8);
            }
            _mm512_mask_storeu_ps(out + c0, m->store, act16(acc, c->fd));
        }
    }
}

static void depthwise_rows(const invres_t *c, const dw_masks_t *masks, const float *e, int64_t i0, const float *wt,
                           float bias, float *out, int64_t o0, int64_t o1) {
    if (c->s == 1)
        depthwise_rows_s(c, masks, e, i0, wt, bias, out, o0, o1, 1);
    else
        depthwise_rows_s(c, masks, e, i0, wt, bias, out, o0, o1, 2);
}

/* e (channels c->ecap floats apart) = the expanded input rows [i0, i1) of image n (img): the rows of them that
 * have[0..2] (image, first row, end row) says e already holds are moved to the front, the rest computed. */
static void expand_band(const invres_t *c, const float *img, int64_t n, int64_t i0, int64_t i1, float *e,
                        int64_t *have) {
    int64_t kept = 0;
    if (have[0] == n && have[1] <= i0 && i0 < have[2]) {
        kept = (have[2] < i1 ? have[2] : i1) - i0;
        if (i0 > have[1])
            for (int64_t ch = 0; ch < c->ce; ch++)
                memmove(e + ch * c->ecap, e + ch * c->ecap + (i0 - have[1]) * c->w, kept * c->w * sizeof(float));
    }
    if (i0 + kept < i1)
        product(c->we, c->we_end, c->be, img + (i0 + kept) * c->w, c->h * c->w, c->c, e + kept * c->w, c->ecap,
                c->ce, (i1 - i0 - kept) * c->w, NULL, c->fe, 0);
    have[0] = n, have[1] = i0, have[2] = i1;
}

/* Items [begin, end) of n * bands, in order: each band expands the input rows it lacks, runs the depthwise rows
 * and projects them into y. `slot` picks the thread's scratch. */
static void invres_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const invres_t *c = p;
    float *e = c->scratch + slot * c->slot_floats, *d = e + c->ce * c->ecap;
    const int64_t plane = c->h * c->w, opix = c->oh * c->ow;
    int64_t have[3] = {-1, 0, 0}; /* the image and input rows [have[1], have[2]) now in e */
    dw_masks_t masks[MAX_VECTORS];
    depthwise_masks(c, masks);
    for (int64_t item = begin; item < end; item++) {
        const int64_t n = item / c->bands, b = item % c->bands;
        const int64_t o0 = b * c->band, o1 = o0 + c->band < c->oh ? o0 + c->band : c->oh;
        const int64_t i0 = o0 * c->s - 1 < 0 ? 0 : o0 * c->s - 1;
        const int64_t i1 = (o1 - 1) * c->s + 2 < c->h ? (o1 - 1) * c->s + 2 : c->h;
        const float *img = c->x + n * c->c * plane, *planes = img; /* the depthwise input: the image's planes */
        int64_t first = 0, apart = plane;                           /* (its first row, its planes' distance) */
        if (c->we) {
            expand_band(c, img, n, i0, i1, e, have);
            planes = e, first = i0, apart = c->ecap;
        }
        for (int64_t ch = 0; ch < c->ce; ch++)
            depthwise_rows(c, masks, planes + ch * apart, first, c->wd + 9 * ch, c->bd[ch], d + ch * c->dcap, o0,
                           o1);
        const int64_t at = n * c->co * opix + o0 * c->ow;
        product(c->wp, c->wp_end, c->bp, d, c->dcap, c->ce, c->y + at, opix, c->co, (o1 - o0) * c->ow,
                c->residual ? img + o0 * c->ow : NULL, c->fp, 0);
    }
}

/* Small maps (SMALL_MAP_PIXELS), first pass: items [begin, end) of n * chunks of c->chunk expanded channels, each
 * expanded over the whole map into the thread's scratch, then its depthwise map written to the shared d. */
static void channels_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const invres_t *c = p;
    const int64_t plane = c->h * c->w, opix = c->oh * c->ow, chunks = (c->ce + c->chunk - 1) / c->chunk;
    float *e = c->scratch + slot * c->slot_floats, *d = c->scratch + c->shared_at;
    dw_masks_t masks[MAX_VECTORS];
    depthwise_masks(c, masks);
    for (int64_t item = begin; item < end; item++) {
        const int64_t n = item / chunks, ch0 = item % chunks * c->chunk;
        const int64_t rows = c->ce - ch0 < c->chunk ? c->ce - ch0 : c->chunk;
        const float *expanded = c->x + (n * c->c + ch0) * plane; /* no expansion: the image's planes */
        if (c->we) {
            product(c->we + ch0 * c->c, c->we_end, c->be + ch0, c->x + n * c->c * plane, plane, c->c, e, plane, rows,
                    plane, NULL, c->fe, 1);
            expanded = e;
        }
        for (int64_t j = 0; j < rows; j++)
            depthwise_rows(c, masks, expanded + j * plane, 0, c->wd + 9 * (ch0 + j), c->bd[ch0 + j],
                           d + (n * c->ce + ch0 + j) * opix, 0, c->oh);
    }
}

/* Small maps, second pass: items [begin, end) of n * groups of c->group projection rows, each over the
 * whole map (a group gathers the tail pixel's column of each depth block once for its row panels). */
static void project_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    (void)slot;
    const invres_t *c = p;
    const int64_t plane = c->h * c->w, opix = c->oh * c->ow, groups = (c->co + c->group - 1) / c->group;
    const float *d = c->scratch + c->shared_at;
    for (int64_t item = begin; item < end; item++) {
        const int64_t n = item / groups, row = item % groups * c->group;
        const int64_t rows = c->co - row < c->group ? c->co - row : c->group;
        product(c->wp + row * c->ce, c->wp_end, c->bp + row, d + n * c->ce * opix, opix, c->ce,
                c->y + (n * c->co + row) * opix, opix, rows, opix, c->residual ? c->x + (n * c->c + row) * plane : NULL,
                c->fp, 1);
    }
}

#else

int64_t invres_vectorized(void) { return 0; }

#endif

static int64_t round16(int64_t v) { return (v + 15) / 16 * 16; }

static int small_map(int64_t oh, int64_t ow) { return oh * ow <= SMALL_MAP_PIXELS; }

#if defined(__AVX512F__)
/* row panels an item takes of `panels` (per image, n images) so that `threads` get CARRACK_PIECES_PER_THREAD items
 * each where there are enough, at most `most` */
static int64_t panels_an_item(int64_t panels, int64_t n, int64_t threads, int64_t most) {
    const int64_t wanted = threads * CARRACK_PIECES_PER_THREAD, per = n * panels / (wanted > 0 ? wanted : 1);
    return per < 1 ? 1 : per > most ? most : per;
}
#endif

/* the floats of one thread's scratch: the expanded rows and the depthwise rows of a band of `band` output rows, or
 * (small maps) a chunk's expanded maps */
static int64_t slot_floats(int64_t ce, int64_t h, int64_t w, int64_t stride, int64_t band) {
    const int64_t oh = (h - 1) / stride + 1, ow = (w - 1) / stride + 1;
    if (small_map(oh, ow)) return round16(CHUNK * h * w);
    return ce * (round16(((band - 1) * stride + 3) * w) + round16(band * ow));
}

/* the floats of scratch a call needs (threads slots, and the small maps' shared depthwise maps) */
int64_t invres_scratch_floats(int64_t n, int64_t ce, int64_t h, int64_t w, int64_t stride, int64_t band,
                              int64_t threads) {
    const int64_t oh = (h - 1) / stride + 1, ow = (w - 1) / stride + 1;
    return threads * slot_floats(ce, h, w, stride, band) + (small_map(oh, ow) ? round16(n * ce * oh * ow) : 0);
}

/* The block over images [0, n), in bands of `band` output rows (or, small maps, channel chunks) split over
 * `threads`; scratch: invres_scratch_floats of it. we, wp: the expansion's and projection's weights packed by
 * packconv_pack_weights (we and be NULL: a block without expansion, its depthwise convolution reads x); wd the
 * depthwise weights [CE, 9]; the other biases given. Returns 0, or -1 without vector code
 * or for output rows wider than MAX_VECTORS vectors (nothing written). */
int64_t invres_f32_threads(const float *x, const float *we, const float *be, const float *wd, const float *bd,
                           const float *wp, const float *bp, float *y, float *scratch, int64_t n, int64_t c,
                           int64_t ce, int64_t co, int64_t h, int64_t w, int64_t stride, int64_t residual,
                           int64_t band, int64_t act_e, float ae, float be_, int64_t act_d, float ad, float bd_,
                           int64_t act_p, float ap, float bp_, int64_t threads) {
#if defined(__AVX512F__)
    const int64_t oh = (h - 1) / stride + 1, ow = (w - 1) / stride + 1;
    if ((ow + 15) / 16 > MAX_VECTORS) return -1;
    const int64_t bands = (oh + band - 1) / band, slot = slot_floats(ce, h, w, stride, band);
    invres_t call = {x, we, be, wd, bd, wp, bp, we ? we + packconv_weights_size(1, ce, c) : NULL,
                     wp + packconv_weights_size(1, co, ce), y, scratch, c, ce, co, h, w, oh, ow, stride, residual,
                     band, bands, round16(((band - 1) * stride + 3) * w), round16(band * ow), slot, threads * slot,
                     CHUNK, PROJECT_ROWS, {ae, be_, (int)act_e}, {ad, bd_, (int)act_d}, {ap, bp_, (int)act_p}};
    if (small_map(oh, ow)) {
        /* items of whole panels, as large as CHUNK / PROJECT_ROWS while each thread still gets several */
        call.chunk = PR * panels_an_item((ce + PR - 1) / PR, n, threads, CHUNK / PR);
        call.group = PR * panels_an_item((co + PR - 1) / PR, n, threads, PROJECT_ROWS / PR);
        const int64_t chunks = n * ((ce + call.chunk - 1) / call.chunk);
        const int64_t panels = n * ((co + call.group - 1) / call.group);
        /* each item its own piece: items of one size, claimed one at a time, the threads end at most an item apart
         * (pieces_for's few pieces of 2 or 3 items each left one thread up to 3 items behind) */
        parallel_for(channels_piece, &call, 0, chunks, chunks, threads);
        parallel_for(project_piece, &call, 0, panels, panels, threads);
        return 0;
    }
    const int64_t items = n * bands;
    parallel_for(invres_piece, &call, 0, items, threads < items ? threads : items, threads);
    return 0;
#else
    (void)x, (void)we, (void)be, (void)wd, (void)bd, (void)wp, (void)bp, (void)y, (void)scratch, (void)n, (void)c;
    (void)ce, (void)co, (void)h, (void)w, (void)stride, (void)residual, (void)band, (void)act_e, (void)ae;
    (void)be_, (void)act_d, (void)ad, (void)bd_, (void)act_p, (void)ap, (void)bp_, (void)threads;
    return -1;
#endif
}

CARRACK_POOL_CLIENT(invres)
