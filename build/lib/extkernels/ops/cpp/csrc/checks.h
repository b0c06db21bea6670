// The argument checks of the C++ operators (chapter 9), on the host, shared by the CPU
// and CUDA kernels. They keep the book's contract (extkernels/ops/checks.py): the
// message starts with the argument's name and says what was expected; a wrong dtype is
// a TypeError in Python (TORCH_CHECK_TYPE), a wrong shape, device, layout or value a
// ValueError (TORCH_CHECK_VALUE).
//
// Each message is joined into one std::string by msg() before it reaches the check:
// c10 then passes it through as it is, without formatting its pieces in a stream. (With
// PyTorch 2.11 and g++ 13.3, a failing check whose pieces include an integer crashed the
// process instead of raising.)
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "grid.h"

namespace extkernels {

// The pieces of a message, each appended as text (no stream): what c10's stream would
// print for them ("[a, b]" for sizes, "Float" for a dtype, "cuda:0" for a device).
inline void append(std::string& s, const char* text) { s += text; }
inline void append(std::string& s, const std::string& text) { s += text; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T value) {
  s += std::to_string(value);
}
inline void append(std::string& s, double value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", value);
  s += text;
}
inline void append(std::string& s, at::IntArrayRef sizes) {
  s += '[';
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(sizes[i]);
  }
  s += ']';
}
inline void append(std::string& s, at::ScalarType dtype) { s += c10::toString(dtype); }
inline void append(std::string& s, const at::Device& device) { s += device.str(); }

template <typename... Pieces>
std::string msg(const Pieces&... pieces) {
  std::string s;
  (append(s, pieces), ...);
  return s;
}

// Whether the operators check that coordinates are finite (a device synchronisation on
// a GPU), for the calling thread only: an entry point that has just checked the values
// switches the kernels' checks off around its own call, and another thread calling at
// the same time keeps its checks. Python's value_checks switch sets it through the
// operator set_value_checks that each library including this header registers (the C++
// and fused backends).
inline bool& value_checks_flag() {
  thread_local bool flag = true;
  return flag;
}

// The operator set_value_checks: switches this thread's checks, returns the previous
// setting.
inline bool set_value_checks(bool enabled) {
  bool& flag = value_checks_flag();
  const bool previous = flag;
  flag = enabled;
  return previous;
}

// The most reference points the kernels take: the grid's cell keys (up to 8 cells per
// point) and the points' rows are 32-bit integers. Python reads it, with the most
// neighbours, from the operator limits.
constexpr int64_t kMaxPoints = (int64_t{1} << 28) - 1;

inline void check_cloud(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, msg(name,
                   ": expected dtype torch.float32, got ", t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(1) == 3, msg(name,
                    ": expected shape (n, 3), got ", t.sizes()));
  TORCH_CHECK_VALUE(t.size(0) > 0, msg(name,
                    ": expected at least one point, got an empty cloud of shape (0, 3)"));
  TORCH_CHECK_VALUE(t.is_contiguous(), msg(name,
                    ": expected a contiguous tensor (call .contiguous() first)"));
}

inline void check_same_device(const at::Tensor& first, const char* first_name,
                              const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device() == first.device(), msg(name, ": expected a tensor on ",
                    first.device(), " like ", first_name, ", got ", t.device()));
}

inline void check_clouds(const at::Tensor& p_query, const at::Tensor& p_ref) {
  check_cloud(p_query, "p_query");
  check_cloud(p_ref, "p_ref");
  check_same_device(p_query, "p_query", p_ref, "p_ref");
  TORCH_CHECK_VALUE(p_ref.size(0) <= kMaxPoints,
                    msg("p_ref: expected at most ", kMaxPoints,
                        " points (the kernels index cells and points with 32-bit "
                        "integers), got ", p_ref.size(0)));
}

inline void check_feats_dtype(const at::Tensor& t, const char* name);

// Features: float32, float64 or float16, (n_ref, F) with F >= 1, contiguous.
inline void check_feats(const at::Tensor& feats, const at::Tensor& p_ref) {
  check_feats_dtype(feats, "feats");
  TORCH_CHECK_VALUE(feats.dim() == 2 && feats.size(1) > 0,
                    msg("feats: expected shape (n_ref, F) with F >= 1, got ", feats.sizes()));
  TORCH_CHECK_VALUE(feats.size(0) == p_ref.size(0),
                    msg("feats: expected one row per reference point (", p_ref.size(0),
                    " rows), got ", feats.size(0)));
  TORCH_CHECK_VALUE(feats.is_contiguous(),
                    msg("feats: expected a contiguous tensor (call .contiguous() first)"));
  check_same_device(p_ref, "p_ref", feats, "feats");
}

