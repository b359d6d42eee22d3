/* carrack's intra-op thread pool: persistent workers that the kernels' parallel regions borrow.
 *
 * Workers are created once (lazily, as many as the largest region has asked for) and live for the process. A
 * region (carrack_parallel) reserves only workers that are idle at that moment, so sessions running in several
 * threads at once share the workers instead of each bringing its own: a region that finds none idle runs on its
 * calling thread alone, and the machine never runs more pool threads than the largest thread count asked for.
 *
 * A worker between regions spins for a short while (CARRACK_SPIN_US, default 200 microseconds: the gap between
 * two kernels of one inference is usually shorter) and then sleeps on a condition variable, so an idle process
 * costs no CPU. The caller takes pieces too; when it has run out of pieces it withdraws the workers that have not
 * started yet (a sleeping worker's wake-up can take longer than the work) and waits only for those running.
 *
 * Pieces are claimed from a shared counter: a participant that the machine delays leaves its pieces to the others.
 * Which participant runs a piece never changes what the piece computes.
 */
// carrack-cflags: -pthread
#define _GNU_SOURCE
#define CARRACK_THREADPOOL_IMPLEMENTATION
#include "threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield")
#else
#define cpu_relax() ((void)0)
#endif

#define MAX_WORKERS 255
#define FINISH_SPIN_NS 30000 /* how long a caller spins for its helpers to finish before it sleeps */
#define HELD_FINISH_SPIN_NS 200000 /* the same while a run holds the pool (see carrack_pool_hold) */
#define HELD_SPIN_DEFAULT_US 5000 /* how long an idle worker spins while a run holds the pool */
#define YIELD_EVERY_NS 50000 /* a held worker's spin yields the core this often to any other runnable thread */

/* A worker's state word: the state in the low 2 bits, above them the number of the last reservation, so that a
 * caller withdrawing its assignment can never withdraw a newer one given by another caller meanwhile. */
enum { IDLE, RESERVED, ASSIGNED, RUNNING };
#define STATE(word) ((int)((word) & 3))
#define WITH_STATE(word, state) (((word) & ~(int64_t)3) | (state))

typedef struct {
    carrack_task task;
    void *context;
    int64_t begin, count, chunks;
    _Atomic int64_t next;    /* the next unclaimed piece */
    _Atomic int64_t slots;   /* slot numbers handed out (the caller is slot 0) */
    int64_t region;          /* its number in the trace (carrack_pool_trace), -1 when not traced */
} job_t;

typedef struct {
    _Atomic int64_t state;
    _Atomic int sleeping;
    _Atomic int caller_waiting; /* callers asleep on `done` until this worker finishes their job */
    job_t *_Atomic job;
    pthread_mutex_t mutex;
    pthread_cond_t wake, done;
    pthread_t thread;
} __attribute__((aligned(64))) worker_t;

static worker_t workers[MAX_WORKERS];
static _Atomic int worker_count;
static pthread_mutex_t grow_lock = PTHREAD_MUTEX_INITIALIZER;
static int64_t spin_ns = -1, held_spin_ns = -1;

/* Runs in progress that asked for two or more threads (carrack_pool_hold). While there is one, an idle worker
 * spins up to held_spin_ns (CARRACK_HELD_SPIN_US) instead of spin_ns before it sleeps: a run's serial stretches
 * between two split kernels (Python dispatch, a small op on one thread) are often longer than spin_ns, and waking a
 * sleeping worker costs tens of microseconds (a halted virtual CPU, more) at the start of the next region. Once
 * the runs have ended, workers sleep after spin_ns as before, so an idle process costs no CPU.
 *
 * The count is kept in words: word 0 is shared (carrack_pool_hold), and a Python thread may own one of the others
 * (carrack_pool_hold_slot), which it then updates by a plain store, without a call: a session run takes the hold
 * and gives it back, and two ctypes calls per run would cost a small model's run a microsecond. */
#define HOLD_WORDS 64
static _Atomic int64_t hold_words[HOLD_WORDS];
static _Atomic int hold_words_used = 1;

void carrack_pool_hold(int64_t delta) { atomic_fetch_add_explicit(&hold_words[0], delta, memory_order_relaxed); }

/* The address of the hold words, and a word of its own for the calling thread: its index, or -1 when none is left
 * (the thread then uses carrack_pool_hold). */
int64_t *carrack_pool_hold_words(void) { return (int64_t *)hold_words; }

int64_t carrack_pool_hold_slot(void) {
    const int slot = atomic_fetch_add(&hold_words_used, 1);
    return slot < HOLD_WORDS ? slot : -1;
}

