// The split master's codec; the encoding is described in split_master.h.
#include "split_master.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "cpu_adam.h"
#include "thread_pool.h"

namespace zk {
namespace {

// Elements per task: a multiple of 64, so a task's tie bytes start on an 8-byte
// boundary of the bitmask (no byte is shared by two threads) and the SIMD blocks
// below tile it.
constexpr int64_t kChunk = 32768;

// [Note: streaming stores]
// split's `low`/`ties` and join's `out` are write-only. Above a few MiB a
// streaming store skips reading each line before writing it, a quarter to a
// third of the traffic: on this repo's 2-core AMD EPYC VM (32 MiB L3), one
// thread at 16M elements went from 0.137 to 0.113 ns/element (split) and 0.232
// to 0.170 (join). In the caches it is the other way round (join at 2M
// elements: 0.073 plain, 0.114 streamed), and join's output is read by the
// optimizer right after, so calls below kStreamMin elements store normally.
constexpr int64_t kStreamMin = int64_t{1} << 22;

inline uint32_t load_bits(const float* p) {
    uint32_t u;
    std::memcpy(&u, p, 4);
    return u;
}

inline void store_bits(float* p, uint32_t u) { std::memcpy(p, &u, 4); }

// ---------------------------------------------------------------------------
// Scalar: the reference the SIMD paths match byte for byte.
// ---------------------------------------------------------------------------

// Groups of 8 elements, one tie byte each, a fixed count the compiler unrolls,
// through restrict pointers (a store through uint8_t* may alias anything, and
// without them every store made the compiler reload the others). The partial
// last group (kLast) takes the same code with a run-time count.

template <bool kLast>
inline void split_group(const float* __restrict master, uint16_t* __restrict low, uint8_t* __restrict ties,
                        int64_t i, int count) {
    uint32_t byte = 0;
    for (int k = 0; k < (kLast ? count : 8); ++k) {
        const uint32_t bits = load_bits(master + i + k);
        low[i + k] = static_cast<uint16_t>(bits);
        byte |= static_cast<uint32_t>((bits & 0x1FFFFu) == 0x8000u) << k;
    }
    ties[i / 8] = static_cast<uint8_t>(byte);  // a partial group's padding bits are 0
}

template <bool kLast>
inline void join_group(const uint16_t* __restrict high, const uint16_t* __restrict low,
                       const uint8_t* __restrict ties, float* __restrict out, int64_t i, int count) {
    const uint32_t byte = ties[i / 8];
    for (int k = 0; k < (kLast ? count : 8); ++k) {
        const uint32_t l = low[i + k];
        const uint32_t kept = (byte >> k) & 1u;
        const uint32_t carry = static_cast<uint32_t>(l > 0x8000u) | (static_cast<uint32_t>(l == 0x8000u) & (kept ^ 1u));
        store_bits(out + i + k, ((static_cast<uint32_t>(high[i + k]) - carry) << 16) | l);
    }
}

// `begin` is a multiple of 8.
void split_scalar(const float* master, uint16_t* low, uint8_t* ties, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) split_group<false>(master, low, ties, i, 8);
    if (i < end) split_group<true>(master, low, ties, i, static_cast<int>(end - i));
}

void join_scalar(const uint16_t* high, const uint16_t* low, const uint8_t* ties, float* out, int64_t begin,
                 int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) join_group<false>(high, low, ties, out, i, 8);
    if (i < end) join_group<true>(high, low, ties, out, i, static_cast<int>(end - i));
}

// ---------------------------------------------------------------------------
// AVX-512: 16 lanes; a compare's mask is 16 tie bits as they are stored.
// ---------------------------------------------------------------------------

#define ZK_SPLIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

template <bool kStream>
ZK_SPLIT_AVX512 void split_avx512(const float* master, uint16_t* low, uint8_t* ties, int64_t begin, int64_t end) {
    const __m512i tie_bits = _mm512_set1_epi32(0x1FFFF);
    const __m512i tie = _mm512_set1_epi32(0x8000);
    const bool aligned = (reinterpret_cast<uintptr_t>(low + begin) & 31) == 0;
    int64_t i = begin;
    for (; i + 64 <= end; i += 64) {  // 64 elements: 8 tie bytes, one 8-byte store
        uint64_t packed = 0;
        for (int k = 0; k < 4; ++k) {
            const __m512i bits = _mm512_loadu_si512(master + i + 16 * k);
            const __m256i halves = _mm512_cvtepi32_epi16(bits);
            __m256i* dst = reinterpret_cast<__m256i*>(low + i + 16 * k);
            if (kStream && aligned) _mm256_stream_si256(dst, halves);
            else _mm256_storeu_si256(dst, halves);
            packed |= static_cast<uint64_t>(_mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, tie_bits), tie)) << (16 * k);
        }
        if (kStream) _mm_stream_si64(reinterpret_cast<long long*>(ties + i / 8), static_cast<long long>(packed));
        else std::memcpy(ties + i / 8, &packed, 8);
    }
    if (kStream) _mm_sfence();
    split_scalar(master, low, ties, i, end);
}

