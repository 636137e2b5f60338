// The torch binding of GraceAdam: checks every input (nothing is touched when a check fails),
// releases the GIL, and runs the core on the process's own thread pool.
#include <torch/extension.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <sstream>
#include <cstring>
#include <string>
#include <tuple>

#include "grace_adam.h"
#include "thread_pool.h"

namespace grace_adam {
namespace {

// Step chunks start at multiples of this many elements (64 KiB of fp32 state per buffer), so a
// small bucket runs on the calling thread alone.
constexpr int64_t kStepGrain = 1 << 14;

struct Pool {
  ThreadPool pool;
  pid_t pid;
};

std::atomic<Pool*> g_pool{nullptr};
std::atomic<int> g_pool_size{1};

// The pool of this process. After a fork the child has none of the parent's threads: it leaks the
// parent's pool (whose mutexes may be held by threads that no longer exist) and starts its own.
ThreadPool& pool() {
  Pool* current = g_pool.load();
  if (current != nullptr && current->pid == getpid()) return current->pool;
  Pool* fresh = new Pool{ThreadPool(g_pool_size.load()), getpid()};
  if (g_pool.compare_exchange_strong(current, fresh)) return fresh->pool;
  delete fresh;
  return g_pool.load()->pool;
}

std::string dtype_name(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(st);
  }
}

std::string describe(const at::Tensor& t) {
  std::ostringstream out;
  out << dtype_name(t.scalar_type()) << " on " << t.device() << ", shape " << t.sizes() << ", strides " << t.strides();
  return out.str();
}

void check_buffer(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK_TYPE(t.device().is_cpu(), "`", name, "` must be a CPU tensor, got ", describe(t),
                   ". The host Adam works on host memory: pass the host copy of the buffer.");
  TORCH_CHECK_VALUE(t.dim() == 1, "`", name, "` must be a flat 1-D tensor, got ", describe(t),
                    ". Pass a flat view (e.g. `.view(-1)` of a contiguous buffer).");
  TORCH_CHECK_VALUE(t.is_contiguous(), "`", name, "` must be contiguous, got ", describe(t),
                    ". The kernel writes in place and never works on a hidden copy: pass the "
                    "contiguous buffer itself, not a strided view of it.");
  TORCH_CHECK_VALUE(t.numel() == n, "`", name, "` has ", t.numel(), " elements, `param` has ", n,
                    "; all buffers must have the same length.");
}

void check_state(const at::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "`", name, "` must be float32, got ", describe(t),
                   ". The host state (fp32 master weights and Adam moments) is kept in float32.");
  check_buffer(t, name, n);
}

GradDtype grad_dtype_of(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "`", name,
                   "` must be float32, bfloat16 or float16, got ", describe(t),
                   ". Cast it (`.float()`) into the fp32 staging buffer first.");
  return st == at::kFloat ? GradDtype::F32 : (st == at::kBFloat16 ? GradDtype::BF16 : GradDtype::F16);
}

GradDtype check_grad(const at::Tensor& grad, int64_t n) {
  const GradDtype gd = grad_dtype_of(grad, "grad");
  check_buffer(grad, "grad", n);
  return gd;
}

LowpDtype check_lowp(const std::optional<at::Tensor>& lowp, int64_t n) {
  if (!lowp.has_value()) return LowpDtype::NONE;
  const auto st = lowp->scalar_type();
  TORCH_CHECK_TYPE(st == at::kBFloat16 || st == at::kHalf,
                   "`param_lowp` must be None, bfloat16 or float16, got ", describe(*lowp),
                   ". It receives the rounded copy of the updated fp32 param.");
  check_buffer(*lowp, "param_lowp", n);
  return st == at::kBFloat16 ? LowpDtype::BF16 : LowpDtype::F16;
}