int64_t carrack_pool_holds(void) {
    const int used = atomic_load_explicit(&hold_words_used, memory_order_relaxed);
    int64_t total = 0;
    for (int i = 0; i < used && i < HOLD_WORDS; i++) total += atomic_load_explicit(&hold_words[i], memory_order_relaxed);
    return total;
}

static int held(void) { return carrack_pool_holds() > 0; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* CPU time the participants of split regions (callers and workers together) spent running pieces, counted while
 * carrack_pool_count_work is on (two clock reads per participant and region: off by default). Beside the process's
 * CPU time it separates a run's useful work from its spinning; beside a one-thread run's CPU time it shows the work
 * a split adds. CPU time, not wall time, so that other processes taking the cores do not count. */
static _Atomic int64_t work_ns;
static _Atomic int counting_work;

void carrack_pool_count_work(int64_t on) { atomic_store(&counting_work, on != 0); }

static int64_t thread_cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Runs pieces of the job until none is left; returns how many it ran. */
static int64_t run_pieces(job_t *job, int64_t slot) {
    for (int64_t ran = 0;; ran++) {
        const int64_t piece = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);
        if (piece >= job->chunks) return ran;
        const int64_t lo = job->begin + job->count * piece / job->chunks;
        const int64_t hi = job->begin + job->count * (piece + 1) / job->chunks;
        if (hi > lo) job->task(job->context, lo, hi, slot);
    }
}

/* A trace of split regions, for profiling how the participants of one region share it (carrack_pool_trace: off by
 * default). Each participant's run of a region's pieces is one record: the region's number, the participant's
 * slot, its pieces, its start and end (CLOCK_MONOTONIC) and its CPU time over them; each region ends with a record
 * of slot -1 for the caller's whole region (from before it assigns workers to after the last one finished). The
 * records fill a ring of TRACE_RECORDS; carrack_pool_trace_read copies the newest out. */
#define TRACE_RECORDS 8192
enum { TRACE_REGION, TRACE_SLOT, TRACE_PIECES, TRACE_START, TRACE_END, TRACE_CPU, TRACE_FIELDS };
static int64_t trace_ring[TRACE_RECORDS][TRACE_FIELDS];
static _Atomic int64_t trace_written, trace_regions;
static _Atomic int tracing;

/* Starts (forgetting earlier records) or stops recording; the records stay readable after a stop. */
void carrack_pool_trace(int64_t on) {
    atomic_store(&tracing, 0);
    if (on) atomic_store(&trace_written, 0);
    atomic_store(&tracing, on != 0);
}

static void trace_record(int64_t region, int64_t slot, int64_t pieces, int64_t start, int64_t end, int64_t cpu) {
    const int64_t at = atomic_fetch_add_explicit(&trace_written, 1, memory_order_relaxed) % TRACE_RECORDS;
    const int64_t record[TRACE_FIELDS] = {region, slot, pieces, start, end, cpu};
    for (int i = 0; i < TRACE_FIELDS; i++) trace_ring[at][i] = record[i];
}

/* Copies the newest records (at most `capacity`, oldest first) into out[capacity][TRACE_FIELDS]; returns how many. */
int64_t carrack_pool_trace_read(int64_t *out, int64_t capacity) {
    const int64_t written = atomic_load(&trace_written);
    int64_t count = written < TRACE_RECORDS ? written : TRACE_RECORDS;
    if (count > capacity) count = capacity;
    for (int64_t r = 0; r < count; r++)
        for (int i = 0; i < TRACE_FIELDS; i++)
            out[r * TRACE_FIELDS + i] = trace_ring[(written - count + r) % TRACE_RECORDS][i];
    return count;
}

static void run_pieces_timed(job_t *job, int64_t slot) {
    const int traced = job->region >= 0;
    if (!traced && !atomic_load_explicit(&counting_work, memory_order_relaxed)) {
        run_pieces(job, slot);
        return;
    }
    const int64_t start = thread_cpu_ns(), wall = traced ? now_ns() : 0;
    const int64_t pieces = run_pieces(job, slot);
    const int64_t cpu = thread_cpu_ns() - start;
    if (traced) trace_record(job->region, slot, pieces, wall, now_ns(), cpu);
    if (atomic_load_explicit(&counting_work, memory_order_relaxed))
        atomic_fetch_add_explicit(&work_ns, cpu, memory_order_relaxed);
}

/* Waits until the worker is given a job: spinning first (longer while a run holds the pool, yielding the core now
 * and then to any other runnable thread), then asleep. */
