// GraceAdam: the torch-free core of the host Adam.
//
// Raw pointers, sizes and every hyperparameter on every call; no state, no allocation, no
// threads (the binding owns the thread pool and hands each worker a slice). Every ISA path
// computes the same function with the same operations in the same order, so all paths agree
// bitwise with the scalar one (sqrt and division are correctly rounded everywhere; fused
// multiply-adds are written explicitly, and the build uses -ffp-contract=off so the compiler
// adds none of its own). The math is documented in superoffload_hf/host/reference.py.
//
// Besides the Adam step, the core converts gradients: grad_copy (dst = float(src)) and
// grad_accumulate (dst = dst + float(src), one fp32 addition), with src fp32, bf16 or fp16, so
// that micro-batch accumulation and the upcast run on the kernel's own threads.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// For the small vector helpers of the compact step: a call per vector (with its arguments
// spilled) costs as much as the helper's work, and GCC does not always inline them on its own.
#define GRACE_ADAM_INLINE inline __attribute__((always_inline))

namespace grace_adam {

enum class GradDtype : int { F32 = 0, BF16 = 1, F16 = 2 };
enum class LowpDtype : int { NONE = 0, BF16 = 1, F16 = 2 };
enum class Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2, NEON = 3, SVE = 4 };

// Scalars derived once per call (in double, then rounded to float).
struct Coeffs {
  float beta1, beta2;
  float one_minus_beta1, one_minus_beta2;
  float step_size;     // lr / bc1
  float inv_sqrt_bc2;  // 1 / sqrt(bc2)
  float eps;
  float decay;         // AdamW: 1 - lr*wd (applied to p before the update); Adam: 1
  float l2;            // Adam: wd (g += wd*p); AdamW: 0
  float grad_scale;
};