Isa check_isa(int64_t isa) {
  TORCH_CHECK_VALUE(isa >= static_cast<int64_t>(Isa::SCALAR) && isa <= static_cast<int64_t>(Isa::SVE),
                    "`isa` is ", isa, "; expected 0 (scalar), 1 (avx2), 2 (avx512), 3 (neon) or 4 (sve).");
  const Isa chosen = static_cast<Isa>(isa);
  TORCH_CHECK_VALUE(isa_supported(chosen), "`isa` is ", isa_name(chosen),
                    ", which this CPU does not support; use best_isa() or one isa_supported() accepts.");
  return chosen;
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0) return false;
  const char* a0 = static_cast<const char*>(a.data_ptr());
  const char* b0 = static_cast<const char*>(b.data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

void check_no_overlap(const std::vector<std::pair<const char*, const at::Tensor*>>& named) {
  for (size_t i = 0; i < named.size(); ++i) {
    for (size_t j = i + 1; j < named.size(); ++j) {
      TORCH_CHECK_VALUE(!overlaps(*named[i].second, *named[j].second), "`", named[i].first, "` and `",
                        named[j].first, "` share memory; each buffer must be its own storage.");
    }
  }
}

struct Buffers {
  float *p, *m, *v;
  const void* g;
  GradDtype gd;
  void* lowp;
  LowpDtype ld;
  int64_t n;
};

Buffers check_buffers(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                      const at::Tensor& grad, const std::optional<at::Tensor>& param_lowp) {
  const int64_t n = param.numel();
  check_state(param, "param", n);
  check_state(exp_avg, "exp_avg", n);
  check_state(exp_avg_sq, "exp_avg_sq", n);
  const GradDtype gd = check_grad(grad, n);
  const LowpDtype ld = check_lowp(param_lowp, n);
  std::vector<std::pair<const char*, const at::Tensor*>> named = {
      {"param", &param}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}, {"grad", &grad}};
  if (param_lowp.has_value()) named.emplace_back("param_lowp", &*param_lowp);
  check_no_overlap(named);
  void* lowp = param_lowp.has_value() ? param_lowp->data_ptr() : nullptr;
  return Buffers{param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
                 grad.data_ptr(), gd, lowp, ld, n};
}

Coeffs check_coeffs(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                    bool adamw, bool bias_correction, double grad_scale) {
  TORCH_CHECK_VALUE(step >= 1, "`step` is ", step, "; expected the 1-based count of the step being taken (>= 1).");
  return make_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
}

void check_invertible(const Coeffs& c) {
  TORCH_CHECK_VALUE(c.beta1 != 0.0f && c.beta2 != 0.0f && c.decay != 0.0f,
                    "rollback cannot invert a step taken with beta1 = ", c.beta1, ", beta2 = ", c.beta2,
                    ", 1 - lr*weight_decay = ", c.decay,
                    " (each must be non-zero); restore from a snapshot instead (config rollback=\"snapshot\").");
}

using Kernel = void (*)(Isa, float*, float*, float*, const void*, GradDtype, void*, LowpDtype, int64_t,
                        const Coeffs&);

void run_on_pool(Kernel kernel, Isa isa, const Buffers& b, const Coeffs& c) {
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(b.n, kStepGrain, [&](int64_t begin, int64_t end) {
    uint16_t* lowp = b.lowp == nullptr ? nullptr : static_cast<uint16_t*>(b.lowp) + begin;
    kernel(isa, b.p + begin, b.m + begin, b.v + begin, grad_offset(b.g, b.gd, begin), b.gd, lowp, b.ld,
           end - begin, c);
  });
}

void adam_step_(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                const at::Tensor& grad, const std::optional<at::Tensor>& param_lowp, int64_t step, double lr,
                double beta1, double beta2, double eps, double weight_decay, bool adamw, bool bias_correction,
                double grad_scale, int64_t isa) {
  const Buffers b = check_buffers(param, exp_avg, exp_avg_sq, grad, param_lowp);
  const Coeffs c = check_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
  run_on_pool(&grace_adam::step, check_isa(isa), b, c);
}

void adam_rollback_(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                    const at::Tensor& grad, const std::optional<at::Tensor>& param_lowp, int64_t step, double lr,
                    double beta1, double beta2, double eps, double weight_decay, bool adamw,
                    bool bias_correction, double grad_scale, int64_t isa) {
  const Buffers b = check_buffers(param, exp_avg, exp_avg_sq, grad, param_lowp);
  const Coeffs c = check_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
  check_invertible(c);
  run_on_pool(&grace_adam::rollback, check_isa(isa), b, c);
}

// Block sums land in their own slots and are added in block order afterwards, so the result is
// the same for any number of threads.
double sum_squares_(const at::Tensor& grad, int64_t isa) {
  const GradDtype gd = check_grad(grad, grad.numel());
  const Isa chosen = check_isa(isa);
  const int64_t n = grad.numel();
  const void* g = grad.data_ptr();
  std::vector<double> block_sums((n + kSumSquaresBlock - 1) / kSumSquaresBlock, 0.0);
  {
    pybind11::gil_scoped_release no_gil;
    pool().parallel_for(n, kSumSquaresBlock, [&](int64_t begin, int64_t end) {
      for (int64_t at = begin; at < end; at += kSumSquaresBlock) {
        const int64_t len = std::min(kSumSquaresBlock, end - at);
        block_sums[at / kSumSquaresBlock] = sum_squares(chosen, grad_offset(g, gd, at), gd, len);
      }
    });
  }
  double total = 0.0;
  for (double s : block_sums) total += s;
  return total;
}

