// The radius search of the fused backend on the GPU (chapter 16): one thread per query
// walks the radius grid of grid_build_cuda.cu (radius_search.h), as the radius
// aggregation's simplest kernel does, and keeps its neighbours ordered by (distance,
// row) by insertion.
//
// CSR: a first launch counts each query's neighbours, their running sum gives the
// offsets, and the last offset, E, is copied to the host: the one synchronisation, which
// the outputs' allocation needs (the fake sizes E with new_dynamic_size()). A second
// launch walks again and writes each query's neighbours into its own slice. The padded
// form needs no copy: its sizes are its inputs'.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "checks.h"
#include "fused.h"
#include "grid.h"
#include "launch.cuh"
#include "radius_search.h"
#include "radius_search_checks.h"

namespace extkernels {
namespace {

using SearchOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

struct Walk {
  const float* q;
  int64_t m, n;
  const Point4* ref;
  const int32_t* start;
  const GridParams* params;
  float radius;
  Batch batch;
};

template <typename Visit>
__device__ __forceinline__ void walk_query(const Walk& w, int64_t row, Visit&& visit) {
  const GridParams g = *w.params;
  const float qp[3] = {w.q[3 * row], w.q[3 * row + 1], w.q[3 * row + 2]};
  const Rows rows = rows_of_query(w.batch.query, w.batch.ref, w.batch.clouds, row, w.n);
  for_rows_within(qp, w.ref, w.start, g, w.radius, rows, visit);
}

// counts[row + 1]: the neighbours of query row (counts[0] stays 0).
__global__ void count_kernel(Walk w, int64_t* counts) {
  const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (row >= w.m) return;
  int64_t count = 0;
  walk_query(w, row, [&](int32_t, float) { ++count; });
  counts[row + 1] = count;
}

__global__ void fill_kernel(Walk w, const int64_t* offsets, float* distances,
                            int64_t* indices) {
  const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (row >= w.m) return;
  const int64_t first = offsets[row], size = offsets[row + 1] - first;
  int64_t used = 0;
  walk_query(w, row, [&](int32_t j, float d) {
    used = insert_sorted(distances + first, indices + first, used, size, d, j);
  });
}

__global__ void padded_kernel(Walk w, int64_t k, float* distances, int64_t* indices,
                              int64_t* counts) {
  const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (row >= w.m) return;
  int64_t used = 0;
  walk_query(w, row, [&](int32_t j, float d) {
    used = insert_sorted(distances + row * k, indices + row * k, used, k, d, j);
  });
  counts[row] = used;
}

// The grid and the walk's arguments; `grid` keeps the grid's tensors alive.
Walk walk_of(const at::Tensor& p_query, const at::Tensor& p_ref, double radius,
             const Batch& batch, SavedGrid& grid) {
  // Cells as wide as the radius, as the radius aggregation's (radius_cuda.cu).
  grid = build_grid(p_ref, /*deterministic=*/true, /*robust=*/true, (float)radius);
  return Walk{p_query.data_ptr<float>(),
              p_query.size(0),
              p_ref.size(0),
              reinterpret_cast<const Point4*>(grid.ref.data_ptr<float>()),
              grid.start.data_ptr<int32_t>(),
              reinterpret_cast<const GridParams*>(grid.params.data_ptr<uint8_t>()),
              (float)radius,
              batch};
}

SearchOut radius_search_cuda(const at::Tensor& p_query, const at::Tensor& p_ref,
                             double radius, const std::optional<at::Tensor>& query_offsets,
                             const std::optional<at::Tensor>& ref_offsets) {
  const c10::cuda::CUDAGuard guard(p_query.device());
  const Batch batch = check_radius_search(p_query, p_ref, radius, query_offsets,
                                          ref_offsets, /*values=*/!capturing());
  const int64_t m = p_query.size(0);
  if (m == 0 || p_ref.size(0) == 0) return empty_csr(p_query);
  at::Tensor offsets = at::zeros({m + 1}, p_query.options().dtype(at::kLong));
  SavedGrid grid;
  const Walk w = walk_of(p_query, p_ref, radius, batch, grid);
  auto stream = c10::cuda::getCurrentCUDAStream();
  count_kernel<<<blocks_for(m), kThreads, 0, stream>>>(w, offsets.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  offsets.cumsum_(0);
  const int64_t edges = offsets[m].item<int64_t>();  // the one copy to the host
  at::Tensor distances = at::empty({edges}, p_query.options());
  at::Tensor indices = at::empty({edges}, offsets.options());
  if (edges > 0) {
    fill_kernel<<<blocks_for(m), kThreads, 0, stream>>>(
        w, offsets.data_ptr<int64_t>(), distances.data_ptr<float>(),
        indices.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {distances, offsets, indices};
}

SearchOut radius_search_padded_cuda(const at::Tensor& p_query, const at::Tensor& p_ref,
                                    double radius, int64_t max_neighbours,
                                    const std::optional<at::Tensor>& query_offsets,
                                    const std::optional<at::Tensor>& ref_offsets) {
  const c10::cuda::CUDAGuard guard(p_query.device());
  const Batch batch = check_radius_search(p_query, p_ref, radius, query_offsets,
                                          ref_offsets, /*values=*/!capturing());
  check_max_neighbours(max_neighbours);
  const int64_t m = p_query.size(0), k = max_neighbours;
  auto [distances, indices, counts] = unfilled_padded(p_query, k);
  if (m == 0 || p_ref.size(0) == 0) return {distances, indices, counts};
  SavedGrid grid;
  const Walk w = walk_of(p_query, p_ref, radius, batch, grid);
  auto stream = c10::cuda::getCurrentCUDAStream();
  padded_kernel<<<blocks_for(m), kThreads, 0, stream>>>(
      w, k, distances.data_ptr<float>(), indices.data_ptr<int64_t>(),
      counts.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {distances, indices, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_fused, CUDA, m) {
  m.impl("radius_search", &radius_search_cuda);
  m.impl("radius_search_padded", &radius_search_padded_cuda);
}

}  // namespace extkernels
