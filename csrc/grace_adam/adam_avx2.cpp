// GraceAdam, AVX2 path (AVX2 + FMA + F16C): 8 floats per vector, the operations of step_one /
// rollback_one lane by lane, the tail with those same inline functions.
#include <immintrin.h>

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

}  // namespace

void step_avx2(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
               LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {
    step_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c);
  });
}

void rollback_avx2(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
                   LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {
    rollback_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c);
  });
}

double sum_squares_avx2(const void* g, GradDtype gd, int64_t n) {
  double sum = 0.0;
  for (int64_t begin = 0; begin < n; begin += kSumSquaresBlock) {
    const int64_t len = n - begin < kSumSquaresBlock ? n - begin : kSumSquaresBlock;
    const void* block = grad_offset(g, gd, begin);
    sum += with_grad_dtype(gd, [&](auto gt) { return sum_squares_block<decltype(gt)::value>(block, len); });
  }
  return sum;
}

void grad_copy_avx2(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, false>(dst, src, n); });
}

void grad_accumulate_avx2(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, true>(dst, src, n); });
}

}  // namespace grace_adam
