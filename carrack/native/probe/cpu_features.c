/* The CPU features carrack's kernel variants need, read with cpuid and checked against what the operating system
 * enables (XCR0: a CPU may have AVX-512 that the OS does not save on a context switch). Built in the portable
 * variant only, so it runs everywhere; carrack picks the kernel variant from the names written here (the names of
 * Linux's /proc/cpuinfo, space-separated), and reads /proc/cpuinfo itself where this library is absent. */
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static unsigned long long xcr0(void) {
    unsigned int eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((unsigned long long)edx << 32) | eax;
}

static void add(char *out, int size, const char *name) {
    if ((int)(strlen(out) + strlen(name) + 2) > size) return;
    if (out[0]) strcat(out, " ");
    strcat(out, name);
}

int carrack_cpu_features(char *out, int size) {
    unsigned int a, b, c, d;
    if (size < 1) return -1;
    out[0] = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    unsigned int leaf1_ecx = c;
    int os_avx = (leaf1_ecx >> 27 & 1) && (xcr0() & 0x6) == 0x6;
    int os_avx512 = os_avx && (xcr0() & 0xe6) == 0xe6;
    if (leaf1_ecx >> 22 & 1) add(out, size, "movbe");
    if (os_avx) {
        if (leaf1_ecx >> 28 & 1) add(out, size, "avx");
        if (leaf1_ecx >> 12 & 1) add(out, size, "fma");
        if (leaf1_ecx >> 29 & 1) add(out, size, "f16c");
    }
    if (__get_cpuid(0x80000001, &a, &b, &c, &d) && (c >> 5 & 1)) add(out, size, "abm");
    if (__get_cpuid_max(0, 0) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        if (b >> 3 & 1) add(out, size, "bmi1");
        if (b >> 8 & 1) add(out, size, "bmi2");
        if (os_avx && (b >> 5 & 1)) add(out, size, "avx2");
        if (os_avx512) {
            static const struct { int bit; const char *name; } ebx_bits[] = {
                {16, "avx512f"}, {17, "avx512dq"}, {28, "avx512cd"}, {30, "avx512bw"}, {31, "avx512vl"}};
            for (unsigned i = 0; i < sizeof ebx_bits / sizeof ebx_bits[0]; i++)
                if (b >> ebx_bits[i].bit & 1) add(out, size, ebx_bits[i].name);
            if (c >> 11 & 1) add(out, size, "avx512_vnni");
        }
    }
    return (int)strlen(out);
}
#else
int carrack_cpu_features(char *out, int size) {
    if (size > 0) out[0] = 0;
    return 0;
}
#endif
