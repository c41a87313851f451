// CRC32C kernel; the algorithm is described in crc32c.h.
//
// Polynomials are kept in the reflected bit order of the CRC register: bit 31
// holds the coefficient of x^0 and bit 0 that of x^31, so multiplying by x is
// a right shift that folds the polynomial back in when x^32 falls out.
#include "crc32c.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace zk {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;
constexpr uint32_t kOne = 0x80000000u;  // the polynomial 1

// Lane lengths of the hardware path's three-lane blocks (multiples of 8).
constexpr int64_t kLongLane = 8192;
constexpr int64_t kShortLane = 256;
// Piece length of crc32c_parallel.
constexpr int64_t kPiece = 1 << 20;

inline uint64_t load_u64(const uint8_t* p) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    return w;  // x86 is little-endian: byte 0 is the low byte, as the CRC consumes it
}

// a * b mod P.
uint32_t multiply(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t bit = kOne; bit != 0; bit >>= 1) {
        if (a & bit) product ^= b;
        b = (b >> 1) ^ ((b & 1u) ? kPoly : 0u);
    }
    return product;
}

struct Tables {
    uint32_t bytes[8][256];       // slicing-by-8: bytes[k][b] = CRC effect of byte b then k zero bytes
    uint32_t pow8_2k[64];         // x^(8 * 2^k) mod P
    uint32_t long_shift[4][256];  // multiplication by x^(8 * kLongLane), byte by byte
    uint32_t short_shift[4][256]; // multiplication by x^(8 * kShortLane)

    Tables() {
        for (uint32_t b = 0; b < 256; ++b) {
            uint32_t r = b;
            for (int i = 0; i < 8; ++i) r = (r >> 1) ^ ((r & 1u) ? kPoly : 0u);
            bytes[0][b] = r;
        }
        for (int k = 1; k < 8; ++k)
            for (int b = 0; b < 256; ++b)
                bytes[k][b] = (bytes[k - 1][b] >> 8) ^ bytes[0][bytes[k - 1][b] & 0xFFu];
        pow8_2k[0] = kOne >> 8;  // x^8: no reduction needed below x^32
        for (int k = 1; k < 64; ++k) pow8_2k[k] = multiply(pow8_2k[k - 1], pow8_2k[k - 1]);
        fill_shift(long_shift, power(kLongLane));
        fill_shift(short_shift, power(kShortLane));
    }

    // x^(8 n) mod P.
    uint32_t power(uint64_t n) const {
        uint32_t result = kOne;
        for (int k = 0; n != 0; ++k, n >>= 1)
            if (n & 1u) result = multiply(result, pow8_2k[k]);
        return result;
    }

    static void fill_shift(uint32_t (&table)[4][256], uint32_t op) {
        for (int k = 0; k < 4; ++k)
            for (uint32_t b = 0; b < 256; ++b) table[k][b] = multiply(b << (8 * k), op);
    }
};

const Tables& tables() {
    static const Tables t;
    return t;
}

// The table-driven multiplication by a fixed x^(8n) (linear in the register).
inline uint32_t shift_by_table(const uint32_t (&table)[4][256], uint32_t r) {
    return table[0][r & 0xFFu] ^ table[1][(r >> 8) & 0xFFu] ^ table[2][(r >> 16) & 0xFFu] ^ table[3][r >> 24];
}

// ---------------------------------------------------------------------------
// Software path: slicing-by-8. Registers are pre- and post-inverted by the caller.
// ---------------------------------------------------------------------------

uint32_t table_register(uint32_t r, const uint8_t* p, int64_t n) {
    const Tables& t = tables();
    for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0; --n) r = (r >> 8) ^ t.bytes[0][(r ^ *p++) & 0xFFu];
    for (; n >= 8; n -= 8, p += 8) {
        const uint64_t w = load_u64(p) ^ r;
        r = t.bytes[7][w & 0xFFu] ^ t.bytes[6][(w >> 8) & 0xFFu] ^ t.bytes[5][(w >> 16) & 0xFFu] ^
            t.bytes[4][(w >> 24) & 0xFFu] ^ t.bytes[3][(w >> 32) & 0xFFu] ^ t.bytes[2][(w >> 40) & 0xFFu] ^
            t.bytes[1][(w >> 48) & 0xFFu] ^ t.bytes[0][w >> 56];
    }
    for (; n > 0; --n) r = (r >> 8) ^ t.bytes[0][(r ^ *p++) & 0xFFu];
    return r;
}

// ---------------------------------------------------------------------------
// Hardware path: SSE4.2 crc32, three independent lanes per block.
// ---------------------------------------------------------------------------

#define ZK_SSE42 __attribute__((target("sse4.2")))

