// GraceAdam, Arm SVE path, vector-length agnostic: svcntw() floats per vector, whatever the
// hardware has (128 bits on Grace, 256 on Graviton3, 512 on A64FX). The operations of step_one /
// rollback_one lane by lane (svmad is one fused multiply-add, used exactly where they use
// std::fma; svsqrt and svdiv are correctly rounded), so results equal the scalar path bitwise.
// The tail is the last iteration of the same loop under a partial predicate (no scalar tail).
// Only this file is compiled with SVE enabled (the pragma below); dispatch.cpp calls it only
// when the CPU reports HWCAP_SVE. On other architectures this file compiles to nothing.
#if defined(__aarch64__)

#include "grace_adam.h"

// The pragma comes after every other header: inline functions of grace_adam.h and of the
// standard library keep the base target, so no out-of-line copy of them carries SVE
// instructions (the linker keeps one arbitrary copy of each, which may run on a CPU without SVE).
#pragma GCC push_options
#pragma GCC target("+sve")
#include <arm_sve.h>

namespace grace_adam {
namespace {

// std::fma(a, b, c) == svmad(a, b, c): one rounding of a*b + c.
inline svfloat32_t fma_vec(svbool_t pg, svfloat32_t a, svfloat32_t b, svfloat32_t c) {
  return svmad_f32_x(pg, a, b, c);
}

template <GradDtype GD>
svfloat32_t load_grad_vec(svbool_t pg, const void* g, int64_t i) {
  if constexpr (GD == GradDtype::F32) {
    return svld1_f32(pg, static_cast<const float*>(g) + i);
  } else {
    const svuint32_t h = svld1uh_u32(pg, static_cast<const uint16_t*>(g) + i);  // zero-extended
    // fp16 in the low half of each 32-bit lane, which is what svcvt_f32_f16 converts: exact
    // (FPCR.FZ16 is off by default); a NaN is quieted, as f16_to_f32.
    if constexpr (GD == GradDtype::F16) return svcvt_f32_f16_x(pg, svreinterpret_f16_u32(h));
    return svreinterpret_f32_u32(svlsl_n_u32_x(pg, h, 16));  // bf16 bits are the high half of an f32
  }
}

// f32_to_bf16_rne in integer arithmetic: bits + 0x7fff + lsb, keep the high half; NaN -> 0x7fc0.
svuint32_t f32_to_bf16_rne_vec(svbool_t pg, svfloat32_t p) {
  const svuint32_t bits = svreinterpret_u32_f32(p);
  const svbool_t is_nan = svcmpgt_n_u32(pg, svand_n_u32_x(pg, bits, 0x7fffffffu), 0x7f800000u);
  const svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, bits, 16), 1u);
  const svuint32_t rounded = svlsr_n_u32_x(pg, svadd_u32_x(pg, bits, svadd_n_u32_x(pg, lsb, 0x7fffu)), 16);
  return svsel_u32(is_nan, svdup_n_u32(0x7fc0u), rounded);
}

// Hardware round-to-nearest-even (the default FPCR mode; no flush to zero). svcvt_f16_f32 puts
// each half in the low 16 bits of its 32-bit lane. A NaN becomes sign | 0x7e00 as in
// f32_to_f16_rne (the hardware would keep the top payload bits).
svuint32_t f32_to_f16_rne_vec(svbool_t pg, svfloat32_t p) {
  const svuint32_t h = svreinterpret_u32_f16(svcvt_f16_f32_x(pg, p));
  const svbool_t is_nan = svcmpuo_f32(pg, p, p);
  const svuint32_t sign = svand_n_u32_x(pg, svlsr_n_u32_x(pg, svreinterpret_u32_f32(p), 16), 0x8000u);
  return svsel_u32(is_nan, svorr_n_u32_x(pg, sign, 0x7e00u), h);
}

template <LowpDtype LD>
void store_lowp_vec(svbool_t pg, void* out, int64_t i, svfloat32_t p) {
  if constexpr (LD != LowpDtype::NONE) {
    const svuint32_t h = LD == LowpDtype::BF16 ? f32_to_bf16_rne_vec(pg, p) : f32_to_f16_rne_vec(pg, p);
    svst1h_u32(pg, static_cast<uint16_t*>(out) + i, h);  // narrowing store: low 16 bits of each lane
  }
}