// ---- segmented gradients -----------------------------------------------------------------------
// A bucket's gradient given as the tensors autograd produced, one per parameter, instead of one
// flat buffer (the CPU device with fp32, where copying them into a flat buffer would cost more
// than the step's own bookkeeping). Segment k covers elements [offset_k, offset_k + numel_k) of
// the flat state, consecutively; each may have its own dtype.

struct Segment {
  const void* g;
  GradDtype gd;
  int64_t offset, numel;
};

// Every segment: fp32/bf16/fp16, CPU, contiguous (of any shape: autograd's gradients as they come);
// none overlapping `state` (the buffers the step writes). `n`: the element count they must add up
// to (-1: any).
std::vector<Segment> check_segments(const std::vector<at::Tensor>& grads, int64_t n,
                                    const std::vector<std::pair<const char*, const at::Tensor*>>& state) {
  std::vector<Segment> segments;
  segments.reserve(grads.size());
  int64_t offset = 0;
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& t = grads[k];
    const std::string name = "grads[" + std::to_string(k) + "]";
    const GradDtype gd = grad_dtype_of(t, name.c_str());
    TORCH_CHECK_TYPE(t.device().is_cpu(), "`", name, "` must be a CPU tensor, got ", describe(t),
                     ". The host Adam works on host memory: pass the host copy of the gradient.");
    TORCH_CHECK_VALUE(t.is_contiguous(), "`", name, "` must be contiguous, got ", describe(t),
                      ". The kernel never works on a hidden copy: pass `.contiguous()` of it.");
    for (const auto& [state_name, s] : state) {
      TORCH_CHECK_VALUE(!overlaps(t, *s), "`", name, "` and `", state_name,
                        "` share memory; a gradient must not alias the state the step writes.");
    }
    segments.push_back(Segment{t.data_ptr(), gd, offset, t.numel()});
    offset += t.numel();
  }
  TORCH_CHECK_VALUE(n < 0 || offset == n, "the ", grads.size(), " gradient segments have ", offset,
                    " elements in all, `param` has ", n, "; they must cover it exactly, in order.");
  return segments;
}

// [segment, begin, end) pieces of at most `grain` elements, each starting at a multiple of
// `grain` within its segment: the units one parallel_for spreads over the pool.
struct Piece {
  int32_t segment;
  int64_t begin, end;
};

std::vector<Piece> pieces_of(const std::vector<Segment>& segments, int64_t grain) {
  std::vector<Piece> pieces;
  for (size_t k = 0; k < segments.size(); ++k) {
    for (int64_t at = 0; at < segments[k].numel; at += grain) {
      pieces.push_back(Piece{static_cast<int32_t>(k), at, std::min(at + grain, segments[k].numel)});
    }
  }
  return pieces;
}

void run_segments_on_pool(Kernel kernel, Isa isa, const Buffers& b, const std::vector<Segment>& segments,
                          const Coeffs& c) {
  const std::vector<Piece> pieces = pieces_of(segments, kStepGrain);
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(static_cast<int64_t>(pieces.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const Segment& s = segments[pieces[i].segment];
      const int64_t at = s.offset + pieces[i].begin;  // in the flat state
      uint16_t* lowp = b.lowp == nullptr ? nullptr : static_cast<uint16_t*>(b.lowp) + at;
      kernel(isa, b.p + at, b.m + at, b.v + at, grad_offset(s.g, s.gd, pieces[i].begin), s.gd, lowp, b.ld,
             pieces[i].end - pieces[i].begin, c);
    }
  });
}

