/* One-argument entry to carrack's native kernels, for calls where ctypes' argument conversion costs more than the
 * arithmetic: ctypes converts each argument through its argtypes (a 13-argument kernel call costs 3-5 us before
 * any work, a 16x64x64 product 1.5 us of work), while a call with one prepared pointer argument costs ~0.2 us.
 *
 * A packet is an int64 array: packet[0] the kernel's address, packet[1] the argument count n, packet[2 .. 2+n) the
 * arguments (a kind < 0 instead of n: one of the prototypes below). The kernels called by count take only pointers
 * and int64_t and return void; on the 64-bit ABIs carrack builds for (x86-64 System V and Windows, AArch64) a
 * pointer and an int64_t argument both take one integer register or one 8-byte stack slot, in order, so such a
 * kernel is
 * called through an all-int64 prototype of its arity. Kernels with float or int parameters have kinds of their own
 * below, called through their exact prototypes. */
#include <stdint.h>

#define CARRACK_CALLPACK_MAX 20

int64_t carrack_callpack_max_arguments(void) { return sizeof(void *) == 8 ? CARRACK_CALLPACK_MAX : 0; }

typedef int64_t w;
#define A1 a[0]
#define A2 A1, a[1]
#define A3 A2, a[2]
#define A4 A3, a[3]
#define A5 A4, a[4]
#define A6 A5, a[5]
#define A7 A6, a[6]
#define A8 A7, a[7]
#define A9 A8, a[8]
#define A10 A9, a[9]
#define A11 A10, a[10]
#define A12 A11, a[11]
#define A13 A12, a[12]
#define A14 A13, a[13]
#define A15 A14, a[14]
#define A16 A15, a[15]
#define A17 A16, a[16]
#define A18 A17, a[17]
#define A19 A18, a[18]
#define A20 A19, a[19]
#define T1 w
#define T2 T1, w
#define T3 T2, w
#define T4 T3, w
#define T5 T4, w
#define T6 T5, w
#define T7 T6, w
#define T8 T7, w
#define T9 T8, w
#define T10 T9, w
#define T11 T10, w
#define T12 T11, w
#define T13 T12, w
#define T14 T13, w
#define T15 T14, w
#define T16 T15, w
#define T17 T16, w
#define T18 T17, w
#define T19 T18, w
#define T20 T19, w
#define CALL(n) case n: ((void (*)(T##n))fn)(A##n); return 0;

/* Kernels with a float parameter are called through their exact prototype (a float travels in a floating-point
 * register, or in a slot of its own position on Windows): the packet carries the float's bits in its slot. Their
 * kinds are negative; carrack/native/packed.py names them. */
typedef void *p;
static float as_float(int64_t slot) {
    union { uint32_t bits; float value; } u;
    u.bits = (uint32_t)slot;
    return u.value;
}
#define PTR(x) ((void *)(intptr_t)(x))
#define KIND_SOFTMAX (-1)    /* rowops.c carrack_softmax_threads */
#define KIND_LAYER_NORM (-2) /* rowops.c carrack_layer_norm_threads */
#define KIND_GELU (-3)       /* rowops.c carrack_gelu_threads (an int parameter: exact, whatever the ABI packs) */

/* Calls the packet's kernel; returns 0, or -1 for a kind this entry does not cover (nothing called). */
int64_t carrack_call_packed(const int64_t *packet) {
    void (*fn)(void) = (void (*)(void))(intptr_t)packet[0];
    const int64_t *a = packet + 2;
    if (sizeof(void *) != 8) return -1;
    switch (packet[1]) {
    case KIND_SOFTMAX:
        ((void (*)(p, p, w, w, w, float, p, w, w, w, w, w, int, w))fn)(
            PTR(a[0]), PTR(a[1]), a[2], a[3], a[4], as_float(a[5]), PTR(a[6]), a[7], a[8], a[9], a[10], a[11],
            (int)a[12], a[13]);
        return 0;
    case KIND_LAYER_NORM:
        ((void (*)(p, p, p, p, p, p, p, p, p, w, w, w, float, w))fn)(
            PTR(a[0]), PTR(a[1]), PTR(a[2]), PTR(a[3]), PTR(a[4]), PTR(a[5]), PTR(a[6]), PTR(a[7]), PTR(a[8]), a[9],
            a[10], a[11], as_float(a[12]), a[13]);
        return 0;
    case KIND_GELU:
        ((void (*)(p, p, p, w, w, w, int, w))fn)(PTR(a[0]), PTR(a[1]), PTR(a[2]), a[3], a[4], a[5], (int)a[6], a[7]);
        return 0;
        CALL(1) CALL(2) CALL(3) CALL(4) CALL(5) CALL(6) CALL(7) CALL(8) CALL(9) CALL(10)
        CALL(11) CALL(12) CALL(13) CALL(14) CALL(15) CALL(16) CALL(17) CALL(18) CALL(19) CALL(20)
    default: return -1;
    }
}
