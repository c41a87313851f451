// CPU Adam / AdamW kernel; the algorithm is described in cpu_adam.h.
#include "cpu_adam.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "thread_pool.h"

namespace zk {
namespace {

// Elements per task: 32K fp32 = 128 KiB per stream, a few streams fit in L2.
constexpr int64_t kChunk = 32768;

// Hyperparameters rounded to fp32 exactly as torch rounds the Python scalars.
struct Coeffs {
    float grad_scale;
    float weight_decay;    // L2 term (Adam)
    float decay;           // 1 - lr * wd (AdamW)
    bool l2;
    bool decoupled;
    float lerp_coeff;      // w or w - 1 (torch's lerp, w = 1 - beta1)
    bool lerp_from_m;      // |w| < 0.5: base is m, else base is g
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;
    float eps;
    float step_size;
};

Coeffs make_coeffs(const AdamHyper& h) {
    Coeffs c{};
    c.grad_scale = static_cast<float>(h.grad_scale);
    c.l2 = !h.adamw && h.weight_decay != 0.0;
    c.decoupled = h.adamw && h.weight_decay != 0.0;
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
    float w = static_cast<float>(1.0 - h.beta1);
    c.lerp_from_m = std::fabs(w) < 0.5f;
    c.lerp_coeff = c.lerp_from_m ? w : w - 1.0f;
    c.beta2 = static_cast<float>(h.beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
    const double step = static_cast<double>(h.step);
    const double bc1 = 1.0 - std::pow(h.beta1, step);
    const double bc2 = 1.0 - std::pow(h.beta2, step);
    c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
    c.eps = static_cast<float>(h.eps);
    c.step_size = static_cast<float>(h.lr / bc1);
    return c;
}

struct Buffers {
    float* param;
    const void* grad;
    float* exp_avg;
    float* exp_avg_sq;
    void* out;
};

// ---------------------------------------------------------------------------
// Scalar conversions (bit-exact references for the SIMD paths)
// ---------------------------------------------------------------------------

inline uint32_t f32_bits(float x) {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    return u;
}

inline float bits_f32(uint32_t u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float x) {
    if (std::isnan(x)) return 0x7FC0;
    uint32_t u = f32_bits(x);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE fp32 -> fp16, round to nearest even (the algorithm of the FP16 library
// that c10::Half uses).
inline uint16_t f32_to_f16(float f) {
    const float scale_to_inf = bits_f32(0x77800000u);
    const float scale_to_zero = bits_f32(0x08800000u);
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

template <bool kBf16Grad>
inline float load_grad(const void* grad, int64_t i) {
    if constexpr (kBf16Grad) return bf16_to_f32(static_cast<const uint16_t*>(grad)[i]);
    else return static_cast<const float*>(grad)[i];
}

template <int kOut>
inline void store_out(void* out, int64_t i, float p) {
    if constexpr (kOut == static_cast<int>(OutDtype::BF16)) static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
    if constexpr (kOut == static_cast<int>(OutDtype::F16)) static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
}

template <bool kBf16Grad, int kOut>
inline void adam_scalar_range(const Buffers& b, const Coeffs& c, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        float p = b.param[i];
        float g = load_grad<kBf16Grad>(b.grad, i) * c.grad_scale;
        if (c.l2) g = std::fma(p, c.weight_decay, g);
        if (c.decoupled) p = p * c.decay;
        float m = b.exp_avg[i];
        m = std::fma(c.lerp_coeff, g - m, c.lerp_from_m ? m : g);
        float v = b.exp_avg_sq[i] * c.beta2;
        v = std::fma(c.one_minus_beta2 * g, g, v);
        const float d = std::sqrt(v) / c.bc2_sqrt + c.eps;
        p = p - (c.step_size * m) / d;
        b.param[i] = p;
        b.exp_avg[i] = m;
        b.exp_avg_sq[i] = v;
        store_out<kOut>(b.out, i, p);
    }
}

// ---------------------------------------------------------------------------
// AVX-512 (F, BW, VL): 16 lanes, masked tail
// ---------------------------------------------------------------------------

#define ZK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c")))

template <bool kBf16Grad>
ZK_AVX512 inline __m512 avx512_load_grad(const void* grad, int64_t i, __mmask16 mask) {
    if constexpr (kBf16Grad) {
        __m256i h = mask == 0xFFFF
                        ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i))
                        : _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
        const float* src = static_cast<const float*>(grad) + i;
        return mask == 0xFFFF ? _mm512_loadu_ps(src) : _mm512_maskz_loadu_ps(mask, src);
    }
}

ZK_AVX512 inline __m256i avx512_to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
}

template <int kOut, bool kFull>
ZK_AVX512 inline void avx512_store_out(void* out, int64_t i, __m512 p, __mmask16 mask) {
    if constexpr (kOut == static_cast<int>(OutDtype::NONE)) return;
    __m256i h;
    if constexpr (kOut == static_cast<int>(OutDtype::BF16)) h = avx512_to_bf16(p);
    else h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    uint16_t* dst = static_cast<uint16_t*>(out) + i;
    if constexpr (kFull) {
        // The copy-out is write-only: a streaming store skips reading its lines first.
        if ((reinterpret_cast<uintptr_t>(dst) & 31) == 0) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), h);
        else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), h);
    } else {
        _mm256_mask_storeu_epi16(dst, mask, h);
    }
}