// Whole blocks of three kLane-byte lanes: lane A continues the register, B and
// C start from 0, and the three are joined as r = (A * x^(8L) ^ B) * x^(8L) ^ C.
template <int64_t kLane>
ZK_SSE42 inline uint64_t hw_blocks(uint64_t r, const uint8_t*& p, int64_t& n,
                                   const uint32_t (&shift)[4][256]) {
    for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
        uint64_t a = r, b = 0, c = 0;
        for (int64_t i = 0; i < kLane; i += 8) {
            a = _mm_crc32_u64(a, load_u64(p + i));
            b = _mm_crc32_u64(b, load_u64(p + kLane + i));
            c = _mm_crc32_u64(c, load_u64(p + 2 * kLane + i));
        }
        const uint32_t ab = shift_by_table(shift, static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b);
        r = shift_by_table(shift, ab) ^ static_cast<uint32_t>(c);
    }
    return r;
}

ZK_SSE42 uint32_t hw_register(uint32_t crc_register, const uint8_t* p, int64_t n) {
    uint64_t r = crc_register;
    for (; n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0; --n) r = _mm_crc32_u8(static_cast<uint32_t>(r), *p++);
    const Tables& t = tables();
    r = hw_blocks<kLongLane>(r, p, n, t.long_shift);
    r = hw_blocks<kShortLane>(r, p, n, t.short_shift);
    for (; n >= 8; n -= 8, p += 8) r = _mm_crc32_u64(r, load_u64(p));
    for (; n > 0; --n) r = _mm_crc32_u8(static_cast<uint32_t>(r), *p++);
    return static_cast<uint32_t>(r);
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

enum class CrcPath : int { TABLE = 0, SSE42 = 1 };

CrcPath detect_best() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") ? CrcPath::SSE42 : CrcPath::TABLE;
}

const CrcPath g_best = detect_best();
std::atomic<int> g_path{static_cast<int>(g_best)};

const char* path_name(CrcPath p) { return p == CrcPath::SSE42 ? "sse4.2" : "table"; }

}  // namespace

uint32_t crc32c_update(uint32_t crc, const void* data, int64_t n) {
    if (n <= 0) return crc;
    const uint8_t* p = static_cast<const uint8_t*>(data);
    const uint32_t r = static_cast<CrcPath>(g_path.load(std::memory_order_relaxed)) == CrcPath::SSE42
                           ? hw_register(~crc, p, n)
                           : table_register(~crc, p, n);
    return ~r;
}

uint32_t crc32c_shift_operator(int64_t len) { return tables().power(static_cast<uint64_t>(std::max<int64_t>(len, 0))); }

uint32_t crc32c_shift(uint32_t crc, uint32_t op) { return multiply(crc, op); }

uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b) {
    return crc32c_shift(crc_a, crc32c_shift_operator(len_b)) ^ crc_b;
}

uint32_t crc32c_parallel(uint32_t crc, const void* data, int64_t n, int threads) {
    const int64_t pieces = (n + kPiece - 1) / kPiece;
    if (pieces <= 1 || threads == 1) return crc32c_update(crc, data, n);
    const uint8_t* base = static_cast<const uint8_t*>(data);
    std::vector<uint32_t> crcs(static_cast<size_t>(pieces));
    parallel_for(pieces, threads, [&](int64_t t) {
        const int64_t begin = t * kPiece;
        crcs[static_cast<size_t>(t)] = crc32c_update(0, base + begin, std::min(kPiece, n - begin));
    });
    const uint32_t whole_piece = crc32c_shift_operator(kPiece);
    for (int64_t t = 0; t < pieces; ++t) {
        const int64_t len = std::min(kPiece, n - t * kPiece);
        const uint32_t op = len == kPiece ? whole_piece : crc32c_shift_operator(len);
        crc = crc32c_shift(crc, op) ^ crcs[static_cast<size_t>(t)];
    }
    return crc;
}

std::string crc32c_path() { return path_name(static_cast<CrcPath>(g_path.load())); }

std::string best_crc32c_path() { return path_name(g_best); }

void set_crc32c_path(const std::string& name) {
    CrcPath want;
    if (name == "auto") want = g_best;
    else if (name == "sse4.2") want = CrcPath::SSE42;
    else if (name == "table") want = CrcPath::TABLE;
    else throw std::invalid_argument("unknown CRC32C path '" + name + "'; valid: auto, sse4.2, table");
    if (static_cast<int>(want) > static_cast<int>(g_best))
        throw std::invalid_argument("this CPU does not support the '" + name + "' CRC32C path (best: " +
                                    path_name(g_best) + ")");
    g_path.store(static_cast<int>(want));
}

}  // namespace zk