// The state and lowp of check_buffers, the gradient as segments.
std::pair<Buffers, std::vector<Segment>> check_buffers_segmented(
    const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
    const std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& param_lowp) {
  const int64_t n = param.numel();
  check_state(param, "param", n);
  check_state(exp_avg, "exp_avg", n);
  check_state(exp_avg_sq, "exp_avg_sq", n);
  const LowpDtype ld = check_lowp(param_lowp, n);
  std::vector<std::pair<const char*, const at::Tensor*>> named = {
      {"param", &param}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}};
  if (param_lowp.has_value()) named.emplace_back("param_lowp", &*param_lowp);
  check_no_overlap(named);
  std::vector<Segment> segments = check_segments(grads, n, named);
  void* lowp = param_lowp.has_value() ? param_lowp->data_ptr() : nullptr;
  return {Buffers{param.data_ptr<float>(), exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(), nullptr,
                  GradDtype::F32, lowp, ld, n},
          std::move(segments)};
}

void adam_step_segments_(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                         const std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& param_lowp,
                         int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                         bool adamw, bool bias_correction, double grad_scale, int64_t isa) {
  const auto [b, segments] = check_buffers_segmented(param, exp_avg, exp_avg_sq, grads, param_lowp);
  const Coeffs c = check_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
  run_segments_on_pool(&grace_adam::step, check_isa(isa), b, segments, c);
}

void adam_rollback_segments_(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                             const std::vector<at::Tensor>& grads, const std::optional<at::Tensor>& param_lowp,
                             int64_t step, double lr, double beta1, double beta2, double eps,
                             double weight_decay, bool adamw, bool bias_correction, double grad_scale,
                             int64_t isa) {
  const auto [b, segments] = check_buffers_segmented(param, exp_avg, exp_avg_sq, grads, param_lowp);
  const Coeffs c = check_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
  check_invertible(c);
  run_segments_on_pool(&grace_adam::rollback, check_isa(isa), b, segments, c);
}

// Blocks of kSumSquaresBlock within each segment (so a block never spans two segments), each in
// its own slot, added in order: the same result for any number of threads. It may differ in the
// last bits from sum_squares of the concatenation, whose blocks fall elsewhere.
double sum_squares_segments_(const std::vector<at::Tensor>& grads, int64_t isa) {
  const std::vector<Segment> segments = check_segments(grads, -1, {});
  const Isa chosen = check_isa(isa);
  const std::vector<Piece> blocks = pieces_of(segments, kSumSquaresBlock);
  std::vector<double> block_sums(blocks.size(), 0.0);
  {
    pybind11::gil_scoped_release no_gil;
    pool().parallel_for(static_cast<int64_t>(blocks.size()), 1, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) {
        const Segment& s = segments[blocks[i].segment];
        block_sums[i] = sum_squares(chosen, grad_offset(s.g, s.gd, blocks[i].begin), s.gd,
                                    blocks[i].end - blocks[i].begin);
      }
    });
  }
  double total = 0.0;
  for (double s : block_sums) total += s;
  return total;
}

// Gradient conversion chunks start at multiples of this many elements (64 KiB of fp32 output).
constexpr int64_t kGradGrain = 1 << 14;

using GradKernel = void (*)(Isa, float*, const void*, GradDtype, int64_t);

// dst (fp32) and src (fp32/bf16/fp16) may have any shapes of one element count; both contiguous.
void check_grad_pair(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK_TYPE(dst.scalar_type() == at::kFloat, "`dst` must be float32, got ", describe(dst),
                   ". It is the fp32 gradient staging buffer the Adam step reads.");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"dst", &dst}, {"src", &src}}) {
    TORCH_CHECK_TYPE(t->device().is_cpu(), "`", name, "` must be a CPU tensor, got ", describe(*t),
                     ". Gradient accumulation runs on host memory: pass the host buffer.");
    TORCH_CHECK_VALUE(t->is_contiguous(), "`", name, "` must be contiguous, got ", describe(*t),
                      ". The kernel never works on a hidden copy: pass the contiguous buffer itself.");
  }
  TORCH_CHECK_VALUE(src.numel() == dst.numel(), "`src` has ", src.numel(), " elements, `dst` has ", dst.numel(),
                    "; they must have the same number of elements.");
  TORCH_CHECK_VALUE(!overlaps(dst, src), "`dst` and `src` share memory; accumulate into a separate fp32 buffer.");
}

void run_grad_op(GradKernel kernel, const at::Tensor& dst, const at::Tensor& src, int64_t isa) {
  const GradDtype sd = grad_dtype_of(src, "src");
  check_grad_pair(dst, src);
  const Isa chosen = check_isa(isa);
  float* out = dst.data_ptr<float>();
  const void* in = src.data_ptr();
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(dst.numel(), kGradGrain, [&](int64_t begin, int64_t end) {
    kernel(chosen, out + begin, grad_offset(in, sd, begin), sd, end - begin);
  });
}