template <GradDtype GD, LowpDtype LD, bool L2>
void step_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n, const Coeffs& c) {
  const svfloat32_t beta1 = svdup_n_f32(c.beta1), beta2 = svdup_n_f32(c.beta2);
  const svfloat32_t one_minus_beta1 = svdup_n_f32(c.one_minus_beta1);
  const svfloat32_t one_minus_beta2 = svdup_n_f32(c.one_minus_beta2);
  const svfloat32_t neg_step_size = svdup_n_f32(-c.step_size), decay = svdup_n_f32(c.decay);
  const svfloat32_t inv_sqrt_bc2 = svdup_n_f32(c.inv_sqrt_bc2), eps = svdup_n_f32(c.eps);
  const svfloat32_t l2 = svdup_n_f32(c.l2), grad_scale = svdup_n_f32(c.grad_scale);
  for (int64_t i = 0; i < n; i += static_cast<int64_t>(svcntw())) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    svfloat32_t pv = svld1_f32(pg, p + i);
    svfloat32_t gv = svmul_f32_x(pg, load_grad_vec<GD>(pg, g, i), grad_scale);
    if constexpr (L2) gv = fma_vec(pg, l2, pv, gv);
    const svfloat32_t mv = fma_vec(pg, beta1, svld1_f32(pg, m + i), svmul_f32_x(pg, one_minus_beta1, gv));
    const svfloat32_t g2 = svmul_f32_x(pg, svmul_f32_x(pg, one_minus_beta2, gv), gv);
    const svfloat32_t vv = fma_vec(pg, beta2, svld1_f32(pg, v + i), g2);
    const svfloat32_t denom = fma_vec(pg, svsqrt_f32_x(pg, vv), inv_sqrt_bc2, eps);
    const svfloat32_t upd = svdiv_f32_x(pg, mv, denom);
    pv = fma_vec(pg, neg_step_size, upd, svmul_f32_x(pg, pv, decay));
    svst1_f32(pg, p + i, pv);
    svst1_f32(pg, m + i, mv);
    svst1_f32(pg, v + i, vv);
    store_lowp_vec<LD>(pg, lowp, i, pv);
  }
}

template <GradDtype GD, LowpDtype LD, bool L2>
void rollback_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n,
                   const Coeffs& c) {
  const svfloat32_t beta1 = svdup_n_f32(c.beta1), beta2 = svdup_n_f32(c.beta2);
  const svfloat32_t one_minus_beta1 = svdup_n_f32(c.one_minus_beta1);
  const svfloat32_t one_minus_beta2 = svdup_n_f32(c.one_minus_beta2);
  const svfloat32_t step_size = svdup_n_f32(c.step_size), decay = svdup_n_f32(c.decay);
  const svfloat32_t inv_sqrt_bc2 = svdup_n_f32(c.inv_sqrt_bc2), eps = svdup_n_f32(c.eps);
  const svfloat32_t l2 = svdup_n_f32(c.l2), grad_scale = svdup_n_f32(c.grad_scale);
  const svfloat32_t zero = svdup_n_f32(0.0f);
  for (int64_t i = 0; i < n; i += static_cast<int64_t>(svcntw())) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    const svfloat32_t mv = svld1_f32(pg, m + i);
    const svfloat32_t vv = svld1_f32(pg, v + i);
    const svfloat32_t denom = fma_vec(pg, svsqrt_f32_x(pg, vv), inv_sqrt_bc2, eps);
    svfloat32_t pv = fma_vec(pg, step_size, svdiv_f32_x(pg, mv, denom), svld1_f32(pg, p + i));
    pv = svdiv_f32_x(pg, pv, decay);
    svfloat32_t gv = svmul_f32_x(pg, load_grad_vec<GD>(pg, g, i), grad_scale);
    if constexpr (L2) gv = fma_vec(pg, l2, pv, gv);
    const svfloat32_t m_prev =  // as rollback_one
        svdiv_f32_x(pg, svsub_f32_x(pg, mv, svmul_f32_x(pg, one_minus_beta1, gv)), beta1);
    const svfloat32_t g2 = svmul_f32_x(pg, svmul_f32_x(pg, one_minus_beta2, gv), gv);
    const svfloat32_t v_prev = svdiv_f32_x(pg, svsub_f32_x(pg, vv, g2), beta2);
    // `v_prev > 0 ? v_prev : 0` as in rollback_one: a NaN or -0 compares false and becomes +0.
    svst1_f32(pg, v + i, svsel_f32(svcmpgt_f32(pg, v_prev, zero), v_prev, zero));
    svst1_f32(pg, m + i, m_prev);
    svst1_f32(pg, p + i, pv);
    store_lowp_vec<LD>(pg, lowp, i, pv);
  }
}

