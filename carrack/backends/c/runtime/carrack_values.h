/* carrack's kernels for values of any element type in compiled models (`carrack compile`): int64, int32, uint8,
 * int8, int16, bool (one byte, 0 or 1) and float32. They move and compare what a model's integer side computes (token
 * ids, attention-mask chains, shapes the compile-time folding could not fix): embedding rows gathered by index,
 * casts, comparisons, logic, where, expand, concat. Elementwise kernels broadcast over 6 dims with element
 * strides (0 where a dim is broadcast), like carrack_rt.h's cr_binary. No allocation, no I/O.
 */
#ifndef CARRACK_VALUES_H
#define CARRACK_VALUES_H

#include "carrack_rt.h"

/* element types, as the generated code names them */
enum cr_type { CR_F32 = 0, CR_I64 = 1, CR_I32 = 2, CR_U8 = 3, CR_I8 = 4, CR_BOOL = 5, CR_I16 = 6 };
enum cr_compare_op { CR_EQ, CR_LT, CR_LE, CR_GT, CR_GE };
enum cr_logic_op { CR_AND, CR_OR, CR_XOR };
#define CR_RANK 6

static inline int64_t cr_get_int(const void *p, int type, int64_t k) {
    switch (type) {
    case CR_F32: return (int64_t)((const float *)p)[k];
    case CR_I64: return ((const int64_t *)p)[k];
    case CR_I32: return ((const int32_t *)p)[k];
    case CR_U8: return ((const uint8_t *)p)[k];
    case CR_I8: return ((const int8_t *)p)[k];
    case CR_I16: return ((const int16_t *)p)[k];
    default: return ((const uint8_t *)p)[k] != 0;
    }
}

static inline double cr_get_real(const void *p, int type, int64_t k) {
    return type == CR_F32 ? (double)((const float *)p)[k] : (double)cr_get_int(p, type, k);
}

/* element k of y (of `type`) from a real (is_real) or an integer value; narrower integers wrap like numpy's */
static inline void cr_set(void *p, int type, int64_t k, int is_real, double real, int64_t integer) {
    if (type == CR_F32) {
        ((float *)p)[k] = is_real ? (float)real : (float)integer;
        return;
    }
    if (type == CR_BOOL) {
        ((uint8_t *)p)[k] = is_real ? real != 0.0 : integer != 0;
        return;
    }
    int64_t v = is_real ? (int64_t)real : integer;
    switch (type) {
    case CR_I64: ((int64_t *)p)[k] = v; break;
    case CR_I32: ((int32_t *)p)[k] = (int32_t)v; break;
    case CR_U8: ((uint8_t *)p)[k] = (uint8_t)v; break;
    case CR_I16: ((int16_t *)p)[k] = (int16_t)v; break;
    default: ((int8_t *)p)[k] = (int8_t)v; break;
    }
}

/* a walk over a 6-D shape keeping up to three operands' element offsets */
typedef struct {
    int64_t index[CR_RANK];
    int64_t offset[3];
} cr_walk;

static inline void cr_walk_next(cr_walk *w, const int64_t *shape, const int64_t *const *strides, int operands) {
    for (int d = CR_RANK - 1; d >= 0; d--) {
        w->index[d]++;
        for (int o = 0; o < operands; o++) w->offset[o] += strides[o][d];
        if (w->index[d] < shape[d]) return;
        for (int o = 0; o < operands; o++) w->offset[o] -= strides[o][d] * shape[d];
        w->index[d] = 0;
    }
}

static inline int64_t cr_count(const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < CR_RANK; d++) n *= shape[d];
    return n;
}

/* y = x converted to y's type, n elements (numpy's astype: truncation toward zero, nonzero is true) */
static CR_UNUSED void cr_cast(const void *x, int tx, void *y, int ty, int64_t n) {
    if (tx == ty) {
        static const int bytes[] = {4, 8, 4, 1, 1, 1, 2};
        if (x != y) memmove(y, x, (size_t)n * (size_t)bytes[tx]);
        return;
    }
    if (tx == CR_F32) {
        for (int64_t k = 0; k < n; k++) cr_set(y, ty, k, 1, ((const float *)x)[k], 0);
    } else {
        for (int64_t k = 0; k < n; k++) cr_set(y, ty, k, 0, 0.0, cr_get_int(x, tx, k));
    }
}

