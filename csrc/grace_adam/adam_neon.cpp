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

// ---- the compact step: one group of kCompactGroup elements at a time, 8 lanes (2 vectors) per
// unit so that the 8-bit buffers load and store 8 bytes at once. The operations of compact_group
// (adam_scalar.cpp) lane by lane; the narrowing moves saturate (the clamps).

GRACE_ADAM_INLINE uint32x4_t f32_to_bf16_bits_vec(float32x4_t p) {  // f32_to_bf16_rne_vec before narrowing
  const uint32x4_t bits = vreinterpretq_u32_f32(p);
  const uint32x4_t is_nan = vcgtq_u32(vandq_u32(bits, vdupq_n_u32(0x7fffffffu)), vdupq_n_u32(0x7f800000u));
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1u));
  const uint32x4_t rounded = vshrq_n_u32(vaddq_u32(bits, vaddq_u32(lsb, vdupq_n_u32(0x7fffu))), 16);
  return vbslq_u32(is_nan, vdupq_n_u32(0x7fc0u), rounded);
}

// master_decode_one lane by lane: (hi << 16) + (err << (15 - b)), integer only.
GRACE_ADAM_INLINE float32x4_t master_decode_vec(uint32x4_t hb, int32x4_t e, int b) {
  const int32x4_t delta = vshlq_s32(e, vdupq_n_s32(master_err_shift(b)));
  return vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_u32(vshlq_n_u32(hb, 16)), delta));
}

// master_encode_one lane by lane, before the clamp: (hi bits, err as int32).
GRACE_ADAM_INLINE void master_encode_vec(float32x4_t w, int b, uint32x4_t& hb, int32x4_t& e) {
  const int s = master_err_shift(b);
  hb = f32_to_bf16_bits_vec(w);
  const int32x4_t delta = vreinterpretq_s32_u32(vsubq_u32(vreinterpretq_u32_f32(w), vshlq_n_u32(hb, 16)));  // [-32768, 32768]
  int32x4_t q = delta;
  if (s != 0) {  // master_err_round: floor((delta + 2^(s-1) - 1 + parity) / 2^s); vshlq by -s is an arithmetic shift
    const int32x4_t parity = vandq_s32(vshlq_s32(delta, vdupq_n_s32(-s)), vdupq_n_s32(1));
    q = vshlq_s32(vaddq_s32(delta, vaddq_s32(parity, vdupq_n_s32((1 << (s - 1)) - 1))), vdupq_n_s32(-s));
  }
  const uint32x4_t not_finite = vceqq_u32(vandq_u32(hb, vdupq_n_u32(0x7f80u)), vdupq_n_u32(0x7f80u));
  e = vbicq_s32(q, vreinterpretq_s32_u32(not_finite));
}

// sqrt_v_dither_bits lane by lane, as the float u in [0, 1) (grace_adam.h).
GRACE_ADAM_INLINE float32x4_t sqrt_v_dither_vec(float32x4_t mv, float32x4_t sv, int64_t first_lane) {
  const uint32_t lanes[4] = {0, 1, 2, 3};
  const uint32x4_t lane = vaddq_u32(vdupq_n_u32(static_cast<uint32_t>(first_lane)), vld1q_u32(lanes));
  uint32x4_t h = veorq_u32(vreinterpretq_u32_f32(sv), vmulq_n_u32(vreinterpretq_u32_f32(mv), kDitherM));
  h = veorq_u32(h, vmulq_n_u32(lane, kDitherLane));
  h = veorq_u32(h, vshrq_n_u32(h, 16));
  h = vmulq_n_u32(h, kDitherMix1);
  h = veorq_u32(h, vshrq_n_u32(h, 15));
  h = vmulq_n_u32(h, kDitherMix2);
  h = veorq_u32(h, vshrq_n_u32(h, 16));
  return vmulq_n_f32(vcvtq_f32_u32(vshrq_n_u32(h, 8)), 0x1p-24f);
}

