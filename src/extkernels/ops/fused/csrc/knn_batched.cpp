// The batched brute-force kNN (chapter 11): its schema and its CPU kernel, which tests
// every pair of each cloud in plain loops (the reference for the CUDA kernel of
// knn_batched_cuda.cu, which tests the same pairs in the same order).
//
// Synchronisation: the operator checks the offsets' values (start at 0, never decrease,
// end at the number of points, k reference points in every cloud with queries) and the
// coordinates (finite) where the value checks are on. On the CPU that costs nothing. On
// the GPU it is one copy of both offsets to the host and one read of the finite check;
// with the checks off (the Python entry point, which has checked the values itself, and
// any CUDA graph's capture) the CUDA operator reads nothing back, and a cloud with fewer
// than k points leaves its queries' last neighbours at distance infinity, row -1.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>

#include "checks.h"
#include "grid.h"
#include "knn_batched.h"
#include "tree.h"

namespace extkernels {
namespace {

std::tuple<at::Tensor, at::Tensor> knn_batched_cpu(const at::Tensor& p_query,
                                                   const at::Tensor& p_ref,
                                                   const at::Tensor& query_offsets,
                                                   const at::Tensor& ref_offsets,
                                                   int64_t k) {
  check_knn_batched(p_query, p_ref, query_offsets, ref_offsets, k);
  const int64_t m = p_query.size(0), n = p_ref.size(0);
  // Unchecked offsets would send the loops out of the tensors: always checked here.
  check_batch_values(query_offsets, ref_offsets, m, n, k);
  check_finite(p_query, p_ref, /*capturing=*/false);
  at::Tensor distances = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  const float *q = p_query.data_ptr<float>(), *r = p_ref.data_ptr<float>();
  const int64_t* qo = query_offsets.data_ptr<int64_t>();
  const int64_t* ro = ref_offsets.data_ptr<int64_t>();
  const int64_t clouds = query_offsets.size(0) - 1;
  float* d = distances.data_ptr<float>();
  int64_t* idx = indices.data_ptr<int64_t>();
  EK_DISPATCH_KMAX(k, {
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      TopK<KMAX> best;
      for (int64_t row = begin; row < end; ++row) {
        int64_t first, last;
        cloud_rows(ro, cloud_of(qo, clouds, row), n, first, last);
        best.init((int)k);
        const float* p = q + 3 * row;
        for (int64_t j = first; j < last; ++j) {  // in row order: ties to the lower row
          const float* s = r + 3 * j;
          best.push(dist2(p[0] - s[0], p[1] - s[1], p[2] - s[2]), (int32_t)j);
        }
        for (int64_t e = 0; e < k; ++e) {
          d[row * k + e] = std::sqrt(best.d[e]);
          idx[row * k + e] = best.i[e];
        }
      }
    });
  });
  return {distances, indices};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(extkernels_fused, m) {
  // The k nearest of each query among its own cloud's reference points, for a batch of
  // clouds (knn_batched.h): distances (M, k) float32 ascending, rows (M, k) int64 of p_ref.
  m.def(
      "knn_batched(Tensor p_query, Tensor p_ref, Tensor query_offsets,"
      " Tensor ref_offsets, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(extkernels_fused, CPU, m) { m.impl("knn_batched", &knn_batched_cpu); }

}  // namespace extkernels
