// The radius search of the fused backend (chapter 16): its schemas, the checks both
// devices share, and its CPU kernels (radius_search.h's walk of the radius grid).
//
// - radius_search: every neighbour, as CSR: distances (E,) float32, offsets (M + 1,)
//   int64, rows (E,) int64 of p_ref. A first walk counts each query's neighbours, the
//   offsets are their running sum, a second walk writes and orders each query's
//   neighbours. E is the last offset: on the GPU the one copy to the host the search
//   makes (the caller allocates nothing before it knows E).
// - radius_search_padded: the max_neighbours nearest within the radius: distances (M, K)
//   (+inf in unused slots), rows (M, K) (-1 there), counts (M,). One walk, no copy.
//
// With offsets, the queries of cloud b take neighbours among the rows of cloud b only:
// one grid over every cloud, each walk skipping the other clouds' rows.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "checks.h"
#include "grid.h"
#include "grid_cpu.h"
#include "knn_batched.h"
#include "radius_search.h"
#include "radius_search_checks.h"

namespace extkernels {
namespace {

using SearchOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Each query's walk over the grid of p_ref, visit(row, rows of p_ref it may take, the
// walk): the grid built once, the queries split over the threads.
template <typename Body>
void walk_queries(const at::Tensor& p_query, const at::Tensor& p_ref, double radius,
                  const Batch& batch, Body&& body) {
  const Sorted s = build_grid_cpu(p_ref, /*robust=*/true, (float)radius);
  const auto* ref = reinterpret_cast<const Point4*>(s.ref.data_ptr<float>());
  const int32_t* start = s.start.data_ptr<int32_t>();
  const float* q = p_query.data_ptr<float>();
  const int64_t n = p_ref.size(0);
  at::parallel_for(0, p_query.size(0), 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const Rows rows = rows_of_query(batch.query, batch.ref, batch.clouds, row, n);
      body(row, [&](auto&& visit) {
        for_rows_within(q + 3 * row, ref, start, s.g, (float)radius, rows, visit);
      });
    }
  });
}

SearchOut radius_search_cpu(const at::Tensor& p_query, const at::Tensor& p_ref,
                            double radius, const std::optional<at::Tensor>& query_offsets,
                            const std::optional<at::Tensor>& ref_offsets) {
  const Batch batch = check_radius_search(p_query, p_ref, radius, query_offsets,
                                          ref_offsets, /*values=*/true);
  const int64_t m = p_query.size(0);
  if (m == 0 || p_ref.size(0) == 0) return empty_csr(p_query);
  at::Tensor offsets = at::zeros({m + 1}, p_query.options().dtype(at::kLong));
  int64_t* o = offsets.data_ptr<int64_t>();
  walk_queries(p_query, p_ref, radius, batch, [&](int64_t row, auto&& walk) {
    int64_t count = 0;
    walk([&](int32_t, float) { ++count; });
    o[row + 1] = count;
  });
  for (int64_t row = 0; row < m; ++row) o[row + 1] += o[row];
  at::Tensor distances = at::empty({o[m]}, p_query.options());
  at::Tensor indices = at::empty({o[m]}, offsets.options());
  float* d = distances.data_ptr<float>();
  int64_t* idx = indices.data_ptr<int64_t>();
  walk_queries(p_query, p_ref, radius, batch, [&](int64_t row, auto&& walk) {
    const int64_t first = o[row], size = o[row + 1] - o[row];
    int64_t used = 0;
    walk([&](int32_t j, float dist) {
      used = insert_sorted(d + first, idx + first, used, size, dist, j);
    });
  });
  return {distances, offsets, indices};
}

SearchOut radius_search_padded_cpu(const at::Tensor& p_query, const at::Tensor& p_ref,
                                   double radius, int64_t max_neighbours,
                                   const std::optional<at::Tensor>& query_offsets,
                                   const std::optional<at::Tensor>& ref_offsets) {
  const Batch batch = check_radius_search(p_query, p_ref, radius, query_offsets,
                                          ref_offsets, /*values=*/true);
  check_max_neighbours(max_neighbours);
  const int64_t m = p_query.size(0), k = max_neighbours;
  auto [distances, indices, counts] = unfilled_padded(p_query, k);
  if (m == 0 || p_ref.size(0) == 0) return {distances, indices, counts};
  float* d = distances.data_ptr<float>();
  int64_t* idx = indices.data_ptr<int64_t>();
  int64_t* c = counts.data_ptr<int64_t>();
  walk_queries(p_query, p_ref, radius, batch, [&](int64_t row, auto&& walk) {
    int64_t used = 0;
    walk([&](int32_t j, float dist) {
      used = insert_sorted(d + row * k, idx + row * k, used, k, dist, j);
    });
    c[row] = used;
  });
  return {distances, indices, counts};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(extkernels_fused, m) {
  // Every reference point within radius of each query, nearest first, ties to the lower
  // row: (distances (E,) float32, offsets (M + 1,) int64, rows (E,) int64 of p_ref).
  m.def(
      "radius_search(Tensor p_query, Tensor p_ref, float radius,"
      " Tensor? query_offsets=None, Tensor? ref_offsets=None) -> (Tensor, Tensor, Tensor)");
  // The max_neighbours nearest within radius: (distances (M, K), rows (M, K), counts (M,)).
  m.def(
      "radius_search_padded(Tensor p_query, Tensor p_ref, float radius,"
      " int max_neighbours, Tensor? query_offsets=None, Tensor? ref_offsets=None)"
      " -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(extkernels_fused, CPU, m) {
  m.impl("radius_search", &radius_search_cpu);
  m.impl("radius_search_padded", &radius_search_padded_cpu);
}

}  // namespace extkernels
