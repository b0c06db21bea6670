// The C++ backend's CUDA kernels (chapter 9): the grid built on the device (box by a
// device reduction, a counting sort by cell with a prefix sum), one thread per query
// running the ring search of grid.h, then the gather of the neighbours' features and
// its adjoint. Every launch goes to PyTorch's current stream and nothing is read back
// on the host (but the optional value check), so the operators can be captured in a
// CUDA graph.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "grid.h"
#include "grid_cuda.cuh"
#include "launch.cuh"

namespace extkernels {
namespace {

constexpr int kSearchThreads = 64;  // of the search: more blocks, spread over more SMs

__global__ void grid_params_kernel(const float* lo, const float* hi, const float* sd,
                                   int64_t n, GridParams* out) {
  *out = make_grid(lo, hi, sd, n);
}

// One thread per query. With SOFTMAX the neighbours' softmax weights are written
// instead of their distances.
template <int KMAX, bool SOFTMAX>
__global__ void __launch_bounds__(kSearchThreads)
    search_kernel(const float* q, int64_t m, const Point4* ref, const int32_t* start,
                  const GridParams* params, int k, float inv_sigma, float* out,
                  int64_t* idx) {
  const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (row >= m) return;
  const GridParams g = *params;
  TopK<KMAX> best;
  best.init(k);
  ring_search(q + 3 * row, ref, start, g, best);
  const float nearest = sqrtf(best.d[0]);
  float total = 0.0f;
#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    if (j < k) {
      const float d = sqrtf(best.d[j]);
      best.d[j] = SOFTMAX ? __expf((nearest - d) * inv_sigma) : d;
      total += best.d[j];
    }
  }
  const float scale = SOFTMAX ? 1.0f / total : 1.0f;
#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    if (j < k) {
      out[row * k + j] = best.d[j] * scale;
      idx[row * k + j] = best.i[j];
    }
  }
}

// One thread per (query, feature): out[q, c] = sum_j w[q, j] * feats[idx[q, j], c].
template <typename scalar_t>
__global__ void gather_kernel(const float* w, const int64_t* idx, const scalar_t* feats,
                              int64_t m, int k, int64_t f, scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= m * f) return;
  const int64_t q = t / f, c = t % f;
  acc_t acc = 0;
  for (int j = 0; j < k; ++j) {
    const int64_t r = idx[q * k + j];
    if (r >= 0) acc += (acc_t)w[q * k + j] * (acc_t)feats[r * f + c];  // -1: none
  }
  out[t] = (scalar_t)acc;
}

// The same with one thread per four features, read by one float4 load (F % 4 == 0).
__global__ void gather_float4_kernel(const float* w, const int64_t* idx,
                                     const float4* feats, int64_t m, int k, int64_t f4,
                                     float4* out) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= m * f4) return;
  const int64_t q = t / f4, c = t % f4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j = 0; j < k; ++j) {
    const int64_t r = idx[q * k + j];
    if (r < 0) continue;  // no neighbour (value checks off)
    const float wj = w[q * k + j];
    const float4 x = __ldg(feats + r * f4 + c);
    acc.x += wj * x.x;
    acc.y += wj * x.y;
    acc.z += wj * x.z;
    acc.w += wj * x.w;
  }
  out[t] = acc;
}

// The adjoint, one thread per (query, feature): k atomic additions into grad.
template <typename scalar_t, typename acc_t>
__global__ void scatter_add_kernel(const scalar_t* grad_out, const float* w,
                                   const int64_t* idx, int64_t m, int k, int64_t f,
                                   acc_t* grad) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= m * f) return;
  const int64_t q = t / f, c = t % f;
  const acc_t g = (acc_t)grad_out[t];
  for (int j = 0; j < k; ++j) {
    const int64_t r = idx[q * k + j];
    if (r >= 0) atomicAdd(grad + r * f + c, (acc_t)w[q * k + j] * g);
  }
}

struct DeviceGrid {
  at::Tensor params;  // one GridParams, as bytes
  at::Tensor ref;     // (n, 4) float32 holding n Point4 in cell order
  at::Tensor start;   // (capacity + 1,) int32
};

