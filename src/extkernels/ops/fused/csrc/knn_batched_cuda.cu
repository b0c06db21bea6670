// The batched brute-force kNN on the GPU (chapter 11): one launch for a whole batch of
// clouds (knn_batched.h), every pair of each cloud tested.
//
// Up to 32 neighbours in clouds of up to kGroupRefsPerCloud points on average
// (knn_group_kernel): a group of G lanes of a warp per query, G the smallest of 8, 16
// and 32 that holds k. The group keeps its query's list spread over its lanes, sorted,
// slot s in lane s. It reads its cloud's reference points G at a time, one per lane, in
// row order; a lane whose point is nearer than the k-th best raises its bit of a warp
// ballot, and the group then takes the raised points one by one, lowest lane first:
// each lane keeps its slot, takes the newcomer or takes the slot below's (one shuffle),
// so a point enters in a handful of instructions instead of k. Most points raise no bit
// once the list has filled: the work is the distances.
//
// Otherwise (knn_thread_kernel): one thread per query, 128 consecutive query rows per
// block. A block's queries belong to one cloud or to a few consecutive ones, whose
// reference points are consecutive rows of p_ref: the block streams that run through
// shared memory a tile at a time, and each thread tests the part of each tile that
// belongs to its own cloud, in row order, keeping its k best in registers, sorted, the
// list right-aligned in KMAX slots whose first KMAX - k hold -infinity (never
// displaced), so that the k-th best is always the last slot.
//
// Either way a point enters only if strictly nearer than the k-th best: visited in row
// order, of two equally near points the lower row stays, as in every kernel of the
// book. Nothing is allocated but the outputs, nothing read back with the value checks
// off: the launch can be captured in a CUDA graph.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "grid.h"
#include "knn_batched.h"
#include "launch.cuh"
#include "tree.h"

