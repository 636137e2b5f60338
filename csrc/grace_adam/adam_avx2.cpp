// GraceAdam, AVX2 path (AVX2 + FMA + F16C): 8 floats per vector, the operations of step_one /
// rollback_one lane by lane, the tail with those same inline functions.
#include <immintrin.h>

#include <algorithm>

#include "grace_adam.h"

#pragma GCC target("avx2,fma,f16c")

namespace grace_adam {
namespace {

constexpr int64_t kWidth = 8;

struct Vcoeffs {
  __m256 beta1, beta2, one_minus_beta1, one_minus_beta2;
  __m256 step_size, neg_step_size, inv_sqrt_bc2, eps, decay, l2, grad_scale;

  explicit Vcoeffs(const Coeffs& c)
      : beta1(_mm256_set1_ps(c.beta1)),
        beta2(_mm256_set1_ps(c.beta2)),
        one_minus_beta1(_mm256_set1_ps(c.one_minus_beta1)),
        one_minus_beta2(_mm256_set1_ps(c.one_minus_beta2)),
        step_size(_mm256_set1_ps(c.step_size)),
        neg_step_size(_mm256_set1_ps(-c.step_size)),
        inv_sqrt_bc2(_mm256_set1_ps(c.inv_sqrt_bc2)),
        eps(_mm256_set1_ps(c.eps)),
        decay(_mm256_set1_ps(c.decay)),
        l2(_mm256_set1_ps(c.l2)),
        grad_scale(_mm256_set1_ps(c.grad_scale)) {}
};

template <GradDtype GD>
__m256 load_grad_vec(const void* g, int64_t i) {
  if constexpr (GD == GradDtype::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (GD == GradDtype::F16) return _mm256_cvtph_ps(h);  // exact; a NaN is quieted, as f16_to_f32
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  // bf16: the high half
  }
}

// Eight 32-bit lanes holding values <= 0xffff, narrowed to 16 bits (no saturation happens).
__m128i narrow_u32_to_u16(__m256i x) {
  return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}

// f32_to_bf16_rne in integer arithmetic: bits + 0x7fff + lsb, keep the high half; NaN -> 0x7fc0.
__m128i f32_to_bf16_rne_vec(__m256 p) {
  const __m256i bits = _mm256_castps_si256(p);
  const __m256i abs_bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
  return narrow_u32_to_u16(rounded);
}

// Hardware round-to-nearest-even; a NaN becomes sign | 0x7e00 as in f32_to_f16_rne (the hardware
// would keep the top payload bits).
__m128i f32_to_f16_rne_vec(__m256 p) {
  const __m128i h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i is_nan32 = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
  const __m128i is_nan = _mm_packs_epi32(_mm256_castsi256_si128(is_nan32), _mm256_extracti128_si256(is_nan32, 1));
  const __m128i sign = _mm_and_si128(h, _mm_set1_epi16(static_cast<short>(0x8000)));
  return _mm_blendv_epi8(h, _mm_or_si128(sign, _mm_set1_epi16(0x7e00)), is_nan);
}

template <LowpDtype LD>
void store_lowp_vec(void* out, int64_t i, __m256 p) {
  if constexpr (LD != LowpDtype::NONE) {
    const __m128i h = LD == LowpDtype::BF16 ? f32_to_bf16_rne_vec(p) : f32_to_f16_rne_vec(p);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i), h);
  }
}