static void await_assignment(worker_t *w) {
    const int64_t start = now_ns(), deadline = start + spin_ns, held_deadline = start + held_spin_ns;
    int64_t next_yield = start + YIELD_EVERY_NS;
    for (int spins = 0; STATE(atomic_load_explicit(&w->state, memory_order_acquire)) != ASSIGNED; spins++) {
        cpu_relax();
        if ((spins & 63) != 63) continue;
        const int64_t now = now_ns();
        if (now < deadline) continue;
        if (now >= held_deadline || !held()) break;
        if (now >= next_yield) {
            sched_yield();
            next_yield = now + YIELD_EVERY_NS;
        }
    }
    if (STATE(atomic_load(&w->state)) == ASSIGNED) return;
    pthread_mutex_lock(&w->mutex);
    atomic_store(&w->sleeping, 1);
    while (STATE(atomic_load(&w->state)) != ASSIGNED) pthread_cond_wait(&w->wake, &w->mutex);
    atomic_store(&w->sleeping, 0);
    pthread_mutex_unlock(&w->mutex);
}

static void *worker_main(void *arg) {
    worker_t *w = arg;
    for (;;) {
        await_assignment(w);
        int64_t assigned = atomic_load(&w->state);
        /* the caller may have withdrawn the job meanwhile (then the state is IDLE, or a newer assignment) */
        if (STATE(assigned) != ASSIGNED ||
            !atomic_compare_exchange_strong(&w->state, &assigned, WITH_STATE(assigned, RUNNING)))
            continue;
        job_t *job = atomic_load_explicit(&w->job, memory_order_acquire);
        run_pieces_timed(job, atomic_fetch_add_explicit(&job->slots, 1, memory_order_relaxed));
        /* the job's last use: its caller may return (and the job leave its stack) once this is seen */
        atomic_store(&w->state, WITH_STATE(assigned, IDLE)); /* sequentially consistent, before the read below */
        if (atomic_load(&w->caller_waiting)) {
            pthread_mutex_lock(&w->mutex);
            pthread_cond_broadcast(&w->done);
            pthread_mutex_unlock(&w->mutex);
        }
    }
    return NULL;
}

static void reset_after_fork(void) {
    /* a forked child has none of the parent's threads: its workers are created again when first needed */
    atomic_store(&worker_count, 0);
    pthread_mutex_init(&grow_lock, NULL);
}

static void ensure_workers(int wanted) {
    if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
    if (atomic_load_explicit(&worker_count, memory_order_acquire) >= wanted) return;
    pthread_mutex_lock(&grow_lock);
    if (spin_ns < 0) {
        const char *text = getenv("CARRACK_SPIN_US");
        spin_ns = (text && *text ? atoll(text) : 200) * 1000;
        const char *held_text = getenv("CARRACK_HELD_SPIN_US");
        held_spin_ns = (held_text && *held_text ? atoll(held_text) : HELD_SPIN_DEFAULT_US) * 1000;
        if (held_spin_ns < spin_ns) held_spin_ns = spin_ns;
        pthread_atfork(NULL, NULL, reset_after_fork);
    }
    for (int i = atomic_load(&worker_count); i < wanted; i++) {
        worker_t *w = &workers[i];
        atomic_store(&w->state, IDLE);
        atomic_store(&w->sleeping, 0);
        pthread_mutex_init(&w->mutex, NULL);
        pthread_cond_init(&w->wake, NULL);
        pthread_cond_init(&w->done, NULL);
        atomic_store(&w->caller_waiting, 0);
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) break;
        pthread_detach(w->thread);
        atomic_store_explicit(&worker_count, i + 1, memory_order_release);
    }
    pthread_mutex_unlock(&grow_lock);
}

/* Sleeping workers that regions had to wake (a region that finds its workers spinning starts sooner) */
static _Atomic int64_t wakes;

static void assign(worker_t *w, job_t *job, int64_t reserved) {
    atomic_store_explicit(&w->job, job, memory_order_relaxed);
    /* sequentially consistent: ordered before the read of `sleeping` */
    atomic_store(&w->state, WITH_STATE(reserved, ASSIGNED));
    if (atomic_load(&w->sleeping)) {
        atomic_fetch_add_explicit(&wakes, 1, memory_order_relaxed);
        pthread_mutex_lock(&w->mutex);
        pthread_cond_signal(&w->wake);
        pthread_mutex_unlock(&w->mutex);
    }
}

/* Returns once the worker has left `running` (its run of the caller's job): spinning for a short while (its
 * last piece usually ends about when the caller's does), then asleep, leaving the core to the worker should the
 * machine have preempted it. */