void grad_copy_(const at::Tensor& dst, const at::Tensor& src, int64_t isa) {
  run_grad_op(&grace_adam::grad_copy, dst, src, isa);
}

void grad_accumulate_(const at::Tensor& dst, const at::Tensor& src, int64_t isa) {
  run_grad_op(&grace_adam::grad_accumulate, dst, src, isa);
}

// dst (bf16/fp16) = round(src (fp32)), the rounding the step's param_lowp gets; flat, contiguous.
void lowp_copy_(const at::Tensor& dst, const at::Tensor& src) {
  const auto st = dst.scalar_type();
  TORCH_CHECK_TYPE(st == at::kBFloat16 || st == at::kHalf, "`dst` must be bfloat16 or float16, got ", describe(dst),
                   ". It receives the rounded copy of the fp32 `src`.");
  TORCH_CHECK_TYPE(src.scalar_type() == at::kFloat, "`src` must be float32, got ", describe(src), ".");
  TORCH_CHECK_VALUE(dst.numel() == src.numel(), "`dst` has ", dst.numel(), " elements, `src` has ", src.numel(),
                    "; they must have the same number of elements.");
  check_buffer(src, "src", src.numel());
  check_buffer(dst, "dst", src.numel());
  TORCH_CHECK_VALUE(!overlaps(dst, src), "`dst` and `src` share memory; cast into a separate buffer.");
  const LowpDtype ld = st == at::kBFloat16 ? LowpDtype::BF16 : LowpDtype::F16;
  void* out = dst.data_ptr();
  const float* in = src.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(src.numel(), kGradGrain, [&](int64_t begin, int64_t end) {
    lowp_copy(static_cast<uint16_t*>(out) + begin, ld, in + begin, end - begin);
  });
}

// ---- the compact state ----------------------------------------------------------------------
// The six buffers of host/compact.py: master_bf16 bf16 [n], master_err int8/int16 [n], exp_avg_q
// int8 [n], exp_avg_scale bf16 [ceil(n/32)], exp_avg_sq_q uint8 [n], exp_avg_sq_scale bf16
// [ceil(n/32)]. Work is split at multiples of kStepGrain (a multiple of the group size).
static_assert(kStepGrain % kCompactGroup == 0, "chunks must start on group boundaries");

void check_compact_buffer(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel,
                          const char* numel_what) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "`", name, "` must be ", dtype_name(dtype), ", got ", describe(t),
                   ". The compact state format is defined in superoffload_hf/host/compact.py.");
  TORCH_CHECK_TYPE(t.device().is_cpu(), "`", name, "` must be a CPU tensor, got ", describe(t),
                   ". The compact state lives in host memory.");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), "`", name, "` must be a flat contiguous 1-D tensor, got ",
                    describe(t), ". The kernel writes in place and never works on a hidden copy.");
  TORCH_CHECK_VALUE(t.numel() == numel, "`", name, "` has ", t.numel(), " elements; expected ", numel, " (",
                    numel_what, ").");
}

struct Compact {
  CompactBuffers b;
  ErrDtype ed;
  int64_t n;
};

