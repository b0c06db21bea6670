// The fused backend's uniform grid on the GPU (chapter 11): build_grid (fused.h), the
// grid that the kNN lanes (knn_lanes_cuda.cu) and the radius walk (radius_cuda.cu)
// search.
//
// - The grid: the box and the spread of the cloud in one pass of partial sums (no
//   separate min/max and standard-deviation reductions), then chapter 9's counting sort.
//   For the radius walk the box skips the blocks' most extreme values (robust_bound,
//   grid.h): a far outlier lands in an edge cell instead of stretching every cell
//   (chapter 14). The kNN rings keep the whole box: their stopping rule assumes every
//   point lies in its cell.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "fused.h"
#include "grid.h"
#include "grid_cuda.cuh"
#include "launch.cuh"
#include "launch_fused.cuh"
#include "warp.cuh"

namespace extkernels {
namespace {

struct Moments {
  float lo[3], hi[3];
  double sum[3], sum2[3];
};

// Each block reduces a stride of the cloud to one Moments; the same threads zero the
// cell counts of the counting sort.
__global__ void __launch_bounds__(kRobustChunk)
    moments_kernel(const float* p, int64_t n, Moments* partial, int32_t* counts,
                   int64_t n_counts) {
  __shared__ Moments shared[kRobustChunk];
  Moments m;
  for (int a = 0; a < 3; ++a) {
    m.lo[a] = INFINITY;
    m.hi[a] = -INFINITY;
    m.sum[a] = 0.0;
    m.sum2[a] = 0.0;
  }
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  const int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  for (int64_t c = first; c < n_counts; c += stride) counts[c] = 0;
  for (int64_t j = first; j < n; j += stride) {
    for (int a = 0; a < 3; ++a) {
      const float x = p[3 * j + a];
      m.lo[a] = fminf(m.lo[a], x);
      m.hi[a] = fmaxf(m.hi[a], x);
      m.sum[a] += x;
      m.sum2[a] += (double)x * x;
    }
  }
  shared[threadIdx.x] = m;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      Moments& mine = shared[threadIdx.x];
      const Moments& other = shared[threadIdx.x + half];
      for (int a = 0; a < 3; ++a) {
        mine.lo[a] = fminf(mine.lo[a], other.lo[a]);
        mine.hi[a] = fmaxf(mine.hi[a], other.hi[a]);
        mine.sum[a] += other.sum[a];
        mine.sum2[a] += other.sum2[a];
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = shared[0];
}

// One block of kParamsThreads: a thread per (bound, axis, block) finds whether its
// block's extreme is the bound, with `skip` blocks further out (0: the whole box;
// robust_skip: the robust box, further_out in grid.h), and the same thread takes its
// block's sum (or sum of squares) of that axis, which its warp adds up; then one thread
// makes the grid. (One thread adding the blocks' sums would wait on one load after the
// other; a warp's lanes issue theirs at once.)
static_assert(kRobustBlocks % 32 == 0, "a stat's blocks fill whole warps");

__global__ void __launch_bounds__(kParamsThreads)
    params_kernel(const Moments* partial, int blocks, int64_t n, int skip, float min_h,
                  GridParams* out) {
  __shared__ float extremes[6][kRobustBlocks];
  __shared__ float bound[6];  // lo[3], then hi[3]
  const int t = (int)threadIdx.x, b = t % kRobustBlocks, which = t / kRobustBlocks;
  const int a = which % 3;
  const bool upper = which >= 3;
  // Thread (which, b) also takes block b's sum (which < 3) or sum of squares of axis a;
  // the kRobustBlocks / 32 warps of a stat leave their sums in warp order.
  __shared__ double sums[6][kRobustBlocks / 32];
  double v = b < blocks ? (upper ? partial[b].sum2[a] : partial[b].sum[a]) : 0.0;
  if (b < blocks) extremes[which][b] = upper ? partial[b].hi[a] : partial[b].lo[a];
  __syncthreads();
  if (b < blocks && further_out(extremes[which], blocks, b, upper) == skip) {
    bound[which] = extremes[which][b];  // a far outlier falls in an edge cell
  }
  v = warp_sum(v);
  if (t % 32 == 0) sums[which][b / 32] = v;
  __syncthreads();
  if (t != 0) return;
  float lo[3], hi[3], sd[3];
  for (int axis = 0; axis < 3; ++axis) {
    double s = 0.0, s2 = 0.0;
    for (int w = 0; w < kRobustBlocks / 32; ++w) {
      s += sums[axis][w];
      s2 += sums[3 + axis][w];
    }
    const double mean = s / (double)n;
    const double var = s2 / (double)n - mean * mean;
    sd[axis] = (float)sqrt(var > 0.0 ? var : 0.0);
    lo[axis] = bound[axis];
    hi[axis] = bound[3 + axis];
  }
  *out = make_grid(lo, hi, sd, n, min_h);
}

}  // namespace

SavedGrid build_grid(const at::Tensor& p_ref, bool deterministic, bool robust,
                     float min_h) {
  const int64_t n = p_ref.size(0);
  const int64_t capacity = cell_capacity(n);
  auto stream = c10::cuda::getCurrentCUDAStream();
  auto bytes = p_ref.options().dtype(at::kByte);
  auto ints = p_ref.options().dtype(at::kInt);
  const int blocks = robust_blocks(n);  // blocks of kRobustChunk threads
  at::Tensor partial = at::empty({(int64_t)(blocks * sizeof(Moments))}, bytes);
  at::Tensor counts = at::empty({capacity + 1}, ints);
  auto* moments = reinterpret_cast<Moments*>(partial.data_ptr<uint8_t>());
  moments_kernel<<<blocks, kRobustChunk, 0, stream>>>(
      p_ref.data_ptr<float>(), n, moments, counts.data_ptr<int32_t>(), capacity + 1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  SavedGrid d;
  d.params = at::empty({(int64_t)sizeof(GridParams)}, bytes);
  auto* params = reinterpret_cast<GridParams*>(d.params.data_ptr<uint8_t>());
  const int skip = robust ? robust_skip(blocks) : 0;
  params_kernel<<<1, kParamsThreads, 0, stream>>>(moments, blocks, n, skip, min_h, params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor keys = at::empty({n}, ints);
  count_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      p_ref.data_ptr<float>(), n, params, keys.data_ptr<int32_t>(),
      counts.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  d.start = at::cumsum(counts, 0, at::kInt);
  d.ref = at::empty({n, 4}, p_ref.options());
  at::Tensor unordered = deterministic ? at::empty({n, 4}, p_ref.options()) : d.ref;
  scatter_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
      p_ref.data_ptr<float>(), n, keys.data_ptr<int32_t>(), d.start.data_ptr<int32_t>(),
      counts.data_ptr<int32_t>(), reinterpret_cast<Point4*>(unordered.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (deterministic) {
    settle_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        reinterpret_cast<const Point4*>(unordered.data_ptr<float>()), n, params,
        d.start.data_ptr<int32_t>(), reinterpret_cast<Point4*>(d.ref.data_ptr<float>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return d;
}

}  // namespace extkernels
