// CRC32C (Castagnoli; reflected polynomial 0x82F63B78, the iSCSI/ext4/SSE4.2
// checksum) for swap-file integrity: every write of the NVMe tier is
// checksummed and every read verified.
//
// Values follow the usual convention: crc32c(0, "123456789") = 0xE3069283 and
// crc32c(crc32c(0, A), B) = crc32c(0, A || B), so `crc` is the CRC of the
// bytes before.
//
// Hardware path (SSE4.2 crc32 instruction): the instruction has a latency of
// 3 cycles and a throughput of 1 per cycle, so one dependent chain runs at a
// third of the unit's speed. The buffer is cut into blocks of three equal
// lanes run as three independent chains, 8 bytes per instruction each; the
// lanes' CRC registers are then joined by "shifting" the first two past the
// bytes that follow them (a multiplication by x^(8n) mod P, done with four
// table look-ups for the fixed lane lengths). Software path (CPUs without
// SSE4.2): slicing-by-8 tables. Both give the same values; the path is chosen
// once from the CPU's flags and can be forced for tests.
#pragma once

#include <cstdint>
#include <string>

namespace zk {

// CRC32C of n bytes at `data`, continuing from `crc`; on the calling thread.
uint32_t crc32c_update(uint32_t crc, const void* data, int64_t n);

// The same, split into 1 MiB pieces on the thread pool (threads <= 0: the pool's
// default) whose CRCs are combined; small inputs stay on the calling thread.
uint32_t crc32c_parallel(uint32_t crc, const void* data, int64_t n, int threads);

// CRC32C of A || B from crc_a = CRC32C(A), crc_b = CRC32C(B) and len_b = |B|.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b);

// The operator that crc32c_combine applies for a given len_b, for combining
// many pieces of one length: crc32c_combine(a, b, len) ==
// crc32c_shift(a, crc32c_shift_operator(len)) ^ b.
uint32_t crc32c_shift_operator(int64_t len);
uint32_t crc32c_shift(uint32_t crc, uint32_t op);

// "sse4.2" or "table": the path crc32c_update uses now / the best this CPU has.
std::string crc32c_path();
std::string best_crc32c_path();
// Force a path ("auto" restores the best); throws std::invalid_argument if the
// CPU lacks it.
void set_crc32c_path(const std::string& name);

}  // namespace zk