template <int B, GradDtype GD, bool L2>
GRACE_ADAM_INLINE void compact_full_group(const CompactBuffers& b, const void* g, const Vcoeffs& k) {
  using Err = std::conditional_t<B == 7, int8_t, int16_t>;
  constexpr int kUnits = kCompactGroup / (2 * kWidth);
  Err* err = static_cast<Err*>(b.err);
  const float m_scale = bf16_to_f32(b.ms[0]), s_scale = bf16_to_f32(b.vs[0]);
  float32x4_t m_new[2 * kUnits], s_new[2 * kUnits];
  uint32x4_t m_amax = vdupq_n_u32(0), s_amax = vdupq_n_u32(0);
  for (int u = 0; u < kUnits; ++u) {
    const int64_t i = u * 2 * kWidth;
    const uint16x8_t hi8 = vld1q_u16(b.hi + i);
    int16x8_t err8;
    if constexpr (B == 7) err8 = vmovl_s8(vld1_s8(err + i));
    else err8 = vld1q_s16(err + i);
    const int16x8_t mq8 = vmovl_s8(vld1_s8(b.mq + i));
    const uint16x8_t vq8 = vmovl_u8(vld1_u8(b.vq + i));
    uint32x4_t hb_out[2];
    int32x4_t e_out[2];
    for (int h = 0; h < 2; ++h) {
      const uint32x4_t hb = h == 0 ? vmovl_u16(vget_low_u16(hi8)) : vmovl_high_u16(hi8);
      const int32x4_t e = h == 0 ? vmovl_s16(vget_low_s16(err8)) : vmovl_high_s16(err8);
      const int32x4_t mq = h == 0 ? vmovl_s16(vget_low_s16(mq8)) : vmovl_high_s16(mq8);
      const uint32x4_t vq = h == 0 ? vmovl_u16(vget_low_u16(vq8)) : vmovl_high_u16(vq8);
      float32x4_t pv = master_decode_vec(hb, e, B);
      const float32x4_t t = vmulq_n_f32(vcvtq_f32_u32(vq), s_scale);
      float32x4_t gv = vmulq_f32(load_grad_vec<GD>(g, i + h * kWidth), k.grad_scale);
      if constexpr (L2) gv = fma4(k.l2, pv, gv);
      const float32x4_t mv = fma4(k.beta1, vmulq_n_f32(vcvtq_f32_s32(mq), m_scale), vmulq_f32(k.one_minus_beta1, gv));
      const float32x4_t g2 = vmulq_f32(vmulq_f32(k.one_minus_beta2, gv), gv);
      const float32x4_t vv = fma4(k.beta2, vmulq_f32(t, t), g2);
      const float32x4_t sv = vsqrtq_f32(vv);
      const float32x4_t denom = fma4(sv, k.inv_sqrt_bc2, k.eps);
      pv = fma4(k.neg_step_size, vdivq_f32(mv, denom), vmulq_f32(pv, k.decay));
      master_encode_vec(pv, B, hb_out[h], e_out[h]);
      m_new[2 * u + h] = mv;
      s_new[2 * u + h] = sv;
      m_amax = vmaxq_u32(m_amax, vandq_u32(vreinterpretq_u32_f32(mv), vdupq_n_u32(0x7fffffffu)));
      s_amax = vmaxq_u32(s_amax, vandq_u32(vreinterpretq_u32_f32(sv), vdupq_n_u32(0x7fffffffu)));
    }
    vst1q_u16(b.hi + i, vcombine_u16(vmovn_u32(hb_out[0]), vmovn_u32(hb_out[1])));
    const int16x8_t e16 = vcombine_s16(vqmovn_s32(e_out[0]), vqmovn_s32(e_out[1]));  // saturating: the clamp
    if constexpr (B == 7) vst1_s8(err + i, vqmovn_s16(e16));
    else vst1q_s16(err + i, e16);
  }
  const GroupScale ms = exp_avg_scale(vmaxvq_u32(m_amax)), ss = exp_avg_sq_scale(vmaxvq_u32(s_amax));
  b.ms[0] = ms.bits;
  b.vs[0] = ss.bits;
  for (int u = 0; u < kUnits; ++u) {
    const int64_t i = u * 2 * kWidth;
    int32x4_t mq[2], vq[2];
    for (int h = 0; h < 2; ++h) {
      const float32x4_t s = s_new[2 * u + h];
      mq[h] = vcvtnq_s32_f32(vmulq_n_f32(m_new[2 * u + h], ms.rcp));
      const float32x4_t z = vaddq_f32(vmulq_n_f32(s, ss.rcp), sqrt_v_dither_vec(m_new[2 * u + h], s, i + h * kWidth));
      const int32x4_t q = vminq_s32(vcvtq_s32_f32(z), vdupq_n_s32(255));  // z >= 0: truncation is floor
      const int32x4_t positive = vreinterpretq_s32_u32(vcgtq_f32(s, vdupq_n_f32(0.0f)));
      vq[h] = vmaxq_s32(q, vandq_s32(positive, vdupq_n_s32(1)));  // a nonzero v never encodes to 0
    }
    // A non-finite group stores zeros (its scale is NaN).
    const int8x8_t m8 = ms.finite ? vqmovn_s16(vcombine_s16(vqmovn_s32(mq[0]), vqmovn_s32(mq[1]))) : vdup_n_s8(0);
    const uint8x8_t v8 = ss.finite ? vqmovn_u16(vcombine_u16(vqmovun_s32(vq[0]), vqmovun_s32(vq[1]))) : vdup_n_u8(0);
    vst1_s8(b.mq + i, m8);
    vst1_u8(b.vq + i, v8);
  }
}

template <int B, GradDtype GD, bool L2>
void compact_step_loop(const CompactBuffers& b, ErrDtype ed, const void* g, int64_t n, const Coeffs& c) {
  const Vcoeffs k(c);
  const int64_t full = n - n % kCompactGroup;
  for (int64_t at = 0; at < full; at += kCompactGroup) {
    compact_full_group<B, GD, L2>(compact_offset(b, ed, at), grad_offset(g, GD, at), k);
  }
  if (full < n) compact_step_scalar(compact_offset(b, ed, full), ed, grad_offset(g, GD, full), GD, n - full, c);
}

}  // namespace

GRACE_ADAM_DEFINE_ISA(neon, sum_squares_block)

}  // namespace grace_adam

#endif  // defined(__aarch64__)
