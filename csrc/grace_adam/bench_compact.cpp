// The compact step against the fp32 step on one thread, timed in thread CPU time
// (CLOCK_THREAD_CPUTIME_ID: memory stalls count, time spent waiting for a core does not), so that
// a machine shared with other jobs still gives the kernels' own cost. Torch-free; every contender
// alternates with the others in each round. benchmarks/README.md ("Compact host state") has the
// figures. Build and run (x86_64):
//
//   g++ -O3 -ffp-contract=off -std=c++17 -Icsrc/grace_adam csrc/grace_adam/{adam_scalar,dispatch,adam_avx2,adam_avx512,bench_compact}.cpp -o bench_compact
//   ./bench_compact [n=4194304] [rounds=15] [steps per timing=1]     (e.g. 33554432 5 1; 16384 31 200 in cache)
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
#include "grace_adam.h"
namespace ga = grace_adam;
static double now() { timespec ts; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }
int main(int argc, char** argv) {
  int64_t n = argc > 1 ? atoll(argv[1]) : (1 << 22);
  int reps = argc > 2 ? atoi(argv[2]) : 15;
  int inner = argc > 3 ? atoi(argv[3]) : 1;
  std::vector<float> p(n), m(n), v(n), g(n);
  std::vector<uint16_t> gb(n);
  std::mt19937 rng(1); std::normal_distribution<float> nd(0, 1);
  for (int64_t i = 0; i < n; ++i) { p[i] = nd(rng) * 0.02f; m[i] = nd(rng) * 1e-3f; v[i] = std::abs(nd(rng)) * 1e-6f; g[i] = nd(rng) * 1e-2f; }
  for (int64_t i = 0; i < n; ++i) gb[i] = ga::f32_to_bf16_rne(g[i]);
  int64_t k = (n + 31) / 32;
  std::vector<uint16_t> hi(n), ms(k), vs(k); std::vector<int8_t> err(n), mq(n); std::vector<uint8_t> vq(n);
  ga::CompactBuffers b{hi.data(), err.data(), mq.data(), ms.data(), vq.data(), vs.data()};
  ga::compact_encode(b, ga::ErrDtype::I8, p.data(), m.data(), v.data(), n);
  ga::Coeffs c = ga::make_coeffs(10, 1e-3, 0.9, 0.999, 1e-8, 0.01, true, true, 1.0);
  ga::Isa isas[2] = {ga::Isa::AVX2, ga::Isa::AVX512};
  const char* names[6] = {"avx2 fp32", "avx2 compact f32g", "avx2 compact bf16g", "avx512 fp32", "avx512 compact f32g", "avx512 compact bf16g"};
  std::vector<double> t[6];
  for (int r = 0; r < reps + 1; ++r) {
    for (int j = 0; j < 6; ++j) {
      ga::Isa isa = isas[j / 3];
      if (!ga::isa_supported(isa)) continue;  // e.g. AVX-512 on an AVX2-only CPU
      double t0 = now();
      for (int q = 0; q < inner; ++q) {
        if (j % 3 == 0) ga::step(isa, p.data(), m.data(), v.data(), g.data(), ga::GradDtype::F32, nullptr, ga::LowpDtype::NONE, n, c);
        else if (j % 3 == 1) ga::compact_step(isa, b, ga::ErrDtype::I8, g.data(), ga::GradDtype::F32, n, c);
        else ga::compact_step(isa, b, ga::ErrDtype::I8, gb.data(), ga::GradDtype::BF16, n, c);
      }
      double dt = (now() - t0) / inner;
      if (r) t[j].push_back(dt);
    }
  }
  for (int j = 0; j < 6; ++j) {
    if (t[j].empty()) continue;
    std::sort(t[j].begin(), t[j].end());
    printf("%-22s n=%lld  min %.3f ns/el  med %.3f ns/el\n", names[j], (long long)n, t[j][0] / n * 1e9, t[j][t[j].size() / 2] / n * 1e9);
  }
  for (int i = 0; i < 2; ++i)
    if (!t[3 * i].empty()) printf("%s: compact/fp32 speed (min): f32g %.2fx bf16g %.2fx\n", i ? "avx512" : "avx2", t[3*i][0] / t[3*i+1][0], t[3*i][0] / t[3*i+2][0]);
}
