// The C++ backend's operators (chapter 9): their schemas, and their CPU kernels, which
// run the same grid and ring search as the CUDA kernels (grid.h) in plain C++.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "checks.h"
#include "grid.h"
#include "grid_cpu.h"

namespace extkernels {

namespace {

void search_cpu(const at::Tensor& p_query, const Sorted& s, int64_t k, float inv_sigma,
                at::Tensor& out, at::Tensor& indices) {
  const float* q = p_query.data_ptr<float>();
  const auto* ref = reinterpret_cast<const Point4*>(s.ref.data_ptr<float>());
  const int32_t* start = s.start.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  int64_t* idx = indices.data_ptr<int64_t>();
  EK_DISPATCH_KMAX(k, {
    at::parallel_for(0, p_query.size(0), 64, [&](int64_t begin, int64_t end) {
      TopK<KMAX> best;
      float d[KMAX];
      for (int64_t row = begin; row < end; ++row) {
        best.init((int)k);
        ring_search(q + 3 * row, ref, start, s.g, best);
        const float nearest = std::sqrt(best.d[0]);
        float total = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
          d[j] = std::sqrt(best.d[j]);
          if (inv_sigma > 0.0f) {
            d[j] = std::exp((nearest - d[j]) * inv_sigma);
            total += d[j];
          }
        }
        for (int64_t j = 0; j < k; ++j) {
          o[row * k + j] = inv_sigma > 0.0f ? d[j] / total : d[j];
          idx[row * k + j] = best.i[j];
        }
      }
    });
  });
}

std::tuple<at::Tensor, at::Tensor> knn_cpu(const at::Tensor& p_query,
                                           const at::Tensor& p_ref, int64_t k) {
  check_clouds(p_query, p_ref);
  check_k(k, p_ref.size(0));
  check_finite(p_query, p_ref, /*capturing=*/false);
  const int64_t m = p_query.size(0);
  at::Tensor distances = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  search_cpu(p_query, build_grid_cpu(p_ref), k, 0.0f, distances, indices);
  return {distances, indices};
}

// out[q] = sum_j weights[q, j] * feats[indices[q, j]] (vector_loads changes nothing on
// the CPU).
at::Tensor gather_cpu(const at::Tensor& weights, const at::Tensor& indices,
                      const at::Tensor& feats, bool vector_loads) {
  check_gather(weights, indices, feats, vector_loads);
  const int64_t m = weights.size(0), k = weights.size(1), f = feats.size(1);
  at::Tensor out = at::empty({m, f}, feats.options());
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(feats.scalar_type(), "gather_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const float* w = weights.data_ptr<float>();
    const int64_t* idx = indices.data_ptr<int64_t>();
    const scalar_t* x = feats.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(f);
      for (int64_t q = begin; q < end; ++q) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        for (int64_t j = 0; j < k; ++j) {
          if (idx[q * k + j] < 0) continue;  // no neighbour (value checks off)
          const acc_t wj = w[q * k + j];
          const scalar_t* row = x + idx[q * k + j] * f;
          for (int64_t c = 0; c < f; ++c) acc[c] += wj * static_cast<acc_t>(row[c]);
        }
        for (int64_t c = 0; c < f; ++c) o[q * f + c] = static_cast<scalar_t>(acc[c]);
      }
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> knn_aggregate_fwd_cpu(
    const at::Tensor& p_query, const at::Tensor& p_ref, const at::Tensor& feats,
    int64_t k, double sigma) {
  check_clouds(p_query, p_ref);
  check_feats(feats, p_ref);
  check_k(k, p_ref.size(0));
  check_sigma(sigma);
  check_finite(p_query, p_ref, /*capturing=*/false);
  const int64_t m = p_query.size(0);
  at::Tensor weights = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  search_cpu(p_query, build_grid_cpu(p_ref), k, (float)(1.0 / sigma), weights, indices);
  return {gather_cpu(weights, indices, feats, false), weights, indices};
}

// The gather's adjoint: grad[indices[q, j]] += weights[q, j] * grad_out[q], accumulated
// in float32 (float64 for float64), returned in grad_out's dtype.
at::Tensor knn_aggregate_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& weights,
                                 const at::Tensor& indices, int64_t n_ref) {
  check_backward(grad_out, weights, indices, n_ref);
  const int64_t m = weights.size(0), k = weights.size(1), f = grad_out.size(1);
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(grad_out.scalar_type(), "knn_aggregate_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor acc = at::zeros({n_ref, f}, grad_out.options().dtype(
                                               c10::CppTypeToScalarType<acc_t>::value));
    const float* w = weights.data_ptr<float>();
    const int64_t* idx = indices.data_ptr<int64_t>();
    const scalar_t* g = grad_out.data_ptr<scalar_t>();
    acc_t* a = acc.data_ptr<acc_t>();
    for (int64_t q = 0; q < m; ++q) {  // serial: rows of different queries collide
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = idx[q * k + j];
        if (r < 0) continue;
        for (int64_t c = 0; c < f; ++c) {
          a[r * f + c] += w[q * k + j] * static_cast<acc_t>(g[q * f + c]);
        }
      }
    }
    grad = acc.scalar_type() == grad_out.scalar_type() ? acc
                                                        : acc.to(grad_out.scalar_type());
  });
  return grad;
}

}  // namespace

TORCH_LIBRARY(extkernels_cpp, m) {
  m.def("knn(Tensor p_query, Tensor p_ref, int k) -> (Tensor, Tensor)");
  m.def(
      "knn_aggregate_fwd(Tensor p_query, Tensor p_ref, Tensor feats, int k, float sigma)"
      " -> (Tensor, Tensor, Tensor)");
  m.def("knn_aggregate_bwd(Tensor grad_out, Tensor weights, Tensor indices, int n_ref)"
        " -> Tensor");
  m.def("gather(Tensor weights, Tensor indices, Tensor feats, bool vector_loads=False)"
        " -> Tensor");
  m.def("set_value_checks(bool enabled) -> bool", &set_value_checks);
}

// What Python needs of the kernels' limits, from their one source: the most neighbours
// a query keeps (grid.h) and the most reference points (checks.h).
TORCH_LIBRARY_FRAGMENT(extkernels_cpp, m) {
  m.def("limits() -> int[]", []() { return std::vector<int64_t>{kMaxK, kMaxPoints}; });
}

TORCH_LIBRARY_IMPL(extkernels_cpp, CPU, m) {
  m.impl("knn", &knn_cpu);
  m.impl("knn_aggregate_fwd", &knn_aggregate_fwd_cpu);
  m.impl("knn_aggregate_bwd", &knn_aggregate_bwd_cpu);
  m.impl("gather", &gather_cpu);
}

}  // namespace extkernels