// The tail is the last iteration under a partial predicate, as in step_loop.
template <GradDtype SD, bool ACCUMULATE>
void grad_loop(float* dst, const void* src, int64_t n) {
  for (int64_t i = 0; i < n; i += static_cast<int64_t>(svcntw())) {
    const svbool_t pg = svwhilelt_b32_s64(i, n);
    svfloat32_t x = load_grad_vec<SD>(pg, src, i);
    if constexpr (ACCUMULATE) x = svadd_f32_x(pg, svld1_f32(pg, dst + i), x);  // dst + x, as grad_accumulate_one
    svst1_f32(pg, dst + i, x);
  }
}

// ---- sum of squares ------------------------------------------------------------------------
// The order documented at kSumSquaresLanes has 16 double accumulators whatever the vector
// length. With D = svcntd() doubles per vector: D in {2, 4, 8} gives K = 16 / D accumulator
// vectors (accumulator j = lane j % D of vector j / D); D >= 16 gives one vector with its first
// 16 lanes active. D in {6, 10, 12, 14} (a vector length that is not a power of two, which
// SVE once allowed) uses the scalar order.

// Floats i .. i+D-1 (under pg), each widened exactly into a 64-bit lane.
template <GradDtype GD>
svfloat64_t load_grad_f64(svbool_t pg, const void* g, int64_t i) {
  svuint64_t bits;
  if constexpr (GD == GradDtype::F32) {
    bits = svld1uw_u64(pg, static_cast<const uint32_t*>(g) + i);
  } else if constexpr (GD == GradDtype::F16) {
    // The half sits in the low quarter of each 64-bit lane: svcvt_f64_f16 widens it exactly.
    return svcvt_f64_f16_x(pg, svreinterpret_f16_u64(svld1uh_u64(pg, static_cast<const uint16_t*>(g) + i)));
  } else {
    bits = svlsl_n_u64_x(pg, svld1uh_u64(pg, static_cast<const uint16_t*>(g) + i), 16);
  }
  // The float sits in the low half of each 64-bit lane, which is what svcvt_f64_f32 converts.
  return svcvt_f64_f32_x(pg, svreinterpret_f32_u64(bits));
}

// acc + x*x; x*x is exact in double, so the fused form equals mul + add. Inactive lanes keep acc.
template <GradDtype GD>
svfloat64_t square_add(svbool_t pg, svfloat64_t acc, const void* g, int64_t i) {
  const svfloat64_t x = load_grad_f64<GD>(pg, g, i);
  return svmla_f64_m(pg, acc, x, x);
}

// One tree level `a[j] += a[j + W]` when W is below the vector length: lanes, within acc.
template <int W>
svfloat64_t fold_lanes(svfloat64_t acc) {
  return svadd_f64_x(svptrue_b64(), acc, svext_f64(acc, acc, W));
}

