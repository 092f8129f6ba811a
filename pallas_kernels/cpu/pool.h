/* What the CPU kernels share: running a call's jobs on XLA's own thread pool, and
 * returning an error to XLA. Included by decode.c and linear.c (one library). */
#ifndef PAGED_JAX_POOL_H
#define PAGED_JAX_POOL_H
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

#define MAX_THREADS 64

/* How many threads a call takes: at most `asked`, one per `work_units` (the work divided
 * by the least a thread is given), one per `parts` the work splits into, and
 * MAX_THREADS; at least 1. */
static inline int64_t clamp_threads(int64_t asked, int64_t work_units, int64_t parts) {
  int64_t t = asked;
  if (t > work_units) t = work_units;
  if (t > parts) t = parts;
  if (t > MAX_THREADS) t = MAX_THREADS;
  return t < 1 ? 1 : t;
}

/* A job handed to XLA's own thread pool, the one its compute runs on. The calling thread
 * (itself one of the pool's) claims back every job no worker has started, so a busy or
 * one-thread pool cannot leave the call waiting. The struct is on the heap and freed by
 * whichever of the call and the task lets go of it last: a task may run after its call
 * returned. */
typedef struct {
  void *job;
  void *(*run)(void *);
  atomic_int state; /* 0: nobody's, 1: taken, 2: done */
  atomic_int refs;
} Handed;

static int claim(Handed *h) {
  int expected = 0;
  return atomic_compare_exchange_strong(&h->state, &expected, 1);
}

static void let_go(Handed *h) {
  if (atomic_fetch_sub(&h->refs, 1) == 1) free(h);
}

static void handed_task(void *data) {
  Handed *h = data;
  if (claim(h)) {
    h->run(h->job);
    atomic_store_explicit(&h->state, 2, memory_order_release);
  }
  let_go(h);
}

/* Schedules `h` on XLA's thread pool; 0 if there is none (an XLA too old, or none here). */
static int schedule(const XLA_FFI_CallFrame *frame, Handed *h) {
  const XLA_FFI_Api *api = frame->api;
  if (api->struct_size < offsetof(XLA_FFI_Api, XLA_FFI_ThreadPool_Schedule) + sizeof(void *) ||
      !api->XLA_FFI_ThreadPool_Schedule)
    return 0;
  XLA_FFI_ThreadPool_Schedule_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
  args.ctx = frame->ctx;
  args.task = handed_task;
  args.data = h;
  XLA_FFI_Error *err = api->XLA_FFI_ThreadPool_Schedule(&args);
  if (!err) return 1;
  XLA_FFI_Error_Destroy_Args destroy;
  memset(&destroy, 0, sizeof destroy);
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.error = err;
  api->XLA_FFI_Error_Destroy(&destroy);
  return 0;
}

/* Runs jobs[0 .. n) with `run`: jobs[0] here, the others on XLA's thread pool, or on
 * threads of their own where it takes none. With a thread created and joined per run in
 * every call, the kernel took 9.2-9.5 ms of a 32-sequence SmolLM2 decode step (30 calls);
 * on XLA's pool, 7.7-8.0 ms. */
static void run_jobs(const XLA_FFI_CallFrame *frame, void *jobs, size_t size, int64_t n,
                     void *(*run)(void *)) {
#define JOB(t) ((char *)jobs + (size_t)(t) * size)
  Handed *handed[MAX_THREADS] = {0};
  pthread_t tid[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  for (int64_t t = 1; t < n; ++t) {
    Handed *h = malloc(sizeof *h);
    if (h) {
      h->job = JOB(t);
      h->run = run;
      atomic_init(&h->state, 0);
      atomic_init(&h->refs, 2);
      if (schedule(frame, h)) {
        handed[t] = h;
        continue;
      }
      free(h);
    }
    started[t] = pthread_create(&tid[t], NULL, run, JOB(t)) == 0;
  }
  run(JOB(0));
  for (int64_t t = 1; t < n; ++t) {
    Handed *h = handed[t];
    if (h) {
      if (claim(h)) { /* no worker got to it */
        run(JOB(t));
      } else {
        while (atomic_load_explicit(&h->state, memory_order_acquire) != 2) sched_yield();
      }
      let_go(h);
    } else if (started[t]) {
      pthread_join(tid[t], NULL);
    } else {
      run(JOB(t)); /* no thread to be had: run it here */
    }
  }
}
#undef JOB

static XLA_FFI_Error *fail(const XLA_FFI_CallFrame *frame, const char *msg) {
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = msg;
  args.errc = XLA_FFI_Error_Code_INVALID_ARGUMENT;
  return frame->api->XLA_FFI_Error_Create(&args);
}

/* Answers XLA's question of which FFI version a handler speaks: 1 when the call was that
 * question (the handler then returns NULL at once). */
static int ffi_metadata(XLA_FFI_CallFrame *frame) {
  if (frame->extension_start && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    XLA_FFI_Metadata_Extension *ext = (XLA_FFI_Metadata_Extension *)frame->extension_start;
    ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    ext->metadata->traits = 0;
    return 1;
  }
  return 0;
}

#endif