template <bool kBf16Grad, int kOut, bool kFull>
ZK_AVX512 inline void adam_avx512_block(const Buffers& b, const Coeffs& c, int64_t i, __mmask16 mask) {
    // kFull: plain loads/stores (masked stores are slow on some cores); else masked (the tail).
    const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
    __m512 p = kFull ? _mm512_loadu_ps(b.param + i) : _mm512_maskz_loadu_ps(mask, b.param + i);
    __m512 g = _mm512_mul_ps(avx512_load_grad<kBf16Grad>(b.grad, i, mask), grad_scale);
    if (c.l2) g = _mm512_fmadd_ps(p, _mm512_set1_ps(c.weight_decay), g);
    if (c.decoupled) p = _mm512_mul_ps(p, _mm512_set1_ps(c.decay));
    __m512 m = kFull ? _mm512_loadu_ps(b.exp_avg + i) : _mm512_maskz_loadu_ps(mask, b.exp_avg + i);
    m = _mm512_fmadd_ps(_mm512_set1_ps(c.lerp_coeff), _mm512_sub_ps(g, m), c.lerp_from_m ? m : g);
    __m512 v = kFull ? _mm512_loadu_ps(b.exp_avg_sq + i) : _mm512_maskz_loadu_ps(mask, b.exp_avg_sq + i);
    v = _mm512_mul_ps(v, _mm512_set1_ps(c.beta2));
    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), g), g, v);
    const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), _mm512_set1_ps(c.bc2_sqrt)),
                                   _mm512_set1_ps(c.eps));
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.step_size), m), d));
    if constexpr (kFull) {
        _mm512_storeu_ps(b.param + i, p);
        _mm512_storeu_ps(b.exp_avg + i, m);
        _mm512_storeu_ps(b.exp_avg_sq + i, v);
    } else {
        _mm512_mask_storeu_ps(b.param + i, mask, p);
        _mm512_mask_storeu_ps(b.exp_avg + i, mask, m);
        _mm512_mask_storeu_ps(b.exp_avg_sq + i, mask, v);
    }
    avx512_store_out<kOut, kFull>(b.out, i, p, mask);
}

template <bool kBf16Grad, int kOut>
ZK_AVX512 void adam_avx512_range(const Buffers& b, const Coeffs& c, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 16 <= end; i += 16) adam_avx512_block<kBf16Grad, kOut, true>(b, c, i, 0xFFFF);
    if (i < end)
        adam_avx512_block<kBf16Grad, kOut, false>(b, c, i, static_cast<__mmask16>((1u << (end - i)) - 1u));
    if constexpr (kOut != static_cast<int>(OutDtype::NONE)) _mm_sfence();
}

template <int kOut>
ZK_AVX512 void convert_avx512_range(const float* src, void* dst, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += 16) {
        const int64_t left = end - i;
        const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << left) - 1u);
        if (left >= 16) avx512_store_out<kOut, true>(dst, i, _mm512_loadu_ps(src + i), mask);
        else avx512_store_out<kOut, false>(dst, i, _mm512_maskz_loadu_ps(mask, src + i), mask);
    }
    _mm_sfence();
}

// ---------------------------------------------------------------------------
// AVX2 (+FMA, F16C): 8 lanes, scalar tail
// ---------------------------------------------------------------------------

