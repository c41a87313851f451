// Persistent worker pool; see thread_pool.h.
#include "thread_pool.h"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace zk {
namespace {

int default_threads() {
    if (const char* env = std::getenv("ZKERNEL_NATIVE_THREADS")) {
        int n = std::atoi(env);
        if (n >= 1) return n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    return static_cast<int>(std::max(1L, n));
}

class Pool {
  public:
    explicit Pool(int threads) { start(threads); }
    ~Pool() { stop(); }

    int threads() const { return n_threads_; }

    void resize(int threads) {
        std::lock_guard<std::mutex> run(run_mutex_);
        stop();
        start(threads);
    }

    void run(int64_t n_tasks, int want, const std::function<void(int64_t)>& fn) {
        if (n_tasks <= 0) return;
        std::lock_guard<std::mutex> run(run_mutex_);
        int helpers = std::min<int64_t>({static_cast<int64_t>(workers_.size()),
                                         static_cast<int64_t>(want > 0 ? want - 1 : workers_.size()),
                                         n_tasks - 1});
        if (helpers <= 0) {
            for (int64_t t = 0; t < n_tasks; ++t) fn(t);
            return;
        }
        {
            std::lock_guard<std::mutex> lock(mutex_);
            fn_ = &fn;
            n_tasks_ = n_tasks;
            next_.store(0, std::memory_order_relaxed);
            active_helpers_ = helpers;
            remaining_helpers_ = helpers;
            ++generation_;
        }
        wake_.notify_all();
        drain();
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [&] { return remaining_helpers_ == 0; });
        fn_ = nullptr;
    }

  private:
    void start(int threads) {
        n_threads_ = std::max(1, threads);
        quit_ = false;
        for (int i = 0; i < n_threads_ - 1; ++i) workers_.emplace_back([this, i] { loop(i); });
    }

    void stop() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            quit_ = true;
        }
        wake_.notify_all();
        for (auto& w : workers_) w.join();
        workers_.clear();
    }

    void drain() {
        const std::function<void(int64_t)>& fn = *fn_;
        for (int64_t t; (t = next_.fetch_add(1, std::memory_order_relaxed)) < n_tasks_;) fn(t);
    }

    void loop(int index) {
        uint64_t seen = 0;
        for (;;) {
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [&] { return quit_ || generation_ != seen; });
                if (quit_) return;
                seen = generation_;
                if (index >= active_helpers_) continue;
            }
            drain();
            {
                std::lock_guard<std::mutex> lock(mutex_);
                if (--remaining_helpers_ == 0) done_.notify_one();
            }
        }
    }

    std::mutex run_mutex_;  // one loop at a time
    std::mutex mutex_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> workers_;
    const std::function<void(int64_t)>* fn_ = nullptr;
    int64_t n_tasks_ = 0;
    std::atomic<int64_t> next_{0};
    int active_helpers_ = 0;
    int remaining_helpers_ = 0;
    uint64_t generation_ = 0;
    bool quit_ = false;
    int n_threads_ = 1;
};

Pool* g_pool = nullptr;
std::mutex g_pool_mutex;

void forget_pool_after_fork() {
    // The child has only the forking thread; the old pool's threads are gone and
    // its mutexes may be held. Leak it and build a new one on first use.
    new (&g_pool_mutex) std::mutex();
    g_pool = nullptr;
}

Pool& pool() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (g_pool == nullptr) {
        static bool registered = [] { return pthread_atfork(nullptr, nullptr, forget_pool_after_fork) == 0; }();
        (void)registered;
        g_pool = new Pool(default_threads());
    }
    return *g_pool;
}

}  // namespace

void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn) {
    pool().run(n_tasks, threads, fn);
}

int pool_threads() { return pool().threads(); }

void set_pool_threads(int n) { pool().resize(n); }

}  // namespace zk