// The grid of the reference cloud, on the device; the workspace is sized from the
// shapes (cell_capacity(n) cells), never from values.
DeviceGrid build_grid_cuda(const at::Tensor& p_ref) {
  const int64_t n = p_ref.size(0);
  const int64_t capacity = cell_capacity(n);
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto [lo, hi] = at::aminmax(p_ref, 0);
  const at::Tensor sd = at::std(p_ref, at::IntArrayRef{0}, at::Scalar(0), false);
  DeviceGrid d;
  d.params = at::empty({(int64_t)sizeof(GridParams)}, p_ref.options().dtype(at::kByte));
  auto* params = reinterpret_cast<GridParams*>(d.params.data_ptr<uint8_t>());
  grid_params_kernel<<<1, 1, 0, stream>>>(lo.data_ptr<float>(), hi.data_ptr<float>(),
                                          sd.data_ptr<float>(), n, params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto ints = p_ref.options().dtype(at::kInt);
  at::Tensor keys = at::empty({n}, ints);
  at::Tensor counts = at::zeros({capacity + 1}, ints);
  count_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      p_ref.data_ptr<float>(), n, params, keys.data_ptr<int32_t>(),
      counts.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  d.start = at::cumsum(counts, 0, at::kInt);  // each cell's first sorted point
  d.ref = at::empty({n, 4}, p_ref.options());
  scatter_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      p_ref.data_ptr<float>(), n, keys.data_ptr<int32_t>(), d.start.data_ptr<int32_t>(),
      counts.data_ptr<int32_t>(), reinterpret_cast<Point4*>(d.ref.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return d;
}

void search_cuda(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
                 float inv_sigma, at::Tensor& out, at::Tensor& indices) {
  DeviceGrid d = build_grid_cuda(p_ref);
  if (at::globalContext().deterministicAlgorithms()) {
    // The atomics of the counting sort leave a cell's points in any order; ordered by
    // row, equally near neighbours come back the same on every call.
    const int64_t n = p_ref.size(0);
    at::Tensor unordered = d.ref;
    d.ref = at::empty_like(unordered);
    settle_kernel<<<blocks_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        reinterpret_cast<const Point4*>(unordered.data_ptr<float>()), n,
        reinterpret_cast<const GridParams*>(d.params.data_ptr<uint8_t>()),
        d.start.data_ptr<int32_t>(), reinterpret_cast<Point4*>(d.ref.data_ptr<float>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t m = p_query.size(0);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* ref = reinterpret_cast<const Point4*>(d.ref.data_ptr<float>());
  const auto* params = reinterpret_cast<const GridParams*>(d.params.data_ptr<uint8_t>());
  EK_DISPATCH_KMAX(k, {
    auto kernel = inv_sigma > 0.0f ? search_kernel<KMAX, true> : search_kernel<KMAX, false>;
    kernel<<<blocks_for(m, kSearchThreads), kSearchThreads, 0, stream>>>(
        p_query.data_ptr<float>(), m, ref, d.start.data_ptr<int32_t>(), params, (int)k,
        inv_sigma, out.data_ptr<float>(), indices.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::tuple<at::Tensor, at::Tensor> knn_cuda(const at::Tensor& p_query,
                                            const at::Tensor& p_ref, int64_t k) {
  check_clouds(p_query, p_ref);
  check_k(k, p_ref.size(0));
  const c10::cuda::CUDAGuard guard(p_query.device());
  check_finite(p_query, p_ref, capturing());
  const int64_t m = p_query.size(0);
  at::Tensor distances = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  search_cuda(p_query, p_ref, k, 0.0f, distances, indices);
  return {distances, indices};
}

at::Tensor gather_cuda(const at::Tensor& weights, const at::Tensor& indices,
                       const at::Tensor& feats, bool vector_loads) {
  check_gather(weights, indices, feats, vector_loads);
  const c10::cuda::CUDAGuard guard(weights.device());
  const int64_t m = weights.size(0), f = feats.size(1);
  const int k = (int)weights.size(1);
  at::Tensor out = at::empty({m, f}, feats.options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (vector_loads) {
    const int64_t f4 = f / 4;
    gather_float4_kernel<<<blocks_for(m * f4), kThreads, 0, stream>>>(
        weights.data_ptr<float>(), indices.data_ptr<int64_t>(),
        reinterpret_cast<const float4*>(feats.data_ptr<float>()), m, k, f4,
        reinterpret_cast<float4*>(out.data_ptr<float>()));
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND_HALF(feats.scalar_type(), "gather_cuda", [&] {
      gather_kernel<scalar_t><<<blocks_for(m * f), kThreads, 0, stream>>>(
          weights.data_ptr<float>(), indices.data_ptr<int64_t>(),
          feats.data_ptr<scalar_t>(), m, k, f, out.data_ptr<scalar_t>());
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// float4 loads where the layout allows them: float32 rows of a multiple of 4 features
// (16-byte aligned, since PyTorch's allocations are).
bool float4_rows(const at::Tensor& feats) {
  return feats.scalar_type() == at::kFloat && feats.size(1) % 4 == 0 &&
         reinterpret_cast<uintptr_t>(feats.data_ptr()) % 16 == 0;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> knn_aggregate_fwd_cuda(
    const at::Tensor& p_query, const at::Tensor& p_ref, const at::Tensor& feats,
    int64_t k, double sigma) {
  check_clouds(p_query, p_ref);
  check_feats(feats, p_ref);
  check_k(k, p_ref.size(0));
  check_sigma(sigma);
  const c10::cuda::CUDAGuard guard(p_query.device());
  check_finite(p_query, p_ref, capturing());
  const int64_t m = p_query.size(0);
  at::Tensor weights = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  search_cuda(p_query, p_ref, k, (float)(1.0 / sigma), weights, indices);
  return {gather_cuda(weights, indices, feats, float4_rows(feats)), weights, indices};
}

at::Tensor knn_aggregate_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& weights,
                                  const at::Tensor& indices, int64_t n_ref) {
  check_backward(grad_out, weights, indices, n_ref);
  at::globalContext().alertNotDeterministic(
      "extkernels_cpp::knn_aggregate_bwd (atomic additions of gradient rows)");
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t m = weights.size(0), f = grad_out.size(1);
  const int k = (int)weights.size(1);
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(grad_out.scalar_type(), "knn_aggregate_bwd", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor acc = at::zeros(
        {n_ref, f}, grad_out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    scatter_add_kernel<scalar_t, acc_t><<<blocks_for(m * f), kThreads, 0, stream>>>(
        grad_out.data_ptr<scalar_t>(), weights.data_ptr<float>(),
        indices.data_ptr<int64_t>(), m, k, f, acc.data_ptr<acc_t>());
    grad = acc.scalar_type() == grad_out.scalar_type() ? acc
                                                        : acc.to(grad_out.scalar_type());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_cpp, CUDA, m) {
  m.impl("knn", &knn_cuda);
  m.impl("knn_aggregate_fwd", &knn_aggregate_fwd_cuda);
  m.impl("knn_aggregate_bwd", &knn_aggregate_bwd_cuda);
  m.impl("gather", &gather_cuda);
}

}  // namespace extkernels
