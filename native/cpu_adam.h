// CPU Adam / AdamW over raw fp32 buffers: one fused, SIMD, multi-threaded pass.
//
// Per element, in the order torch.optim.Adam/AdamW (foreach=False) applies it,
// with every hyperparameter rounded to fp32 the way torch rounds a Python scalar:
//
//   g  = grad * grad_scale                       (grad fp32, or bf16 widened exactly)
//   g  = fma(param, weight_decay, g)             Adam (L2) only
//   p  = param * (1 - lr * weight_decay)         AdamW (decoupled) only
//   m  = fma(c, g - m, base)                     torch's lerp(m, g, 1 - beta1)
//   v  = fma((1 - beta2) * g, g, v * beta2)      torch's mul_ then addcmul_
//   d  = sqrt(v) / sqrt(1 - beta2^step) + eps
//   p  = p - (lr / (1 - beta1^step) * m) / d
//   copy_out = round_to_nearest_even(p)          bf16 or fp16, optional
//
// The AVX-512, AVX2 and scalar paths compute bit-identical results; the path is
// chosen once from the CPU's flags (never an illegal instruction on an older
// CPU). Work is split into cache-friendly chunks handed to a persistent thread
// pool (thread_pool.h).
#pragma once

#include <cstdint>
#include <string>

namespace zk {

enum class GradDtype : int { F32 = 0, BF16 = 1 };
enum class OutDtype : int { NONE = 0, BF16 = 1, F16 = 2 };

struct AdamHyper {
    double lr = 1e-3;
    double beta1 = 0.9;
    double beta2 = 0.999;
    double eps = 1e-8;
    double weight_decay = 0.0;
    double grad_scale = 1.0;
    int64_t step = 1;          // 1-based step count after this update
    bool adamw = true;         // decoupled weight decay (AdamW) or L2 (Adam)
};

// Update `param`, `exp_avg`, `exp_avg_sq` (n fp32 each) in place from `grad`
// (n elements of grad_dtype); when out_dtype != NONE also write the updated
// params rounded to nearest-even into `out` (n 16-bit elements).
// threads <= 0 uses the pool's default.
void adam_step(float* param, const void* grad, GradDtype grad_dtype, float* exp_avg,
               float* exp_avg_sq, void* out, OutDtype out_dtype, int64_t n,
               const AdamHyper& hyper, int threads);

// Undo one adam_step in place: given the `param`, `exp_avg`, `exp_avg_sq` that
// adam_step left, the same `grad` buffer and the same hyperparameters (`step`
// is the count of the step being undone), restore the values from before it,
// to within a few ulps (see cpu_adam.cpp, [Note: rollback error]). The forward
// math run backwards, per element:
//
//   d  = sqrt(v) / sqrt(1 - beta2^step) + eps      (bit-identical to the step's)
//   p  = p + (lr / (1 - beta1^step) * m) / d
//   p  = p / (1 - lr * weight_decay)               AdamW only
//   g  = grad * grad_scale (+ weight_decay * p)    the L2 term from the restored p
//   m  = (m - (1 - beta1) * g) / beta1
//   v  = max(0, (v - (1 - beta2) * g * g) / beta2)
//
// except that m and v are restored to exact zeros where the step left exactly
// its own rounded gradient term, i.e. where it started from zeros.
//
// Throws std::invalid_argument when the step cannot be undone: beta1 or beta2
// is 0 (in fp32), or AdamW's 1 - lr * weight_decay is 0. A step whose inputs
// were not finite left NaN/inf that no rollback recovers.
void adam_rollback(float* param, const void* grad, GradDtype grad_dtype, float* exp_avg, float* exp_avg_sq,
                   int64_t n, const AdamHyper& hyper, int threads);

// Round n fp32 values to bf16 / fp16 (round to nearest even), multi-threaded.
void convert_f32(const float* src, void* dst, OutDtype dst_dtype, int64_t n, int threads);

// "avx512", "avx2" or "scalar": the path adam_step uses now.
std::string simd_path();
// The best path this CPU supports.
std::string best_simd_path();
// Force a path ("auto" restores the best); throws std::invalid_argument if the
// CPU lacks it.
void set_simd_path(const std::string& name);

}  // namespace zk
