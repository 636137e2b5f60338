// GraceAdam, portable scalar path: the per-element specification of grace_adam.h in a loop.
// Every vector path must agree with this one bitwise.
#include <algorithm>

#include "grace_adam.h"

namespace grace_adam {
namespace {

template <GradDtype GD, LowpDtype LD>
void step_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n, const Coeffs& c) {
  for (int64_t i = 0; i < n; ++i) {
    step_one(p[i], m[i], v[i], load_grad(g, GD, i), c);
    store_lowp(lowp, LD, i, p[i]);
  }
}

template <GradDtype GD, LowpDtype LD>
void rollback_loop(float* p, float* m, float* v, const void* g, void* lowp, int64_t n,
                   const Coeffs& c) {
  for (int64_t i = 0; i < n; ++i) {
    rollback_one(p[i], m[i], v[i], load_grad(g, GD, i), c);
    store_lowp(lowp, LD, i, p[i]);
  }
}

template <GradDtype SD, bool ACCUMULATE>
void grad_loop(float* dst, const void* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (ACCUMULATE) grad_accumulate_one(dst[i], load_grad(src, SD, i));
    else grad_copy_one(dst[i], load_grad(src, SD, i));
  }
}

double sum_squares_one_block(const void* g, GradDtype gd, int64_t n) {
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

// One group of len <= kCompactGroup elements starting at element 0 of b: decode, step_one_sqrt,
// encode (master per element; the moments once the group's largest values are known).
template <int B, GradDtype GD>
void compact_group(const CompactBuffers& b, const void* g, int64_t len, const Coeffs& c) {
  using Err = std::conditional_t<B == 7, int8_t, int16_t>;
  Err* err = static_cast<Err*>(b.err);
  const float m_scale = bf16_to_f32(b.ms[0]), s_scale = bf16_to_f32(b.vs[0]);
  float m_new[kCompactGroup], s_new[kCompactGroup];
  uint32_t m_amax = 0, s_amax = 0;
  for (int64_t i = 0; i < len; ++i) {
    float p = master_decode_one<B>(b.hi[i], err[i]);
    float m = decode_exp_avg(b.mq[i], m_scale);
    float v = decode_exp_avg_sq(b.vq[i], s_scale);
    const float s = step_one_sqrt(p, m, v, load_grad(g, GD, i), c);
    int32_t e;
    master_encode_one<B>(p, b.hi[i], e);
    err[i] = static_cast<Err>(e);
    m_new[i] = m;
    s_new[i] = s;
    m_amax = std::max(m_amax, abs_bits(m));
    s_amax = std::max(s_amax, abs_bits(s));
  }
  store_compact_moments(b, m_new, s_new, len, m_amax, s_amax);
}

template <int B>
void encode_group(const CompactBuffers& b, const float* p, const float* m, const float* v, int64_t len) {
  using Err = std::conditional_t<B == 7, int8_t, int16_t>;
  float s[kCompactGroup];
  uint32_t m_amax = 0, s_amax = 0;
  for (int64_t i = 0; i < len; ++i) {
    int32_t e;
    master_encode_one<B>(p[i], b.hi[i], e);
    static_cast<Err*>(b.err)[i] = static_cast<Err>(e);
    s[i] = std::sqrt(v[i]);
    m_amax = std::max(m_amax, abs_bits(m[i]));
    s_amax = std::max(s_amax, abs_bits(s[i]));
  }
  store_compact_moments(b, m, s, len, m_amax, s_amax);
}

template <int B>
void decode_group(const CompactBuffers& b, float* p, float* m, float* v, int64_t len) {
  using Err = std::conditional_t<B == 7, int8_t, int16_t>;
  const float m_scale = bf16_to_f32(b.ms[0]), s_scale = bf16_to_f32(b.vs[0]);
  for (int64_t i = 0; i < len; ++i) {
    p[i] = master_decode_one<B>(b.hi[i], static_cast<const Err*>(b.err)[i]);
    m[i] = decode_exp_avg(b.mq[i], m_scale);
    v[i] = decode_exp_avg_sq(b.vq[i], s_scale);
  }
}

// f(group buffers, first element, length) for each group of [0, n).
template <class F>
void for_each_group(const CompactBuffers& b, ErrDtype ed, int64_t n, F&& f) {
  for (int64_t at = 0; at < n; at += kCompactGroup) {
    f(compact_offset(b, ed, at), at, std::min(kCompactGroup, n - at));
  }
}

}  // namespace

void store_compact_moments(const CompactBuffers& b, const float* m, const float* s, int64_t len, uint32_t m_amax,
                           uint32_t s_amax) {
  const GroupScale ms = exp_avg_scale(m_amax), ss = exp_avg_sq_scale(s_amax);
  b.ms[0] = ms.bits;
  b.vs[0] = ss.bits;
  for (int64_t i = 0; i < len; ++i) {
    b.mq[i] = ms.finite ? static_cast<int8_t>(quantise_exp_avg(m[i], ms.rcp)) : 0;
    b.vq[i] = ss.finite ? static_cast<uint8_t>(quantise_sqrt_v(s[i], ss.rcp, m[i], static_cast<uint32_t>(i))) : 0;
  }
}

void compact_step_scalar(const CompactBuffers& b, ErrDtype ed, const void* g, GradDtype gd, int64_t n,
                         const Coeffs& c) {
  with_grad_dtype(gd, [&](auto gt) {
    constexpr GradDtype GD = decltype(gt)::value;
    for_each_group(b, ed, n, [&](const CompactBuffers& gb, int64_t at, int64_t len) {
      const void* ga = grad_offset(g, GD, at);
      if (ed == ErrDtype::I8) compact_group<7, GD>(gb, ga, len, c);
      else compact_group<15, GD>(gb, ga, len, c);
    });
  });
}

void compact_encode(const CompactBuffers& b, ErrDtype ed, const float* p, const float* m, const float* v,
                    int64_t n) {
  for_each_group(b, ed, n, [&](const CompactBuffers& gb, int64_t at, int64_t len) {
    if (ed == ErrDtype::I8) encode_group<7>(gb, p + at, m + at, v + at, len);
    else encode_group<15>(gb, p + at, m + at, v + at, len);
  });
}

void compact_decode(const CompactBuffers& b, ErrDtype ed, float* p, float* m, float* v, int64_t n) {
  for_each_group(b, ed, n, [&](const CompactBuffers& gb, int64_t at, int64_t len) {
    if (ed == ErrDtype::I8) decode_group<7>(gb, p + at, m + at, v + at, len);
    else decode_group<15>(gb, p + at, m + at, v + at, len);
  });
}

void step_scalar(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
                 LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto) {
    step_loop<decltype(gt)::value, decltype(lt)::value>(p, m, v, g, lowp, n, c);
  });
}

void rollback_scalar(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
                     LowpDtype ld, int64_t n, const Coeffs& c) {
  with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto) {
    rollback_loop<decltype(gt)::value, decltype(lt)::value>(p, m, v, g, lowp, n, c);
  });
}

double sum_squares_scalar(const void* g, GradDtype gd, int64_t n) {
  double sum = 0.0;
  for (int64_t begin = 0; begin < n; begin += kSumSquaresBlock) {
    const int64_t len = n - begin < kSumSquaresBlock ? n - begin : kSumSquaresBlock;
    sum += sum_squares_one_block(grad_offset(g, gd, begin), gd, len);
  }
  return sum;
}

void grad_copy_scalar(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, false>(dst, src, n); });
}

void grad_accumulate_scalar(float* dst, const void* src, GradDtype sd, int64_t n) {
  with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, true>(dst, src, n); });
}

}  // namespace grace_adam
