// GraceAdam, Arm NEON path: 4 floats per vector, the operations of step_one / rollback_one lane
// by lane (vfmaq_f32 exactly where they use std::fma; vsqrtq_f32 and vdivq_f32 are correctly
// rounded), the tail with those same inline functions. NEON is part of every aarch64 CPU; on
// other architectures this file compiles to nothing.
#if defined(__aarch64__)

#include <arm_neon.h>

#include "grace_adam.h"

namespace grace_adam {
namespace {

constexpr int64_t kWidth = 4;

struct Vcoeffs {
  float32x4_t beta1, beta2, one_minus_beta1, one_minus_beta2;
  float32x4_t step_size, neg_step_size, inv_sqrt_bc2, eps, decay, l2, grad_scale;

  explicit Vcoeffs(const Coeffs& c)
      : beta1(vdupq_n_f32(c.beta1)),
        beta2(vdupq_n_f32(c.beta2)),
        one_minus_beta1(vdupq_n_f32(c.one_minus_beta1)),
        one_minus_beta2(vdupq_n_f32(c.one_minus_beta2)),
        step_size(vdupq_n_f32(c.step_size)),
        neg_step_size(vdupq_n_f32(-c.step_size)),
        inv_sqrt_bc2(vdupq_n_f32(c.inv_sqrt_bc2)),
        eps(vdupq_n_f32(c.eps)),
        decay(vdupq_n_f32(c.decay)),
        l2(vdupq_n_f32(c.l2)),
        grad_scale(vdupq_n_f32(c.grad_scale)) {}
};

// std::fma(a, b, c) == vfmaq_f32(c, a, b): one rounding of a*b + c.
inline float32x4_t fma4(float32x4_t a, float32x4_t b, float32x4_t c) { return vfmaq_f32(c, a, b); }

template <GradDtype GD>
float32x4_t load_grad_vec(const void* g, int64_t i) {
  if constexpr (GD == GradDtype::F32) {
    return vld1q_f32(static_cast<const float*>(g) + i);
  } else {
    const uint16x4_t h = vld1_u16(static_cast<const uint16_t*>(g) + i);
    // fp16: exact (FPCR.FZ16 is off by default); a NaN is quieted, as f16_to_f32.
    if constexpr (GD == GradDtype::F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));  // bf16 bits are the high half of an f32
  }
}

// f32_to_bf16_rne in integer arithmetic: bits + 0x7fff + lsb, keep the high half; NaN -> 0x7fc0.
uint16x4_t f32_to_bf16_rne_vec(float32x4_t p) {
  const uint32x4_t bits = vreinterpretq_u32_f32(p);
  const uint32x4_t is_nan = vcgtq_u32(vandq_u32(bits, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u));
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1u));
  const uint32x4_t rounded = vaddq_u32(bits, vaddq_u32(lsb, vdupq_n_u32(0x7fffu)));
  return vbsl_u16(vmovn_u32(is_nan), vdup_n_u16(0x7fc0u), vshrn_n_u32(rounded, 16));
}

// Hardware round-to-nearest-even (the default FPCR mode; no flush to zero); a NaN becomes
// sign | 0x7e00 as in f32_to_f16_rne (the hardware would keep the top payload bits).
uint16x4_t f32_to_f16_rne_vec(float32x4_t p) {
  const uint16x4_t h = vreinterpret_u16_f16(vcvt_f16_f32(p));
  const uint16x4_t is_nan = vmovn_u32(vmvnq_u32(vceqq_f32(p, p)));
  const uint16x4_t quiet_nan = vorr_u16(vand_u16(h, vdup_n_u16(0x8000u)), vdup_n_u16(0x7e00u));
  return vbsl_u16(is_nan, quiet_nan, h);
}

template <LowpDtype LD>
void store_lowp_vec(void* out, int64_t i, float32x4_t p) {
  if constexpr (LD != LowpDtype::NONE) {
    const uint16x4_t h = LD == LowpDtype::BF16 ? f32_to_bf16_rne_vec(p) : f32_to_f16_rne_vec(p);
    vst1_u16(static_cast<uint16_t*>(out) + i, h);
  }
}

template <GradDtype GD, LowpDtype LD, bool L2>
void step_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n, const Coeffs& c) {
  const Vcoeffs k(c);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    float32x4_t pv = vld1q_f32(p + i);
    float32x4_t gv = vmulq_f32(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = fma4(k.l2, pv, gv);
    const float32x4_t mv = fma4(k.beta1, vld1q_f32(m + i), vmulq_f32(k.one_minus_beta1, gv));
    const float32x4_t g2 = vmulq_f32(vmulq_f32(k.one_minus_beta2, gv), gv);
    const float32x4_t vv = fma4(k.beta2, vld1q_f32(v + i), g2);
    const float32x4_t denom = fma4(vsqrtq_f32(vv), k.inv_sqrt_bc2, k.eps);
    const float32x4_t upd = vdivq_f32(mv, denom);
    pv = fma4(k.neg_step_size, upd, vmulq_f32(pv, k.decay));
    vst1q_f32(p + i, pv);
    vst1q_f32(m + i, mv);
    vst1q_f32(v + i, vv);
    store_lowp_vec<LD>(lowp, i, pv);
  }
  for (; i < n; ++i) {
    step_one(p[i], m[i], v[i], load_grad(g, GD, i), c);
    store_lowp(lowp, LD, i, p[i]);
  }
}

