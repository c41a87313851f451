// A persistent pool of worker threads for data-parallel loops over index ranges.
//
// parallel_for(n_tasks, fn) runs fn(task) for task in [0, n_tasks) on the
// pool's workers plus the calling thread and returns when every task has
// finished; fn must not throw. Participant k (the caller is 0) owns the k-th
// contiguous share of the tasks, the same share on every call, as torch's
// static at::parallel_for does, so data a step leaves in a core's caches is
// where the next step looks for it; a participant that has finished its share
// takes the rest of the others' (so a core busy elsewhere, or a worker that
// wakes late, is helped out); on the pool's own threads the call never waits
// for a worker that has not started. One loop runs at a time; concurrent
// callers are serialised.
//
// When the process already has an OpenMP runtime loaded (torch's libgomp) and
// the call comes from the main thread, the loop runs on that runtime's team
// (GOMP_parallel, found with dlsym; nothing is loaded) rather than on the pool's
// own threads: torch leaves its team spinning for milliseconds after every CPU
// op, and a second set of threads woken then shares the cores with the
// spinners (unlike the pool, the team's closing barrier does wait for a thread
// descheduled on an oversubscribed machine). ZKERNEL_NATIVE_OPENMP=0 turns
// this off (read per loop). After
// fork() the child gets a fresh, empty pool (threads do not survive fork) and
// never uses OpenMP, so a forked DataLoader worker never waits on a dead thread.
#pragma once

#include <cstdint>
#include <functional>

namespace zk {

// Run fn(task) for every task in [0, n_tasks) on up to `threads` threads
// (0 = the pool's size). Blocks until all tasks are done.
void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn);

// Run range(begin, end) over [0, n) in chunks of `chunk` elements (the last one shorter), one
// task per chunk, on up to `threads` threads; every chunk but the last starts at a multiple of
// `chunk`. Blocks until all are done.
void parallel_chunks(int64_t n, int64_t chunk, int threads, const std::function<void(int64_t, int64_t)>& range);

// Number of threads parallel_for uses by default (worker threads + caller).
int pool_threads();

// Resize the pool (n >= 1; the caller counts as one thread).
void set_pool_threads(int n);

}  // namespace zk
