// What the fused backend's CPU and CUDA kernels share (chapters 11 and 14): the grid
// handed from the radius forward to its backward, and the checks of the arguments that
// the C++ backend's checks.h does not cover.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <tuple>
#include <utility>

#include "checks.h"
#include "grid.h"

// The group sizes the kNN kernels are built for and the schemas' defaults are written
// once, in build.py (LANES, DEFAULT_LANES, DEFAULT_INDEX), which hands them to the
// compiler as EK_LANES_BITS (bit b set: groups of 2^b lanes), EK_DEFAULT_LANES and
// EK_DEFAULT_INDEX.
#if !defined(EK_LANES_BITS) || !defined(EK_DEFAULT_LANES) || !defined(EK_DEFAULT_INDEX)
#error "build with extkernels.ops.fused.build.load(), which defines the EK_ constants"
#endif
#define EK_STR_(x) #x
#define EK_STR(x) EK_STR_(x)
// The search operators' last arguments, with their defaults.
#define EK_SEARCH_DEFAULTS \
  "int lanes=" EK_STR(EK_DEFAULT_LANES) ", str index=\"" EK_STR(EK_DEFAULT_INDEX) "\""

namespace extkernels {

// Group sizes are powers of two up to a warp: 2^0 to 2^kMaxLanesLog2.
constexpr int kMaxLanesLog2 = 5;
constexpr bool lanes_built(int64_t lanes) {
  for (int b = 0; b <= kMaxLanesLog2; ++b) {
    if (((EK_LANES_BITS >> b) & 1) && lanes == (int64_t{1} << b)) return true;
  }
  return false;
}

// The grid as operator outputs: (n, 4) sorted points, (cell_capacity(n) + 1,) int32
// cell starts, GridParams as (sizeof(GridParams),) uint8 (the fakes read both sizes
// from the operator grid_layout).
struct SavedGrid {
  at::Tensor ref, start, params;
};

// The grid of p_ref's points on the GPU (grid_build_cuda.cu), for the kNN lanes and the
// radius walk: with `deterministic` each cell's points in row order, with `robust` the
// box less its blocks' most extreme values (robust_bound, grid.h); cells at least min_h
// wide.
SavedGrid build_grid(const at::Tensor& p_ref, bool deterministic, bool robust,
                     float min_h);

// radius_aggregate_fwd: the output, each query's total weight, and the grid.
using RadiusOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The most queries of the kNN operators: the tree search hands its long queries to a
// second kernel in a list of int32_t rows (`heavy`, tree_search_cuda.cu); one limit for
// either index. Python reads it, with kMaxRadiusQueries, from the operator limits.
constexpr int64_t kMaxQueries = 2147483647;  // INT32_MAX
// The most queries of the radius aggregation: its dense queries' lists hold int32_t rows
// too, and radius_dense_fwd_kernel (radius_cuda.cu) steps an int through a list by a
// grid's width of teams, some thousands: the step past a list of nearly 2^31 rows would
// wrap. Half leaves room.
constexpr int64_t kMaxRadiusQueries = int64_t{1} << 30;

inline void check_queries(const at::Tensor& p_query, int64_t limit, const char* why) {
  TORCH_CHECK_VALUE(p_query.size(0) <= limit, msg("p_query: expected at most ", limit,
                                                  " queries (", why, "), got ",
                                                  p_query.size(0)));
}

// An output buffer of knn_out: (M, k) of `dtype`, contiguous, on the clouds' device.
inline void check_out(const at::Tensor& t, const char* name, at::ScalarType dtype,
                      const char* dtype_name, const at::Tensor& p_query, int64_t k) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, msg(name, ": expected dtype ", dtype_name,
                                                 ", got ", t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(0) == p_query.size(0) && t.size(1) == k,
                    msg(name, ": expected shape (", p_query.size(0), ", ", k,
                        ") (M, k), got ", t.sizes()));
  TORCH_CHECK_VALUE(t.is_contiguous(), msg(name, ": expected a contiguous tensor"));
  TORCH_CHECK_VALUE(t.device() == p_query.device(),
                    msg(name, ": expected a tensor on ", p_query.device(),
                        " like p_query, got ", t.device()));
}

inline void check_lanes(int64_t lanes) {
  std::string expected;  // "1, 4, 8, 16 or 32"
  for (int b = 0, last = 31 - __builtin_clz(EK_LANES_BITS); b <= last; ++b) {
    if (!((EK_LANES_BITS >> b) & 1)) continue;
    if (!expected.empty()) expected += b == last ? " or " : ", ";
    expected += std::to_string(1 << b);
  }
  TORCH_CHECK_VALUE(lanes_built(lanes), msg("lanes: expected ", expected, " threads per query, got ",
                               lanes));
}