template <GradDtype GD, LowpDtype LD, bool L2>
void step_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n, const Coeffs& c) {
  const Vcoeffs k(c);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    __m256 pv = _mm256_loadu_ps(p + i);
    __m256 gv = _mm256_mul_ps(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = _mm256_fmadd_ps(k.l2, pv, gv);
    const __m256 mv = _mm256_fmadd_ps(k.beta1, _mm256_loadu_ps(m + i), _mm256_mul_ps(k.one_minus_beta1, gv));
    const __m256 g2 = _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, gv), gv);
    const __m256 vv = _mm256_fmadd_ps(k.beta2, _mm256_loadu_ps(v + i), g2);
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), k.inv_sqrt_bc2, k.eps);
    const __m256 upd = _mm256_div_ps(mv, denom);
    pv = _mm256_fmadd_ps(k.neg_step_size, upd, _mm256_mul_ps(pv, k.decay));
    _mm256_storeu_ps(p + i, pv);
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
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
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    const __m256 mv = _mm256_loadu_ps(m + i);
    const __m256 vv = _mm256_loadu_ps(v + i);
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), k.inv_sqrt_bc2, k.eps);
    __m256 pv = _mm256_fmadd_ps(k.step_size, _mm256_div_ps(mv, denom), _mm256_loadu_ps(p + i));
    pv = _mm256_div_ps(pv, k.decay);
    __m256 gv = _mm256_mul_ps(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = _mm256_fmadd_ps(k.l2, pv, gv);
    const __m256 m_prev = _mm256_div_ps(_mm256_sub_ps(mv, _mm256_mul_ps(k.one_minus_beta1, gv)), k.beta1);  // as rollback_one
    const __m256 g2 = _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, gv), gv);
    const __m256 v_prev = _mm256_div_ps(_mm256_sub_ps(vv, g2), k.beta2);
    // max(x, 0) returns its second operand when x is NaN: as `x > 0 ? x : 0` in rollback_one.
    _mm256_storeu_ps(v + i, _mm256_max_ps(v_prev, _mm256_setzero_ps()));
    _mm256_storeu_ps(m + i, m_prev);
    _mm256_storeu_ps(p + i, pv);
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
    __m256 x = load_grad_vec<SD>(src, i);
    if constexpr (ACCUMULATE) x = _mm256_add_ps(_mm256_loadu_ps(dst + i), x);  // dst + x, as grad_accumulate_one
    _mm256_storeu_ps(dst + i, x);
  }
  for (; i < n; ++i) {
    if constexpr (ACCUMULATE) grad_accumulate_one(dst[i], load_grad(src, SD, i));
    else grad_copy_one(dst[i], load_grad(src, SD, i));
  }
}

__m256d square_add(__m128 x, __m256d acc) {
  const __m256d xd = _mm256_cvtps_pd(x);
  return _mm256_fmadd_pd(xd, xd, acc);  // x*x is exact in double: fma == mul + add
}

// One block in the order documented at kSumSquaresLanes: accumulators 0-3, 4-7, 8-11, 12-15 are
// the lanes of acc[0], acc[1], acc[2], acc[3].
template <GradDtype GD>
double sum_squares_block(const void* g, int64_t n) {
  static_assert(kSumSquaresLanes == 2 * kWidth, "two vectors of floats per accumulator set");
  __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
  const int64_t n_lanes = n - n % kSumSquaresLanes;
  for (int64_t i = 0; i < n_lanes; i += 2 * kWidth) {
    const __m256 x0 = load_grad_vec<GD>(g, i);
    const __m256 x1 = load_grad_vec<GD>(g, i + kWidth);
    acc[0] = square_add(_mm256_castps256_ps128(x0), acc[0]);
    acc[1] = square_add(_mm256_extractf128_ps(x0, 1), acc[1]);
    acc[2] = square_add(_mm256_castps256_ps128(x1), acc[2]);
    acc[3] = square_add(_mm256_extractf128_ps(x1, 1), acc[3]);
  }
  const __m256d s4 = _mm256_add_pd(_mm256_add_pd(acc[0], acc[2]), _mm256_add_pd(acc[1], acc[3]));
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  const double s1 = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
  return sum_squares_tail(g, GD, n_lanes, n, s1);
}

// ---- the compact step: tiles of up to kTileGroups groups -------------------------------------
// As adam_avx512.cpp: pass 1 updates every element of the tile (new m and s into an L1 buffer,
// each group's |x| maxima as a vector), then the scales of the tile's 8 groups are one vector
// (lane j = group j), then pass 2 quantises.

constexpr int kTileGroups = 8;
constexpr int64_t kTile = kTileGroups * kCompactGroup;
constexpr int kGroupVecs = kCompactGroup / kWidth;