static void await_finish(worker_t *w, int64_t running) {
    const int64_t deadline = now_ns() + (held() ? HELD_FINISH_SPIN_NS : FINISH_SPIN_NS);
    for (int spins = 0; atomic_load_explicit(&w->state, memory_order_acquire) == running; spins++) {
        cpu_relax();
        if ((spins & 63) == 63 && now_ns() >= deadline) break;
    }
    if (atomic_load(&w->state) != running) return;
    pthread_mutex_lock(&w->mutex);
    atomic_fetch_add(&w->caller_waiting, 1); /* a count: the previous job's caller may not have left yet */
    while (atomic_load(&w->state) == running) pthread_cond_wait(&w->done, &w->mutex);
    atomic_fetch_sub(&w->caller_waiting, 1);
    pthread_mutex_unlock(&w->mutex);
}

/* Wall time callers have spent in regions split over two or more threads, for the profile of a run: what is
 * outside it ran on one core (`carrack_pool_parallel_ns`). */
static _Atomic int64_t parallel_ns;

static void run_split(carrack_task task, void *context, int64_t begin, int64_t end, int64_t chunks, int64_t threads);

void carrack_parallel(carrack_task task, void *context, int64_t begin, int64_t end, int64_t chunks,
                      int64_t threads) {
    if (end <= begin) return;
    if (chunks > end - begin) chunks = end - begin;
    if (threads > chunks) threads = chunks;
    if (threads <= 1) {
        task(context, begin, end, 0);
        return;
    }
    const int64_t start = now_ns();
    run_split(task, context, begin, end, chunks, threads);
    atomic_fetch_add_explicit(&parallel_ns, now_ns() - start, memory_order_relaxed);
}

int64_t carrack_pool_parallel_ns(void) { return atomic_load_explicit(&parallel_ns, memory_order_relaxed); }

int64_t carrack_pool_work_ns(void) { return atomic_load_explicit(&work_ns, memory_order_relaxed); }

int64_t carrack_pool_wakes(void) { return atomic_load_explicit(&wakes, memory_order_relaxed); }

static void run_split(carrack_task task, void *context, int64_t begin, int64_t end, int64_t chunks,
                      int64_t threads) {
    ensure_workers((int)(threads - 1 < MAX_WORKERS ? threads - 1 : MAX_WORKERS));
    const int64_t traced_at = atomic_load_explicit(&tracing, memory_order_relaxed) ? now_ns() : -1;
    job_t job = {task, context, begin, end - begin, chunks, 0, 1,
                 traced_at < 0 ? -1 : atomic_fetch_add_explicit(&trace_regions, 1, memory_order_relaxed)};
    int taken[MAX_WORKERS], count = 0;
    int64_t reservation[MAX_WORKERS];
    const int available = atomic_load_explicit(&worker_count, memory_order_acquire);
    for (int i = 0; i < available && count < threads - 1; i++) {
        int64_t idle = atomic_load_explicit(&workers[i].state, memory_order_relaxed);
        if (STATE(idle) != IDLE) continue;
        const int64_t reserved = WITH_STATE(idle + 4, RESERVED); /* the next reservation number */
        if (atomic_compare_exchange_strong(&workers[i].state, &idle, reserved)) {
            assign(&workers[i], &job, reserved);
            reservation[count] = reserved;
            taken[count++] = i;
        }
    }
    run_pieces_timed(&job, 0);
    for (int i = 0; i < count; i++) { /* withdraw the workers that have not started on this job */
        int64_t expected = WITH_STATE(reservation[i], ASSIGNED);
        atomic_compare_exchange_strong(&workers[taken[i]].state, &expected, WITH_STATE(reservation[i], IDLE));
    }
    for (int i = 0; i < count; i++) await_finish(&workers[taken[i]], WITH_STATE(reservation[i], RUNNING));
    if (job.region >= 0) trace_record(job.region, -1, chunks, traced_at, now_ns(), 0);
}

/* Workers created so far (for tests and `carrack info`). */
int64_t carrack_pool_workers(void) { return atomic_load(&worker_count); }

/* For the tests: a region over items [0, count) in `chunks` pieces on `threads` threads, each item taking about
 * `item_ns` nanoseconds; owner[i] (-1 on entry) gets the slot that ran item i, or -2 when it ran more than once. */
typedef struct {
    int64_t *owner, item_ns;
} selftest_t;

static void selftest_piece(void *p, int64_t begin, int64_t end, int64_t slot) {
    const selftest_t *s = p;
    for (int64_t i = begin; i < end; i++) {
        const int64_t until = now_ns() + s->item_ns;
        while (now_ns() < until) cpu_relax();
        s->owner[i] = s->owner[i] == -1 ? slot : -2;
    }
}

void carrack_pool_selftest(int64_t *owner, int64_t count, int64_t chunks, int64_t threads, int64_t item_ns) {
    selftest_t s = {owner, item_ns};
    carrack_parallel(selftest_piece, &s, 0, count, chunks, threads);
}
