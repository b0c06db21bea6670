// The C++ backend's CUDA kernels (chapter 9): the grid built on the device (box by a
// device reduction, a counting sort by cell with a prefix sum), then one thread per
// query running the ring search of grid.h. Every launch goes to PyTorch's current
// stream and nothing is read back on the host, so the operators can be captured in a
// CUDA graph.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "grid.h"

namespace extkernels {
namespace {

constexpr int kThreads = 128;

int blocks_for(int64_t n) { return (int)((n + kThreads - 1) / kThreads); }

__global__ void grid_params_kernel(const float* lo, const float* hi, int64_t n,
                                   GridParams* out) {
  *out = make_grid(lo, hi, n);
}

__global__ void count_kernel(const float* p, int64_t n, const GridParams* params,
                             int32_t* keys, int32_t* counts) {
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int32_t key = (int32_t)key_of(p + 3 * j, *params);
  keys[j] = key;
  atomicAdd(counts + key + 1, 1);
}

__global__ void scatter_kernel(const float* p, int64_t n, const int32_t* keys,
                               const int32_t* start, int32_t* fill, float* ref,
                               int64_t* index) {
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int32_t key = keys[j];
  const int32_t at = start[key] + atomicAdd(fill + key, 1);
  ref[3 * at] = p[3 * j];
  ref[3 * at + 1] = p[3 * j + 1];
  ref[3 * at + 2] = p[3 * j + 2];
  index[at] = j;
}

__global__ void knn_kernel(const float* q, int64_t m, const float* ref,
                           const int64_t* index, const int32_t* start,
                           const GridParams* params, int k, float* dist, int64_t* idx) {
  const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (row >= m) return;
  const GridParams g = *params;
  TopK best;
  best.init(k);
  ring_search(q + 3 * row, ref, index, start, g, best);
  for (int j = 0; j < k; ++j) {
    dist[row * k + j] = sqrtf(best.d[j]);
    idx[row * k + j] = best.i[j];
  }
}

struct DeviceGrid {
  at::Tensor params;  // one GridParams, as bytes
  at::Tensor ref, index, start;
};

// The grid of the reference cloud, on the device; the workspace is sized from the
// shapes (cell_capacity(n) cells), never from values.
DeviceGrid build_grid_cuda(const at::Tensor& p_ref) {
  const int64_t n = p_ref.size(0);
  const int64_t capacity = cell_capacity(n);
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto [lo, hi] = at::aminmax(p_ref, 0);
  DeviceGrid d;
  d.params = at::empty({(int64_t)sizeof(GridParams)}, p_ref.options().dtype(at::kByte));
  auto* params = reinterpret_cast<GridParams*>(d.params.data_ptr<uint8_t>());
  grid_params_kernel<<<1, 1, 0, stream>>>(lo.data_ptr<float>(), hi.data_ptr<float>(), n,
                                          params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto ints = p_ref.options().dtype(at::kInt);
  at::Tensor keys = at::empty({n}, ints);
  at::Tensor counts = at::zeros({capacity + 1}, ints);
  count_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      p_ref.data_ptr<float>(), n, params, keys.data_ptr<int32_t>(),
      counts.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  d.start = at::cumsum(counts, 0, at::kInt);  // each cell's first sorted point
  at::Tensor fill = at::zeros({capacity}, ints);
  d.ref = at::empty({n, 3}, p_ref.options());
  d.index = at::empty({n}, p_ref.options().dtype(at::kLong));
  scatter_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      p_ref.data_ptr<float>(), n, keys.data_ptr<int32_t>(), d.start.data_ptr<int32_t>(),
      fill.data_ptr<int32_t>(), d.ref.data_ptr<float>(), d.index.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return d;
}

std::tuple<at::Tensor, at::Tensor> knn_cuda(const at::Tensor& p_query,
                                            const at::Tensor& p_ref, int64_t k) {
  TORCH_CHECK(p_query.is_cuda() && p_ref.is_cuda() &&
                  p_query.device() == p_ref.device(),
              "p_query, p_ref: expected CUDA tensors on one device");
  TORCH_CHECK(p_query.dim() == 2 && p_query.size(1) == 3 && p_ref.dim() == 2 &&
                  p_ref.size(1) == 3,
              "p_query, p_ref: expected shapes (M, 3) and (N, 3)");
  TORCH_CHECK(p_query.scalar_type() == at::kFloat && p_ref.scalar_type() == at::kFloat,
              "p_query, p_ref: expected float32");
  TORCH_CHECK(p_query.is_contiguous() && p_ref.is_contiguous(),
              "p_query, p_ref: expected contiguous tensors");
  TORCH_CHECK(k >= 1 && k <= p_ref.size(0) && k <= kMaxK, "k: expected 1 <= k <= ",
              std::min<int64_t>(p_ref.size(0), kMaxK), ", got ", k);
  const c10::cuda::CUDAGuard guard(p_query.device());
  const int64_t m = p_query.size(0);
  at::Tensor distances = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  if (m == 0) return {distances, indices};
  const DeviceGrid d = build_grid_cuda(p_ref);
  knn_kernel<<<blocks_for(m), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      p_query.data_ptr<float>(), m, d.ref.data_ptr<float>(),
      d.index.data_ptr<int64_t>(), d.start.data_ptr<int32_t>(),
      reinterpret_cast<const GridParams*>(d.params.data_ptr<uint8_t>()), (int)k,
      distances.data_ptr<float>(), indices.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {distances, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_cpp, CUDA, m) { m.impl("knn", &knn_cuda); }

}  // namespace extkernels
