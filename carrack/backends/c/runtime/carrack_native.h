/* The session's own kernels (carrack/native/packconv.c and dwconv.c, copied beside model.c and built into the
 * library with it) as model.c calls them: native x86-64 libraries with AVX-512 only. Each runs single-threaded
 * here (no pool is attached: parallel_for runs the whole range on the caller) and returns nonzero when it could
 * not allocate its scratch memory. */
#ifndef CARRACK_NATIVE_H
#define CARRACK_NATIVE_H

#include <stdint.h>

/* y = act(conv(x, w) + bias + z) over weights packed at compile time (packconv_pack_weights' layout), pixel
 * panels [begin, end) of n * groups * ceil(oh * ow / 64) */
int64_t packconv_f32_threads(const float *x, const float *wp, const float *bias, float *y, const float *z, int64_t n,
                             int64_t groups, int64_t mg, int64_t cg, int64_t h, int64_t w, int64_t kh, int64_t kw,
                             int64_t oh, int64_t ow, int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt,
                             int64_t pl, int64_t begin, int64_t end, int64_t act, float alpha, float beta,
                             int64_t threads);

/* depthwise: input planes [begin, end) of x[N * channels, h, w] into y, weights w[channels * mult, kh * kw] */
int64_t dwconv2d_f32(const float *x, const float *w, const float *bias, float *y, int64_t channels, int64_t mult,
                     int64_t h, int64_t w_, int64_t kh, int64_t kw, int64_t oh, int64_t ow, int64_t sh, int64_t sw,
                     int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t begin, int64_t end, int64_t act,
                     float alpha, float beta);

/* max (mode 0) or average (1: over the taps inside the image, 2: inside the image and its explicit pads) pool of
 * the planes [begin, end) */
int64_t pool2d_f32(const float *x, float *y, int64_t h, int64_t w, int64_t kh, int64_t kw, int64_t oh, int64_t ow,
                   int64_t sh, int64_t sw, int64_t dh, int64_t dw, int64_t pt, int64_t pl, int64_t pb, int64_t pr,
                   int64_t begin, int64_t end, int64_t mode);

/* MobileNetV2's inverted-residual block (invres.c, which includes packconv.c): y = act_p(project(act_d(depthwise_3x3(
 * act_e(expand(x) + be)) + bd)) + bp [+ x]) over images [0, n), output rows in bands of `band` (or channel chunks on
 * maps of at most 256 pixels) whose intermediates stay in `scratch` (invres_scratch_floats of it); we and wp
 * packed as packconv_pack_weights packs them (we and be NULL: no expansion). Returns 0, -1 without vector code. */
int64_t invres_f32_threads(const float *x, const float *we, const float *be, const float *wd, const float *bd,
                           const float *wp, const float *bp, float *y, float *scratch, int64_t n, int64_t c,
                           int64_t ce, int64_t co, int64_t h, int64_t w, int64_t stride, int64_t residual,
                           int64_t band, int64_t act_e, float ae, float be_, int64_t act_d, float ad, float bd_,
                           int64_t act_p, float ap, float bp_, int64_t threads);

#endif
