// GraceAdam, portable scalar path: the per-element specification of grace_adam.h in a loop.
// Every vector path must agree with this one bitwise.
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

}  // namespace

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