namespace extkernels {
namespace {

// (d, j) enters the sorted list (d < the last slot): every slot takes its own, the one
// below's, or the newcomer, each decided by one comparison (c[s]: d is nearer than slot
// s), all unrolled so that the list stays in registers.
template <int KMAX>
__device__ __forceinline__ void insert(float (&dist)[KMAX], int32_t (&row)[KMAX], float d,
                                       int32_t j) {
#pragma unroll
  for (int s = KMAX - 1; s > 0; --s) {
    const bool below = d < dist[s - 1], here = d < dist[s];
    dist[s] = below ? dist[s - 1] : (here ? d : dist[s]);
    row[s] = below ? row[s - 1] : (here ? j : row[s]);
  }
  if (d < dist[0]) {
    dist[0] = d;
    row[0] = j;
  }
}

template <int KMAX>
__global__ void __launch_bounds__(kBatchedThreads)
    knn_thread_kernel(const float* q, int64_t m, const float* ref, int64_t n,
                      const int64_t* query_offsets, const int64_t* ref_offsets,
                      int64_t clouds, int k, float* out, int64_t* idx) {
  __shared__ float4 tile[kBatchedTile];
  __shared__ int64_t span[2];  // the block's reference rows: its clouds' runs together
  const int64_t first = (int64_t)blockIdx.x * kBatchedThreads;
  const int64_t last = (first + kBatchedThreads < m ? first + kBatchedThreads : m) - 1;
  const int64_t row = first + threadIdx.x;
  int64_t begin = 0, end = 0;  // this query's cloud's reference rows
  if (row <= last && clouds > 0) {
    cloud_rows(ref_offsets, cloud_of(query_offsets, clouds, row), n, begin, end);
  }
  if (row == first) span[0] = begin;
  if (row == last) span[1] = end;
  __syncthreads();
  const int64_t lo = span[0], hi = span[1];
  float qx = 0.0f, qy = 0.0f, qz = 0.0f;
  if (row <= last) {
    qx = q[3 * row];
    qy = q[3 * row + 1];
    qz = q[3 * row + 2];
  }
  float dist[KMAX];
  int32_t nearest[KMAX];
#pragma unroll
  for (int s = 0; s < KMAX; ++s) {
    dist[s] = s < KMAX - k ? -INFINITY : INFINITY;
    nearest[s] = -1;
  }
  for (int64_t t0 = lo; t0 < hi; t0 += kBatchedTile) {
    const int count = (int)(hi - t0 < kBatchedTile ? hi - t0 : kBatchedTile);
    for (int i = threadIdx.x; i < count; i += kBatchedThreads) {
      const float* p = ref + 3 * (t0 + i);
      tile[i] = make_float4(__ldg(p), __ldg(p + 1), __ldg(p + 2), 0.0f);
    }
    __syncthreads();
    const int from = begin > t0 ? (int)(begin - t0) : 0;
    const int to = end - t0 < count ? (int)(end - t0) : count;  // <= from: none of mine
    for (int i = from; i < to; ++i) {
      const float4 p = tile[i];
      const float d = dist2(qx - p.x, qy - p.y, qz - p.z);
      if (d < dist[KMAX - 1]) insert<KMAX>(dist, nearest, d, (int32_t)(t0 + i));
    }
    __syncthreads();  // the tile is read before the next one overwrites it
  }
  if (row > last) return;
#pragma unroll
  for (int s = 0; s < KMAX; ++s) {
    if (s >= KMAX - k) {
      out[row * k + s - (KMAX - k)] = sqrtf(dist[s]);
      idx[row * k + s - (KMAX - k)] = nearest[s];
    }
  }
}

// Threads per block of the group kernel: 8 warps.
constexpr int kGroupThreads = 256;

// One query per group of G lanes (G = 8, 16 or 32, k <= G); see the top of the file.
// Every lane of the warp runs every iteration, so that the shuffles and ballots see the
// whole warp: a group past the last query, or done with its cloud, tests nothing.
template <int G>
__global__ void __launch_bounds__(kGroupThreads)
    knn_group_kernel(const float* q, int64_t m, const float* ref, int64_t n,
                     const int64_t* query_offsets, const int64_t* ref_offsets,
                     int64_t clouds, int k, float* out, int64_t* idx) {
  const int64_t row = ((int64_t)blockIdx.x * kGroupThreads + threadIdx.x) / G;
  const int lane = threadIdx.x & 31;
  const int slot = lane & (G - 1);  // this lane's slot in its query's list
  const unsigned group = (G == 32 ? kFullWarp : (1u << G) - 1u) << (lane & ~(G - 1));
  int64_t begin = 0, end = 0;  // the query's cloud's reference rows
  float qx = 0.0f, qy = 0.0f, qz = 0.0f;
  if (row < m) {
    cloud_rows(ref_offsets, cloud_of(query_offsets, clouds, row), n, begin, end);
    qx = q[3 * row];
    qy = q[3 * row + 1];
    qz = q[3 * row + 2];
  }
  float best = INFINITY;  // slot `slot` of the sorted list
  int32_t best_row = -1;
  for (int64_t t = begin; __any_sync(kFullWarp, t < end); t += G) {
    const int64_t j = t + slot;
    float d = INFINITY;
    if (j < end) {
      const float* p = ref + 3 * j;
      d = dist2(qx - __ldg(p), qy - __ldg(p + 1), qz - __ldg(p + 2));
    }
    const float kth = __shfl_sync(kFullWarp, best, k - 1, G);
    unsigned raised = __ballot_sync(kFullWarp, d < kth) & group;
    while (__any_sync(kFullWarp, raised != 0)) {
      const int from = raised ? __ffs(raised) - 1 : lane;
      const bool has = raised != 0;
      raised &= raised - 1;
      float dn = __shfl_sync(kFullWarp, d, from);
      const int32_t jn = __shfl_sync(kFullWarp, (int32_t)j, from);
      if (!has) dn = INFINITY;  // this group has taken all of its points
      const float below = __shfl_up_sync(kFullWarp, best, 1, G);
      const int32_t below_row = __shfl_up_sync(kFullWarp, best_row, 1, G);
      if (slot > 0 && dn < below) {
        best = below;
        best_row = below_row;
      } else if (dn < best) {
        best = dn;
        best_row = jn;
      }
    }
  }
  if (row < m && slot < k) {
    out[row * k + slot] = sqrtf(best);
    idx[row * k + slot] = best_row;
  }
}

// Launches the group kernel where k <= 32 and the clouds hold at most
// kGroupRefsPerCloud reference points on average; returns whether it did.
bool launch_group(const float* q, int64_t m, const float* ref, int64_t n,
                  const int64_t* query_offsets, const int64_t* ref_offsets,
                  int64_t clouds, int64_t k, float* out, int64_t* idx,
                  cudaStream_t stream) {
  if (k > 32 || n > kGroupRefsPerCloud * clouds) return false;
  const auto go = [&](auto kernel, int lanes) {
    kernel<<<blocks_for(m * lanes, kGroupThreads), kGroupThreads, 0, stream>>>(
        q, m, ref, n, query_offsets, ref_offsets, clouds, (int)k, out, idx);
    return true;
  };
  if (k <= 8) return go(knn_group_kernel<8>, 8);
  if (k <= 16) return go(knn_group_kernel<16>, 16);
  return go(knn_group_kernel<32>, 32);
}

std::tuple<at::Tensor, at::Tensor> knn_batched_cuda(const at::Tensor& p_query,
                                                    const at::Tensor& p_ref,
                                                    const at::Tensor& query_offsets,
                                                    const at::Tensor& ref_offsets,
                                                    int64_t k) {
  check_knn_batched(p_query, p_ref, query_offsets, ref_offsets, k);
  const c10::cuda::CUDAGuard guard(p_query.device());
  const int64_t m = p_query.size(0), n = p_ref.size(0);
  if (value_checks_flag() && !capturing()) {  // one copy of both offsets to the host
    const at::Tensor host = at::cat({query_offsets, ref_offsets}).cpu();
    const int64_t count = query_offsets.size(0);
    check_batch_values(host.narrow(0, 0, count), host.narrow(0, count, count), m, n, k);
  }
  check_finite(p_query, p_ref, capturing());
  at::Tensor distances = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t clouds = query_offsets.size(0) - 1;
  const float *q = p_query.data_ptr<float>(), *r = p_ref.data_ptr<float>();
  const int64_t* qo = query_offsets.data_ptr<int64_t>();
  const int64_t* ro = ref_offsets.data_ptr<int64_t>();
  float* d = distances.data_ptr<float>();
  int64_t* i = indices.data_ptr<int64_t>();
  if (!launch_group(q, m, r, n, qo, ro, clouds, k, d, i, stream)) {
    EK_DISPATCH_KMAX(k, {
      knn_thread_kernel<KMAX><<<blocks_for(m, kBatchedThreads), kBatchedThreads, 0,
                                stream>>>(q, m, r, n, qo, ro, clouds, (int)k, d, i);
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {distances, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_fused, CUDA, m) { m.impl("knn_batched", &knn_batched_cuda); }

}  // namespace extkernels
