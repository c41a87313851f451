// Memory-bandwidth probes; see bandwidth.h.
#include "bandwidth.h"

#include <algorithm>
#include <cstring>

#include "thread_pool.h"

namespace zk {
namespace {
constexpr int64_t kChunk = 32768;

}  // namespace

void probe_copy(const float* src, float* dst, int64_t n, int threads) {
    parallel_chunks(n, kChunk, threads, [&](int64_t b, int64_t e) {
        std::memcpy(dst + b, src + b, static_cast<size_t>(e - b) * sizeof(float));
    });
}

void probe_adam_pattern(float* p, const float* g, float* m, float* v, int64_t n, int threads) {
    parallel_chunks(n, kChunk, threads, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
            const float x = g[i];
            p[i] += x;
            m[i] += x;
            v[i] += x;
        }
    });
}

}  // namespace zk