inline Coeffs make_coeffs(int64_t step, double lr, double beta1, double beta2, double eps,
                          double weight_decay, bool adamw, bool bias_correction,
                          double grad_scale) {
  double bc1 = 1.0, bc2 = 1.0;
  if (bias_correction) {
    bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  }
  Coeffs c;
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.step_size = static_cast<float>(lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(eps);
  c.decay = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.l2 = adamw ? 0.0f : static_cast<float>(weight_decay);
  c.grad_scale = static_cast<float>(grad_scale);
  return c;
}

// ---- conversions (bit-exact, round to nearest even) -----------------------------------------

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16_rne(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;  // NaN: the canonical quiet NaN, as torch
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE binary16, round to nearest even, overflow to inf, gradual underflow (as torch's .half()).
inline uint16_t f32_to_f16_rne(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN: quiet NaN, sign kept, as torch
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65536: inf
  if (ax < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero (2^-25 ties to 0)
    const uint32_t e = ax >> 23;                                   // 102..112
    const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;                               // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = ((ax >> 13) - (112u << 10));  // rebias exponent 127 -> 15
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | h);
}

// IEEE binary16 to float: exact (subnormal halves become normal floats). A NaN keeps its sign
// and payload and is quieted (bit 22 set), as F16C's vcvtph2ps and Arm's fcvt do.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u);  // inf, or a quiet NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);  // rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;  // +-0
  } else {  // subnormal mant * 2^-24: normalise
    uint32_t e = 113;  // the biased float exponent of 2^-14
    while ((mant & 0x400u) == 0) mant <<= 1, --e;
    bits = sign | (e << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float load_grad(const void* g, GradDtype gd, int64_t i) {
  if (gd == GradDtype::F32) return static_cast<const float*>(g)[i];
  const uint16_t h = static_cast<const uint16_t*>(g)[i];
  return gd == GradDtype::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

inline int64_t grad_itemsize(GradDtype gd) { return gd == GradDtype::F32 ? 4 : 2; }

// The address of gradient element i (a caller that splits work hands each slice its own start).
inline const void* grad_offset(const void* g, GradDtype gd, int64_t i) {
  return static_cast<const char*>(g) + i * grad_itemsize(gd);
}

inline void store_lowp(void* out, LowpDtype ld, int64_t i, float p) {
  if (ld == LowpDtype::BF16) static_cast<uint16_t*>(out)[i] = f32_to_bf16_rne(p);
  else if (ld == LowpDtype::F16) static_cast<uint16_t*>(out)[i] = f32_to_f16_rne(p);
}

// ---- the per-element specification (vector paths do exactly this, lane by lane) -------------

// step_one, returning sqrt of the new v (the compact step stores it).
inline float step_one_sqrt(float& p, float& m, float& v, float g_raw, const Coeffs& c) {
  float g = g_raw * c.grad_scale;
  if (c.l2 != 0.0f) g = std::fma(c.l2, p, g);
  m = std::fma(c.beta1, m, c.one_minus_beta1 * g);
  v = std::fma(c.beta2, v, (c.one_minus_beta2 * g) * g);
  const float s = std::sqrt(v);
  const float denom = std::fma(s, c.inv_sqrt_bc2, c.eps);
  const float upd = m / denom;
  p = std::fma(-c.step_size, upd, p * c.decay);
  return s;
}

inline void step_one(float& p, float& m, float& v, float g_raw, const Coeffs& c) {
  step_one_sqrt(p, m, v, g_raw, c);
}

inline void rollback_one(float& p, float& m, float& v, float g_raw, const Coeffs& c) {
  const float denom = std::fma(std::sqrt(v), c.inv_sqrt_bc2, c.eps);
  const float upd = m / denom;
  p = std::fma(c.step_size, upd, p);
  p = p / c.decay;
  float g = g_raw * c.grad_scale;
  if (c.l2 != 0.0f) g = std::fma(c.l2, p, g);
  // Subtract the very term step_one added, rounded as it was: from m = 0 (a parameter or element
  // that never had a gradient) this restores exactly 0. An fma would leave that term's rounding
  // residue, and with v restored to exactly 0 the next step would divide the residue by eps.
  m = (m - c.one_minus_beta1 * g) / c.beta1;
  const float vr = (v - (c.one_minus_beta2 * g) * g) / c.beta2;
  v = vr > 0.0f ? vr : 0.0f;  // a negative rounding residue (or a NaN) becomes 0, as max(vr, 0) in SIMD
}

// Gradient conversion: x is float(src[i]) (load_grad). Accumulation is one fp32 addition, dst + x
// (torch's `dst.add_(src.float())` computes the same: its add is fma(x, 1, dst), exact for x*1).
// When both operands are NaN the result is a NaN whose payload depends on the instruction form
// and the operand order the compiler picks (so ISA paths agree bitwise except there).
inline void grad_copy_one(float& dst, float x) { dst = x; }
inline void grad_accumulate_one(float& dst, float x) { dst = dst + x; }

// ---- the compact state (superoffload_hf/host/compact.py defines the format) -----------------
// Per element: master bf16 `hi` + err (int8, B = 7, or int16, B = 15): the fp32 bits of the weight
// minus hi's bits << 16, in units of 2^(15 - B) (master_decode_one); exp_avg int8 and sqrt(exp_avg_sq) uint8 in
// groups of kCompactGroup with one bf16 scale per group. A buffer passed in starts a group at its
// element 0; a caller that splits work splits at multiples of kCompactGroup.

constexpr int64_t kCompactGroup = 32;
enum class ErrDtype : int { I8 = 0, I16 = 1 };

// The six compact buffers of one flat range; the scales hold one entry per group.
struct CompactBuffers {
  uint16_t* hi;       // master_bf16
  void* err;          // master_err: int8_t or int16_t
  int8_t* mq;         // exp_avg_q
  uint16_t* ms;       // exp_avg_scale (bf16)
  uint8_t* vq;        // exp_avg_sq_q
  uint16_t* vs;       // exp_avg_sq_scale (bf16)
};

// The same buffers from element `begin` on (a multiple of kCompactGroup).
inline CompactBuffers compact_offset(const CompactBuffers& b, ErrDtype ed, int64_t begin) {
  const int64_t group = begin / kCompactGroup;
  void* err = ed == ErrDtype::I8 ? static_cast<void*>(static_cast<int8_t*>(b.err) + begin)
                                 : static_cast<void*>(static_cast<int16_t*>(b.err) + begin);
  return CompactBuffers{b.hi + begin, err, b.mq + begin, b.ms + group, b.vq + begin, b.vs + group};
}

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The master in integer bit space: bf16 round-to-nearest-even rounds the fp32 bit pattern (an
// integer, sign-magnitude) to a multiple of 2^16, so delta = bits(w) - (bits(hi) << 16) lies in
// [-32768, 32768] and encodes the remainder exactly (continuous across binade edges). err is delta
// (B = 15, clamped) or rne(delta / 256) (B = 7, clamped); decode is one shift and one add.
constexpr int master_err_shift(int b) { return 15 - b; }

template <int B>
inline float master_decode_one(uint16_t hi, int32_t err) {
  const uint32_t delta = static_cast<uint32_t>(err) << master_err_shift(B);  // err * 2^(15-B), two's complement
  return f32_from_bits((static_cast<uint32_t>(hi) << 16) + delta);
}

// rne(delta / 2^(15-B)) in integer arithmetic (an arithmetic shift is floor; bit 15-B of delta is
// the parity of that floor), before the clamp.
template <int B>
inline int32_t master_err_round(int32_t delta) {
  constexpr int s = master_err_shift(B);
  if constexpr (s == 0) return delta;
  else return (delta + ((1 << (s - 1)) - 1) + ((delta >> s) & 1)) >> s;
}

template <int B>
inline void master_encode_one(float w, uint16_t& hi, int32_t& err) {
  hi = f32_to_bf16_rne(w);
  if ((hi & 0x7f80) == 0x7f80) {  // hi is inf or NaN: no remainder
    err = 0;
    return;
  }
  const int32_t delta = static_cast<int32_t>(f32_bits(w) - (static_cast<uint32_t>(hi) << 16));  // [-32768, 32768]
  const int32_t q = master_err_round<B>(delta);
  const int32_t lo = -(1 << B), hi_q = (1 << B) - 1;
  err = q < lo ? lo : (q > hi_q ? hi_q : q);
}

// bf16 round up (toward +inf) of a non-negative finite float: the least bf16 >= x.
inline uint32_t bf16_round_up_bits(uint32_t bits) { return (bits >> 16) + ((bits & 0xffffu) != 0 ? 1u : 0u); }

// One group's scale from the largest |x| compared as bits (compact.py): the bf16 bits stored, and
// the fp32 reciprocal the quantisation multiplies by (0 for an all-zero or a non-finite group).
struct GroupScale {
  uint16_t bits;
  float rcp;
  bool finite;
};

inline GroupScale group_scale(uint32_t amax_bits, float levels, uint32_t floor_bits) {
  if (amax_bits >= 0x7f800000u) return GroupScale{0x7fc0u, 0.0f, false};
  if (amax_bits == 0) return GroupScale{0, 0.0f, true};
  const float x = f32_from_bits(amax_bits) / levels;
  uint32_t up = bf16_round_up_bits(f32_bits(x)) << 16;
  if (up < floor_bits) up = floor_bits;
  return GroupScale{static_cast<uint16_t>(up >> 16), 1.0f / f32_from_bits(up), true};
}

constexpr float kExpAvgLevels = 127.0f, kExpAvgSqLevels = 255.0f;
constexpr uint32_t kExpAvgScaleFloorBits = 0x00800000u;    // 2^-126: 1/scale stays finite
constexpr uint32_t kExpAvgSqScaleFloorBits = 0x1a800000u;  // 2^-74: a decoded nonzero v stays nonzero

inline GroupScale exp_avg_scale(uint32_t amax_bits) { return group_scale(amax_bits, kExpAvgLevels, kExpAvgScaleFloorBits); }
inline GroupScale exp_avg_sq_scale(uint32_t amax_bits) {
  return group_scale(amax_bits, kExpAvgSqLevels, kExpAvgSqScaleFloorBits);
}

// q of one element of a finite group (|x| <= the group's amax, so |q| <= levels without a clamp).
inline int32_t quantise_exp_avg(float m, float rcp) { return static_cast<int32_t>(std::nearbyint(m * rcp)); }
// sqrt(v) rounds stochastically (compact.py says why): the dither is 24 bits of a hash of the new
// m and s bits and the element's index in its group, in uint32 arithmetic (kDither* below).
constexpr uint32_t kDitherM = 0x9E3779B1u, kDitherLane = 0x632BE5ABu, kDitherMix1 = 0x7FEB352Du,
                   kDitherMix2 = 0x846CA68Bu;
inline uint32_t sqrt_v_dither_bits(float m, float s, uint32_t lane) {
  uint32_t h = f32_bits(s) ^ (f32_bits(m) * kDitherM) ^ (lane * kDitherLane);
  h ^= h >> 16;
  h *= kDitherMix1;
  h ^= h >> 15;
  h *= kDitherMix2;
  h ^= h >> 16;
  return h >> 8;
}
inline int32_t quantise_sqrt_v(float s, float rcp, float m, uint32_t lane) {
  const float y = s * rcp;
  const float z = y + static_cast<float>(sqrt_v_dither_bits(m, s, lane)) * 0x1p-24f;
  int32_t q = static_cast<int32_t>(z);  // z >= 0: truncation is floor
  q = q > 255 ? 255 : q;
  return q < 1 && s > 0.0f ? 1 : q;  // a nonzero v never encodes to 0
}

inline float decode_exp_avg(int8_t q, float scale) { return static_cast<float>(q) * scale; }
inline float decode_exp_avg_sq(uint8_t q, float scale) {
  const float t = static_cast<float>(q) * scale;
  return t * t;
}

// |x| as bits: compared as integers, NaN and inf sort above every finite value.
inline uint32_t abs_bits(float x) { return f32_bits(x) & 0x7fffffffu; }

// The moments of one group (len <= kCompactGroup elements at element 0 of b) from the new m and
// s = sqrt(v) and their largest |x| as bits: its two scales and 2*len q (adam_scalar.cpp; a vector
// path may quantise itself, bitwise alike).
void store_compact_moments(const CompactBuffers& b, const float* m, const float* s, int64_t len, uint32_t m_amax,
                           uint32_t s_amax);

// ---- entry points per ISA: each processes elements [0, n) -----------------------------------
// p, m, v: fp32 state, updated in place. g: fp32, bf16 or fp16 gradient (read only).
// lowp: nullptr, or n bf16/fp16 outputs (the updated p, rounded to nearest even).
// grad_copy / grad_accumulate: dst fp32 (written), src fp32, bf16 or fp16 (read only), disjoint.

#define GRACE_ADAM_DECLARE_ISA(suffix)                                                            \
  void step_##suffix(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,       \
                     LowpDtype ld, int64_t n, const Coeffs& c);                                   \
  void rollback_##suffix(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,   \
                         LowpDtype ld, int64_t n, const Coeffs& c);                               \
  double sum_squares_##suffix(const void* g, GradDtype gd, int64_t n);                             \
  void grad_copy_##suffix(float* dst, const void* src, GradDtype sd, int64_t n);                  \
  void grad_accumulate_##suffix(float* dst, const void* src, GradDtype sd, int64_t n);             \
  void compact_step_##suffix(const CompactBuffers& b, ErrDtype ed, const void* g, GradDtype gd,   \
                             int64_t n, const Coeffs& c);

GRACE_ADAM_DECLARE_ISA(scalar)
#if defined(__x86_64__) || defined(_M_X64)
GRACE_ADAM_DECLARE_ISA(avx2)
GRACE_ADAM_DECLARE_ISA(avx512)
#endif
#if defined(__aarch64__)
GRACE_ADAM_DECLARE_ISA(neon)
GRACE_ADAM_DECLARE_ISA(sve)
#endif
#undef GRACE_ADAM_DECLARE_ISA

// Dispatch (dispatch.cpp): what this CPU supports, and the entry points by ISA.
bool isa_supported(Isa isa);
Isa best_isa();
const char* isa_name(Isa isa);
void step(Isa isa, float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
          LowpDtype ld, int64_t n, const Coeffs& c);
void rollback(Isa isa, float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
              LowpDtype ld, int64_t n, const Coeffs& c);
double sum_squares(Isa isa, const void* g, GradDtype gd, int64_t n);
void grad_copy(Isa isa, float* dst, const void* src, GradDtype sd, int64_t n);
void grad_accumulate(Isa isa, float* dst, const void* src, GradDtype sd, int64_t n);
// dst[i] = the bf16 / fp16 rounding of src[i] (nearest even, store_lowp: the step's param_lowp),
// for i in [0, n); one portable loop for every ISA (a memory-bound cast the compiler vectorizes).
void lowp_copy(void* dst, LowpDtype ld, const float* src, int64_t n);
// The compact step (decode, the update of step_one, encode; one pass) on elements [0, n) of b, the
// gradient read as it landed. Vector paths hand a partial last group to the scalar path.
void compact_step(Isa isa, const CompactBuffers& b, ErrDtype ed, const void* g, GradDtype gd, int64_t n,
                  const Coeffs& c);
// fp32 state <-> compact bytes, elements [0, n): one portable loop for every ISA (conversions at
// load, save and precision changes, not in the training step).
void compact_encode(const CompactBuffers& b, ErrDtype ed, const float* p, const float* m, const float* v,
                    int64_t n);
void compact_decode(const CompactBuffers& b, ErrDtype ed, float* p, float* m, float* v, int64_t n);

// sum_squares is computed in fixed blocks of this many elements, each summed in float64 and
// the block sums added in order, so the result does not depend on how blocks are spread over
// threads. Vector paths keep this block size; a caller that splits work splits at multiples of it.
constexpr int64_t kSumSquaresBlock = 1 << 14;

// The order inside one block, shared by every path so that they agree bitwise: element i of the
// first n - n % kSumSquaresLanes goes to accumulator i % kSumSquaresLanes (acc += x*x in double;
// the product of two floats is exact in double); the accumulators are reduced as a tree
// (a[j] += a[j+8], then a[j] += a[j+4], a[j] += a[j+2], a[0] += a[1]); the last n % kSumSquaresLanes
// elements are then added in order.
constexpr int kSumSquaresLanes = 16;

inline double sum_squares_tail(const void* g, GradDtype gd, int64_t begin, int64_t end, double sum) {
  for (int64_t i = begin; i < end; ++i) {
    const double x = load_grad(g, gd, i);
    sum += x * x;
  }
  return sum;
}

// ---- compile-time variants ---------------------------------------------------------------------
// Every ISA loop is a template on (grad dtype, lowp dtype, l2 != 0) so its inner loop has no
// branches; with_variant maps the run-time values to the template arguments:
// f(GradTag<GD>{}, LowpTag<LD>{}, std::bool_constant<L2>{}).
template <GradDtype GD>
using GradTag = std::integral_constant<GradDtype, GD>;
template <LowpDtype LD>
using LowpTag = std::integral_constant<LowpDtype, LD>;

template <class GT, class F>
inline void with_lowp_and_l2(GT gt, LowpDtype ld, bool has_l2, F&& f) {
  auto with_l2 = [&](auto lt) {
    if (has_l2) f(gt, lt, std::true_type{});
    else f(gt, lt, std::false_type{});
  };
  if (ld == LowpDtype::BF16) with_l2(LowpTag<LowpDtype::BF16>{});
  else if (ld == LowpDtype::F16) with_l2(LowpTag<LowpDtype::F16>{});
  else with_l2(LowpTag<LowpDtype::NONE>{});
}

// f(GradTag<GD>{}) for the run-time gradient dtype.
template <class F>
inline decltype(auto) with_grad_dtype(GradDtype gd, F&& f) {
  if (gd == GradDtype::BF16) return f(GradTag<GradDtype::BF16>{});
  if (gd == GradDtype::F16) return f(GradTag<GradDtype::F16>{});
  return f(GradTag<GradDtype::F32>{});
}

template <class F>
inline void with_variant(GradDtype gd, LowpDtype ld, bool has_l2, F&& f) {
  with_grad_dtype(gd, [&](auto gt) { with_lowp_and_l2(gt, ld, has_l2, f); });
}

// ---- the entry points of a vector ISA file ---------------------------------------------------
// adam_<suffix>.cpp defines, in its anonymous namespace, step_loop<GD, LD, L2>, rollback_loop<GD, LD, L2>,
// SUM_BLOCK<GD>(g, len) (one block of kSumSquaresBlock elements), grad_loop<SD, ACCUMULATE> and
// compact_step_loop<B, GD, L2>(b, ed, g, n, c); this expands (inside namespace grace_adam, after
// that anonymous namespace) to the six functions GRACE_ADAM_DECLARE_ISA declares, which map the
// run-time dtypes, l2 and error width to those templates.
#define GRACE_ADAM_DEFINE_ISA(suffix, SUM_BLOCK)                                                        \
  void compact_step_##suffix(const CompactBuffers& b, ErrDtype ed, const void* g, GradDtype gd, int64_t n, \
                             const Coeffs& c) {                                                         \
    with_variant(gd, LowpDtype::NONE, c.l2 != 0.0f, [&](auto gt, auto, auto l2) {                       \
      constexpr GradDtype GD = decltype(gt)::value;                                                     \
      constexpr bool L2 = decltype(l2)::value;                                                          \
      if (ed == ErrDtype::I8) compact_step_loop<7, GD, L2>(b, ed, g, n, c);                             \
      else compact_step_loop<15, GD, L2>(b, ed, g, n, c);                                               \
    });                                                                                                 \
  }                                                                                                     \
  void step_##suffix(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp, LowpDtype ld, \
                     int64_t n, const Coeffs& c) {                                                      \
    with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {                                 \
      step_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c); \
    });                                                                                                 \
  }                                                                                                     \
  void rollback_##suffix(float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp, LowpDtype ld, \
                         int64_t n, const Coeffs& c) {                                                  \
    with_variant(gd, ld, c.l2 != 0.0f, [&](auto gt, auto lt, auto l2) {                                 \
      rollback_loop<decltype(gt)::value, decltype(lt)::value, decltype(l2)::value>(p, m, v, g, lowp, n, c); \
    });                                                                                                 \
  }                                                                                                     \
  double sum_squares_##suffix(const void* g, GradDtype gd, int64_t n) {                                 \
    double sum = 0.0;                                                                                   \
    for (int64_t begin = 0; begin < n; begin += kSumSquaresBlock) {                                     \
      const int64_t len = n - begin < kSumSquaresBlock ? n - begin : kSumSquaresBlock;                  \
      const void* block = grad_offset(g, gd, begin);                                                    \
      sum += with_grad_dtype(gd, [&](auto gt) { return SUM_BLOCK<decltype(gt)::value>(block, len); });  \
    }                                                                                                   \
    return sum;                                                                                         \
  }                                                                                                     \
  void grad_copy_##suffix(float* dst, const void* src, GradDtype sd, int64_t n) {                       \
    with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, false>(dst, src, n); });          \
  }                                                                                                     \
  void grad_accumulate_##suffix(float* dst, const void* src, GradDtype sd, int64_t n) {                 \
    with_grad_dtype(sd, [&](auto st) { grad_loop<decltype(st)::value, true>(dst, src, n); });           \
  }

}  // namespace grace_adam
