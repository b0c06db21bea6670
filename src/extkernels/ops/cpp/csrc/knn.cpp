// The C++ backend's operators (chapter 9): their schemas, and their CPU kernels, which
// run the same grid and ring search as the CUDA kernels (grid.h) in plain C++.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "grid.h"

namespace extkernels {
namespace {

struct Sorted {
  GridParams g;
  at::Tensor ref;    // (n, 3) float32 in cell order
  at::Tensor index;  // (n,) int64: each sorted point's index in the caller's cloud
  at::Tensor start;  // (cells + 1,) int32: each cell's first sorted point
};

// The grid and the counting sort of the reference cloud by cell.
Sorted build_grid_cpu(const at::Tensor& p_ref) {
  const int64_t n = p_ref.size(0);
  const float* p = p_ref.data_ptr<float>();
  float lo[3] = {INFINITY, INFINITY, INFINITY}, hi[3] = {-INFINITY, -INFINITY, -INFINITY};
  for (int64_t j = 0; j < n; ++j) {
    for (int a = 0; a < 3; ++a) {
      lo[a] = std::min(lo[a], p[3 * j + a]);
      hi[a] = std::max(hi[a], p[3 * j + a]);
    }
  }
  Sorted s;
  s.g = make_grid(lo, hi, n);
  const int64_t cells = (int64_t)s.g.dims[0] * s.g.dims[1] * s.g.dims[2];
  std::vector<int64_t> key(n);
  s.start = at::zeros({cells + 1}, p_ref.options().dtype(at::kInt));
  int32_t* start = s.start.data_ptr<int32_t>();
  for (int64_t j = 0; j < n; ++j) {
    key[j] = key_of(p + 3 * j, s.g);
    ++start[key[j] + 1];
  }
  for (int64_t c = 0; c < cells; ++c) start[c + 1] += start[c];  // prefix sum
  s.ref = at::empty({n, 3}, p_ref.options());
  s.index = at::empty({n}, p_ref.options().dtype(at::kLong));
  float* ref = s.ref.data_ptr<float>();
  int64_t* index = s.index.data_ptr<int64_t>();
  std::vector<int32_t> fill(start, start + cells);
  for (int64_t j = 0; j < n; ++j) {
    const int32_t at = fill[key[j]]++;
    std::copy(p + 3 * j, p + 3 * j + 3, ref + 3 * at);
    index[at] = j;
  }
  return s;
}

void check_clouds(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k) {
  TORCH_CHECK(p_query.dim() == 2 && p_query.size(1) == 3,
              "p_query: expected shape (M, 3), got ", p_query.sizes());
  TORCH_CHECK(p_ref.dim() == 2 && p_ref.size(1) == 3,
              "p_ref: expected shape (N, 3), got ", p_ref.sizes());
  TORCH_CHECK(p_query.scalar_type() == at::kFloat && p_ref.scalar_type() == at::kFloat,
              "p_query, p_ref: expected float32");
  TORCH_CHECK(p_query.is_contiguous() && p_ref.is_contiguous(),
              "p_query, p_ref: expected contiguous tensors");
  TORCH_CHECK(k >= 1 && k <= p_ref.size(0) && k <= kMaxK, "k: expected 1 <= k <= ",
              std::min<int64_t>(p_ref.size(0), kMaxK), ", got ", k);
}

std::tuple<at::Tensor, at::Tensor> knn_cpu(const at::Tensor& p_query,
                                           const at::Tensor& p_ref, int64_t k) {
  check_clouds(p_query, p_ref, k);
  const int64_t m = p_query.size(0);
  at::Tensor distances = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  const Sorted s = build_grid_cpu(p_ref);
  const float* q = p_query.data_ptr<float>();
  const float* ref = s.ref.data_ptr<float>();
  const int64_t* index = s.index.data_ptr<int64_t>();
  const int32_t* start = s.start.data_ptr<int32_t>();
  float* d = distances.data_ptr<float>();
  int64_t* i = indices.data_ptr<int64_t>();
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
    TopK best;
    for (int64_t row = begin; row < end; ++row) {
      best.init((int)k);
      ring_search(q + 3 * row, ref, index, start, s.g, best);
      for (int64_t j = 0; j < k; ++j) {
        d[row * k + j] = std::sqrt(best.d[j]);
        i[row * k + j] = best.i[j];
      }
    }
  });
  return {distances, indices};
}

}  // namespace

TORCH_LIBRARY(extkernels_cpp, m) {
  m.def("knn(Tensor p_query, Tensor p_ref, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(extkernels_cpp, CPU, m) { m.impl("knn", &knn_cpu); }

}  // namespace extkernels