// lane j of the result = the largest of the 8 lanes of v[j] (signed; the inputs are >= 0).
GRACE_ADAM_INLINE __m256i lanes_max_8x8(const __m256i* v) {
  __m256i w[4], x[2];
  for (int i = 0; i < 4; ++i)  // group 2i in lanes 0-3, 2i+1 in lanes 4-7
    w[i] = _mm256_max_epi32(_mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x20),
                            _mm256_permute2x128_si256(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // half h: groups 4i + h (lanes 0-1) and 4i + 2 + h (lanes 2-3)
    x[i] = _mm256_max_epi32(_mm256_unpacklo_epi64(w[2 * i], w[2 * i + 1]), _mm256_unpackhi_epi64(w[2 * i], w[2 * i + 1]));
  const __m256 x0 = _mm256_castsi256_ps(x[0]), x1 = _mm256_castsi256_ps(x[1]);
  const __m256i z = _mm256_max_epi32(_mm256_castps_si256(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(2, 0, 2, 0))),
                                     _mm256_castps_si256(_mm256_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 1, 3, 1))));
  return _mm256_permutevar8x32_epi32(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // lane 4h + t holds group 2t + h
}

// group_scale (grace_adam.h) of 8 groups at once: the bf16 scales into scale_out[0..8), the
// reciprocals (0 for an all-zero or a non-finite group) into rcp_out; returns the finite groups' bits.
GRACE_ADAM_INLINE int tile_scales(__m256i amax, float levels, uint32_t floor_bits, uint16_t* scale_out, float* rcp_out) {
  const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000), amax);
  const __m256i normal = _mm256_andnot_si256(_mm256_cmpeq_epi32(amax, _mm256_setzero_si256()), finite);
  const __m256i xb = _mm256_castps_si256(_mm256_div_ps(_mm256_castsi256_ps(amax), _mm256_set1_ps(levels)));
  __m256i up = _mm256_srli_epi32(_mm256_add_epi32(xb, _mm256_set1_epi32(0xffff)), 16);  // bf16_round_up_bits
  up = _mm256_max_epi32(_mm256_slli_epi32(up, 16), _mm256_set1_epi32(static_cast<int>(floor_bits)));
  const __m256 rcp = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_castsi256_ps(up));
  _mm256_store_ps(rcp_out, _mm256_and_ps(rcp, _mm256_castsi256_ps(normal)));
  const __m256i bits = _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc0), _mm256_and_si256(_mm256_srli_epi32(up, 16), normal), finite);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scale_out), narrow_u32_to_u16(bits));
  return _mm256_movemask_ps(_mm256_castsi256_ps(finite));
}

// f32_to_bf16_rne_vec before narrowing: the bf16 bits in the low half of each 32-bit lane.
GRACE_ADAM_INLINE __m256i f32_to_bf16_bits_vec(__m256i bits, __m256i abs_bits) {
  const __m256i is_nan = _mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), is_nan);
}

template <int B>
GRACE_ADAM_INLINE __m256i load_err(const void* err, int64_t i) {
  if constexpr (B == 7) return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(err) + i)));
  else return _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int16_t*>(err) + i)));
}

// master_decode_one lane by lane: (hi << 16) + (err << (15 - B)), integer only.
template <int B>
GRACE_ADAM_INLINE __m256 master_decode_vec(const uint16_t* hi, const void* err, int64_t i) {
  const __m256i hb = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + i)));
  const __m256i delta = _mm256_slli_epi32(load_err<B>(err, i), master_err_shift(B));
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(hb, 16), delta));
}

// master_encode_one lane by lane: stores hi and err (saturating packs are the clamp). hi is finite
// iff |bits| < 0x7f7f8000; for B = 7, rne(delta / 256) is the nearest-even conversion (MXCSR's
// default, as every cvtps here) of float(delta) * 2^-8, both exact (|delta| <= 2^15).
template <int B>
GRACE_ADAM_INLINE void master_encode_vec(__m256 w, uint16_t* hi, void* err, int64_t i) {
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i abs_bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i not_finite = _mm256_cmpgt_epi32(abs_bits, _mm256_set1_epi32(0x7f7f7fff));
  const __m256i hb = f32_to_bf16_bits_vec(bits, abs_bits);
  const __m256i delta = _mm256_sub_epi32(bits, _mm256_slli_epi32(hb, 16));  // [-32768, 32768]
  __m256i q = delta;
  if constexpr (B == 7) q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(delta), _mm256_set1_ps(1.0f / 256.0f)));
  const __m256i e = _mm256_andnot_si256(not_finite, q);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), narrow_u32_to_u16(hb));
  const __m128i e16 = _mm_packs_epi32(_mm256_castsi256_si128(e), _mm256_extracti128_si256(e, 1));
  if constexpr (B == 7) _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<int8_t*>(err) + i), _mm_packs_epi16(e16, e16));
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<int16_t*>(err) + i), e16);
}

