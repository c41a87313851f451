// A persistent pool of worker threads for data-parallel loops over index ranges.
//
// parallel_for(n_tasks, fn) runs fn(task) for task in [0, n_tasks) on the pool's
// workers plus the calling thread, handing out tasks through one atomic counter
// (dynamic scheduling: a core that is busy elsewhere simply takes fewer tasks),
// and returns when every task has finished. One loop runs at a time; concurrent
// callers are serialised by a mutex. Workers sleep on a condition variable
// between loops. After fork() the child gets a fresh, empty pool (threads do not
// survive fork), so a forked DataLoader worker never waits on a dead thread.
#pragma once

#include <cstdint>
#include <functional>

namespace zk {

// Run fn(task) for every task in [0, n_tasks) on up to `threads` threads
// (0 = the pool's size). Blocks until all tasks are done.
void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn);

// Number of threads parallel_for uses by default (worker threads + caller).
int pool_threads();

// Resize the pool (n >= 1; the caller counts as one thread).
void set_pool_threads(int n);

}  // namespace zk
