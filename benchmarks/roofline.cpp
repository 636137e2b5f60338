// Roofline for benchmarks/adam.py: the host Adam's memory traffic with almost no arithmetic.
//
// Per element it reads p, g, m, v (fp32) and writes p, m, v (fp32) and the bf16 copy of p:
// 16 B read + 14 B written = 30 B, the bytes a fused Adam step with a bf16 copy must move.
// The arithmetic is one add or fma per state element and a shift, so the time is what the
// memory system allows. Benchmark-only: built with -march=native, never part of the package.
#include <torch/extension.h>

#include <omp.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// A power of two: g * kTiny is exact, so the results are checkable bit for bit in PyTorch
// (p + g*kTiny, m + g*kTiny, v + (g*g)*kTiny, built with -ffp-contract=off).
constexpr float kTiny = 0x1p-20f;
// Thread slices start at multiples of this many elements (256 B of fp32, 128 B of bf16), so no
// two threads write the same cache line.
constexpr int64_t kSliceAlign = 64;

inline uint16_t bf16_truncate(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>(bits >> 16);
}

inline void traffic_one(float* p, float* m, float* v, const float* g, uint16_t* lowp, int64_t i) {
  const float gi = g[i];
  const float pi = p[i] + gi * kTiny;
  m[i] = m[i] + gi * kTiny;
  v[i] = v[i] + (gi * gi) * kTiny;
  p[i] = pi;
  lowp[i] = bf16_truncate(pi);
}

// Plain stores everywhere: the bf16 lines are write-allocated (read before written) as in any
// kernel that does not use streaming stores.
void traffic_plain(float* __restrict p, float* __restrict m, float* __restrict v,
                   const float* __restrict g, uint16_t* __restrict lowp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float pi = p[i] + gi * kTiny;
    m[i] = m[i] + gi * kTiny;
    v[i] = v[i] + (gi * gi) * kTiny;
    p[i] = pi;
    uint32_t bits;
    std::memcpy(&bits, &pi, 4);
    lowp[i] = static_cast<uint16_t>(bits >> 16);
  }
}

#if defined(__AVX2__)
// The bf16 copy written with non-temporal (streaming) stores: no write-allocate read of the
// write-only output. p, m, v are read first, so their lines are in cache and stored normally.
void traffic_streaming(float* p, float* m, float* v, const float* g, uint16_t* lowp, int64_t n) {
  int64_t i = 0;
  for (; i < n && (reinterpret_cast<uintptr_t>(lowp + i) & 31u) != 0; ++i) traffic_one(p, m, v, g, lowp, i);
  const __m256 tiny = _mm256_set1_ps(kTiny);
  for (; i + 16 <= n; i += 16) {
    __m256 hi16[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t j = i + 8 * h;
      const __m256 gj = _mm256_loadu_ps(g + j);
      const __m256 pj = _mm256_add_ps(_mm256_loadu_ps(p + j), _mm256_mul_ps(gj, tiny));
      _mm256_storeu_ps(m + j, _mm256_add_ps(_mm256_loadu_ps(m + j), _mm256_mul_ps(gj, tiny)));
      _mm256_storeu_ps(v + j, _mm256_add_ps(_mm256_loadu_ps(v + j),
                                            _mm256_mul_ps(_mm256_mul_ps(gj, gj), tiny)));
      _mm256_storeu_ps(p + j, pj);
      hi16[h] = _mm256_castsi256_ps(_mm256_srli_epi32(_mm256_castps_si256(pj), 16));
    }
    // packus interleaves 128-bit lanes (a0-3 b0-3 a4-7 b4-7); the permute restores order.
    const __m256i packed = _mm256_packus_epi32(_mm256_castps_si256(hi16[0]), _mm256_castps_si256(hi16[1]));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(lowp + i), _mm256_permute4x64_epi64(packed, 0xD8));
  }
  for (; i < n; ++i) traffic_one(p, m, v, g, lowp, i);
  _mm_sfence();  // streaming stores are weakly ordered: fence before the caller reads lowp
}
#endif

void check_buffer(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.is_contiguous(),
              "roofline: `", name, "` must be a flat contiguous CPU tensor of ", c10::toString(dtype),
              ", got ", t.scalar_type(), " of shape ", t.sizes(), " on ", t.device());
  TORCH_CHECK(t.numel() == n, "roofline: `", name, "` has ", t.numel(), " elements, `param` has ", n);
}

bool has_streaming() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

// One pass over all elements on exactly `threads` threads (an explicit OpenMP team size, so
// OMP_NUM_THREADS does not matter), each thread one contiguous slice.
void traffic(torch::Tensor p, torch::Tensor m, torch::Tensor v, torch::Tensor g, torch::Tensor lowp,
             int64_t threads, bool streaming) {
  const int64_t n = p.numel();
  check_buffer(p, "param", torch::kFloat, n);
  check_buffer(m, "exp_avg", torch::kFloat, n);
  check_buffer(v, "exp_avg_sq", torch::kFloat, n);
  check_buffer(g, "grad", torch::kFloat, n);
  check_buffer(lowp, "param_lowp", torch::kBFloat16, n);
  TORCH_CHECK(threads >= 1, "roofline: `threads` is ", threads, "; expected >= 1");
  TORCH_CHECK(!streaming || has_streaming(), "roofline: streaming stores need AVX2; this build has none");
  float* pp = p.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  uint16_t* lp = reinterpret_cast<uint16_t*>(lowp.data_ptr<at::BFloat16>());
  pybind11::gil_scoped_release no_gil;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t per = (n / nt + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
    const int64_t begin = std::min(n, t * per), end = (t == nt - 1) ? n : std::min(n, begin + per);
    if (end > begin) {
#if defined(__AVX2__)
      if (streaming) {
        traffic_streaming(pp + begin, mp + begin, vp + begin, gp + begin, lp + begin, end - begin);
      } else
#endif
      {
        traffic_plain(pp + begin, mp + begin, vp + begin, gp + begin, lp + begin, end - begin);
      }
    }
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("traffic", &traffic, "One pass of the Adam access pattern with negligible arithmetic.");
  module.def("has_streaming", &has_streaming, "Whether the streaming-store (non-temporal bf16 write) variant exists.");
}
