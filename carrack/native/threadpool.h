/* carrack's intra-op thread pool, as the kernel libraries see it.
 *
 * The pool lives in threadpool.c, built as a library of its own; every kernel library that includes this header
 * gets `parallel_for` and an exported `<prefix>_use_pool` through which carrack/native/__init__.py hands it the
 * pool's entry point once, after loading. Until then (or when the pool library cannot be built) `parallel_for`
 * runs the whole range on the calling thread.
 *
 * A task computes the items [begin, end) of a region: kernels split by output tiles, so each output element is
 * computed by exactly one call, in the same order whatever the split (results do not depend on the thread count).
 * `slot` (< threads) names the participant running the call, for per-thread scratch buffers; the calls of one
 * slot never run at the same time.
 */
#ifndef CARRACK_THREADPOOL_H
#define CARRACK_THREADPOOL_H

#include <stdatomic.h>
#include <stdint.h>

typedef void (*carrack_task)(void *context, int64_t begin, int64_t end, int64_t slot);

/* Runs task over [begin, end) cut into `chunks` contiguous near-equal pieces, on the calling thread and up to
 * threads - 1 idle pool workers; returns when every piece is done. */
typedef void (*carrack_parallel_fn)(carrack_task task, void *context, int64_t begin, int64_t end, int64_t chunks,
                                    int64_t threads);

#ifndef CARRACK_THREADPOOL_IMPLEMENTATION

/* Pieces per thread when a kernel allows finer pieces than one per thread: a participant that the machine delays
 * (other processes share the cores) leaves its unclaimed pieces to the others. */
#define CARRACK_PIECES_PER_THREAD 4

static carrack_parallel_fn carrack_pool_entry;

/* Defines the function through which the loader attaches the pool: `<prefix>_use_pool` (one name per library,
 * so libraries linked together would not clash). */
#define CARRACK_POOL_CLIENT(prefix) \
    void prefix##_use_pool(carrack_parallel_fn entry) { carrack_pool_entry = entry; }

/* The pieces a region of `count` items gets for `threads` threads when each item may be its own piece. */
static inline int64_t pieces_for(int64_t count, int64_t threads) {
    const int64_t pieces = threads * CARRACK_PIECES_PER_THREAD;
    return threads <= 1 ? 1 : pieces < count ? pieces : count;
}

static inline void parallel_for(carrack_task task, void *context, int64_t begin, int64_t end, int64_t chunks,
                                int64_t threads) {
    if (end <= begin) return;
    if (threads <= 1 || chunks <= 1 || carrack_pool_entry == 0)
        task(context, begin, end, 0);
    else
        carrack_pool_entry(task, context, begin, end, chunks, threads);
}

#endif
#endif
