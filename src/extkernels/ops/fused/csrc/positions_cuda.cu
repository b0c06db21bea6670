// The clouds' gradients of the fused radius aggregation on the GPU (chapter 6's formula,
// radius.h's radius_position_grad): one thread per query walks the grid the forward
// built, adds each neighbour's pull into its own query's gradient and, atomically, the
// opposite pull into the neighbour's.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "fused.h"
#include "grid.h"
#include "launch.cuh"
#include "radius.h"

namespace extkernels {

namespace {

__global__ void radius_positions_bwd_kernel(const float* grad_out, const float* out,
                                            const float* feats, const float* q, int64_t m,
                                            const float* totals, const Point4* ref,
                                            const int32_t* start, const GridParams* params,
                                            float radius, float inv_sigma, int64_t f,
                                            float* grad_query, float* grad_ref) {
  const int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (row >= m) return;
  const float* g_row = grad_out + row * f;
  float grad_dot_out = 0.0f;
  for (int64_t c = 0; c < f; ++c) grad_dot_out += g_row[c] * out[row * f + c];
  const GridParams g = *params;
  const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
  radius_position_grad(
      qp, ref, start, g, radius, inv_sigma, totals[row], grad_dot_out, grad_query + 3 * row,
      [&](int32_t j) {
        const float* x = feats + (int64_t)j * f;
        float dot = 0.0f;
        for (int64_t c = 0; c < f; ++c) dot += g_row[c] * __ldg(x + c);
        return dot;
      },
      [&](int32_t j, float px, float py, float pz) {
        atomicAdd(grad_ref + 3 * (int64_t)j, px);
        atomicAdd(grad_ref + 3 * (int64_t)j + 1, py);
        atomicAdd(grad_ref + 3 * (int64_t)j + 2, pz);
      });
}

std::tuple<at::Tensor, at::Tensor> radius_positions_bwd_cuda(
    const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& feats,
    const at::Tensor& p_query, const at::Tensor& totals, const at::Tensor& grid_ref,
    const at::Tensor& grid_start, const at::Tensor& grid_params, double radius,
    double sigma) {
  check_radius_positions_backward(grad_out, out, feats, p_query, totals, grid_ref,
                                  grid_start, grid_params);
  at::globalContext().alertNotDeterministic(
      "extkernels_fused::radius_positions_bwd (atomic additions into p_ref's gradient)");
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t m = p_query.size(0), f = grad_out.size(1), n = grid_ref.size(0);
  at::Tensor grad_query = at::empty({m, 3}, p_query.options());
  at::Tensor grad_ref = at::zeros({n, 3}, p_query.options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  radius_positions_bwd_kernel<<<blocks_for(m), kThreads, 0, stream>>>(
      grad_out.data_ptr<float>(), out.data_ptr<float>(), feats.data_ptr<float>(),
      p_query.data_ptr<float>(), m, totals.data_ptr<float>(),
      reinterpret_cast<const Point4*>(grid_ref.data_ptr<float>()),
      grid_start.data_ptr<int32_t>(),
      reinterpret_cast<const GridParams*>(grid_params.data_ptr<uint8_t>()), (float)radius,
      (float)(1.0 / sigma), f, grad_query.data_ptr<float>(), grad_ref.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_query, grad_ref};
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_fused, CUDA, m) {
  m.impl("radius_positions_bwd", &radius_positions_bwd_cuda);
}

}  // namespace extkernels