template <GradDtype GD, int K>
double sum_squares_block(const void* g, int64_t n) {
  constexpr int D = K == 1 ? 16 : 16 / K;  // lanes used per vector
  const svbool_t pg = K == 1 ? svwhilelt_b64_s32(0, 16) : svptrue_b64();
  svfloat64_t a0 = svdup_n_f64(0.0), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const int64_t n_lanes = n - n % kSumSquaresLanes;
  for (int64_t i = 0; i < n_lanes; i += kSumSquaresLanes) {
    a0 = square_add<GD>(pg, a0, g, i);
    if constexpr (K >= 2) a1 = square_add<GD>(pg, a1, g, i + D);
    if constexpr (K >= 4) {
      a2 = square_add<GD>(pg, a2, g, i + 2 * D);
      a3 = square_add<GD>(pg, a3, g, i + 3 * D);
    }
    if constexpr (K == 8) {
      a4 = square_add<GD>(pg, a4, g, i + 4 * D);
      a5 = square_add<GD>(pg, a5, g, i + 5 * D);
      a6 = square_add<GD>(pg, a6, g, i + 6 * D);
      a7 = square_add<GD>(pg, a7, g, i + 7 * D);
    }
  }
  const svbool_t all = svptrue_b64();
  // Tree levels W = 8, 4, 2 that span whole vectors (W >= D) add vectors; the rest add lanes.
  if constexpr (K == 8) {
    a0 = svadd_f64_x(all, a0, a4);
    a1 = svadd_f64_x(all, a1, a5);
    a2 = svadd_f64_x(all, a2, a6);
    a3 = svadd_f64_x(all, a3, a7);
  }
  if constexpr (K >= 4) {
    a0 = svadd_f64_x(all, a0, a2);
    a1 = svadd_f64_x(all, a1, a3);
  }
  if constexpr (K >= 2) a0 = svadd_f64_x(all, a0, a1);
  if constexpr (D > 8) a0 = fold_lanes<8>(a0);
  if constexpr (D > 4) a0 = fold_lanes<4>(a0);
  if constexpr (D > 2) a0 = fold_lanes<2>(a0);
  a0 = fold_lanes<1>(a0);
  const double s1 = svlasta_f64(svpfalse_b(), a0);  // with no active lane, lasta returns lane 0
  return sum_squares_tail(g, GD, n_lanes, n, s1);
}

// The scalar order, for vector lengths that are not a power of two.
double sum_squares_block_any(const void* g, GradDtype gd, int64_t n) {
  double acc[kSumSquaresLanes] = {};
  const int64_t n_lanes = n - n % kSumSquaresLanes;
  for (int64_t i = 0; i < n_lanes; ++i) {
    const double x = load_grad(g, gd, i);
    acc[i % kSumSquaresLanes] += x * x;
  }
  for (int width = kSumSquaresLanes / 2; width >= 1; width /= 2) {
    for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
  }
  return sum_squares_tail(g, gd, n_lanes, n, acc[0]);
}

template <GradDtype GD>
double sum_squares_block_vla(const void* g, int64_t n) {
  static_assert(kSumSquaresLanes == 16, "the accumulator layouts below assume 16 accumulators");
  switch (svcntd()) {
    case 2: return sum_squares_block<GD, 8>(g, n);
    case 4: return sum_squares_block<GD, 4>(g, n);
    case 8: return sum_squares_block<GD, 2>(g, n);
    default: break;
  }
  if (svcntd() >= 16) return sum_squares_block<GD, 1>(g, n);
  return sum_squares_block_any(g, GD, n);
}

// ---- the compact step ------------------------------------------------------------------------
// One group at a time (a partial last group under a partial predicate): a first pass decodes,
// updates and encodes the master, keeping the new m and s = sqrt(v) in two group-sized buffers
// on the stack (whatever the vector length, even one longer than a group); a second pass
// quantises them once the group's scales are known. The operations of compact_group
// (adam_scalar.cpp) lane by lane.

template <int B>
GRACE_ADAM_INLINE svint32_t load_err(svbool_t pg, const void* err, int64_t i) {
  if constexpr (B == 7) return svld1sb_s32(pg, static_cast<const int8_t*>(err) + i);
  else return svld1sh_s32(pg, static_cast<const int16_t*>(err) + i);
}

// master_decode_one lane by lane: (hi << 16) + (err << (15 - B)), integer only.
template <int B>
GRACE_ADAM_INLINE svfloat32_t master_decode_vec(svbool_t pg, svuint32_t hb, svint32_t e) {
  const svuint32_t delta = svlsl_n_u32_x(pg, svreinterpret_u32_s32(e), master_err_shift(B));
  return svreinterpret_f32_u32(svadd_u32_x(pg, svlsl_n_u32_x(pg, hb, 16), delta));
}

