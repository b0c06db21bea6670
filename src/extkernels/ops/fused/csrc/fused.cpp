// The fused backend (chapter 11): schemas, and the CPU kernels.
//
// On the GPU (fused_cuda.cu) the kNN search runs with a group of `lanes` threads per
// query and does the softmax and the gather in the same kernel; on the CPU the kNN
// operators are the C++ backend's kernels (chapter 9), reached through the dispatcher:
// one algorithm, and the lanes are a GPU matter. The radius aggregation walks the same
// grid on both devices (radius.h).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <vector>

#include "checks.h"
#include "fused.h"
#include "grid.h"
#include "grid_cpu.h"
#include "radius.h"

namespace extkernels {

namespace {

using KnnOut = std::tuple<at::Tensor, at::Tensor>;
using AggregateOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

KnnOut knn_cpu(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
               int64_t lanes) {
  check_lanes(lanes);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("extkernels_cpp::knn", "")
                       .typed<KnnOut(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), p_query, p_ref, k);
}

AggregateOut knn_aggregate_fwd_cpu(const at::Tensor& p_query, const at::Tensor& p_ref,
                                   const at::Tensor& feats, int64_t k, double sigma,
                                   int64_t lanes) {
  check_lanes(lanes);
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("extkernels_cpp::knn_aggregate_fwd", "")
                       .typed<AggregateOut(const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, int64_t, double)>();
  return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), p_query, p_ref, feats,
                       k, sigma);
}

// The grid as the radius operators hand it from forward to backward: sorted points,
// cell starts padded to cell_capacity(n) + 1 entries, the parameters as bytes.
SavedGrid build_saved_grid_cpu(const at::Tensor& p_ref) {
  const int64_t n = p_ref.size(0);
  Sorted s = build_grid_cpu(p_ref);
  SavedGrid d;
  d.ref = s.ref;
  d.start = at::full({cell_capacity(n) + 1}, n, p_ref.options().dtype(at::kInt));
  d.start.narrow(0, 0, s.start.size(0)).copy_(s.start);
  d.params = at::empty({(int64_t)sizeof(GridParams)}, p_ref.options().dtype(at::kByte));
  std::memcpy(d.params.data_ptr<uint8_t>(), &s.g, sizeof(GridParams));
  return d;
}

// `warp` chooses a CUDA kernel; the CPU has one walk.
RadiusOut radius_aggregate_fwd_cpu(const at::Tensor& p_query, const at::Tensor& p_ref,
                                   const at::Tensor& feats, double radius, double sigma,
                                   bool /*warp*/) {
  check_radius_args(p_query, p_ref, feats, radius, sigma);
  check_finite(p_query, p_ref, /*capturing=*/false);
  const SavedGrid d = build_saved_grid_cpu(p_ref);
  GridParams g;
  std::memcpy(&g, d.params.data_ptr<uint8_t>(), sizeof(GridParams));
  const int64_t m = p_query.size(0), f = feats.size(1);
  at::Tensor out = at::empty({m, f}, feats.options());
  at::Tensor totals = at::empty({m}, p_query.options());
  const float* q = p_query.data_ptr<float>();
  const auto* ref = reinterpret_cast<const Point4*>(d.ref.data_ptr<float>());
  const int32_t* start = d.start.data_ptr<int32_t>();
  float* tot = totals.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(feats.scalar_type(), "radius_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = feats.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(f);
      for (int64_t row = begin; row < end; ++row) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        float total = 0.0f;
        for_neighbours(q + 3 * row, ref, start, g, (float)radius, (float)(1.0 / sigma),
                       [&](int32_t j, float w) {
                         total += w;
                         for (int64_t c = 0; c < f; ++c) {
                           acc[c] += (acc_t)w * static_cast<acc_t>(x[j * f + c]);
                         }
                       });
        tot[row] = total;
        for (int64_t c = 0; c < f; ++c) {
          o[row * f + c] = static_cast<scalar_t>(total > 0.0f ? acc[c] / total : acc_t(0));
        }
      }
    });
  });
  return {out, totals, d.ref, d.start, d.params};
}

at::Tensor radius_aggregate_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& p_query,
                                    const at::Tensor& totals, const at::Tensor& grid_ref,
                                    const at::Tensor& grid_start,
                                    const at::Tensor& grid_params, double radius,
                                    double sigma, bool /*warp*/) {
  check_radius_backward(grad_out, p_query, totals, grid_ref, grid_start, grid_params);
  GridParams g;
  std::memcpy(&g, grid_params.data_ptr<uint8_t>(), sizeof(GridParams));
  const int64_t m = p_query.size(0), f = grad_out.size(1), n = grid_ref.size(0);
  const float* q = p_query.data_ptr<float>();
  const auto* ref = reinterpret_cast<const Point4*>(grid_ref.data_ptr<float>());
  const int32_t* start = grid_start.data_ptr<int32_t>();
  const float* tot = totals.data_ptr<float>();
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(grad_out.scalar_type(), "radius_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor acc = at::zeros(
        {n, f}, grad_out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const scalar_t* go = grad_out.data_ptr<scalar_t>();
    acc_t* a = acc.data_ptr<acc_t>();
    for (int64_t row = 0; row < m; ++row) {  // serial: rows of different queries collide
      if (!(tot[row] > 0.0f)) continue;
      const acc_t scale = acc_t(1) / (acc_t)tot[row];
      for_neighbours(q + 3 * row, ref, start, g, (float)radius, (float)(1.0 / sigma),
                     [&](int32_t j, float w) {
                       for (int64_t c = 0; c < f; ++c) {
                         a[j * f + c] += (acc_t)w * scale * static_cast<acc_t>(go[row * f + c]);
                       }
                     });
    }
    grad = acc.scalar_type() == grad_out.scalar_type() ? acc
                                                        : acc.to(grad_out.scalar_type());
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY(extkernels_fused, m) {
  m.def("knn(Tensor p_query, Tensor p_ref, int k, int lanes=4) -> (Tensor, Tensor)");
  m.def(
      "knn_aggregate_fwd(Tensor p_query, Tensor p_ref, Tensor feats, int k, float sigma,"
      " int lanes=4) -> (Tensor, Tensor, Tensor)");
  m.def(
      "radius_aggregate_fwd(Tensor p_query, Tensor p_ref, Tensor feats, float radius,"
      " float sigma, bool warp=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "radius_aggregate_bwd(Tensor grad_out, Tensor p_query, Tensor totals,"
      " Tensor grid_ref, Tensor grid_start, Tensor grid_params, float radius,"
      " float sigma, bool warp=True) -> Tensor");
  m.def("set_value_checks(bool enabled) -> bool", &set_value_checks);
}

TORCH_LIBRARY_IMPL(extkernels_fused, CPU, m) {
  m.impl("knn", &knn_cpu);
  m.impl("knn_aggregate_fwd", &knn_aggregate_fwd_cpu);
  m.impl("radius_aggregate_fwd", &radius_aggregate_fwd_cpu);
  m.impl("radius_aggregate_bwd", &radius_aggregate_bwd_cpu);
}

}  // namespace extkernels