template <GradDtype GD, LowpDtype LD, bool L2>
void rollback_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n,
                   const Coeffs& c) {
  const Vcoeffs k(c);
  const float32x4_t zero = vdupq_n_f32(0.0f);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const float32x4_t mv = vld1q_f32(m + i);
    const float32x4_t vv = vld1q_f32(v + i);
    const float32x4_t denom = fma4(vsqrtq_f32(vv), k.inv_sqrt_bc2, k.eps);
    float32x4_t pv = fma4(k.step_size, vdivq_f32(mv, denom), vld1q_f32(p + i));
    pv = vdivq_f32(pv, k.decay);
    float32x4_t gv = vmulq_f32(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = fma4(k.l2, pv, gv);
    const float32x4_t m_prev = vdivq_f32(vsubq_f32(mv, vmulq_f32(k.one_minus_beta1, gv)), k.beta1);  // as rollback_one
    const float32x4_t g2 = vmulq_f32(vmulq_f32(k.one_minus_beta2, gv), gv);
    const float32x4_t v_prev = vdivq_f32(vsubq_f32(vv, g2), k.beta2);
    // `v_prev > 0 ? v_prev : 0` as in rollback_one: a NaN or -0 compares false and becomes +0
    // (vmaxq_f32 would propagate the NaN).
    vst1q_f32(v + i, vbslq_f32(vcgtq_f32(v_prev, zero), v_prev, zero));
    vst1q_f32(m + i, m_prev);
    vst1q_f32(p + i, pv);
    store_lowp_vec<LD>(lowp, i, pv);
  }
  for (; i < n; ++i) {
    rollback_one(p[i], m[i], v[i], load_grad(g, GD, i), c);
    store_lowp(lowp, LD, i, p[i]);
  }
}

template <GradDtype SD, bool ACCUMULATE>
void grad_loop(float* dst, const void* src, int64_t n) {
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    float32x4_t x = load_grad_vec<SD>(src, i);
    if constexpr (ACCUMULATE) x = vaddq_f32(vld1q_f32(dst + i), x);  // dst + x, as grad_accumulate_one
    vst1q_f32(dst + i, x);
  }
  for (; i < n; ++i) {
    if constexpr (ACCUMULATE) grad_accumulate_one(dst[i], load_grad(src, SD, i));
    else grad_copy_one(dst[i], load_grad(src, SD, i));
  }
}

// x*x + acc in double for two floats; x*x is exact in double, so fma == mul + add.
inline float64x2_t square_add(float64x2_t acc, float64x2_t x) { return vfmaq_f64(acc, x, x); }

// One block in the order documented at kSumSquaresLanes: accumulator j is lane j % 2 of acc[j / 2].
template <GradDtype GD>
double sum_squares_block(const void* g, int64_t n) {
  static_assert(kSumSquaresLanes == 4 * kWidth, "four vectors of floats per accumulator set");
  float64x2_t acc[8];
  for (float64x2_t& a : acc) a = vdupq_n_f64(0.0);
  const int64_t n_lanes = n - n % kSumSquaresLanes;
  for (int64_t i = 0; i < n_lanes; i += kSumSquaresLanes) {
    for (int q = 0; q < 4; ++q) {
      const float32x4_t x = load_grad_vec<GD>(g, i + q * kWidth);
      acc[2 * q] = square_add(acc[2 * q], vcvt_f64_f32(vget_low_f32(x)));
      acc[2 * q + 1] = square_add(acc[2 * q + 1], vcvt_high_f64_f32(x));
    }
  }
  for (int j = 0; j < 4; ++j) acc[j] = vaddq_f64(acc[j], acc[j + 4]);  // a[j] += a[j+8]
  for (int j = 0; j < 2; ++j) acc[j] = vaddq_f64(acc[j], acc[j + 2]);  // a[j] += a[j+4]
  acc[0] = vaddq_f64(acc[0], acc[1]);                                  // a[j] += a[j+2]
  const double s1 = vgetq_lane_f64(acc[0], 0) + vgetq_lane_f64(acc[0], 1);
  return sum_squares_tail(g, GD, n_lanes, n, s1);
}

}  // namespace

void step_neon(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
               LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {
    step_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c);
  });
}

void rollback_neon(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
                   LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {
    rollback_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c);
  });
}

double sum_squares_neon(const void* g, GradDtype gd, int64_t n) {
  double sum = 0.0;
  for (int64_t begin = 0; begin < n; begin += kSumSquaresBlock) {
    const int64_t len = n - begin < kSumSquaresBlock ? n - begin : kSumSquaresBlock;
    const void* block = grad_offset(g, gd, begin);
    sum += with_grad_dtype(gd, [&](auto gt) { return sum_squares_block<decltype(gt)::value>(block, len); });
  }
  return sum;
}

void grad_copy_neon(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, false>(dst, src, n); });
}

void grad_accumulate_neon(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, true>(dst, src, n); });
}

}  // namespace grace_adam

#endif  // defined(__aarch64__)
