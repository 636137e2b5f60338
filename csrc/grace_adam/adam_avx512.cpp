// GraceAdam, AVX-512 path (AVX512F/BW/VL): 16 floats per vector, the operations of step_one /
// rollback_one lane by lane, the tail with those same inline functions.
#include <immintrin.h>

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

// ---- the compact step: one group of kCompactGroup = 2 vectors at a time ---------------------
// The operations of compact_group (adam_scalar.cpp) lane by lane; see adam_avx2.cpp.

GRACE_ADAM_INLINE __m512i f32_to_bf16_bits_vec(__m512 p) {  // f32_to_bf16_rne_vec before narrowing
  const __m512i bits = _mm512_castps_si512(p);
  const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs_bits, _mm512_set1_epi32(0x7f800000));
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

template <int B>
GRACE_ADAM_INLINE void master_encode_vec(__m512 w, uint16_t* hi, void* err, int64_t i) {
  constexpr int s = master_err_shift(B);
  const __m512i hb = f32_to_bf16_bits_vec(w);
  const __m512i delta = _mm512_sub_epi32(_mm512_castps_si512(w), _mm512_slli_epi32(hb, 16));  // [-32768, 32768]
  __m512i q = delta;
  if constexpr (s != 0) {  // master_err_round
    const __m512i parity = _mm512_and_si512(_mm512_srli_epi32(delta, s), _mm512_set1_epi32(1));
    q = _mm512_srai_epi32(_mm512_add_epi32(delta, _mm512_add_epi32(parity, _mm512_set1_epi32((1 << (s - 1)) - 1))), s);
  }
  const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(hb, _mm512_set1_epi32(0x7f80)), _mm512_set1_epi32(0x7f80));
  const __m512i e = _mm512_maskz_mov_epi32(finite, q);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), _mm512_cvtepi32_epi16(hb));
  // saturating narrowing: the clamp to [-2^B, 2^B - 1]
  if constexpr (B == 7) _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<int8_t*>(err) + i), _mm512_cvtsepi32_epi8(e));
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<int16_t*>(err) + i), _mm512_cvtsepi32_epi16(e));
}

template <int B, GradDtype GD, bool L2>
GRACE_ADAM_INLINE void compact_full_group(const CompactBuffers& b, const void* g, const Vcoeffs& k) {
  constexpr int kVecs = kCompactGroup / kWidth;
  const __m512 m_scale = _mm512_set1_ps(bf16_to_f32(b.ms[0])), s_scale = _mm512_set1_ps(bf16_to_f32(b.vs[0]));
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  __m512 m_new[kVecs], s_new[kVecs];
  __m512i m_amax = _mm512_setzero_si512(), s_amax = _mm512_setzero_si512();
  for (int u = 0; u < kVecs; ++u) {
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
    m_new[u] = mv;
    s_new[u] = sv;
    m_amax = _mm512_max_epi32(m_amax, _mm512_and_si512(_mm512_castps_si512(mv), abs_mask));
    s_amax = _mm512_max_epi32(s_amax, _mm512_and_si512(_mm512_castps_si512(sv), abs_mask));
  }
  const GroupScale ms = exp_avg_scale(static_cast<uint32_t>(_mm512_reduce_max_epi32(m_amax)));
  const GroupScale ss = exp_avg_sq_scale(static_cast<uint32_t>(_mm512_reduce_max_epi32(s_amax)));
  b.ms[0] = ms.bits;
  b.vs[0] = ss.bits;
  const __m512 m_rcp = _mm512_set1_ps(ms.rcp), s_rcp = _mm512_set1_ps(ss.rcp);
  for (int u = 0; u < kVecs; ++u) {
    const int64_t i = u * kWidth;
    __m512i mq = _mm512_cvt_roundps_epi32(_mm512_mul_ps(m_new[u], m_rcp), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i vq = _mm512_cvt_roundps_epi32(_mm512_mul_ps(s_new[u], s_rcp), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 positive = _mm512_cmpgt_epi32_mask(_mm512_castps_si512(s_new[u]), _mm512_setzero_si512());
    vq = _mm512_mask_max_epi32(vq, positive, vq, _mm512_set1_epi32(1));  // a nonzero v never encodes to 0
    // A non-finite group stores zeros (its scale is NaN); cvt of NaN would give INT_MIN.
    if (!ms.finite) mq = _mm512_setzero_si512();
    if (!ss.finite) vq = _mm512_setzero_si512();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b.mq + i), _mm512_cvtsepi32_epi8(mq));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b.vq + i), _mm512_cvtusepi32_epi8(vq));
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

void compact_step_avx512(const CompactBuffers& b, ErrDtype ed, const void* g, GradDtype gd, int64_t n,
                         const Coeffs& c) {
  with_variant(gd, LowpDtype::NONE, c.l2 != 0.0f, [&](auto gt, auto, auto l2) {
    constexpr GradDtype GD = decltype(gt)::value;
    constexpr bool L2 = decltype(l2)::value;
    if (ed == ErrDtype::I8) compact_step_loop<7, GD, L2>(b, ed, g, n, c);
    else compact_step_loop<15, GD, L2>(b, ed, g, n, c);
  });
}

void step_avx512(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
                 LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {
    step_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c);
  });
}

void rollback_avx512(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
                     LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {
    rollback_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c);
  });
}

double sum_squares_avx512(const void* g, GradDtype gd, int64_t n) {
  double sum = 0.0;
  for (int64_t begin = 0; begin < n; begin += kSumSquaresBlock) {
    const int64_t len = n - begin < kSumSquaresBlock ? n - begin : kSumSquaresBlock;
    const void* block = grad_offset(g, gd, begin);
    sum += with_grad_dtype(gd, [&](auto gt) { return sum_squares_block<decltype(gt)::value>(block, len); });
  }
  return sum;
}

void grad_copy_avx512(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, false>(dst, src, n); });
}

void grad_accumulate_avx512(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, true>(dst, src, n); });
}

}  // namespace grace_adam
