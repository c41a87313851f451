// Memory-bandwidth probes; see bandwidth.h.
#include "bandwidth.h"

#include <algorithm>
#include <cstring>

#include "thread_pool.h"

namespace zk {
namespace {
constexpr int64_t kChunk = 32768;

void chunked(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& range) {
    const int64_t tasks = (n + kChunk - 1) / kChunk;
    parallel_for(tasks, threads, [&](int64_t t) {
        const int64_t begin = t * kChunk;
        range(begin, std::min(n, begin + kChunk));
    });
}
}  // namespace

void probe_copy(const float* src, float* dst, int64_t n, int threads) {
    chunked(n, threads, [&](int64_t b, int64_t e) {
        std::memcpy(dst + b, src + b, static_cast<size_t>(e - b) * sizeof(float));
    });
}

void probe_adam_pattern(float* p, const float* g, float* m, float* v, int64_t n, int threads) {
    chunked(n, threads, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            const float x = g[i];
            p[i] += x;
            m[i] += x;
            v[i] += x;
        }
    });
}

}  // namespace zk