/* y (bool) = a OP b, broadcast; integers compare exactly, anything with a float operand as doubles */
static CR_UNUSED void cr_compare(int op, const void *a, int ta, const int64_t *sa, const void *b, int tb,
                                 const int64_t *sb, uint8_t *y, const int64_t *shape) {
    const int64_t *strides[2] = {sa, sb};
    int real = ta == CR_F32 || tb == CR_F32;
    cr_walk w = {{0}, {0}};
    int64_t n = cr_count(shape);
    for (int64_t k = 0; k < n; k++, cr_walk_next(&w, shape, strides, 2)) {
        int less, equal;
        if (real) {
            double u = cr_get_real(a, ta, w.offset[0]), v = cr_get_real(b, tb, w.offset[1]);
            less = u < v, equal = u == v;
        } else {
            int64_t u = cr_get_int(a, ta, w.offset[0]), v = cr_get_int(b, tb, w.offset[1]);
            less = u < v, equal = u == v;
        }
        switch (op) {
        case CR_EQ: y[k] = (uint8_t)equal; break;
        case CR_LT: y[k] = (uint8_t)less; break;
        case CR_LE: y[k] = (uint8_t)(less || equal); break;
        case CR_GT: y[k] = (uint8_t)(!less && !equal); break;
        default: y[k] = (uint8_t)!less; break;
        }
    }
}

/* y (bool) = a OP b on bools, broadcast */
static CR_UNUSED void cr_logic(int op, const uint8_t *a, const int64_t *sa, const uint8_t *b, const int64_t *sb,
                               uint8_t *y, const int64_t *shape) {
    const int64_t *strides[2] = {sa, sb};
    cr_walk w = {{0}, {0}};
    int64_t n = cr_count(shape);
    for (int64_t k = 0; k < n; k++, cr_walk_next(&w, shape, strides, 2)) {
        int u = a[w.offset[0]] != 0, v = b[w.offset[1]] != 0;
        y[k] = (uint8_t)(op == CR_AND ? u && v : op == CR_OR ? u || v : u != v);
    }
}

static CR_UNUSED void cr_not(const uint8_t *x, uint8_t *y, int64_t n) {
    for (int64_t k = 0; k < n; k++) y[k] = (uint8_t)(x[k] == 0);
}

/* y = a OP b on integers of one type (Add, Sub, Mul of carrack_rt.h's cr_binop), broadcast, wrapping */
static CR_UNUSED void cr_binary_int(int op, const void *a, const int64_t *sa, const void *b, const int64_t *sb,
                                    void *y, int type, const int64_t *shape) {
    const int64_t *strides[2] = {sa, sb};
    cr_walk w = {{0}, {0}};
    int64_t n = cr_count(shape);
    for (int64_t k = 0; k < n; k++, cr_walk_next(&w, shape, strides, 2)) {
        uint64_t u = (uint64_t)cr_get_int(a, type, w.offset[0]), v = (uint64_t)cr_get_int(b, type, w.offset[1]);
        uint64_t r = op == CR_ADD ? u + v : op == CR_SUB ? u - v : u * v; /* unsigned: wraps, no overflow UB */
        cr_set(y, type, k, 0, 0.0, (int64_t)r);
    }
}

static inline void cr_copy_element(void *y, int64_t k, const void *x, int64_t j, int bytes) {
    switch (bytes) {
    case 8: ((uint64_t *)y)[k] = ((const uint64_t *)x)[j]; break;
    case 4: ((uint32_t *)y)[k] = ((const uint32_t *)x)[j]; break;
    case 2: ((uint16_t *)y)[k] = ((const uint16_t *)x)[j]; break;
    default: ((uint8_t *)y)[k] = ((const uint8_t *)x)[j]; break;
    }
}

/* y = condition ? a : b (elements of `bytes` bytes), broadcast */
static CR_UNUSED void cr_where(const uint8_t *c, const int64_t *sc, const void *a, const int64_t *sa, const void *b,
                               const int64_t *sb, void *y, int bytes, const int64_t *shape) {
    const int64_t *strides[3] = {sc, sa, sb};
    cr_walk w = {{0}, {0}};
    int64_t n = cr_count(shape);
    for (int64_t k = 0; k < n; k++, cr_walk_next(&w, shape, strides, 3)) {
        if (c[w.offset[0]]) cr_copy_element(y, k, a, w.offset[1], bytes);
        else cr_copy_element(y, k, b, w.offset[2], bytes);
    }
}

