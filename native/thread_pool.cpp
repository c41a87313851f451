// Persistent worker pool; see thread_pool.h.
#include "thread_pool.h"

#include <dlfcn.h>
#include <immintrin.h>
#include <link.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
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

// ---------------------------------------------------------------------------
// The process's OpenMP runtime, when one is already loaded (torch's libgomp).
// ---------------------------------------------------------------------------

// Set in a forked child: OpenMP runtimes are not fork-safe, so the child never uses one.
std::atomic<bool> g_forked{false};

struct OpenMP {
    void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;  // GOMP_parallel
    int (*thread_num)() = nullptr;
    int (*in_parallel)() = nullptr;
};

int find_openmp(struct dl_phdr_info* info, size_t, void* data) {
    const char* name = info->dlpi_name;
    if (name != nullptr && (std::strstr(name, "libgomp") != nullptr || std::strstr(name, "libiomp5") != nullptr)) {
        *static_cast<const char**>(data) = name;
        return 1;
    }
    return 0;
}

// ZKERNEL_NATIVE_OPENMP=0 keeps every loop on the pool's own threads (read per loop).
bool openmp_allowed() {
    const char* env = std::getenv("ZKERNEL_NATIVE_OPENMP");
    return env == nullptr || std::strcmp(env, "0") != 0;
}

// The loaded runtime, or nullptr. Never loads one: only finds a runtime that
// something else (torch) already mapped into the process.
const OpenMP* loaded_openmp() {
    static std::mutex mutex;
    static OpenMP omp;
    static bool found = false;
    std::lock_guard<std::mutex> lock(mutex);
    if (found) return &omp;
    const char* path = nullptr;
    dl_iterate_phdr(find_openmp, &path);
    if (path == nullptr) return nullptr;
    void* handle = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) return nullptr;
    OpenMP got;
    got.parallel = reinterpret_cast<decltype(got.parallel)>(dlsym(handle, "GOMP_parallel"));
    got.thread_num = reinterpret_cast<decltype(got.thread_num)>(dlsym(handle, "omp_get_thread_num"));
    got.in_parallel = reinterpret_cast<decltype(got.in_parallel)>(dlsym(handle, "omp_in_parallel"));
    if (got.parallel == nullptr || got.thread_num == nullptr || got.in_parallel == nullptr) {
        dlclose(handle);
        return nullptr;
    }
    omp = got;  // the handle stays open: the runtime must outlive every use
    found = true;
    return &omp;
}

// ---------------------------------------------------------------------------
// Pool
// ---------------------------------------------------------------------------

