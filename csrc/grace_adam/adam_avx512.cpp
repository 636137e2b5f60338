// GraceAdam, AVX-512 path (AVX512F/BW/VL): 16 floats per vector, the operations of step_one /
// rollback_one lane by lane, the tail with those same inline functions.
#include <immintrin.h>

#include <algorithm>

#include "grace_adam.h"

#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl")
// GCC 12 warns about the `__Y = __Y` idiom inside its own AVX-512 intrinsic headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace grace_adam {
namespace {

constexpr int64_t kWidth = 16;

struct Vcoeffs {
  __m512 beta1, beta2, one_minus_beta1, one_minus_beta2;
  __m512 step_size, neg_step_size, inv_sqrt_bc2, eps, decay, l2, grad_scale;

  explicit Vcoeffs(const Coeffs& c)
      : beta1(_mm512_set1_ps(c.beta1)),
        beta2(_mm512_set1_ps(c.beta2)),
        one_minus_beta1(_mm512_set1_ps(c.one_minus_beta1)),
        one_minus_beta2(_mm512_set1_ps(c.one_minus_beta2)),
        step_size(_mm512_set1_ps(c.step_size)),
        neg_step_size(_mm512_set1_ps(-c.step_size)),
        inv_sqrt_bc2(_mm512_set1_ps(c.inv_sqrt_bc2)),
        eps(_mm512_set1_ps(c.eps)),
        decay(_mm512_set1_ps(c.decay)),
        l2(_mm512_set1_ps(c.l2)),
        grad_scale(_mm512_set1_ps(c.grad_scale)) {}
};

__m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <GradDtype GD>
__m512 load_grad_vec(const void* g, int64_t i) {
  if constexpr (GD == GradDtype::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (GD == GradDtype::F16) return _mm512_cvtph_ps(h);  // exact; a NaN is quieted, as f16_to_f32
    return widen_bf16(h);
  }
}

// f32_to_bf16_rne in integer arithmetic: bits + 0x7fff + lsb, keep the high half; NaN -> 0x7fc0.
__m256i f32_to_bf16_rne_vec(__m512 p) {
  const __m512i bits = _mm512_castps_si512(p);
  const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs_bits, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  rounded = _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}

// Hardware round-to-nearest-even; a NaN becomes sign | 0x7e00 as in f32_to_f16_rne (the hardware
// would keep the top payload bits).
__m256i f32_to_f16_rne_vec(__m512 p) {
  const __m256i h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  const __m256i sign = _mm256_and_si256(h, _mm256_set1_epi16(static_cast<short>(0x8000)));
  const __m256i quiet_nan = _mm256_or_si256(sign, _mm256_set1_epi16(0x7e00));
  return _mm256_mask_mov_epi16(h, is_nan, quiet_nan);
}

template <LowpDtype LD>
void store_lowp_vec(void* out, int64_t i, __m512 p) {
  if constexpr (LD != LowpDtype::NONE) {
    const __m256i h = LD == LowpDtype::BF16 ? f32_to_bf16_rne_vec(p) : f32_to_f16_rne_vec(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), h);
  }
}

