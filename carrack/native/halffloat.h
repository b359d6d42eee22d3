/* IEEE half-precision to float32, exact, shared by the kernels that read ggml's half-float scales and weights:
 * F16C's conversion where the build has it, the bit-level widening elsewhere (subnormals normalized, inf and NaN
 * kept). */
#ifndef CARRACK_HALFFLOAT_H
#define CARRACK_HALFFLOAT_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) && !defined(CARRACK_PORTABLE)
#include <immintrin.h>
#endif

static inline float half_bits_to_float(uint16_t h) {
#if defined(__F16C__) && !defined(CARRACK_PORTABLE)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400u)) { mantissa <<= 1; exponent--; }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* a little-endian half at p (ggml's block scales are not aligned) */
static inline float half_to_float(const uint8_t *p) { return half_bits_to_float((uint16_t)(p[0] | (p[1] << 8))); }

#endif