#define ZK_AVX2 __attribute__((target("avx2,fma,f16c")))

template <bool kBf16Grad>
ZK_AVX2 inline __m256 avx2_load_grad(const void* grad, int64_t i) {
    if constexpr (kBf16Grad) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
    }
}

ZK_AVX2 inline __m128i avx2_to_bf16(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    r = _mm256_srli_epi32(r, 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <int kOut>
ZK_AVX2 inline void avx2_store_out(void* out, int64_t i, __m256 p) {
    if constexpr (kOut == static_cast<int>(OutDtype::NONE)) return;
    __m128i h;
    if constexpr (kOut == static_cast<int>(OutDtype::BF16)) h = avx2_to_bf16(p);
    else h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
    if ((reinterpret_cast<uintptr_t>(dst) & 15) == 0) _mm_stream_si128(dst, h);  // write-only stream
    else _mm_storeu_si128(dst, h);
}

template <bool kBf16Grad, int kOut>
ZK_AVX2 void adam_avx2_range(const Buffers& b, const Coeffs& c, int64_t begin, int64_t end) {
    const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
    const __m256 wd = _mm256_set1_ps(c.weight_decay);
    const __m256 decay = _mm256_set1_ps(c.decay);
    const __m256 lerp_coeff = _mm256_set1_ps(c.lerp_coeff);
    const __m256 beta2 = _mm256_set1_ps(c.beta2);
    const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
    const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
    const __m256 eps = _mm256_set1_ps(c.eps);
    const __m256 step_size = _mm256_set1_ps(c.step_size);
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) {
        __m256 p = _mm256_loadu_ps(b.param + i);
        __m256 g = _mm256_mul_ps(avx2_load_grad<kBf16Grad>(b.grad, i), grad_scale);
        if (c.l2) g = _mm256_fmadd_ps(p, wd, g);
        if (c.decoupled) p = _mm256_mul_ps(p, decay);
        __m256 m = _mm256_loadu_ps(b.exp_avg + i);
        m = _mm256_fmadd_ps(lerp_coeff, _mm256_sub_ps(g, m), c.lerp_from_m ? m : g);
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(b.exp_avg_sq + i), beta2);
        v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, v);
        const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
        p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m), d));
        _mm256_storeu_ps(b.param + i, p);
        _mm256_storeu_ps(b.exp_avg + i, m);
        _mm256_storeu_ps(b.exp_avg_sq + i, v);
        avx2_store_out<kOut>(b.out, i, p);
    }
    adam_scalar_range<kBf16Grad, kOut>(b, c, i, end);
    if constexpr (kOut != static_cast<int>(OutDtype::NONE)) _mm_sfence();
}

template <int kOut>
ZK_AVX2 void convert_avx2_range(const float* src, void* dst, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) avx2_store_out<kOut>(dst, i, _mm256_loadu_ps(src + i));
    for (; i < end; ++i) store_out<kOut>(dst, i, src[i]);
    _mm_sfence();
}

// ---------------------------------------------------------------------------
// Rollback: adam_step run backwards (cpu_adam.h)
// ---------------------------------------------------------------------------
//
// [Note: rollback error]
// The rollback recomputes d and the update q = step_size * m / d bit for bit
// (same v, same m, same fp32 operations), so what it cannot give back is only
// what the step's own roundings threw away:
//   p: p_new = round(p_old * decay - q); adding q back and multiplying by
//      1 / decay leaves |error| <= about 2 ulp of max(|p_old|, |p_new|).
//   m: m_new = beta1 * m_old + w * g rounded once or twice; (m_new - w * g) /
//      beta1 recovers m_old to about 2 ulp of max(|m_old|, |m_new|, |w g|) / beta1.
//      Where |w g| >> |m_old| (the first step, a gradient spike) that is many
//      ulps of m_old itself: the bits were never stored.
//   v: likewise to about 2 ulp of max(v_old, v_new) / beta2, clamped at 0
//      (v_new - (1 - beta2) g^2 can round below 0 when v_old is ~0).
// The redo that follows a rollback adds beta1 * m_old and beta2 * v_old back,
// so these errors land in the redone state at the ulp level of the undone
// step's values: a redo with a smaller grad_scale (clipping) matches a direct
// step to ~1e-7 of max|p| after a realistic history, ~2e-7 after a gradient
// 100x its history's scale, ~2e-5 after one 1000x (tests/test_adam_rollback.py).
//
// State that started from zeros (the first step; rows of an embedding no step
// has touched) is the worst case of the above, since any residue is infinitely
// larger than the true 0, and a redo with a small clip coefficient magnifies
// it. Such a step left m == round((1 - beta1) g) and v == round((1 - beta2) g * g)
// exactly, so where the rollback finds exactly that it restores 0 (any true
// value was then below an ulp of the step's own term, the bound above). With
// AdamW this makes rollback + redo of a fresh state match the direct step to
// ~1e-7; with Adam's L2 term the gradient depends on the restored p, which can
// be an ulp off, and elements where grad * scale and weight_decay * p cancel
// keep errors up to ~5e-3 of max|p| after a 1000x smaller redo.
//
// The three constant divisions (by decay, beta1, beta2) are multiplications
// by reciprocals rounded once from double: at most half an ulp more error than
// dividing, and the rollback keeps pace with memory (dividing made it 1.2-1.3x
// the time of a step on one AVX2 core; see bench/adam_rollback.py).
//
// One source for every ISA: the loop is branch-free (the decay mode and the
// grad dtype are template parameters), and compiled under each path's target
// attribute GCC vectorises it with that path's width. IEEE operations without
// contraction (-ffp-contract=off) round the same at every width, so all paths
// are bit-identical, as adam_step's are.