Compact check_compact(const at::Tensor& master_bf16, const at::Tensor& master_err, const at::Tensor& exp_avg_q,
                      const at::Tensor& exp_avg_scale, const at::Tensor& exp_avg_sq_q,
                      const at::Tensor& exp_avg_sq_scale,
                      std::vector<std::pair<const char*, const at::Tensor*>>& named) {
  const int64_t n = master_bf16.numel();
  const int64_t groups = (n + kCompactGroup - 1) / kCompactGroup;
  const std::string groups_what = "ceil(" + std::to_string(n) + " / " + std::to_string(kCompactGroup) +
                                  "), one scale per group of `master_bf16`'s elements";
  check_compact_buffer(master_bf16, "master_bf16", at::kBFloat16, n, "the length of `master_bf16`");
  const auto err_type = master_err.scalar_type();
  TORCH_CHECK_TYPE(err_type == at::kChar || err_type == at::kShort, "`master_err` must be torch.int8 (compact) or "
                   "torch.int16 (compact32), got ", describe(master_err), ".");
  check_compact_buffer(master_err, "master_err", err_type, n, "the length of `master_bf16`");
  check_compact_buffer(exp_avg_q, "exp_avg_q", at::kChar, n, "the length of `master_bf16`");
  check_compact_buffer(exp_avg_scale, "exp_avg_scale", at::kBFloat16, groups, groups_what.c_str());
  check_compact_buffer(exp_avg_sq_q, "exp_avg_sq_q", at::kByte, n, "the length of `master_bf16`");
  check_compact_buffer(exp_avg_sq_scale, "exp_avg_sq_scale", at::kBFloat16, groups, groups_what.c_str());
  named.insert(named.begin(), {{"master_bf16", &master_bf16}, {"master_err", &master_err}, {"exp_avg_q", &exp_avg_q},
                               {"exp_avg_scale", &exp_avg_scale}, {"exp_avg_sq_q", &exp_avg_sq_q},
                               {"exp_avg_sq_scale", &exp_avg_sq_scale}});
  CompactBuffers b{reinterpret_cast<uint16_t*>(master_bf16.data_ptr()), master_err.data_ptr(),
                   static_cast<int8_t*>(exp_avg_q.data_ptr()), reinterpret_cast<uint16_t*>(exp_avg_scale.data_ptr()),
                   static_cast<uint8_t*>(exp_avg_sq_q.data_ptr()),
                   reinterpret_cast<uint16_t*>(exp_avg_sq_scale.data_ptr())};
  return Compact{b, err_type == at::kChar ? ErrDtype::I8 : ErrDtype::I16, n};
}

void compact_step_(const at::Tensor& master_bf16, const at::Tensor& master_err, const at::Tensor& exp_avg_q,
                   const at::Tensor& exp_avg_scale, const at::Tensor& exp_avg_sq_q, const at::Tensor& exp_avg_sq_scale,
                   const at::Tensor& grad, int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, bool adamw, bool bias_correction, double grad_scale, int64_t isa) {
  std::vector<std::pair<const char*, const at::Tensor*>> named = {{"grad", &grad}};
  const Compact s = check_compact(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                                  named);
  const GradDtype gd = check_grad(grad, s.n);
  check_no_overlap(named);
  const Coeffs c = check_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
  const Isa chosen = check_isa(isa);
  const void* g = grad.data_ptr();
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(s.n, kStepGrain, [&](int64_t begin, int64_t end) {
    compact_step(chosen, compact_offset(s.b, s.ed, begin), s.ed, grad_offset(g, gd, begin), gd, end - begin, c);
  });
}

// The segmented gradient (see above) for the compact step, in blocks of kGatherBlock elements: a
// block inside one segment reads it in place; a block that spans segments (a group needs its 32
// gradients together) first gathers its gradient into an fp32 scratch buffer on the stack (exact:
// the conversion is the one the step would make).
constexpr int64_t kGatherBlock = 2048;
static_assert(kStepGrain % kGatherBlock == 0 && kGatherBlock % kCompactGroup == 0, "blocks start on groups");

void compact_step_segments_(const at::Tensor& master_bf16, const at::Tensor& master_err, const at::Tensor& exp_avg_q,
                            const at::Tensor& exp_avg_scale, const at::Tensor& exp_avg_sq_q,
                            const at::Tensor& exp_avg_sq_scale, const std::vector<at::Tensor>& grads, int64_t step,
                            double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
                            bool bias_correction, double grad_scale, int64_t isa) {
  std::vector<std::pair<const char*, const at::Tensor*>> named;
  const Compact s = check_compact(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                                  named);
  check_no_overlap(named);
  const std::vector<Segment> segments = check_segments(grads, s.n, named);
  const Coeffs c = check_coeffs(step, lr, beta1, beta2, eps, weight_decay, adamw, bias_correction, grad_scale);
  const Isa chosen = check_isa(isa);
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(s.n, kStepGrain, [&](int64_t chunk_begin, int64_t chunk_end) {
    float scratch[kGatherBlock];
    size_t k = 0;  // the first segment ending after `begin` (segments are consecutive, in order)
    for (int64_t begin = chunk_begin; begin < chunk_end; begin += kGatherBlock) {
      const int64_t end = std::min(chunk_end, begin + kGatherBlock);
      while (k < segments.size() && segments[k].offset + segments[k].numel <= begin) ++k;
      const CompactBuffers b = compact_offset(s.b, s.ed, begin);
      if (k < segments.size() && segments[k].offset + segments[k].numel >= end) {
        const Segment& seg = segments[k];
        compact_step(chosen, b, s.ed, grad_offset(seg.g, seg.gd, begin - seg.offset), seg.gd, end - begin, c);
        continue;
      }
      for (size_t j = k; j < segments.size() && segments[j].offset < end; ++j) {
        const Segment& seg = segments[j];
        const int64_t lo = std::max(begin, seg.offset), hi = std::min(end, seg.offset + seg.numel);
        if (hi > lo) {
          grad_copy(chosen, scratch + (lo - begin), grad_offset(seg.g, seg.gd, lo - seg.offset), seg.gd, hi - lo);
        }
      }
      compact_step(chosen, b, s.ed, scratch, GradDtype::F32, end - begin, c);
    }
  });
}