// The tree of tree.h on the GPU (tree_build_cuda.cu): sorted points (n, 4) float32, their
// codes (n,) int64, leaf starts (n + 1,) int32 (as many as there are leaves, plus one,
// are used), node boxes (n_nodes, 8) float32, and the layout and the parameters as
// bytes. Sized from n only: the number of leaves is known on the device alone.
struct TreeTensors {
  at::Tensor ref, codes, leaf_start, nodes, layout, params;
};
// The tree of p_ref's points; `zero`, where given, is set to 0 on the way (a counter of
// the caller's, without a launch of its own).
TreeTensors build_tree_cuda(const at::Tensor& p_ref, int32_t* zero = nullptr);
// The search by the tree (tree_search_cuda.cu): distances (inv_sigma 0) or softmax
// weights into values, rows into indices, and with feats (float32) the gather into out.
void knn_tree_cuda(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
                   float inv_sigma, const at::Tensor* feats, at::Tensor* out,
                   at::Tensor& values, at::Tensor& indices);

// The kNN operators' index: the tree of tree.h (chapter 14) or chapter 9's grid.
enum class Index { Tree, Grid };

inline Index check_index(c10::string_view index) {
  if (index == "tree") return Index::Tree;
  if (index == "grid") return Index::Grid;
  TORCH_CHECK_VALUE(false, msg("index: expected \"tree\" or \"grid\", got \"",
                               std::string(index), "\""));
  return Index::Tree;
}

inline void check_radius_args(const at::Tensor& p_query, const at::Tensor& p_ref,
                              const at::Tensor& feats, double radius, double sigma) {
  check_clouds(p_query, p_ref);
  check_feats(feats, p_ref);
  TORCH_CHECK_VALUE(std::isfinite(radius) && radius > 0,
                    msg("radius: expected a finite value > 0, got ", radius));
  check_sigma(sigma);
}

// The backward's inputs are the forward's outputs: their metadata only.
inline void check_radius_backward(const at::Tensor& grad_out, const at::Tensor& p_query,
                                  const at::Tensor& totals, const at::Tensor& grid_ref,
                                  const at::Tensor& grid_start,
                                  const at::Tensor& grid_params) {
  check_cloud(p_query, "p_query");
  check_feats_dtype(grad_out, "grad_out");
  const int64_t m = p_query.size(0), n = grid_ref.size(0);
  TORCH_CHECK_VALUE(grad_out.dim() == 2 && grad_out.size(0) == m && grad_out.is_contiguous(),
                    msg("grad_out: expected a contiguous (M, F) tensor with M = ", m,
                        ", got ", grad_out.sizes()));
  TORCH_CHECK_VALUE(totals.scalar_type() == at::kFloat && totals.dim() == 1 &&
                        totals.size(0) == m && totals.is_contiguous(),
                    msg("totals: expected a contiguous (M,) float32 tensor with M = ", m,
                        ", got ", totals.sizes()));
  TORCH_CHECK_VALUE(grid_ref.scalar_type() == at::kFloat && grid_ref.dim() == 2 &&
                        grid_ref.size(1) == 4 && n >= 1 && grid_ref.is_contiguous(),
                    msg("grid_ref: expected a contiguous (n, 4) float32 tensor, got ",
                        grid_ref.sizes()));
  TORCH_CHECK_VALUE(grid_start.scalar_type() == at::kInt && grid_start.dim() == 1 &&
                        grid_start.size(0) == cell_capacity(n) + 1,
                    msg("grid_start: expected (", cell_capacity(n) + 1,
                        ",) int32 cell starts, got ", grid_start.sizes()));
  TORCH_CHECK_VALUE(grid_params.scalar_type() == at::kByte &&
                        grid_params.numel() == (int64_t)sizeof(GridParams),
                    msg("grid_params: expected ", (int64_t)sizeof(GridParams),
                        " bytes, got ", grid_params.numel()));
  check_same_device(p_query, "p_query", grad_out, "grad_out");
  check_same_device(p_query, "p_query", totals, "totals");
  check_same_device(p_query, "p_query", grid_ref, "grid_ref");
  check_same_device(p_query, "p_query", grid_start, "grid_start");
  check_same_device(p_query, "p_query", grid_params, "grid_params");
}

// The positions' backward reads the forward's output and the features too, float32.
inline void check_radius_positions_backward(const at::Tensor& grad_out, const at::Tensor& out,
                                            const at::Tensor& feats,
                                            const at::Tensor& p_query,
                                            const at::Tensor& totals,
                                            const at::Tensor& grid_ref,
                                            const at::Tensor& grid_start,
                                            const at::Tensor& grid_params) {
  check_radius_backward(grad_out, p_query, totals, grid_ref, grid_start, grid_params);
  TORCH_CHECK_VALUE(grad_out.scalar_type() == at::kFloat,
                    msg("grad_out: expected dtype float32, got ", grad_out.scalar_type()));
  TORCH_CHECK_VALUE(out.sizes() == grad_out.sizes() && out.scalar_type() == at::kFloat &&
                        out.is_contiguous(),
                    msg("out: expected a contiguous float32 tensor of grad_out's shape ",
                        grad_out.sizes(), ", got ", out.sizes()));
  TORCH_CHECK_VALUE(feats.dim() == 2 && feats.size(0) == grid_ref.size(0) &&
                        feats.size(1) == grad_out.size(1) &&
                        feats.scalar_type() == at::kFloat && feats.is_contiguous(),
                    msg("feats: expected a contiguous float32 (N, F) tensor with N = ",
                        grid_ref.size(0), " and F = ", grad_out.size(1), ", got ",
                        feats.sizes()));
}

}  // namespace extkernels
