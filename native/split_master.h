// The split master's codec over raw buffers: an fp32 master kept as its bf16
// rounding (the parameter, held by the caller), its low 16 bits and one tie bit
// per element (zkernel/platform/split_master.py, [Note: the master's low half]).
//
// Per element i, on the master's bit pattern `bits` (uint32 arithmetic):
//
//   split:  low[i] = bits & 0xFFFF
//           tie[i] = (bits & 0x1FFFF) == 0x8000    (a tie the rounding kept)
//   join:   carry  = low > 0x8000 || (low == 0x8000 && !tie[i])
//           out[i] = ((high[i] - carry) << 16) | low[i]
//
// `ties` is a packed bitmask: element i is bit i % 8 (least significant first)
// of byte i / 8; split writes every byte of it, the last byte's padding bits 0.
// join gives back every master whose round-to-nearest-even is `high` (a NaN as
// a NaN). The AVX-512, AVX2 and scalar paths write the same bytes; the path is
// cpu_adam.h's (set_simd_path). Work is split over the thread pool in chunks
// whose borders are multiples of 64 elements, so every tie byte is written by
// one thread.
#pragma once

#include <cstdint>

namespace zk {

// Write `master`'s (n fp32) low halves into `low` (n) and its tie bits into
// `ties` ((n + 7) / 8 bytes). threads <= 0 uses the pool's default.
void split_master(const float* master, uint16_t* low, uint8_t* ties, int64_t n, int threads);

// Rebuild n fp32 masters into `out` from their bf16 roundings `high` (n bf16
// bit patterns), `low` (n) and `ties` ((n + 7) / 8 bytes). threads <= 0 uses
// the pool's default.
void join_master(const uint16_t* high, const uint16_t* low, const uint8_t* ties, float* out, int64_t n,
                 int threads);

}  // namespace zk