void check_fp32_state(const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, int64_t n,
                      std::vector<std::pair<const char*, const at::Tensor*>>& named) {
  check_state(param, "param", n);
  check_state(exp_avg, "exp_avg", n);
  check_state(exp_avg_sq, "exp_avg_sq", n);
  named.insert(named.end(), {{"param", &param}, {"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}});
}

template <bool ENCODE>
void compact_convert(const at::Tensor& master_bf16, const at::Tensor& master_err, const at::Tensor& exp_avg_q,
                     const at::Tensor& exp_avg_scale, const at::Tensor& exp_avg_sq_q, const at::Tensor& exp_avg_sq_scale,
                     const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
  std::vector<std::pair<const char*, const at::Tensor*>> named;
  const Compact s = check_compact(master_bf16, master_err, exp_avg_q, exp_avg_scale, exp_avg_sq_q, exp_avg_sq_scale,
                                  named);
  check_fp32_state(param, exp_avg, exp_avg_sq, s.n, named);
  check_no_overlap(named);
  float *p = param.data_ptr<float>(), *m = exp_avg.data_ptr<float>(), *v = exp_avg_sq.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(s.n, kStepGrain, [&](int64_t begin, int64_t end) {
    const CompactBuffers b = compact_offset(s.b, s.ed, begin);
    if constexpr (ENCODE) compact_encode(b, s.ed, p + begin, m + begin, v + begin, end - begin);
    else compact_decode(b, s.ed, p + begin, m + begin, v + begin, end - begin);
  });
}

// dst = src bit for bit, on the pool (snapshots of speculated compact buckets).
void bytes_copy_(const at::Tensor& dst, const at::Tensor& src) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"dst", &dst}, {"src", &src}}) {
    TORCH_CHECK_TYPE(t->device().is_cpu(), "`", name, "` must be a CPU tensor, got ", describe(*t), ".");
    TORCH_CHECK_VALUE(t->is_contiguous(), "`", name, "` must be contiguous, got ", describe(*t),
                      ". The copy never works on a hidden copy: pass the contiguous buffer itself.");
  }
  TORCH_CHECK_TYPE(dst.scalar_type() == src.scalar_type(), "`dst` is ", describe(dst), ", `src` is ", describe(src),
                   "; they must have the same dtype (a bytewise copy).");
  TORCH_CHECK_VALUE(dst.numel() == src.numel(), "`dst` has ", dst.numel(), " elements, `src` has ", src.numel(),
                    "; they must have the same number of elements.");
  TORCH_CHECK_VALUE(!overlaps(dst, src), "`dst` and `src` share memory; copy into a separate buffer.");
  char* out = static_cast<char*>(dst.data_ptr());
  const char* in = static_cast<const char*>(src.data_ptr());
  const int64_t nbytes = static_cast<int64_t>(src.nbytes());
  constexpr int64_t kCopyGrain = 1 << 18;  // bytes
  pybind11::gil_scoped_release no_gil;
  pool().parallel_for(nbytes, kCopyGrain, [&](int64_t begin, int64_t end) {
    std::memcpy(out + begin, in + begin, static_cast<size_t>(end - begin));
  });
}

void set_num_threads(int64_t threads) {
  TORCH_CHECK_VALUE(threads >= 1 && threads <= 4096, "`threads` is ", threads, "; expected an integer in [1, 4096].");
  g_pool_size.store(static_cast<int>(threads));
  pool().resize(static_cast<int>(threads));
}

int64_t get_num_threads() { return pool().size(); }

}  // namespace
}  // namespace grace_adam

