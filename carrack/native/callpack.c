/* One-argument entry to carrack's native kernels, for calls where ctypes' argument conversion costs more than the
 * arithmetic: ctypes converts each argument through its argtypes (a 13-argument kernel call costs 3-5 us before
 * any work, a 16x64x64 product 1.5 us of work), while a call with one prepared pointer argument costs ~0.2 us.
 *
 * A packet is an int64 array: packet[0] the kernel's address, packet[1] the argument count n, packet[2 .. 2+n) the
 * arguments. The kernels called this way take only pointers and integers and return void (carrack/native/packed.py
 * lists them); on the 64-bit ABIs carrack builds for (x86-64 System V and Windows, AArch64) a pointer, an int64_t
 * and an int32_t argument all take one integer register or one 8-byte stack slot, in order, so such a kernel is
 * called through an all-int64 prototype of its arity (an int32_t parameter reads the low half of its slot). */
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

/* Calls the packet's kernel; returns 0, or -1 for an argument count this entry does not cover (nothing called). */
int64_t carrack_call_packed(const int64_t *packet) {
    void (*fn)(void) = (void (*)(void))(intptr_t)packet[0];
    const int64_t *a = packet + 2;
    if (sizeof(void *) != 8) return -1;
    switch (packet[1]) {
        CALL(1) CALL(2) CALL(3) CALL(4) CALL(5) CALL(6) CALL(7) CALL(8) CALL(9) CALL(10)
        CALL(11) CALL(12) CALL(13) CALL(14) CALL(15) CALL(16) CALL(17) CALL(18) CALL(19) CALL(20)
    default: return -1;
    }
}