template <GradDtype GD, LowpDtype LD, bool L2>
void step_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n, const Coeffs& c) {
  const Vcoeffs k(c);
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) {
    __m512 pv = _mm512_loadu_ps(p + i);
    __m512 gv = _mm512_mul_ps(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = _mm512_fmadd_ps(k.l2, pv, gv);
    const __m512 mv = _mm512_fmadd_ps(k.beta1, _mm512_loadu_ps(m + i), _mm512_mul_ps(k.one_minus_beta1, gv));
    const __m512 g2 = _mm512_mul_ps(_mm512_mul_ps(k.one_minus_beta2, gv), gv);
    const __m512 vv = _mm512_fmadd_ps(k.beta2, _mm512_loadu_ps(v + i), g2);
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), k.inv_sqrt_bc2, k.eps);
    const __m512 upd = _mm512_div_ps(mv, denom);
    pv = _mm512_fmadd_ps(k.neg_step_size, upd, _mm512_mul_ps(pv, k.decay));
    _mm512_storeu_ps(p + i, pv);
    _mm512_storeu_ps(m + i, mv);
    _mm512_storeu_ps(v + i, vv);
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
    const __m512 mv = _mm512_loadu_ps(m + i);
    const __m512 vv = _mm512_loadu_ps(v + i);
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), k.inv_sqrt_bc2, k.eps);
    __m512 pv = _mm512_fmadd_ps(k.step_size, _mm512_div_ps(mv, denom), _mm512_loadu_ps(p + i));
    pv = _mm512_div_ps(pv, k.decay);
    __m512 gv = _mm512_mul_ps(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = _mm512_fmadd_ps(k.l2, pv, gv);
    const __m512 m_prev = _mm512_div_ps(_mm512_sub_ps(mv, _mm512_mul_ps(k.one_minus_beta1, gv)), k.beta1);  // as rollback_one
    const __m512 g2 = _mm512_mul_ps(_mm512_mul_ps(k.one_minus_beta2, gv), gv);
    const __m512 v_prev = _mm512_div_ps(_mm512_sub_ps(vv, g2), k.beta2);
    // max(x, 0) returns its second operand when x is NaN: as `x > 0 ? x : 0` in rollback_one.
    _mm512_storeu_ps(v + i, _mm512_max_ps(v_prev, _mm512_setzero_ps()));
    _mm512_storeu_ps(m + i, m_prev);
    _mm512_storeu_ps(p + i, pv);
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
    __m512 x = load_grad_vec<SD>(src, i);
    if constexpr (ACCUMULATE) x = _mm512_add_ps(_mm512_loadu_ps(dst + i), x);  // dst + x, as grad_accumulate_one
    _mm512_storeu_ps(dst + i, x);
  }
  for (; i < n; ++i) {
    if constexpr (ACCUMULATE) grad_accumulate_one(dst[i], load_grad(src, SD, i));
    else grad_copy_one(dst[i], load_grad(src, SD, i));
  }
}

// Two float32 halves of 16 gradient elements, widened to double: lanes 0-7 and 8-15.
template <GradDtype GD>
void load_grad_pd(const void* g, int64_t i, __m512d& lo, __m512d& hi) {
  const __m512 x = load_grad_vec<GD>(g, i);
  lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

// One block in the order documented at kSumSquaresLanes (accumulator j = lane j of acc_lo/acc_hi).
template <GradDtype GD>
double sum_squares_block(const void* g, int64_t n) {
  static_assert(kSumSquaresLanes == kWidth, "one vector of floats per accumulator set");
  __m512d acc_lo = _mm512_setzero_pd(), acc_hi = _mm512_setzero_pd();
  const int64_t n_lanes = n - n % kSumSquaresLanes;
  for (int64_t i = 0; i < n_lanes; i += kWidth) {
    __m512d lo, hi;
    load_grad_pd<GD>(g, i, lo, hi);
    acc_lo = _mm512_fmadd_pd(lo, lo, acc_lo);  // x*x is exact in double: fma == mul + add
    acc_hi = _mm512_fmadd_pd(hi, hi, acc_hi);
  }
  const __m512d s8 = _mm512_add_pd(acc_lo, acc_hi);
  const __m256d s4 = _mm256_add_pd(_mm512_castpd512_pd256(s8), _mm512_extractf64x4_pd(s8, 1));
  const __m128d s2 = _mm_add_pd(_mm256_castpd256_pd128(s4), _mm256_extractf128_pd(s4, 1));
  const double s1 = _mm_cvtsd_f64(_mm_add_sd(s2, _mm_unpackhi_pd(s2, s2)));
  return sum_squares_tail(g, GD, n_lanes, n, s1);
}

// ---- the compact step: tiles of up to kTileGroups groups -------------------------------------
// The operations of compact_group (adam_scalar.cpp) lane by lane. A tile runs in two passes: the
// update of every element (its new m and s kept in an L1 buffer, each group's |x| maxima as a
// vector), then the scales of all its groups at once, lane j = group j (so the division, the bf16
// round-up and the reciprocal are vector operations, not per-group scalar work), then the q.

constexpr int kTileGroups = 16;
constexpr int64_t kTile = kTileGroups * kCompactGroup;
constexpr int kGroupVecs = kCompactGroup / kWidth;

GRACE_ADAM_INLINE __m512i max_pair(__m512i a, __m512i b) { return _mm512_max_epu32(a, b); }

// lane j of the result = the largest of the 16 lanes of v[j] (unsigned), in 45 shuffles and maxima
// plus one permutation: each level halves the lanes that belong to one group.
GRACE_ADAM_INLINE __m512i lanes_max_16x16(const __m512i* v) {
  __m512i w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)  // 128-bit chunks: group 2i in chunks 0-1, 2i+1 in chunks 2-3
    w[i] = max_pair(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xee));
  for (int i = 0; i < 4; ++i)  // chunk c: group 4i + c, 4 lanes
    x[i] = max_pair(_mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], 0x88), _mm512_shuffle_i32x4(w[2 * i], w[2 * i + 1], 0xdd));
  for (int i = 0; i < 2; ++i)  // chunk c: groups 8i + c (lanes 0-1) and 8i + 4 + c (lanes 2-3)
    y[i] = max_pair(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  const __m512 y0 = _mm512_castsi512_ps(y[0]), y1 = _mm512_castsi512_ps(y[1]);
  const __m512i z = max_pair(_mm512_castps_si512(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(2, 0, 2, 0))),
                             _mm512_castps_si512(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 1, 3, 1))));
  // lane 4c + t holds group c + 4t
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

