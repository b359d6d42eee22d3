/* The activations fused into carrack's kernels, shared by the native kernels (convgemm.c, dwconv.c) and the
 * runtime of compiled models (carrack/backends/c/runtime/carrack_rt.h, which `carrack compile` ships beside this
 * header): one numbering and one scalar definition. The native layer's Python side passes 0..6; compiled models
 * also use the rest. */
#ifndef CARRACK_ACTIVATIONS_H
#define CARRACK_ACTIVATIONS_H

#include <math.h>

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 2, ACT_LEAKY = 3, ACT_HARDSIGMOID = 4, ACT_HARDSWISH = 5,
       ACT_SIGMOID = 6, ACT_TANH = 7, ACT_GELU = 8, ACT_ELU = 9, ACT_EXP = 10, ACT_NEG = 11, ACT_SQRT = 12,
       ACT_ABS = 13 };

/* an activation and its parameters: clip's bounds, leaky relu's and elu's alpha, hard sigmoid's alpha and beta */
typedef struct {
    float a, b;
    int act;
} act_t;

static inline float activation(float v, int act, float a, float b) {
    switch (act) {
    case ACT_RELU: return v < 0.0f ? 0.0f : v;
    case ACT_CLIP: v = v < a ? a : v; return v > b ? b : v;
    case ACT_LEAKY: return v < 0.0f ? v * a : v;
    case ACT_HARDSIGMOID: {
        float s = v * a + b;
        s = s < 0.0f ? 0.0f : s;
        return s > 1.0f ? 1.0f : s;
    }
    case ACT_HARDSWISH: {
        float s = v * (1.0f / 6.0f) + 0.5f;
        s = s < 0.0f ? 0.0f : s;
        return v * (s > 1.0f ? 1.0f : s);
    }
    case ACT_SIGMOID: return 1.0f / (1.0f + expf(-v));
    case ACT_TANH: return tanhf(v);
    case ACT_GELU: return 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    case ACT_ELU: return v < 0.0f ? a * (expf(v) - 1.0f) : v;
    case ACT_EXP: return expf(v);
    case ACT_NEG: return -v;
    case ACT_SQRT: return sqrtf(v);
    case ACT_ABS: return fabsf(v);
    default: return v;
    }
}

static inline float act_scalar(float v, act_t f) { return activation(v, f.act, f.a, f.b); }

#endif