// Four vectors of 32-bit integers (each in the range of the target) packed to 32 bytes, in order.
template <bool UNSIGNED>
GRACE_ADAM_INLINE __m256i pack_32_bytes(const __m256i q[4]) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  if constexpr (UNSIGNED) {
    const __m256i w = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(w, order);
  } else {
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(w, order);
  }
}

// Pass 1 on one group: the update and the master, the new m and s into m_out / s_out, their |x|
// maxima per lane.
template <int B, GradDtype GD, bool L2>
GRACE_ADAM_INLINE void update_group(const CompactBuffers& b, const void* g, const Vcoeffs& k, float m_scale_f,
                                    float s_scale_f, float* m_out, float* s_out, __m256i& m_amax, __m256i& s_amax) {
  const __m256 m_scale = _mm256_set1_ps(m_scale_f), s_scale = _mm256_set1_ps(s_scale_f);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  m_amax = _mm256_setzero_si256();
  s_amax = _mm256_setzero_si256();
  for (int u = 0; u < kGroupVecs; ++u) {
    const int64_t i = u * kWidth;
    __m256 pv = master_decode_vec<B>(b.hi, b.err, i);
    const __m256 mq = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.mq + i))));
    const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.vq + i)))), s_scale);
    __m256 gv = _mm256_mul_ps(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = _mm256_fmadd_ps(k.l2, pv, gv);
    const __m256 mv = _mm256_fmadd_ps(k.beta1, _mm256_mul_ps(mq, m_scale), _mm256_mul_ps(k.one_minus_beta1, gv));
    const __m256 g2 = _mm256_mul_ps(_mm256_mul_ps(k.one_minus_beta2, gv), gv);
    const __m256 vv = _mm256_fmadd_ps(k.beta2, _mm256_mul_ps(t, t), g2);
    const __m256 sv = _mm256_sqrt_ps(vv);
    const __m256 denom = _mm256_fmadd_ps(sv, k.inv_sqrt_bc2, k.eps);
    pv = _mm256_fmadd_ps(k.neg_step_size, _mm256_div_ps(mv, denom), _mm256_mul_ps(pv, k.decay));
    master_encode_vec<B>(pv, b.hi, b.err, i);
    _mm256_store_ps(m_out + i, mv);
    _mm256_store_ps(s_out + i, sv);
    m_amax = _mm256_max_epi32(m_amax, _mm256_and_si256(_mm256_castps_si256(mv), abs_mask));
    s_amax = _mm256_max_epi32(s_amax, _mm256_and_si256(_mm256_castps_si256(sv), abs_mask));
  }
}

// sqrt_v_dither_bits lane by lane, as the float u in [0, 1) (grace_adam.h).
GRACE_ADAM_INLINE __m256 sqrt_v_dither_vec(__m256 mv, __m256 sv, int64_t first_lane) {
  const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first_lane)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  __m256i h = _mm256_xor_si256(_mm256_castps_si256(sv),
                               _mm256_mullo_epi32(_mm256_castps_si256(mv), _mm256_set1_epi32(static_cast<int>(kDitherM))));
  h = _mm256_xor_si256(h, _mm256_mullo_epi32(lane, _mm256_set1_epi32(static_cast<int>(kDitherLane))));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kDitherMix1)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kDitherMix2)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(h, 8)), _mm256_set1_ps(0x1p-24f));
}