inline void check_k(int64_t k, int64_t n_ref) {
  TORCH_CHECK_VALUE(k >= 1 && k <= n_ref, msg("k: expected 1 <= k <= ", n_ref,
                    " (the size of p_ref), got ", k));
  TORCH_CHECK_VALUE(k <= kMaxK, msg("k: expected k <= ", kMaxK,
                    " (the C++ kernels keep at most that many neighbours), got ", k));
}

inline void check_sigma(double sigma) {
  TORCH_CHECK_VALUE(std::isfinite(sigma) && sigma > 0,
                    msg("sigma: expected a finite value > 0, got ", sigma));
}

// Finite coordinates in both clouds, by one reduction and one read on the host; skipped
// when switched off, and while a CUDA graph is being captured (nothing may be read
// back then).
inline void check_finite(const at::Tensor& p_query, const at::Tensor& p_ref,
                         bool capturing) {
  if (capturing || !value_checks_flag()) return;
  const at::Tensor finite =
      at::stack({at::isfinite(p_query).all(), at::isfinite(p_ref).all()}).cpu();
  const bool* ok = finite.data_ptr<bool>();
  TORCH_CHECK_VALUE(ok[0], msg("p_query: expected finite coordinates, found NaN or infinity"));
  TORCH_CHECK_VALUE(ok[1], msg("p_ref: expected finite coordinates, found NaN or infinity"));
}

// The neighbours the search handed to the gather and its adjoint: (M, k) float32
// weights and int64 rows of p_ref (their values are the search's, not checked again).
inline void check_neighbours(const at::Tensor& weights, const at::Tensor& indices) {
  TORCH_CHECK_TYPE(weights.scalar_type() == at::kFloat,
                   msg("weights: expected dtype torch.float32, got ", weights.scalar_type()));
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kLong,
                   msg("indices: expected dtype torch.int64, got ", indices.scalar_type()));
  TORCH_CHECK_VALUE(weights.dim() == 2 && weights.size(1) >= 1 && weights.is_contiguous(),
                    msg("weights: expected a contiguous (M, k) tensor, got ", weights.sizes()));
  TORCH_CHECK_VALUE(indices.sizes() == weights.sizes() && indices.is_contiguous(),
                    msg("indices: expected a contiguous tensor of the shape of weights ",
                    weights.sizes(), ", got ", indices.sizes()));
  check_same_device(weights, "weights", indices, "indices");
}

inline void check_feats_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf,
                   msg(name, ": expected dtype torch.float32, torch.float64 or "
                   "torch.float16, got ", dtype));
}

// The aggregation's backward: the incoming gradient is (M, F), one row per query.
inline void check_backward(const at::Tensor& grad_out, const at::Tensor& weights,
                           const at::Tensor& indices, int64_t n_ref) {
  check_neighbours(weights, indices);
  check_feats_dtype(grad_out, "grad_out");
  TORCH_CHECK_VALUE(grad_out.dim() == 2 && grad_out.size(0) == weights.size(0) &&
                        grad_out.is_contiguous(),
                    msg("grad_out: expected a contiguous (M, F) tensor with M = ",
                    weights.size(0), ", got ", grad_out.sizes()));
  check_same_device(weights, "weights", grad_out, "grad_out");
  TORCH_CHECK_VALUE(n_ref >= 1, msg("n_ref: expected n_ref >= 1, got ", n_ref));
}

// The gather: features of the reference points, and whether to read them as float4.
inline void check_gather(const at::Tensor& weights, const at::Tensor& indices,
                         const at::Tensor& feats, bool vector_loads) {
  check_neighbours(weights, indices);
  check_feats_dtype(feats, "feats");
  TORCH_CHECK_VALUE(feats.dim() == 2 && feats.size(1) > 0 && feats.is_contiguous(),
                    msg("feats: expected a contiguous (n_ref, F) tensor with F >= 1, got ",
                    feats.sizes()));
  check_same_device(weights, "weights", feats, "feats");
  TORCH_CHECK_VALUE(
      !vector_loads || (feats.scalar_type() == at::kFloat && feats.size(1) % 4 == 0),
      msg("vector_loads: float4 loads need float32 features with F divisible by 4, got ",
      feats.scalar_type(), " and F = ", feats.size(1)));
  const auto misaligned = reinterpret_cast<uintptr_t>(feats.data_ptr()) % 16;
  TORCH_CHECK_VALUE(
      !vector_loads || misaligned == 0,
      msg("feats: float4 loads need features that start on a 16-byte boundary, got ",
      "an address ", (int64_t)misaligned, " bytes past one (a view into a larger tensor?",
      " pass vector_loads=False, or a copy)"));
}

}  // namespace extkernels