// One participant's share of a loop: tasks [next, end), claimed from the front.
struct alignas(64) Slot {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
};

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
        const int helpers = static_cast<int>(std::min<int64_t>(
            {static_cast<int64_t>(workers_.size()), static_cast<int64_t>(want > 0 ? want - 1 : workers_.size()),
             n_tasks - 1}));
        if (helpers <= 0) {
            for (int64_t t = 0; t < n_tasks; ++t) fn(t);
            return;
        }
        // Participant k owns the k-th contiguous share of the tasks, the same share
        // on every call (like torch's static at::parallel_for split), so a working set
        // that fits in the caches stays where the last step left it.
        const int parts = helpers + 1;
        fn_ = &fn;
        parts_ = parts;
        for (int k = 0; k < parts; ++k) {
            slots_[k].next.store(n_tasks * k / parts, std::memory_order_relaxed);
            slots_[k].end = n_tasks * (k + 1) / parts;
        }
        if (const OpenMP* omp = usable_openmp()) {
            omp_ = omp;
            omp->parallel(&Pool::openmp_body, this, static_cast<unsigned>(parts), 0);
            fn_ = nullptr;
            return;
        }
        active_helpers_ = helpers;
        open_.store(true, std::memory_order_seq_cst);
        generation_.fetch_add(1, std::memory_order_seq_cst);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            if (sleepers_ > 0) wake_.notify_all();
        }
        drain(0);
        // Every task is claimed; close the loop so a helper that wakes only now
        // stays out, and wait for those still running a task.
        open_.store(false, std::memory_order_seq_cst);
        for (int spins = 0; busy_.load(std::memory_order_seq_cst) != 0; ++spins) {
            if (spins < 4096) _mm_pause();
            else std::this_thread::yield();
        }
        fn_ = nullptr;
    }

  private:
    // torch's CPU ops run on its OpenMP team, whose threads spin for milliseconds
    // after each op; a second pool of threads woken then shares the cores with
    // those spinners and runs at a fraction of its speed. So when the process has
    // an OpenMP runtime loaded (torch), the loop runs on that runtime's team
    // instead: only from the main thread (the runtime keeps a team per calling
    // thread, and torch's is the main thread's), never nested, never after fork.
    static const OpenMP* usable_openmp() {
        if (!openmp_allowed() || g_forked.load(std::memory_order_relaxed)) return nullptr;
        if (syscall(SYS_gettid) != getpid()) return nullptr;
        const OpenMP* omp = loaded_openmp();
        if (omp == nullptr || omp->in_parallel()) return nullptr;
        return omp;
    }

    static void openmp_body(void* self) {
        Pool* pool = static_cast<Pool*>(self);
        pool->drain(pool->omp_->thread_num() % pool->parts_);
    }

    void start(int threads) {
        n_threads_ = std::max(1, threads);
        slots_.reset(new Slot[n_threads_]);
        quit_.store(false);
        for (int i = 0; i < n_threads_ - 1; ++i) workers_.emplace_back([this, i] { loop(i); });
    }

    void stop() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            quit_.store(true);
            generation_.fetch_add(1);
            wake_.notify_all();
        }
        for (auto& w : workers_) w.join();
        workers_.clear();
    }

    // Run participant `me`'s own share front to back, then take what is left of
    // the others' (a participant that starts late or runs slow is helped out).
    void drain(int me) {
        const std::function<void(int64_t)>& fn = *fn_;
        for (int j = 0; j < parts_; ++j) {
            Slot& s = slots_[(me + j) % parts_];
            for (int64_t t; (t = s.next.fetch_add(1, std::memory_order_relaxed)) < s.end;) fn(t);
        }
    }

    void loop(int index) {
        uint64_t seen = generation_.load();
        for (;;) {
            uint64_t g = seen;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                ++sleepers_;
                // quit_ too: a worker that reads its first `seen` only after stop()
                // bumped the generation would otherwise sleep through it (and a
                // resize right after the pool's creation would join it forever).
                wake_.wait(lock, [&] { return quit_.load() || (g = generation_.load()) != seen; });
                --sleepers_;
            }
            if (quit_.load()) return;
            seen = g;
            // busy_ before open_, and the caller's open_ = false before its busy_ check
            // (all seq_cst): either the caller waits for this helper or the helper
            // sees the loop closed and touches none of its state.
            busy_.fetch_add(1, std::memory_order_seq_cst);
            if (open_.load(std::memory_order_seq_cst) && index < active_helpers_) drain(index + 1);
            busy_.fetch_sub(1, std::memory_order_seq_cst);
        }
    }

    std::mutex run_mutex_;  // one loop at a time
    std::mutex mutex_;      // guards sleepers_ and the sleep/wake handshake
    std::condition_variable wake_;
    std::vector<std::thread> workers_;
    std::unique_ptr<Slot[]> slots_;
    const std::function<void(int64_t)>* fn_ = nullptr;
    const OpenMP* omp_ = nullptr;
    int parts_ = 0;
    int active_helpers_ = 0;
    int sleepers_ = 0;
    int n_threads_ = 1;
    alignas(64) std::atomic<uint64_t> generation_{0};
    alignas(64) std::atomic<bool> open_{false};
    alignas(64) std::atomic<int> busy_{0};
    std::atomic<bool> quit_{false};
};

Pool* g_pool = nullptr;
std::mutex g_pool_mutex;

void forget_pool_after_fork() {
    // The child has only the forking thread; the old pool's threads are gone and
    // its mutexes may be held. Leak it and build a new one on first use.
    new (&g_pool_mutex) std::mutex();
    g_pool = nullptr;
    g_forked.store(true);
}

// Registered at load time, so a child forked before the first loop also knows.
[[maybe_unused]] const bool g_atfork_registered = pthread_atfork(nullptr, nullptr, forget_pool_after_fork) == 0;

Pool& pool() {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (g_pool == nullptr) g_pool = new Pool(default_threads());
    return *g_pool;
}

}  // namespace

void parallel_for(int64_t n_tasks, int threads, const std::function<void(int64_t)>& fn) {
    pool().run(n_tasks, threads, fn);
}

void parallel_chunks(int64_t n, int64_t chunk, int threads, const std::function<void(int64_t, int64_t)>& range) {
    if (n <= 0) return;
    const int64_t tasks = (n + chunk - 1) / chunk;
    parallel_for(tasks, threads, [&](int64_t t) {
        const int64_t begin = t * chunk;
        range(begin, std::min(n, begin + chunk));
    });
}

int pool_threads() { return pool().threads(); }

void set_pool_threads(int n) { pool().resize(n); }

}  // namespace zk