// group_scale (grace_adam.h) of 16 groups at once: stores the bf16 scales of the first ng, writes
// the reciprocals (0 for an all-zero or a non-finite group); returns the mask of finite groups.
GRACE_ADAM_INLINE __mmask16 tile_scales(__m512i amax, float levels, uint32_t floor_bits, __mmask16 live,
                                        uint16_t* scale_out, float* rcp_out) {
  const __mmask16 finite = _mm512_cmplt_epu32_mask(amax, _mm512_set1_epi32(0x7f800000));
  const __mmask16 normal = finite & _mm512_test_epi32_mask(amax, amax);
  const __m512i xb = _mm512_castps_si512(_mm512_div_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(levels)));
  __m512i up = _mm512_srli_epi32(_mm512_add_epi32(xb, _mm512_set1_epi32(0xffff)), 16);  // bf16_round_up_bits
  up = _mm512_max_epu32(_mm512_slli_epi32(up, 16), _mm512_set1_epi32(static_cast<int>(floor_bits)));
  _mm512_store_ps(rcp_out, _mm512_maskz_div_ps(normal, _mm512_set1_ps(1.0f), _mm512_castsi512_ps(up)));
  const __m512i bits = _mm512_mask_mov_epi32(_mm512_maskz_srli_epi32(normal, up, 16), static_cast<__mmask16>(~finite),
                                             _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(scale_out, live, _mm512_cvtepi32_epi16(bits));
  return finite;
}

// The first ng bf16 scales as fp32.
GRACE_ADAM_INLINE void widen_scales(const uint16_t* scales, __mmask16 live, float* out) {
  _mm512_store_ps(out, widen_bf16(_mm256_maskz_loadu_epi16(live, scales)));
}

GRACE_ADAM_INLINE __m512i f32_to_bf16_bits_vec(__m512i bits, __m512i abs_bits) {  // f32_to_bf16_rne_vec before narrowing
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(abs_bits, _mm512_set1_epi32(0x7f800000));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(rounded, is_nan, _mm512_set1_epi32(0x7fc0));
}

template <int B>
GRACE_ADAM_INLINE __m512i load_err(const void* err, int64_t i) {
  if constexpr (B == 7) return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(err) + i)));
  else return _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int16_t*>(err) + i)));
}

template <int B>
GRACE_ADAM_INLINE __m512 master_decode_vec(const uint16_t* hi, const void* err, int64_t i) {
  const __m512i hb = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + i)));
  const __m512i delta = _mm512_slli_epi32(load_err<B>(err, i), master_err_shift(B));
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(hb, 16), delta));
}