template <int B>
GRACE_ADAM_INLINE void master_encode_vec(svbool_t pg, svfloat32_t w, uint16_t* hi, void* err, int64_t i) {
  constexpr int s = master_err_shift(B);
  const svuint32_t hb = f32_to_bf16_rne_vec(pg, w);
  svint32_t e = svreinterpret_s32_u32(svsub_u32_x(pg, svreinterpret_u32_f32(w), svlsl_n_u32_x(pg, hb, 16)));  // [-32768, 32768]
  if constexpr (s != 0) {  // master_err_round: floor((delta + 2^(s-1) - 1 + parity) / 2^s)
    const svint32_t parity = svand_n_s32_x(pg, svasr_n_s32_x(pg, e, s), 1);
    e = svasr_n_s32_x(pg, svadd_s32_x(pg, e, svadd_n_s32_x(pg, parity, (1 << (s - 1)) - 1)), s);
  }
  // clamped to [-2^B, 2^B - 1]; 0 where hi is inf or NaN
  e = svmin_n_s32_x(pg, svmax_n_s32_x(pg, e, -(1 << B)), (1 << B) - 1);
  const svbool_t not_finite = svcmpeq_n_u32(pg, svand_n_u32_x(pg, hb, 0x7f80u), 0x7f80u);
  e = svsel_s32(not_finite, svdup_n_s32(0), e);
  svst1h_u32(pg, hi + i, hb);
  if constexpr (B == 7) svst1b_s32(pg, static_cast<int8_t*>(err) + i, e);
  else svst1h_s32(pg, static_cast<int16_t*>(err) + i, e);
}