enum class DecayMode : int { NONE = 0, L2 = 1, DECOUPLED = 2 };

struct RollbackCoeffs {
    float grad_scale;
    float weight_decay;
    float one_minus_beta1;   // w, the weight the step's lerp gave g
    float one_minus_beta2;
    float bc2_sqrt;
    float eps;
    float step_size;
    // Reciprocals of the step's factors, rounded once from double.
    float inv_decay;         // 1 / (1 - lr * wd), the step's AdamW factor
    float inv_beta1;         // 1 / (1 - w), the weight the step gave m
    float inv_beta2;
    bool beta1_zero;         // the factors themselves are 0: nothing to invert
    bool beta2_zero;
    bool decay_zero;
};

RollbackCoeffs make_rollback_coeffs(const Coeffs& c, const AdamHyper& h) {
    RollbackCoeffs r{};
    r.grad_scale = c.grad_scale;
    r.weight_decay = c.weight_decay;
    r.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
    r.one_minus_beta2 = c.one_minus_beta2;
    r.bc2_sqrt = c.bc2_sqrt;
    r.eps = c.eps;
    r.step_size = c.step_size;
    const float beta1 = static_cast<float>(1.0 - static_cast<double>(r.one_minus_beta1));
    r.beta1_zero = beta1 == 0.0f;
    r.beta2_zero = c.beta2 == 0.0f;
    r.decay_zero = c.decay == 0.0f;
    r.inv_beta1 = static_cast<float>(1.0 / beta1);
    r.inv_beta2 = static_cast<float>(1.0 / c.beta2);
    r.inv_decay = static_cast<float>(1.0 / c.decay);
    return r;
}

template <bool kBf16Grad, int kDecay>
__attribute__((always_inline)) inline void rollback_loop(const Buffers& b, const RollbackCoeffs& r,
                                                         int64_t begin, int64_t end) {
    float* __restrict param = b.param;
    float* __restrict exp_avg = b.exp_avg;
    float* __restrict exp_avg_sq = b.exp_avg_sq;
    const void* grad = b.grad;
    const float grad_scale = r.grad_scale, weight_decay = r.weight_decay, inv_decay = r.inv_decay;
    const float one_minus_beta1 = r.one_minus_beta1, inv_beta1 = r.inv_beta1;
    const float one_minus_beta2 = r.one_minus_beta2, inv_beta2 = r.inv_beta2;
    const float bc2_sqrt = r.bc2_sqrt, eps = r.eps, step_size = r.step_size;
    for (int64_t i = begin; i < end; ++i) {
        const float m = exp_avg[i];
        const float v = exp_avg_sq[i];
        const float d = std::sqrt(v) / bc2_sqrt + eps;
        float p = param[i] + (step_size * m) / d;
        if constexpr (kDecay == static_cast<int>(DecayMode::DECOUPLED)) p = p * inv_decay;
        float g = load_grad<kBf16Grad>(grad, i) * grad_scale;
        if constexpr (kDecay == static_cast<int>(DecayMode::L2)) g = std::fma(p, weight_decay, g);
        // The step's own rounded gradient terms: equal to m and v exactly when it
        // started from zeros ([Note: rollback error]).
        const float wg = one_minus_beta1 * g;
        const float tg = one_minus_beta2 * g;
        const float m_old = (m == wg ? 0.0f : std::fma(-one_minus_beta1, g, m)) * inv_beta1;
        const float v_old = (v == tg * g ? 0.0f : std::fma(-tg, g, v)) * inv_beta2;
        param[i] = p;
        exp_avg[i] = m_old;
        exp_avg_sq[i] = v_old < 0.0f ? 0.0f : v_old;  // NaN stays NaN
    }
}