// master_encode_one lane by lane. hi is finite iff |bits| < 0x7f7f8000 (from there on it rounds to
// inf, or is inf or NaN). For B = 7, rne(delta / 256) is the hardware's nearest-even conversion of
// float(delta) * 2^-8 (both exact: |delta| <= 2^15).
template <int B>
GRACE_ADAM_INLINE void master_encode_vec(__m512 w, uint16_t* hi, void* err, int64_t i) {
  const __m512i bits = _mm512_castps_si512(w);
  const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 finite = _mm512_cmplt_epu32_mask(abs_bits, _mm512_set1_epi32(0x7f7f8000));
  const __m512i hb = f32_to_bf16_bits_vec(bits, abs_bits);
  const __m512i delta = _mm512_sub_epi32(bits, _mm512_slli_epi32(hb, 16));  // [-32768, 32768]
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi32_epi16(hb));
  // saturating narrowing: the clamp to [-2^B, 2^B - 1]
  if constexpr (B == 7) {
    const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(delta), _mm512_set1_ps(1.0f / 256.0f));
    const __m512i e = _mm512_maskz_cvt_roundps_epi32(finite, scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<int8_t*>(err) + i), _mm512_cvtsepi32_epi8(e));
  } else {
    const __m512i e = _mm512_maskz_mov_epi32(finite, delta);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<int16_t*>(err) + i), _mm512_cvtsepi32_epi16(e));
  }
}

// Pass 1 on one group (at element 0 of b, its gradient at g): the update and the master, the new
// m and s into m_out / s_out, and their |x| maxima per lane.
template <int B, GradDtype GD, bool L2>
GRACE_ADAM_INLINE void update_group(const CompactBuffers& b, const void* g, const Vcoeffs& k, float m_scale_f,
                                    float s_scale_f, float* m_out, float* s_out, __m512i& m_amax, __m512i& s_amax) {
  const __m512 m_scale = _mm512_set1_ps(m_scale_f), s_scale = _mm512_set1_ps(s_scale_f);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  m_amax = _mm512_setzero_si512();
  s_amax = _mm512_setzero_si512();
  for (int u = 0; u < kGroupVecs; ++u) {
    const int64_t i = u * kWidth;
    __m512 pv = master_decode_vec<B>(b.hi, b.err, i);
    const __m512 mq = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.mq + i))));
    const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.vq + i)))), s_scale);
    __m512 gv = _mm512_mul_ps(load_grad_vec<GD>(g, i), k.grad_scale);
    if constexpr (L2) gv = _mm512_fmadd_ps(k.l2, pv, gv);
    const __m512 mv = _mm512_fmadd_ps(k.beta1, _mm512_mul_ps(mq, m_scale), _mm512_mul_ps(k.one_minus_beta1, gv));
    const __m512 g2 = _mm512_mul_ps(_mm512_mul_ps(k.one_minus_beta2, gv), gv);
    const __m512 vv = _mm512_fmadd_ps(k.beta2, _mm512_mul_ps(t, t), g2);
    const __m512 sv = _mm512_sqrt_ps(vv);
    const __m512 denom = _mm512_fmadd_ps(sv, k.inv_sqrt_bc2, k.eps);
    pv = _mm512_fmadd_ps(k.neg_step_size, _mm512_div_ps(mv, denom), _mm512_mul_ps(pv, k.decay));
    master_encode_vec<B>(pv, b.hi, b.err, i);
    _mm512_store_ps(m_out + i, mv);
    _mm512_store_ps(s_out + i, sv);
    m_amax = _mm512_max_epu32(m_amax, _mm512_and_si512(_mm512_castps_si512(mv), abs_mask));
    s_amax = _mm512_max_epu32(s_amax, _mm512_and_si512(_mm512_castps_si512(sv), abs_mask));
  }
}

