// GraceAdam dispatch: which instruction sets this CPU runs, and the entry points by ISA.
#include <stdexcept>
#include <string>

#include "grace_adam.h"

#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

namespace grace_adam {
namespace {

constexpr Isa kAllIsas[] = {Isa::SCALAR, Isa::AVX2, Isa::AVX512, Isa::NEON, Isa::SVE};

bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(_M_X64)
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

bool cpu_has_sve() {
#if defined(__aarch64__) && defined(HWCAP_SVE)
  return (getauxval(AT_HWCAP) & HWCAP_SVE) != 0;
#else
  return false;
#endif
}

std::string supported_list() {
  std::string names;
  for (Isa isa : kAllIsas) {
    if (!isa_supported(isa)) continue;
    if (!names.empty()) names += ", ";
    names += isa_name(isa);
  }
  return names;
}

void require_supported(Isa isa) {
  if (isa_supported(isa)) return;
  throw std::invalid_argument(std::string("GraceAdam ISA '") + isa_name(isa) +
                              "' is not supported on this CPU; supported: " + supported_list() + ".");
}

}  // namespace

bool isa_supported(Isa isa) {
  switch (isa) {
    case Isa::SCALAR: return true;
    case Isa::AVX2: return cpu_has_avx2();
    case Isa::AVX512: return cpu_has_avx512();
#if defined(__aarch64__)
    case Isa::NEON: return true;
#else
    case Isa::NEON: return false;
#endif
    case Isa::SVE: return cpu_has_sve();
  }
  return false;
}

Isa best_isa() {
  for (Isa isa : {Isa::AVX512, Isa::SVE, Isa::AVX2, Isa::NEON}) {
    if (isa_supported(isa)) return isa;
  }
  return Isa::SCALAR;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::SCALAR: return "scalar";
    case Isa::AVX2: return "avx2";
    case Isa::AVX512: return "avx512";
    case Isa::NEON: return "neon";
    case Isa::SVE: return "sve";
  }
  return "unknown";
}

// Each case is compiled only where its entry point exists; an ISA not built for this
// architecture is never supported, so require_supported throws before the switch reaches it.
#if defined(__x86_64__) || defined(_M_X64)
#define GRACE_ADAM_CASES(fn, ...)                      \
  case Isa::AVX2: return fn##_avx2(__VA_ARGS__);       \
  case Isa::AVX512: return fn##_avx512(__VA_ARGS__);
#elif defined(__aarch64__)
#define GRACE_ADAM_CASES(fn, ...)                      \
  case Isa::NEON: return fn##_neon(__VA_ARGS__);       \
  case Isa::SVE: return fn##_sve(__VA_ARGS__);
#else
#define GRACE_ADAM_CASES(fn, ...)
#endif

void step(Isa isa, float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
          LowpDtype ld, int64_t n, const Coeffs& c) {
  require_supported(isa);
  switch (isa) {
    GRACE_ADAM_CASES(step, p, m, v, g, gd, lowp, ld, n, c)
    default: return step_scalar(p, m, v, g, gd, lowp, ld, n, c);
  }
}

void rollback(Isa isa, float* p, float* m, float* v, const void* g, GradDtype gd, void* lowp,
              LowpDtype ld, int64_t n, const Coeffs& c) {
  require_supported(isa);
  switch (isa) {
    GRACE_ADAM_CASES(rollback, p, m, v, g, gd, lowp, ld, n, c)
    default: return rollback_scalar(p, m, v, g, gd, lowp, ld, n, c);
  }
}

double sum_squares(Isa isa, const void* g, GradDtype gd, int64_t n) {
  require_supported(isa);
  switch (isa) {
    GRACE_ADAM_CASES(sum_squares, g, gd, n)
    default: return sum_squares_scalar(g, gd, n);
  }
}

void grad_copy(Isa isa, float* dst, const void* src, GradDtype sd, int64_t n) {
  require_supported(isa);
  switch (isa) {
    GRACE_ADAM_CASES(grad_copy, dst, src, sd, n)
    default: return grad_copy_scalar(dst, src, sd, n);
  }
}

void grad_accumulate(Isa isa, float* dst, const void* src, GradDtype sd, int64_t n) {
  require_supported(isa);
  switch (isa) {
    GRACE_ADAM_CASES(grad_accumulate, dst, src, sd, n)
    default: return grad_accumulate_scalar(dst, src, sd, n);
  }
}

void compact_step(Isa isa, const CompactBuffers& b, ErrDtype ed, const void* g, GradDtype gd, int64_t n,
                  const Coeffs& c) {
  require_supported(isa);
  switch (isa) {
    GRACE_ADAM_CASES(compact_step, b, ed, g, gd, n, c)
    default: return compact_step_scalar(b, ed, g, gd, n, c);
  }
}

#undef GRACE_ADAM_CASES

void lowp_copy(void* dst, LowpDtype ld, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) store_lowp(dst, ld, i, src[i]);
}

}  // namespace grace_adam