template <bool kBf16Grad, int kDecay>
void rollback_scalar_range(const Buffers& b, const RollbackCoeffs& r, int64_t begin, int64_t end) {
    rollback_loop<kBf16Grad, kDecay>(b, r, begin, end);
}

template <bool kBf16Grad, int kDecay>
ZK_AVX2 void rollback_avx2_range(const Buffers& b, const RollbackCoeffs& r, int64_t begin, int64_t end) {
    rollback_loop<kBf16Grad, kDecay>(b, r, begin, end);
}

template <bool kBf16Grad, int kDecay>
__attribute__((target("avx512f,avx512bw,avx512vl,fma,f16c,prefer-vector-width=512")))
void rollback_avx512_range(const Buffers& b, const RollbackCoeffs& r, int64_t begin, int64_t end) {
    rollback_loop<kBf16Grad, kDecay>(b, r, begin, end);
}

// ---------------------------------------------------------------------------
// Dispatch
// ---------------------------------------------------------------------------

enum class Path : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

Path detect_best() {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma"))
        return Path::AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return Path::AVX2;
    return Path::SCALAR;
}

const Path g_best = detect_best();
std::atomic<int> g_path{static_cast<int>(g_best)};

using AdamRange = void (*)(const Buffers&, const Coeffs&, int64_t, int64_t);

template <bool kBf16Grad, int kOut>
AdamRange pick_adam(Path path) {
    switch (path) {
        case Path::AVX512: return adam_avx512_range<kBf16Grad, kOut>;
        case Path::AVX2: return adam_avx2_range<kBf16Grad, kOut>;
        default: return adam_scalar_range<kBf16Grad, kOut>;
    }
}

template <bool kBf16Grad>
AdamRange pick_adam(Path path, OutDtype out) {
    switch (out) {
        case OutDtype::BF16: return pick_adam<kBf16Grad, static_cast<int>(OutDtype::BF16)>(path);
        case OutDtype::F16: return pick_adam<kBf16Grad, static_cast<int>(OutDtype::F16)>(path);
        default: return pick_adam<kBf16Grad, static_cast<int>(OutDtype::NONE)>(path);
    }
}

using RollbackRange = void (*)(const Buffers&, const RollbackCoeffs&, int64_t, int64_t);

template <bool kBf16Grad, int kDecay>
RollbackRange pick_rollback(Path path) {
    switch (path) {
        case Path::AVX512: return rollback_avx512_range<kBf16Grad, kDecay>;
        case Path::AVX2: return rollback_avx2_range<kBf16Grad, kDecay>;
        default: return rollback_scalar_range<kBf16Grad, kDecay>;
    }
}

template <bool kBf16Grad>
RollbackRange pick_rollback(Path path, DecayMode mode) {
    switch (mode) {
        case DecayMode::L2: return pick_rollback<kBf16Grad, static_cast<int>(DecayMode::L2)>(path);
        case DecayMode::DECOUPLED: return pick_rollback<kBf16Grad, static_cast<int>(DecayMode::DECOUPLED)>(path);
        default: return pick_rollback<kBf16Grad, static_cast<int>(DecayMode::NONE)>(path);
    }
}

template <int kOut>
void convert_scalar_range(const float* src, void* dst, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) store_out<kOut>(dst, i, src[i]);
}

using ConvertRange = void (*)(const float*, void*, int64_t, int64_t);

template <int kOut>
ConvertRange pick_convert(Path path) {
    switch (path) {
        case Path::AVX512: return convert_avx512_range<kOut>;
        case Path::AVX2: return convert_avx2_range<kOut>;
        default: return convert_scalar_range<kOut>;
    }
}