template <bool kStream>
ZK_SPLIT_AVX512 void join_avx512(const uint16_t* high, const uint16_t* low, const uint8_t* ties, float* out,
                                 int64_t begin, int64_t end) {
    const __m512i tie = _mm512_set1_epi32(0x8000);
    const __m512i one = _mm512_set1_epi32(1);
    const bool aligned = (reinterpret_cast<uintptr_t>(out + begin) & 63) == 0;
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) {
        uint16_t kept;
        std::memcpy(&kept, ties + i / 8, 2);
        __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + i)));
        const __m512i l = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + i)));
        const __mmask16 carry = _mm512_cmpgt_epu32_mask(l, tie) |
                                (_mm512_cmpeq_epu32_mask(l, tie) & static_cast<__mmask16>(~kept));
        h = _mm512_mask_sub_epi32(h, carry, h, one);
        const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(h, 16), l);
        if (kStream && aligned) _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), bits);
        else _mm512_storeu_si512(out + i, bits);
    }
    if (kStream) _mm_sfence();
    join_scalar(high, low, ties, out, i, end);
}

// ---------------------------------------------------------------------------
// AVX2: 8 lanes; movemask gives one tie byte, a broadcast byte tested against
// the lanes' bits unpacks one.
// ---------------------------------------------------------------------------

#define ZK_SPLIT_AVX2 __attribute__((target("avx2")))

template <bool kStream>
ZK_SPLIT_AVX2 void split_avx2(const float* master, uint16_t* low, uint8_t* ties, int64_t begin, int64_t end) {
    const __m256i tie_bits = _mm256_set1_epi32(0x1FFFF);
    const __m256i tie = _mm256_set1_epi32(0x8000);
    const __m256i low_bits = _mm256_set1_epi32(0xFFFF);
    const bool aligned = (reinterpret_cast<uintptr_t>(low + begin) & 31) == 0;
    int64_t i = begin;
    for (; i + 64 <= end; i += 64) {
        uint64_t packed = 0;
        for (int k = 0; k < 4; ++k) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(master + i + 16 * k));
            const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(master + i + 16 * k + 8));
            // packus works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, put back in order.
            const __m256i halves = _mm256_permute4x64_epi64(
                _mm256_packus_epi32(_mm256_and_si256(a, low_bits), _mm256_and_si256(b, low_bits)), 0xD8);
            __m256i* dst = reinterpret_cast<__m256i*>(low + i + 16 * k);
            if (kStream && aligned) _mm256_stream_si256(dst, halves);
            else _mm256_storeu_si256(dst, halves);
            const uint32_t ta = static_cast<uint32_t>(
                _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(a, tie_bits), tie))));
            const uint32_t tb = static_cast<uint32_t>(
                _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(b, tie_bits), tie))));
            packed |= static_cast<uint64_t>(ta | (tb << 8)) << (16 * k);
        }
        if (kStream) _mm_stream_si64(reinterpret_cast<long long*>(ties + i / 8), static_cast<long long>(packed));
        else std::memcpy(ties + i / 8, &packed, 8);
    }
    if (kStream) _mm_sfence();
    split_scalar(master, low, ties, i, end);
}

template <bool kStream>
ZK_SPLIT_AVX2 void join_avx2(const uint16_t* high, const uint16_t* low, const uint8_t* ties, float* out,
                             int64_t begin, int64_t end) {
    const __m256i tie = _mm256_set1_epi32(0x8000);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const bool aligned = (reinterpret_cast<uintptr_t>(out + begin) & 31) == 0;
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        const __m256i kept =
            _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(ties[i / 8]), lane_bit), lane_bit);
        const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high + i)));
        const __m256i l = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(low + i)));
        // Lanes hold 0..0xFFFF, so the signed compare is the unsigned one; carry lanes are -1.
        const __m256i carry = _mm256_or_si256(_mm256_cmpgt_epi32(l, tie),
                                              _mm256_andnot_si256(kept, _mm256_cmpeq_epi32(l, tie)));
        const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(h, carry), 16), l);
        __m256i* dst = reinterpret_cast<__m256i*>(out + i);
        if (kStream && aligned) _mm256_stream_si256(dst, bits);
        else _mm256_storeu_si256(dst, bits);
    }
    if (kStream) _mm_sfence();
    join_scalar(high, low, ties, out, i, end);
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

using SplitRange = void (*)(const float*, uint16_t*, uint8_t*, int64_t, int64_t);
using JoinRange = void (*)(const uint16_t*, const uint16_t*, const uint8_t*, float*, int64_t, int64_t);

SplitRange pick_split(const std::string& path, bool stream) {
    if (path == "avx512") return stream ? split_avx512<true> : split_avx512<false>;
    if (path == "avx2") return stream ? split_avx2<true> : split_avx2<false>;
    return split_scalar;
}

JoinRange pick_join(const std::string& path, bool stream) {
    if (path == "avx512") return stream ? join_avx512<true> : join_avx512<false>;
    if (path == "avx2") return stream ? join_avx2<true> : join_avx2<false>;
    return join_scalar;
}

}  // namespace

void split_master(const float* master, uint16_t* low, uint8_t* ties, int64_t n, int threads) {
    if (n <= 0) return;
    const SplitRange range = pick_split(simd_path(), n >= kStreamMin);
    parallel_chunks(n, kChunk, threads, [&](int64_t begin, int64_t end) { range(master, low, ties, begin, end); });
}

void join_master(const uint16_t* high, const uint16_t* low, const uint8_t* ties, float* out, int64_t n,
                 int threads) {
    if (n <= 0) return;
    const JoinRange range = pick_join(simd_path(), n >= kStreamMin);
    parallel_chunks(n, kChunk, threads, [&](int64_t begin, int64_t end) { range(high, low, ties, out, begin, end); });
}

}  // namespace zk