template <int B, GradDtype GD, bool L2>
void compact_group_sve(const CompactBuffers& b, const void* g, int64_t len, const Coeffs& c) {
  const svfloat32_t beta1 = svdup_n_f32(c.beta1), beta2 = svdup_n_f32(c.beta2);
  const svfloat32_t one_minus_beta1 = svdup_n_f32(c.one_minus_beta1);
  const svfloat32_t one_minus_beta2 = svdup_n_f32(c.one_minus_beta2);
  const svfloat32_t neg_step_size = svdup_n_f32(-c.step_size), decay = svdup_n_f32(c.decay);
  const svfloat32_t inv_sqrt_bc2 = svdup_n_f32(c.inv_sqrt_bc2), eps = svdup_n_f32(c.eps);
  const svfloat32_t l2 = svdup_n_f32(c.l2), grad_scale = svdup_n_f32(c.grad_scale);
  const float m_scale = bf16_to_f32(b.ms[0]), s_scale = bf16_to_f32(b.vs[0]);
  float m_new[kCompactGroup], s_new[kCompactGroup];
  const int64_t vl = static_cast<int64_t>(svcntw());
  svuint32_t m_amax = svdup_n_u32(0), s_amax = svdup_n_u32(0);
  for (int64_t i = 0; i < len; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, len);
    const svuint32_t hb = svld1uh_u32(pg, b.hi + i);
    svfloat32_t pv = master_decode_vec<B>(pg, hb, load_err<B>(pg, b.err, i));
    const svfloat32_t mq = svcvt_f32_s32_x(pg, svld1sb_s32(pg, b.mq + i));
    const svfloat32_t t = svmul_n_f32_x(pg, svcvt_f32_u32_x(pg, svld1ub_u32(pg, b.vq + i)), s_scale);
    svfloat32_t gv = svmul_f32_x(pg, load_grad_vec<GD>(pg, g, i), grad_scale);
    if constexpr (L2) gv = fma_vec(pg, l2, pv, gv);
    const svfloat32_t mv = fma_vec(pg, beta1, svmul_n_f32_x(pg, mq, m_scale), svmul_f32_x(pg, one_minus_beta1, gv));
    const svfloat32_t g2 = svmul_f32_x(pg, svmul_f32_x(pg, one_minus_beta2, gv), gv);
    const svfloat32_t vv = fma_vec(pg, beta2, svmul_f32_x(pg, t, t), g2);
    const svfloat32_t sv = svsqrt_f32_x(pg, vv);
    const svfloat32_t denom = fma_vec(pg, sv, inv_sqrt_bc2, eps);
    pv = fma_vec(pg, neg_step_size, svdiv_f32_x(pg, mv, denom), svmul_f32_x(pg, pv, decay));
    master_encode_vec<B>(pg, pv, b.hi, b.err, i);
    svst1_f32(pg, m_new + i, mv);
    svst1_f32(pg, s_new + i, sv);
    // _m: inactive lanes keep their running maximum
    m_amax = svmax_u32_m(pg, m_amax, svand_n_u32_x(pg, svreinterpret_u32_f32(mv), 0x7fffffffu));
    s_amax = svmax_u32_m(pg, s_amax, svand_n_u32_x(pg, svreinterpret_u32_f32(sv), 0x7fffffffu));
  }
  const svbool_t all = svptrue_b32();
  const GroupScale ms = exp_avg_scale(svmaxv_u32(all, m_amax)), ss = exp_avg_sq_scale(svmaxv_u32(all, s_amax));
  b.ms[0] = ms.bits;
  b.vs[0] = ss.bits;
  for (int64_t i = 0; i < len; i += vl) {
    const svbool_t pg = svwhilelt_b32_s64(i, len);
    const svfloat32_t s = svld1_f32(pg, s_new + i);
    svint32_t mq = svcvt_s32_f32_x(pg, svrintn_f32_x(pg, svmul_n_f32_x(pg, svld1_f32(pg, m_new + i), ms.rcp)));
    const svfloat32_t mv = svld1_f32(pg, m_new + i);
    // sqrt_v_dither_bits lane by lane (grace_adam.h); z >= 0: the truncating conversion is floor
    svuint32_t h = sveor_u32_x(pg, svreinterpret_u32_f32(s), svmul_n_u32_x(pg, svreinterpret_u32_f32(mv), kDitherM));
    h = sveor_u32_x(pg, h, svmul_n_u32_x(pg, svindex_u32(static_cast<uint32_t>(i), 1), kDitherLane));
    h = sveor_u32_x(pg, h, svlsr_n_u32_x(pg, h, 16));
    h = svmul_n_u32_x(pg, h, kDitherMix1);
    h = sveor_u32_x(pg, h, svlsr_n_u32_x(pg, h, 15));
    h = svmul_n_u32_x(pg, h, kDitherMix2);
    h = sveor_u32_x(pg, h, svlsr_n_u32_x(pg, h, 16));
    const svfloat32_t dither = svmul_n_f32_x(pg, svcvt_f32_u32_x(pg, svlsr_n_u32_x(pg, h, 8)), 0x1p-24f);
    const svfloat32_t z = svadd_f32_x(pg, svmul_n_f32_x(pg, s, ss.rcp), dither);
    svint32_t vq = svmin_n_s32_x(pg, svcvt_s32_f32_x(pg, z), 255);
    vq = svmax_s32_m(svcmpgt_n_f32(pg, s, 0.0f), vq, svdup_n_s32(1));  // a nonzero v never encodes to 0
    // A non-finite group stores zeros (its scale is NaN).
    if (!ms.finite) mq = svdup_n_s32(0);
    if (!ss.finite) vq = svdup_n_s32(0);
    svst1b_s32(pg, b.mq + i, mq);  // |q| <= 127 and 0 <= q <= 255 (compact.py): the low byte is q
    svst1b_u32(pg, b.vq + i, svreinterpret_u32_s32(vq));
  }
}

template <int B, GradDtype GD, bool L2>
void compact_step_loop(const CompactBuffers& b, ErrDtype ed, const void* g, int64_t n, const Coeffs& c) {
  for (int64_t at = 0; at < n; at += kCompactGroup) {
    const int64_t len = n - at < kCompactGroup ? n - at : kCompactGroup;
    compact_group_sve<B, GD, L2>(compact_offset(b, ed, at), grad_offset(g, GD, at), len, c);
  }
}

}  // namespace

GRACE_ADAM_DEFINE_ISA(sve, sum_squares_block_vla)

}  // namespace grace_adam

#pragma GCC pop_options
#endif  // defined(__aarch64__)
