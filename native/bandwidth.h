// Memory-bandwidth probes for benchmarks: the traffic of a kernel with no work in it.
//
// copy:         dst[i] = src[i]                      (1 read, 1 write stream)
// adam_pattern: p += g; m += g; v += g               (4 read, 3 write streams, the
//               fp32 Adam step's traffic, 28 bytes per element)
// Both run on the same thread pool and chunking as adam_step, so a kernel's
// bytes/s over the probe's bytes/s is how close it sits to the machine's bound.
#pragma once

#include <cstdint>

namespace zk {

void probe_copy(const float* src, float* dst, int64_t n, int threads);
void probe_adam_pattern(float* p, const float* g, float* m, float* v, int64_t n, int threads);

}  // namespace zk
