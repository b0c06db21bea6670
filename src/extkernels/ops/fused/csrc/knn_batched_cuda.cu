// The batched brute-force kNN on the GPU (chapter 11): one launch for a whole batch of
// clouds (knn_batched.h), every pair of each cloud tested.
//
// One thread per query, 128 consecutive query rows per block. A block's queries belong
// to one cloud or to a few consecutive ones (a cloud of fewer queries than a block, or
// one that ends inside it), whose reference points are consecutive rows of p_ref: the
// block streams that run through shared memory a tile at a time, and each thread tests
// the part of each tile that belongs to its own cloud, in row order. Each thread keeps
// its k best in registers, sorted, the list right-aligned in KMAX slots whose first
// KMAX - k hold -infinity (never displaced), so that the k-th best is always the last
// slot and no slot is indexed at run time. A point enters only if strictly nearer than
// the k-th best: visited in row order, of two equally near points the lower row stays,
// as in every kernel of the book. Nothing is allocated but the outputs, nothing read
// back with the value checks off: the launch can be captured in a CUDA graph.
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
    knn_batched_kernel(const float* q, int64_t m, const float* ref, int64_t n,
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
  const int blocks = blocks_for(m, kBatchedThreads);
  EK_DISPATCH_KMAX(k, {
    knn_batched_kernel<KMAX><<<blocks, kBatchedThreads, 0, stream>>>(
        p_query.data_ptr<float>(), m, p_ref.data_ptr<float>(), n,
        query_offsets.data_ptr<int64_t>(), ref_offsets.data_ptr<int64_t>(),
        query_offsets.size(0) - 1, (int)k, distances.data_ptr<float>(),
        indices.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {distances, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_fused, CUDA, m) { m.impl("knn_batched", &knn_batched_cuda); }

}  // namespace extkernels
