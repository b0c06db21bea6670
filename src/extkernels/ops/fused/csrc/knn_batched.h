// The batched brute-force kNN of the fused backend (chapter 11), shared by its CPU kernel
// (knn_batched.cpp) and its CUDA kernel (knn_batched_cuda.cu): the launch sizes and the
// checks of a batch of clouds packed along the point axis, cloud b's queries at rows
// query_offsets[b] .. query_offsets[b + 1] searching the reference points at rows
// ref_offsets[b] .. ref_offsets[b + 1] (Python's extkernels.ops.batches, whose messages
// these mirror).
//
// Small clouds are where a tree or a grid costs more to build and walk than every pair
// costs to test: a few thousand points, many clouds. The operator tests every pair of a
// cloud in one launch for the whole batch, and returns distances (not squared) ascending
// and global rows of p_ref, ties to the lower row, like the library's other kNN.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "checks.h"
#include "grid.h"

namespace extkernels {

// Clouds of up to this many reference points on average (and k <= 32) take the kernel
// of a group of lanes per query (knn_batched_cuda.cu); larger ones, one thread per query.
// Measured on an H200, 8 clouds, k = 16: the groups were the faster at 4,096 points per
// cloud, one thread per query at 16,384 and 65,536.
constexpr int64_t kGroupRefsPerCloud = 8192;

// The kernel of one thread per query (knn_batched_cuda.cu): queries per block, and
// reference points per tile of shared memory (as float4: 4 KiB). Every thread of a
// block reads the same point of the tile at once (a broadcast), so a tile costs one
// global read per point per block.
constexpr int kBatchedThreads = 128;
constexpr int kBatchedTile = 256;

// The metadata of one tensor of offsets: (B + 1,) int64, contiguous, on the clouds'
// device.
inline void check_offsets_meta(const at::Tensor& offsets, const char* name,
                               const at::Tensor& p_query) {
  TORCH_CHECK_TYPE(offsets.scalar_type() == at::kLong,
                   msg(name, ": expected int64 offsets, got ", offsets.scalar_type()));
  TORCH_CHECK_VALUE(offsets.dim() == 1 && offsets.size(0) >= 1,
                    msg(name, ": expected shape (B + 1,) with B >= 0 clouds, got ",
                        offsets.sizes()));
  TORCH_CHECK_VALUE(offsets.is_contiguous(),
                    msg(name, ": expected a contiguous tensor (call .contiguous() first)"));
  check_same_device(p_query, "p_query", offsets, name);
}

// Both offsets' metadata, and as many clouds of queries as of reference points.
inline void check_batch_meta(const at::Tensor& query_offsets, const at::Tensor& ref_offsets,
                             const at::Tensor& p_query) {
  check_offsets_meta(query_offsets, "query_offsets", p_query);
  check_offsets_meta(ref_offsets, "ref_offsets", p_query);
  TORCH_CHECK_VALUE(query_offsets.size(0) == ref_offsets.size(0),
                    msg("query_offsets, ref_offsets: expected as many clouds of queries "
                        "as of reference points, got ", query_offsets.size(0) - 1, " and ",
                        ref_offsets.size(0) - 1));
}

// Everything that the shapes tell: the clouds, both offsets, as many clouds of queries as
// of reference points, 1 <= k <= kMaxK. The sizes of the clouds are values (below).
inline void check_knn_batched(const at::Tensor& p_query, const at::Tensor& p_ref,
                              const at::Tensor& query_offsets,
                              const at::Tensor& ref_offsets, int64_t k) {
  check_clouds(p_query, p_ref);
  check_batch_meta(query_offsets, ref_offsets, p_query);
  TORCH_CHECK_VALUE(k >= 1 && k <= kMaxK,
                    msg("k: expected 1 <= k <= ", kMaxK,
                        " (the C++ kernels keep at most that many neighbours), got ", k));
}

// The values of offsets on the host: starting at 0, never decreasing, ending at n.
inline void check_offset_values(const int64_t* o, int64_t count, const char* name,
                                int64_t n) {
  TORCH_CHECK_VALUE(o[0] == 0, msg(name, ": expected offsets starting at 0, got ", o[0]));
  for (int64_t b = 1; b < count; ++b) {
    TORCH_CHECK_VALUE(o[b] >= o[b - 1], msg(name, ": expected non-decreasing offsets"));
  }
  TORCH_CHECK_VALUE(o[count - 1] == n,
                    msg(name, ": expected the last offset to be the number of points, ", n,
                        ", got ", o[count - 1]));
}

// Both offsets' values (host tensors), and every cloud with queries holding at least k
// reference points; the error names the first cloud that does not.
inline void check_batch_values(const at::Tensor& query_offsets,
                               const at::Tensor& ref_offsets, int64_t m, int64_t n,
                               int64_t k) {
  const int64_t count = query_offsets.size(0);
  const int64_t* qo = query_offsets.data_ptr<int64_t>();
  const int64_t* ro = ref_offsets.data_ptr<int64_t>();
  check_offset_values(qo, count, "query_offsets", m);
  check_offset_values(ro, count, "ref_offsets", n);
  for (int64_t b = 0; b + 1 < count; ++b) {
    const int64_t queries = qo[b + 1] - qo[b], size = ro[b + 1] - ro[b];
    TORCH_CHECK_VALUE(queries == 0 || size >= k,
                      msg("ref_offsets: expected cloud ", b, " to hold at least k = ", k,
                          " reference points for its ", queries, " queries, got ", size));
  }
}

// The cloud of query row `row`: the last b with offsets[b] <= row, clamped to 0 .. b - 1
// (offsets that were not checked never send a search out of the tensors).
EK_HD int64_t cloud_of(const int64_t* offsets, int64_t clouds, int64_t row) {
  int64_t lo = 0, hi = clouds;  // the answer lies in lo .. hi - 1
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Reference rows first .. end of cloud b, clamped to 0 .. n.
EK_HD void cloud_rows(const int64_t* offsets, int64_t b, int64_t n, int64_t& first,
                      int64_t& end) {
  first = offsets[b] < 0 ? 0 : (offsets[b] > n ? n : offsets[b]);
  end = offsets[b + 1] < first ? first : (offsets[b + 1] > n ? n : offsets[b + 1]);
}

}  // namespace extkernels