// sqrt_v_dither_bits lane by lane, as the float u in [0, 1) (grace_adam.h).
GRACE_ADAM_INLINE __m512 sqrt_v_dither_vec(__m512 mv, __m512 sv, int64_t first_lane) {
  const __m512i lane = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first_lane)),
                                        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  __m512i h = _mm512_xor_si512(_mm512_castps_si512(sv),
                               _mm512_mullo_epi32(_mm512_castps_si512(mv), _mm512_set1_epi32(static_cast<int>(kDitherM))));
  h = _mm512_xor_si512(h, _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(kDitherLane))));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kDitherMix1)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 15));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kDitherMix2)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), _mm512_set1_ps(0x1p-24f));
}

// Pass 3 on one group: q from the new m and s and the group's reciprocals (quantise_exp_avg,
// quantise_sqrt_v); a non-finite group stores zeros (cvt of NaN would give INT_MIN).
GRACE_ADAM_INLINE void quantise_group(const CompactBuffers& b, const float* m_in, const float* s_in, float m_rcp_f,
                                      float s_rcp_f, bool m_finite, bool s_finite) {
  const __m512 m_rcp = _mm512_set1_ps(m_rcp_f), s_rcp = _mm512_set1_ps(s_rcp_f);
  const __mmask16 km = m_finite ? 0xffff : 0, ks = s_finite ? 0xffff : 0;
  for (int u = 0; u < kGroupVecs; ++u) {
    const int64_t i = u * kWidth;
    const __m512 mv = _mm512_load_ps(m_in + i);
    const __m512i mq = _mm512_maskz_cvt_roundps_epi32(km, _mm512_mul_ps(mv, m_rcp),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 sv = _mm512_load_ps(s_in + i);
    const __m512 z = _mm512_add_ps(_mm512_mul_ps(sv, s_rcp), sqrt_v_dither_vec(mv, sv, i));
    __m512i vq = _mm512_min_epi32(_mm512_maskz_cvttps_epi32(ks, z), _mm512_set1_epi32(255));
    const __mmask16 positive = ks & _mm512_cmpgt_epi32_mask(_mm512_castps_si512(sv), _mm512_setzero_si512());
    vq = _mm512_mask_max_epi32(vq, positive, vq, _mm512_set1_epi32(1));  // a nonzero v never encodes to 0
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b.mq + i), _mm512_cvtsepi32_epi8(mq));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b.vq + i), _mm512_cvtusepi32_epi8(vq));
  }
}

// ng (1..kTileGroups) full groups at element 0 of b.
template <int B, GradDtype GD, bool L2>
GRACE_ADAM_INLINE void compact_tile(const CompactBuffers& b, ErrDtype ed, const void* g, int ng, const Vcoeffs& k) {
  alignas(64) float m_new[kTile], s_new[kTile];
  alignas(64) float m_scale[kTileGroups], s_scale[kTileGroups], m_rcp[kTileGroups], s_rcp[kTileGroups];
  __m512i m_amax[kTileGroups], s_amax[kTileGroups];
  const __mmask16 live = static_cast<__mmask16>((1u << ng) - 1u);
  widen_scales(b.ms, live, m_scale);
  widen_scales(b.vs, live, s_scale);
  for (int j = 0; j < ng; ++j) {
    const int64_t at = j * kCompactGroup;
    update_group<B, GD, L2>(compact_offset(b, ed, at), grad_offset(g, GD, at), k, m_scale[j], s_scale[j], m_new + at,
                            s_new + at, m_amax[j], s_amax[j]);
  }
  for (int j = ng; j < kTileGroups; ++j) m_amax[j] = s_amax[j] = _mm512_setzero_si512();
  const __mmask16 m_finite = tile_scales(lanes_max_16x16(m_amax), kExpAvgLevels, kExpAvgScaleFloorBits, live, b.ms, m_rcp);
  const __mmask16 s_finite = tile_scales(lanes_max_16x16(s_amax), kExpAvgSqLevels, kExpAvgSqScaleFloorBits, live, b.vs, s_rcp);
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

GRACE_ADAM_DEFINE_ISA(avx512, sum_squares_block)

}  // namespace grace_adam