/* y = x broadcast to `shape` (Expand), elements of `bytes` bytes */
static CR_UNUSED void cr_expand(const void *x, const int64_t *sx, void *y, int bytes, const int64_t *shape) {
    const int64_t *strides[1] = {sx};
    cr_walk w = {{0}, {0}};
    int64_t n = cr_count(shape);
    for (int64_t k = 0; k < n; k++, cr_walk_next(&w, shape, strides, 1)) cr_copy_element(y, k, x, w.offset[0], bytes);
}

/* Gather along an axis: data is [outer, axis_size, inner bytes], y is [outer, count, inner bytes]; an index may be
 * negative (counted from the end). Returns 1, before writing anything, when an index is outside
 * -axis_size..axis_size-1 (the caller turns it into an error code, never an out-of-bounds read). */
static CR_UNUSED int cr_gather(const void *data, const void *indices, int index_type, void *y, int64_t outer,
                               int64_t axis_size, int64_t inner_bytes, int64_t count) {
    for (int64_t j = 0; j < count; j++) {
        int64_t i = cr_get_int(indices, index_type, j);
        if (i < -axis_size || i >= axis_size) return 1;
    }
    const unsigned char *src = (const unsigned char *)data;
    unsigned char *dst = (unsigned char *)y;
    for (int64_t o = 0; o < outer; o++) {
        for (int64_t j = 0; j < count; j++) {
            int64_t i = cr_get_int(indices, index_type, j);
            if (i < 0) i += axis_size;
            memcpy(dst + (o * count + j) * inner_bytes, src + (o * axis_size + i) * inner_bytes, (size_t)inner_bytes);
        }
    }
    return 0;
}

/* one input of a Concat: its [outer, part bytes] rows written at byte `offset` of y's [outer, whole bytes] rows */
static CR_UNUSED void cr_concat_bytes(const void *x, void *y, int64_t outer, int64_t part, int64_t whole,
                                      int64_t offset) {
    for (int64_t o = 0; o < outer; o++)
        memcpy((unsigned char *)y + o * whole + offset, (const unsigned char *)x + o * part, (size_t)part);
}

/* GatherND (batch_dims 0): each of `count` index tuples of `depth` int64 picks one chunk of data [lead dims...,
 * chunk bytes]; negative indices count from the end. Returns 1, before writing anything, when an index is out of
 * range. */
static CR_UNUSED int cr_gather_nd(const void *data, const int64_t *lead, int depth, const int64_t *indices,
                                  int64_t count, int64_t chunk_bytes, void *y) {
    for (int64_t t = 0; t < count * depth; t++) {
        int64_t size = lead[t % depth], i = indices[t];
        if (i < -size || i >= size) return 1;
    }
    for (int64_t t = 0; t < count; t++) {
        int64_t flat = 0;
        for (int d = 0; d < depth; d++) {
            int64_t i = indices[t * depth + d];
            flat = flat * lead[d] + (i < 0 ? i + lead[d] : i);
        }
        memcpy((unsigned char *)y + t * chunk_bytes, (const unsigned char *)data + flat * chunk_bytes,
               (size_t)chunk_bytes);
    }
    return 0;
}

/* Range: y[i] = start + i * delta for i < count, in y's type */
static CR_UNUSED void cr_range(void *y, int type, double start, double delta, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        if (type == CR_F32) ((float *)y)[i] = (float)(start + (double)i * delta);
        else cr_set(y, type, i, 0, 0.0, (int64_t)start + i * (int64_t)delta);
    }
}

/* Slice over 6 dims: starts as given to the op (negative from the end, clamped like numpy's), steps nonzero;
 * y's shape is the op's output shape (the caller's), elements of `bytes` bytes */
static CR_UNUSED void cr_slice(const void *x, const int64_t *x_shape, const int64_t *starts, const int64_t *steps,
                               void *y, const int64_t *shape, int bytes) {
    int64_t offset = 0, step_strides[CR_RANK], stride = 1;
    for (int d = CR_RANK - 1; d >= 0; d--) {
        int64_t start = starts[d], size = x_shape[d];
        if (start < 0) start += size;
        if (steps[d] > 0) start = start < 0 ? 0 : start > size ? size : start;
        else start = start < -1 ? -1 : start > size - 1 ? size - 1 : start;
        offset += start * stride;
        step_strides[d] = steps[d] * stride;
        stride *= size;
    }
    const int64_t *walk_strides[1] = {step_strides};
    cr_walk w = {{0}, {offset}};
    int64_t n = cr_count(shape);
    for (int64_t k = 0; k < n; k++, cr_walk_next(&w, shape, walk_strides, 1)) cr_copy_element(y, k, x, w.offset[0], bytes);
}

#endif