// Pass 2 on one group: q from the new m and s (quantise_exp_avg, quantise_sqrt_v); a non-finite
// group stores zeros (its scale is NaN; cvtps of NaN would give INT_MIN).
GRACE_ADAM_INLINE void quantise_group(const CompactBuffers& b, const float* m_in, const float* s_in, float m_rcp_f,
                                      float s_rcp_f, bool m_finite, bool s_finite) {
  const __m256 m_rcp = _mm256_set1_ps(m_rcp_f), s_rcp = _mm256_set1_ps(s_rcp_f);
  const __m256i one = _mm256_set1_epi32(1);
  __m256i mq[kGroupVecs], vq[kGroupVecs];
  for (int u = 0; u < kGroupVecs; ++u) {
    const int64_t i = u * kWidth;
    const __m256 mv = _mm256_load_ps(m_in + i);
    mq[u] = _mm256_cvtps_epi32(_mm256_mul_ps(mv, m_rcp));
    const __m256 sv = _mm256_load_ps(s_in + i);
    const __m256 z = _mm256_add_ps(_mm256_mul_ps(sv, s_rcp), sqrt_v_dither_vec(mv, sv, i));
    const __m256i q = _mm256_min_epi32(_mm256_cvttps_epi32(z), _mm256_set1_epi32(255));
    const __m256i positive = _mm256_cmpgt_epi32(_mm256_castps_si256(sv), _mm256_setzero_si256());
    vq[u] = _mm256_max_epi32(q, _mm256_and_si256(positive, one));  // a nonzero v never encodes to 0
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.mq), m_finite ? pack_32_bytes<false>(mq) : _mm256_setzero_si256());
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.vq), s_finite ? pack_32_bytes<true>(vq) : _mm256_setzero_si256());
}

// ng (1..kTileGroups) full groups at element 0 of b.
template <int B, GradDtype GD, bool L2>
GRACE_ADAM_INLINE void compact_tile(const CompactBuffers& b, ErrDtype ed, const void* g, int ng, const Vcoeffs& k) {
  alignas(32) float m_new[kTile], s_new[kTile];
  alignas(32) float m_rcp[kTileGroups], s_rcp[kTileGroups];
  uint16_t m_bits[kTileGroups], s_bits[kTileGroups];
  __m256i m_amax[kTileGroups], s_amax[kTileGroups];
  for (int j = 0; j < ng; ++j) {
    const int64_t at = j * kCompactGroup;
    update_group<B, GD, L2>(compact_offset(b, ed, at), grad_offset(g, GD, at), k, bf16_to_f32(b.ms[j]),
                            bf16_to_f32(b.vs[j]), m_new + at, s_new + at, m_amax[j], s_amax[j]);
  }
  for (int j = ng; j < kTileGroups; ++j) m_amax[j] = s_amax[j] = _mm256_setzero_si256();
  const int m_finite = tile_scales(lanes_max_8x8(m_amax), kExpAvgLevels, kExpAvgScaleFloorBits, m_bits, m_rcp);
  const int s_finite = tile_scales(lanes_max_8x8(s_amax), kExpAvgSqLevels, kExpAvgSqScaleFloorBits, s_bits, s_rcp);
  if (ng == kTileGroups) {
    std::memcpy(b.ms, m_bits, sizeof(m_bits));
    std::memcpy(b.vs, s_bits, sizeof(s_bits));
  } else {
    std::memcpy(b.ms, m_bits, ng * sizeof(uint16_t));
    std::memcpy(b.vs, s_bits, ng * sizeof(uint16_t));
  }
  for (int j = 0; j < ng; ++j) {
    const int64_t at = j * kCompactGroup;
    quantise_group(compact_offset(b, ed, at), m_new + at, s_new + at, m_rcp[j], s_rcp[j], (m_finite >> j) & 1,
                   (s_finite >> j) & 1);
  }
}

template <int B, GradDtype GD, bool L2>
void compact_step_loop(const CompactBuffers& b, ErrDtype ed, const void* g, int64_t n, const Coeffs& c) {
  const Vcoeffs k(c);
  const int64_t full = n - n % kCompactGroup;
  for (int64_t at = 0; at < full; at += kTile) {
    const int ng = static_cast<int>(std::min<int64_t>(kTile, full - at) / kCompactGroup);
    compact_tile<B, GD, L2>(compact_offset(b, ed, at), ed, grad_offset(g, GD, at), ng, k);
  }
  if (full < n) compact_step_scalar(compact_offset(b, ed, full), ed, grad_offset(g, GD, full), GD, n - full, c);
}

}  // namespace

GRACE_ADAM_DEFINE_ISA(avx2, sum_squares_block)

}  // namespace grace_adam