const char* path_name(Path p) {
    switch (p) {
        case Path::AVX512: return "avx512";
        case Path::AVX2: return "avx2";
        default: return "scalar";
    }
}

}  // namespace

void adam_step(float* param, const void* grad, GradDtype grad_dtype, float* exp_avg,
               float* exp_avg_sq, void* out, OutDtype out_dtype, int64_t n,
               const AdamHyper& hyper, int threads) {
    if (n <= 0) return;
    if (hyper.step < 1) throw std::invalid_argument("adam_step: step must be >= 1");
    if (out_dtype != OutDtype::NONE && out == nullptr)
        throw std::invalid_argument("adam_step: copy-out dtype given without a buffer");
    const Coeffs coeffs = make_coeffs(hyper);
    const Buffers buffers{param, grad, exp_avg, exp_avg_sq, out};
    const Path path = static_cast<Path>(g_path.load());
    const AdamRange range = grad_dtype == GradDtype::BF16 ? pick_adam<true>(path, out_dtype)
                                                          : pick_adam<false>(path, out_dtype);
    parallel_chunks(n, kChunk, threads, [&](int64_t begin, int64_t end) { range(buffers, coeffs, begin, end); });
}

void adam_rollback(float* param, const void* grad, GradDtype grad_dtype, float* exp_avg, float* exp_avg_sq,
                   int64_t n, const AdamHyper& hyper, int threads) {
    if (hyper.step < 1) throw std::invalid_argument("adam_rollback: step must be >= 1");
    const Coeffs coeffs = make_coeffs(hyper);
    const RollbackCoeffs r = make_rollback_coeffs(coeffs, hyper);
    if (r.beta1_zero)
        throw std::invalid_argument("adam_rollback: beta1 is 0 (in fp32), so the step overwrote exp_avg with the "
                                    "gradient and the old value cannot be recovered");
    if (r.beta2_zero)
        throw std::invalid_argument("adam_rollback: beta2 is 0 (in fp32), so the step overwrote exp_avg_sq with the "
                                    "squared gradient and the old value cannot be recovered");
    if (coeffs.decoupled && r.decay_zero)
        throw std::invalid_argument("adam_rollback: 1 - lr * weight_decay is 0 (in fp32), so the step's decoupled "
                                    "weight decay zeroed the parameters and they cannot be recovered");
    if (n <= 0) return;
    const DecayMode mode = coeffs.l2 ? DecayMode::L2 : coeffs.decoupled ? DecayMode::DECOUPLED : DecayMode::NONE;
    const Buffers buffers{param, grad, exp_avg, exp_avg_sq, nullptr};
    const Path path = static_cast<Path>(g_path.load());
    const RollbackRange range = grad_dtype == GradDtype::BF16 ? pick_rollback<true>(path, mode)
                                                              : pick_rollback<false>(path, mode);
    parallel_chunks(n, kChunk, threads, [&](int64_t begin, int64_t end) { range(buffers, r, begin, end); });
}

void convert_f32(const float* src, void* dst, OutDtype dst_dtype, int64_t n, int threads) {
    if (n <= 0 || dst_dtype == OutDtype::NONE) return;
    const Path path = static_cast<Path>(g_path.load());
    const ConvertRange range = dst_dtype == OutDtype::BF16
                                   ? pick_convert<static_cast<int>(OutDtype::BF16)>(path)
                                   : pick_convert<static_cast<int>(OutDtype::F16)>(path);
    parallel_chunks(n, kChunk, threads, [&](int64_t begin, int64_t end) { range(src, dst, begin, end); });
}

std::string simd_path() { return path_name(static_cast<Path>(g_path.load())); }

std::string best_simd_path() { return path_name(g_best); }

void set_simd_path(const std::string& name) {
    Path want;
    if (name == "auto") want = g_best;
    else if (name == "avx512") want = Path::AVX512;
    else if (name == "avx2") want = Path::AVX2;
    else if (name == "scalar") want = Path::SCALAR;
    else throw std::invalid_argument("unknown SIMD path '" + name + "'; valid: auto, avx512, avx2, scalar");
    if (static_cast<int>(want) > static_cast<int>(g_best))
        throw std::invalid_argument("this CPU does not support the '" + name + "' path (best: " +
                                    path_name(g_best) + ")");
    g_path.store(static_cast<int>(want));
}

}  // namespace zk