namespace {

template <class Fn>
void def_update(pybind11::module_& module, const char* name, Fn fn, const char* doc) {
  namespace py = pybind11;
  module.def(name, fn, doc, py::arg("param"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("grad"),
             py::arg("param_lowp"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
             py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"), py::arg("bias_correction"),
             py::arg("grad_scale"), py::arg("isa"));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  using namespace grace_adam;
  module.doc() = "GraceAdam: the host Adam kernel (see superoffload_hf/host/reference.py for the math).";
  def_update(module, "adam_step_", &adam_step_, "One Adam step in place.");
  def_update(module, "adam_rollback_", &adam_rollback_, "Undo adam_step_ (same gradient and arguments) in place.");
  module.def("sum_squares", &sum_squares_, "Sum of squares of a flat gradient, in float64.", py::arg("grad"),
             py::arg("isa"));
  def_update(module, "adam_step_segments_", &adam_step_segments_,
             "adam_step_ with the gradient as consecutive segments (`grad`: a list of tensors).");
  def_update(module, "adam_rollback_segments_", &adam_rollback_segments_,
             "adam_rollback_ with the gradient as consecutive segments (`grad`: a list of tensors).");
  module.def("sum_squares_segments", &sum_squares_segments_,
             "Sum of squares of a gradient given as a list of flat segments, in float64.", py::arg("grads"),
             py::arg("isa"));
  module.def("grad_copy_", &grad_copy_, "dst = float(src) (src fp32, bf16 or fp16), in place.", py::arg("dst"),
             py::arg("src"), py::arg("isa"));
  module.def("grad_accumulate_", &grad_accumulate_, "dst += float(src) (one fp32 add; src fp32, bf16 or fp16).",
             py::arg("dst"), py::arg("src"), py::arg("isa"));
  module.def("lowp_copy_", &lowp_copy_, "dst (bf16/fp16) = src (fp32) rounded to nearest even, in place.",
             py::arg("dst"), py::arg("src"));
  module.def("compact_step_", &compact_step_, "One Adam step on the compact state in place (host/compact.py).",
             py::arg("master_bf16"), py::arg("master_err"), py::arg("exp_avg_q"), py::arg("exp_avg_scale"),
             py::arg("exp_avg_sq_q"), py::arg("exp_avg_sq_scale"), py::arg("grad"), py::arg("step"), py::arg("lr"),
             py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
             py::arg("bias_correction"), py::arg("grad_scale"), py::arg("isa"));
  module.def("compact_step_segments_", &compact_step_segments_,
             "compact_step_ with the gradient as consecutive segments (`grads`: a list of tensors).",
             py::arg("master_bf16"), py::arg("master_err"), py::arg("exp_avg_q"), py::arg("exp_avg_scale"),
             py::arg("exp_avg_sq_q"), py::arg("exp_avg_sq_scale"), py::arg("grads"), py::arg("step"), py::arg("lr"),
             py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw"),
             py::arg("bias_correction"), py::arg("grad_scale"), py::arg("isa"));
  for (const auto& [name, fn, doc] :
       {std::tuple<const char*, void (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&),
                   const char*>{"compact_encode_", &compact_convert<true>, "fp32 state -> the compact bytes, in place."},
        {"compact_decode_", &compact_convert<false>, "The compact bytes -> fp32 state, in place."}}) {
    module.def(name, fn, doc, py::arg("master_bf16"), py::arg("master_err"), py::arg("exp_avg_q"),
               py::arg("exp_avg_scale"), py::arg("exp_avg_sq_q"), py::arg("exp_avg_sq_scale"), py::arg("param"),
               py::arg("exp_avg"), py::arg("exp_avg_sq"));
  }
  module.def("bytes_copy_", &bytes_copy_, "dst = src bit for bit (same dtype and numel), on the pool.",
             py::arg("dst"), py::arg("src"));
  module.def("set_num_threads", &set_num_threads, "Resize this process's kernel thread pool.", py::arg("threads"));
  module.def("get_num_threads", &get_num_threads, "Size of this process's kernel thread pool.");
  module.def(
      "hold_pool_workers", [](bool held) { pool().hold_workers(held); },
      "For tests: while held, the pool's workers do not start on a call's chunks (as if not scheduled).",
      py::arg("held"));
  module.def("best_isa", [] { return static_cast<int64_t>(best_isa()); });
  module.def(
      "isa_supported",
      [](int64_t isa) {
        return isa >= 0 && isa <= static_cast<int64_t>(Isa::SVE) && isa_supported(static_cast<Isa>(isa));
      },
      py::arg("isa"));
  module.def(
      "isa_name", [](int64_t isa) { return std::string(isa_name(static_cast<Isa>(isa))); }, py::arg("isa"));
}
