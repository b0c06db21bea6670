// The fused backend's kNN operators on the GPU (chapter 11): knn, knn_out and
// knn_aggregate_fwd search the tree (tree_search_cuda.cu) or the uniform grid
// (grid_build_cuda.cu) with the kernels below.
//
// - kNN: a group of `lanes` threads per query. The lanes walk the same rings and split
//   each run of points between them, each keeping its own top k; after each ring the
//   group merges its lists with warp shuffles to learn the k-th best so far, which both
//   prunes the lanes' pushes and decides, exactly as before, when to stop. The softmax
//   and the gather follow in the same kernel. 27,000 queries with one thread each fill
//   a tenth of an H200's warp slots; eight lanes fill most of them.
#include <utility>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "fused.h"
#include "grid.h"
#include "launch.cuh"

namespace extkernels {
namespace {

// ---- kNN: a group of LANES threads per query -------------------------------------

template <int LANES>
__device__ __forceinline__ unsigned group_mask() {
  if constexpr (LANES == 32) {
    return 0xffffffffu;
  } else {
    const unsigned lane = threadIdx.x & 31u;
    return ((1u << LANES) - 1u) << (lane & ~(unsigned)(LANES - 1));
  }
}

// The first head of the group's sorted lists (the nearest, of equal ones the lowest
// index: grid.h's before); the lane holding it pops it. Returns the popped distance in
// every lane, and with INDEX its row in `index`.
template <int KMAX, int LANES, bool INDEX>
__device__ __forceinline__ float pop_smallest(float (&d)[KMAX], int32_t (&i)[KMAX],
                                              unsigned mask, int32_t& index) {
  float smallest = d[0];
  int32_t first = i[0];
#pragma unroll
  for (int o = LANES / 2; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(mask, smallest, o, LANES);
    const int32_t other_index = __shfl_xor_sync(mask, first, o, LANES);
    if (before(other, other_index, smallest, first)) {
      smallest = other;
      first = other_index;
    }
  }
  const unsigned holders = __ballot_sync(mask, d[0] == smallest && i[0] == first);
  const int winner = holders ? __ffs(holders) - 1 : 0;
  if (INDEX) index = first;
  if ((int)(threadIdx.x & 31u) == winner && holders) {
#pragma unroll
    for (int s = 0; s < KMAX - 1; ++s) {
      d[s] = d[s + 1];
      i[s] = i[s + 1];
    }
    d[KMAX - 1] = INFINITY;
    i[KMAX - 1] = -1;
  }
  return smallest;
}

// The k-th best distance among the group's lists (infinity until k are kept).
template <int KMAX, int LANES>
__device__ __forceinline__ float group_kth(const TopK<KMAX>& best, unsigned mask) {
  float d[KMAX];
  int32_t i[KMAX], unused = 0;
#pragma unroll
  for (int s = 0; s < KMAX; ++s) {
    d[s] = best.d[s];
    i[s] = best.i[s];
  }
  float kth = INFINITY;
#pragma unroll
  for (int t = 0; t < KMAX; ++t) {
    if (t < best.k) kth = pop_smallest<KMAX, LANES, false>(d, i, mask, unused);
  }
  return kth;
}

// Writes distances (SOFTMAX false) or softmax weights, and indices; with feats given
// (float32), the gather's output too.
template <int KMAX, int LANES, bool SOFTMAX>
__global__ void __launch_bounds__(kThreads)
    knn_lanes_kernel(const float* q, int64_t m, const Point4* ref, const int32_t* start,
                     const GridParams* params, int k, float inv_sigma, const float* feats,
                     int64_t f, float* out, float* values, int64_t* idx) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  const int64_t row = t / LANES;
  const int lane = (int)(t % LANES);
  if (row >= m) return;  // a group's lanes share their row: they leave together
  const unsigned mask = group_mask<LANES>();
  const GridParams g = *params;
  const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
  TopK<KMAX> best;
  best.init(k);
  const Rings R = rings_of(qp, g);
  float kth = INFINITY;
  for (int64_t r = R.first; r <= R.last; ++r) {
    for_ring(R, r, g, start, [&](int32_t begin, int32_t end) {
      for (int32_t j = begin + lane; j < end; j += LANES) {
        const Point4 p = load_point(ref, j);
        const float dx = qp[0] - p.x, dy = qp[1] - p.y, dz = qp[2] - p.z;
        const float d2 = dx * dx + dy * dy + dz * dz;
        // Farther than the group's k-th: out (as far may still win a tie by its index).
        if (d2 <= kth) best.push(d2, p.index);
      }
    });
    if constexpr (LANES == 1) {
      kth = best.worst();
    } else {
      kth = group_kth<KMAX, LANES>(best, mask);
    }
    // The same stopping rule as ring_search (grid.h), on the group's k-th best.
    const float bound = ((float)r * g.h + R.inside) * (1.0f - 1e-5f);
    if (kth <= bound * bound) break;
  }
  float d[KMAX], md[KMAX];
  int32_t i[KMAX], mi[KMAX];
#pragma unroll
  for (int s = 0; s < KMAX; ++s) {
    d[s] = best.d[s];
    i[s] = best.i[s];
    md[s] = INFINITY;
    mi[s] = -1;
  }
  if constexpr (LANES == 1) {  // one list, already sorted
#pragma unroll
    for (int s = 0; s < KMAX; ++s) {
      md[s] = d[s];
      mi[s] = i[s];
    }
  } else {
#pragma unroll
    for (int s = 0; s < KMAX; ++s) {
      if (s < k) md[s] = pop_smallest<KMAX, LANES, true>(d, i, mask, mi[s]);
    }
  }
  const float nearest = sqrtf(md[0]);
  float total = 0.0f;
#pragma unroll
  for (int s = 0; s < KMAX; ++s) {
    if (s < k) {
      const float dist = sqrtf(md[s]);
      md[s] = SOFTMAX ? __expf((nearest - dist) * inv_sigma) : dist;
      total += md[s];
    }
  }
  const float scale = SOFTMAX ? 1.0f / total : 1.0f;
#pragma unroll
  for (int s = 0; s < KMAX; ++s) {
    md[s] *= scale;
    if (s < k && s % LANES == lane) {
      values[row * k + s] = md[s];
      idx[row * k + s] = mi[s];
    }
  }
  if (feats == nullptr) return;
  for (int64_t c = lane; c < f; c += LANES) {
    float acc = 0.0f;
#pragma unroll
    for (int s = 0; s < KMAX; ++s) {
      if (s < k && mi[s] >= 0) acc += md[s] * __ldg(feats + (int64_t)mi[s] * f + c);
    }
    out[row * f + c] = acc;
  }
}

// Launches the kernel for the group size `lanes`, one of the sizes 2^B built; false if
// none matches. Lists of more than 16 neighbours are built for one lane only.
template <int KMAX, bool SOFTMAX, int... B>
bool launch_group(std::integer_sequence<int, B...>, int64_t lanes, int blocks,
                  cudaStream_t stream, const float* q, int64_t m, const Point4* ref,
                  const int32_t* start, const GridParams* params, int k, float inv_sigma,
                  const float* feats, int64_t f, float* out, float* values,
                  int64_t* idx) {
  auto one = [&](auto size) {
    constexpr int G = decltype(size)::value;
    if constexpr (!lanes_built(G) || (KMAX > 16 && G != 1)) {
      return false;
    } else {
      if (lanes != G) return false;
      knn_lanes_kernel<KMAX, G, SOFTMAX><<<blocks, kThreads, 0, stream>>>(
          q, m, ref, start, params, k, inv_sigma, feats, f, out, values, idx);
      return true;
    }
  };
  return (one(std::integral_constant<int, 1 << B>{}) || ...);
}

template <int KMAX, bool SOFTMAX>
void launch_lanes(int64_t lanes, int64_t m, cudaStream_t stream, const float* q,
                  const Point4* ref, const int32_t* start, const GridParams* params,
                  int k, float inv_sigma, const float* feats, int64_t f, float* out,
                  float* values, int64_t* idx) {
  // Lists of more than 16 neighbours stay with one thread per query: merging them
  // across lanes would cost more registers than it saves.
  if (KMAX > 16) lanes = 1;
  const int blocks = blocks_for(m * lanes);
  const bool launched = launch_group<KMAX, SOFTMAX>(
      std::make_integer_sequence<int, kMaxLanesLog2 + 1>{}, lanes, blocks, stream, q, m,
      ref, start, params, k, inv_sigma, feats, f, out, values, idx);
  TORCH_CHECK_VALUE(launched, msg("lanes: unsupported value ", lanes));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void search(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
            float inv_sigma, int64_t lanes, Index index, const at::Tensor* feats,
            at::Tensor* out, at::Tensor& values, at::Tensor& indices) {
  if (index == Index::Tree) {
    knn_tree_cuda(p_query, p_ref, k, inv_sigma, feats, out, values, indices);
    return;
  }
  // In deterministic mode the points of a cell keep one order, so that equally near
  // neighbours come back the same on every call.
  const SavedGrid d =
      build_grid(p_ref, at::globalContext().deterministicAlgorithms(), /*robust=*/false,
                 /*min_h=*/0.0f);
  const int64_t m = p_query.size(0);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* ref = reinterpret_cast<const Point4*>(d.ref.data_ptr<float>());
  const auto* params = reinterpret_cast<const GridParams*>(d.params.data_ptr<uint8_t>());
  const float* x = feats ? feats->data_ptr<float>() : nullptr;
  float* o = out ? out->data_ptr<float>() : nullptr;
  const int64_t f = feats ? feats->size(1) : 0;
  EK_DISPATCH_KMAX(k, {
    auto launch = inv_sigma > 0.0f ? launch_lanes<KMAX, true> : launch_lanes<KMAX, false>;
    launch(lanes, m, stream, p_query.data_ptr<float>(), ref, d.start.data_ptr<int32_t>(),
           params, (int)k, inv_sigma, x, f, o, values.data_ptr<float>(),
           indices.data_ptr<int64_t>());
  });
}

// The search into the caller's buffers (knn_out): no allocation, so that a CUDA graph
// can keep them between replays.
void knn_out_cuda(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
                  at::Tensor& distances, at::Tensor& indices, int64_t lanes,
                  c10::string_view index) {
  check_clouds(p_query, p_ref);
  check_queries(p_query, kMaxQueries,
                "the fused tree search lists query rows as 32-bit integers");
  check_k(k, p_ref.size(0));
  check_lanes(lanes);
  const Index which = check_index(index);
  check_out(distances, "distances", at::kFloat, "torch.float32", p_query, k);
  check_out(indices, "indices", at::kLong, "torch.int64", p_query, k);
  const c10::cuda::CUDAGuard guard(p_query.device());
  check_finite(p_query, p_ref, capturing());
  search(p_query, p_ref, k, 0.0f, lanes, which, nullptr, nullptr, distances, indices);
}

std::tuple<at::Tensor, at::Tensor> knn_cuda(const at::Tensor& p_query,
                                            const at::Tensor& p_ref, int64_t k,
                                            int64_t lanes, c10::string_view index) {
  check_clouds(p_query, p_ref);  // before the buffers are sized from them
  check_k(k, p_ref.size(0));
  const int64_t m = p_query.size(0);
  at::Tensor distances = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  knn_out_cuda(p_query, p_ref, k, distances, indices, lanes, index);
  return {distances, indices};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> knn_aggregate_fwd_cuda(
    const at::Tensor& p_query, const at::Tensor& p_ref, const at::Tensor& feats,
    int64_t k, double sigma, int64_t lanes, c10::string_view index) {
  check_clouds(p_query, p_ref);
  check_queries(p_query, kMaxQueries,
                "the fused tree search lists query rows as 32-bit integers");
  check_feats(feats, p_ref);
  check_k(k, p_ref.size(0));
  check_sigma(sigma);
  check_lanes(lanes);
  const Index which = check_index(index);
  const c10::cuda::CUDAGuard guard(p_query.device());
  check_finite(p_query, p_ref, capturing());
  const int64_t m = p_query.size(0);
  at::Tensor weights = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  if (feats.scalar_type() == at::kFloat) {  // the gather in the search's kernel
    at::Tensor out = at::empty({m, feats.size(1)}, feats.options());
    search(p_query, p_ref, k, (float)(1.0 / sigma), lanes, which, &feats, &out, weights,
           indices);
    return {out, weights, indices};
  }
  search(p_query, p_ref, k, (float)(1.0 / sigma), lanes, which, nullptr, nullptr,
         weights, indices);
  static auto gather = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("extkernels_cpp::gather", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, bool)>();
  at::Tensor out = gather.redispatch(c10::DispatchKeySet(c10::DispatchKey::CUDA), weights,
                                     indices, feats, false);
  return {out, weights, indices};
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_fused, CUDA, m) {
  m.impl("knn", &knn_cuda);
  m.impl("knn_out", &knn_out_cuda);
  m.impl("knn_aggregate_fwd", &knn_aggregate_fwd_cuda);
}

}  // namespace extkernels
