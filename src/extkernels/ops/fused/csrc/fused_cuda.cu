// The fused backend's CUDA kernels (chapter 11).
//
// - The grid: the box and the spread of the cloud in one pass of partial sums (no
//   separate min/max and standard-deviation reductions), then chapter 9's counting sort.
//   For the radius walk the box skips the blocks' most extreme values (robust_bound,
//   grid.h): a far outlier lands in an edge cell instead of stretching every cell
//   (chapter 14). The kNN rings keep the whole box: their stopping rule assumes every
//   point lies in its cell.
// - kNN: a group of `lanes` threads per query. The lanes walk the same rings and split
//   each run of points between them, each keeping its own top k; after each ring the
//   group merges its lists with warp shuffles to learn the k-th best so far, which both
//   prunes the lanes' pushes and decides, exactly as before, when to stop. The softmax
//   and the gather follow in the same kernel. 27,000 queries with one thread each fill
//   a tenth of an H200's warp slots; eight lanes fill most of them.
// - Radius: a warp per query (or one thread per (query, feature)) walks the cells of the
//   box query +- radius, on a grid whose cells are at least as wide as the radius. A
//   query whose box holds more than kDenseBox points (beside a tight cluster, on a
//   densely sampled surface) is put on a list for a second kernel, in which a team of
//   2, 4 or 8 warps shares the box's points, 32 at a time, and loads the rows of the
//   neighbours of eight points at once: one warp taking a thousand neighbours in turn
//   would wait for their rows' loads one after the other, on a few warps of the GPU.
//   The forward returns the grid and each query's total weight, so the backward scatters
//   without building the grid again; the grid's sort is made deterministic, so that the
//   outputs are the same on every call.
#include <array>
#include <atomic>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "fused.h"
#include "grid.h"
#include "grid_cuda.cuh"
#include "launch.cuh"
#include "radius.h"
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
constexpr int kParamsThreads = 6 * kRobustBlocks;
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

// ---- radius: one thread per (query, feature) --------------------------------------

template <typename scalar_t>
__global__ void radius_fwd_kernel(const float* q, int64_t m, const Point4* ref,
                                  const int32_t* start, const GridParams* params,
                                  float radius, float inv_sigma, const scalar_t* feats,
                                  int64_t f, scalar_t* out, float* totals) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= m * f) return;
  const int64_t row = t / f, c = t % f;
  const GridParams g = *params;
  const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
  float total = 0.0f;
  acc_t acc = 0;
  for_neighbours(qp, ref, start, g, radius, inv_sigma, [&](int32_t j, float w) {
    total += w;
    acc += (acc_t)w * (acc_t)feats[(int64_t)j * f + c];
  });
  out[t] = (scalar_t)(total > 0.0f ? acc / (acc_t)total : acc_t(0));
  if (c == 0) totals[row] = total;
}

template <typename scalar_t, typename acc_t>
__global__ void radius_bwd_kernel(const scalar_t* grad_out, const float* q, int64_t m,
                                  const float* totals, const Point4* ref,
                                  const int32_t* start, const GridParams* params,
                                  float radius, float inv_sigma, int64_t f, acc_t* grad) {
  const int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (t >= m * f) return;
  const int64_t row = t / f, c = t % f;
  const float total = totals[row];
  if (!(total > 0.0f)) return;
  const acc_t g_scaled = (acc_t)grad_out[t] / (acc_t)total;
  const GridParams g = *params;
  const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
  for_neighbours(qp, ref, start, g, radius, inv_sigma, [&](int32_t j, float w) {
    atomicAdd(grad + (int64_t)j * f + c, (acc_t)w * g_scaled);
  });
}

// The points j0 + lane (those before `end`) tested against the radius by the lanes of a
// warp, and chunk(found, row, weight) called once: found is the ballot of the
// lanes whose point lies within the radius (the same in every lane), row and weight the
// lane's own point's (weight 0 outside the radius or past the run).
template <typename Chunk>
__device__ __forceinline__ void test_32(const float* qp, const Point4* ref, int32_t j0,
                                        int32_t end, float radius, float inv_sigma,
                                        int lane, Chunk& chunk) {
  const int32_t j = j0 + lane;
  float w = 0.0f;
  int32_t index = 0;
  bool inside = false;
  if (j < end) {
    const Point4 p = load_point(ref, j);
    const float dx = qp[0] - p.x, dy = qp[1] - p.y, dz = qp[2] - p.z;
    const float d = sqrtf(dx * dx + dy * dy + dz * dz);
    inside = d <= radius;
    w = inside ? expf(-d * inv_sigma) : 0.0f;
    index = p.index;
  }
  chunk(__ballot_sync(0xffffffffu, inside), index, w);
}

// The runs of sorted points that the box query +- radius covers, one column of cells
// (along the last axis) each, read by the lanes at once: lane c holds column c's run
// [begin, end), the other lanes empty ones. `columns` is 0 for no box and -1 past 32
// (the radius walk's cells are as wide as the radius, so its boxes span at most 3 x 3
// columns): the walk then reads the columns one after the other.
struct Runs {
  int columns;
  int32_t begin, end;
};

__device__ __forceinline__ Runs box_runs(const float* qp, const int32_t* start,
                                         const GridParams& g, float radius, int lane) {
  Runs r{0, 0, 0};
  Box b;
  if (!box_of(qp, radius, g, b)) return r;  // the same for the whole warp
  const int64_t ny = b.hi[1] - b.lo[1] + 1, columns = (b.hi[0] - b.lo[0] + 1) * ny;
  if (columns > 32) {
    r.columns = -1;
    return r;
  }
  r.columns = (int)columns;
  if (lane < columns) {
    const int64_t x = b.lo[0] + lane / ny, y = b.lo[1] + lane % ny;
    const int64_t column = (x * g.dims[1] + y) * g.dims[2];
    r.begin = start[column + b.lo[2]];
    r.end = start[column + b.hi[2] + 1];
  }
  return r;
}

// The walk of for_neighbours with one warp per query: the lanes test 32 points of a run
// at a time (test_32) and call chunk for each 32.
template <typename Chunk>
__device__ void for_chunks_warp(const Runs& r, const float* qp, const Point4* ref,
                                const int32_t* start, const GridParams& g, float radius,
                                float inv_sigma, int lane, Chunk&& chunk) {
  if (r.columns >= 0) {
    for (int c = 0; c < r.columns; ++c) {
      const int32_t begin = __shfl_sync(0xffffffffu, r.begin, c);
      const int32_t end = __shfl_sync(0xffffffffu, r.end, c);
      for (int32_t j0 = begin; j0 < end; j0 += 32) {
        test_32(qp, ref, j0, end, radius, inv_sigma, lane, chunk);
      }
    }
    return;
  }
  Box b;
  box_of(qp, radius, g, b);
  for (int64_t x = b.lo[0]; x <= b.hi[0]; ++x) {
    for (int64_t y = b.lo[1]; y <= b.hi[1]; ++y) {
      const int64_t column = (x * g.dims[1] + y) * g.dims[2];
      const int32_t end = start[column + b.hi[2] + 1];
      for (int32_t j0 = start[column + b.lo[2]]; j0 < end; j0 += 32) {
        test_32(qp, ref, j0, end, radius, inv_sigma, lane, chunk);
      }
    }
  }
}

// Every point within the radius (found by the walk's ballot, taken in turn) handed to
// all 32 lanes at once, as visit(row, weight).
template <typename Visit>
__device__ void for_neighbours_warp(const Runs& r, const float* qp, const Point4* ref,
                                    const int32_t* start, const GridParams& g,
                                    float radius, float inv_sigma, int lane,
                                    Visit&& visit) {
  for_chunks_warp(r, qp, ref, start, g, radius, inv_sigma, lane,
                  [&](unsigned found, int32_t index, float w) {
                    for (; found; found &= found - 1u) {
                      const int src = __ffs(found) - 1;
                      visit((int64_t)__shfl_sync(0xffffffffu, index, src),
                            __shfl_sync(0xffffffffu, w, src));
                    }
                  });
}

// for_chunks_warp for one warp of a team of `share`: it takes the 32s numbered first,
// first + share, ... counted across the box's runs (a surface's runs are short: counted
// run by run, one warp would take them all).
template <typename Chunk>
__device__ __forceinline__ void for_chunks_team(const float* qp, const Point4* ref,
                                                const int32_t* start, const GridParams& g,
                                                float radius, float inv_sigma, int lane,
                                                int first, int share, Chunk&& chunk) {
  Box b;
  if (!box_of(qp, radius, g, b)) return;  // the same for the whole warp
  int skip = first;  // the 32s to pass over before this warp's next one
  for (int64_t x = b.lo[0]; x <= b.hi[0]; ++x) {
    for (int64_t y = b.lo[1]; y <= b.hi[1]; ++y) {
      const int64_t column = (x * g.dims[1] + y) * g.dims[2];
      const int32_t begin = start[column + b.lo[2]], end = start[column + b.hi[2] + 1];
      const int32_t chunks = (end - begin + 31) / 32;
      if (skip >= chunks) {
        skip -= chunks;
        continue;
      }
      const int32_t mine = begin + 32 * skip;  // this warp's first 32 in the run
      skip = (share - 1) - (chunks - 1 - skip) % share;
      for (int32_t j0 = mine; j0 < end; j0 += 32 * share) {
        test_32(qp, ref, j0, end, radius, inv_sigma, lane, chunk);
      }
    }
  }
}

// The sum of run(length) over the cell runs of the box query +- radius, from the runs'
// starts alone.
template <typename Run>
__device__ __forceinline__ int64_t sum_runs(const float* qp, const int32_t* start,
                                            const GridParams& g, float radius, Run&& run) {
  Box b;
  if (!box_of(qp, radius, g, b)) return 0;
  int64_t n = 0;
  for (int64_t x = b.lo[0]; x <= b.hi[0]; ++x) {
    for (int64_t y = b.lo[1]; y <= b.hi[1]; ++y) {
      const int64_t column = (x * g.dims[1] + y) * g.dims[2];
      n += run(start[column + b.hi[2] + 1] - start[column + b.lo[2]]);
    }
  }
  return n;
}

// Points in the box query +- radius: a query's work.
__device__ int64_t box_points(const float* qp, const int32_t* start, const GridParams& g,
                              float radius) {
  return sum_runs(qp, start, g, radius, [](int32_t length) -> int64_t { return length; });
}

// The 32s a warp takes the box's points in (a run's last 32 is partly empty): asked
// only of the dense queries.
__device__ int64_t box_chunks(const float* qp, const int32_t* start, const GridParams& g,
                              float radius) {
  return sum_runs(qp, start, g, radius,
                  [](int32_t length) -> int64_t { return (length + 31) / 32; });
}

// Boxes with more points than kDenseBox go to radius_dense_fwd_kernel (rows of up to 32
// features; on the book's cloud a box holds a few dozen), to a team of 1, 2, 4 or 8
// warps: the most that leaves each warp kChunksPerWarp 32s of the box or more. Such a
// box spans nine 32s at least, so with kChunksPerWarp = 4 the teams are of 2, 4 or 8
// (the median dense box takes two on Panda, four on Spitfire, eight beside a cluster).
constexpr int64_t kDenseBox = 256;
constexpr int64_t kChunksPerWarp = 4;
constexpr int kTeamLists = 4;  // teams of 1 << list warps

__device__ __forceinline__ int team_list(int64_t chunks) {
  const int64_t per = chunks / kChunksPerWarp;
  return per >= 8 ? 3 : (per >= 4 ? 2 : (per >= 2 ? 1 : 0));
}

// The forward with one warp per query: lane c adds the weighted features c, c + 32, ...
// (FPL of them) of every neighbour. Every lane adds the same weights, so every lane
// holds the query's total. Given `dense` lists (kTeamLists counts, then kTeamLists lists
// of m entries), a query whose box holds more than kDenseBox points is appended to its
// team's list instead, for radius_dense_fwd_kernel.
template <typename scalar_t, int FPL>
__global__ void __launch_bounds__(kThreads)
    radius_warp_fwd_kernel(const float* q, int64_t m, const Point4* ref,
                           const int32_t* start, const GridParams* params, float radius,
                           float inv_sigma, const scalar_t* feats, int64_t f,
                           scalar_t* out, float* totals, int32_t* dense) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t row = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
  const int lane = (int)(threadIdx.x & 31u);
  if (row >= m) return;  // the whole warp: one row
  const GridParams g = *params;
  const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
  const Runs runs = box_runs(qp, start, g, radius, lane);
  if (dense != nullptr) {
    const int64_t points = runs.columns >= 0 ? warp_sum((int64_t)(runs.end - runs.begin))
                                             : box_points(qp, start, g, radius);
    if (points > kDenseBox) {
      const int64_t chunks = runs.columns >= 0
                                 ? warp_sum((int64_t)((runs.end - runs.begin + 31) / 32))
                                 : box_chunks(qp, start, g, radius);
      const int list = team_list(chunks);
      if (lane == 0) {
        dense[kTeamLists + list * m + atomicAdd(dense + list, 1)] = (int32_t)row;
      }
      return;
    }
  }
  acc_t acc[FPL];
#pragma unroll
  for (int t = 0; t < FPL; ++t) acc[t] = 0;
  float total = 0.0f;
  for_neighbours_warp(runs, qp, ref, start, g, radius, inv_sigma, lane,
                      [&](int64_t rj, float wj) {
                        total += wj;
#pragma unroll
                        for (int t = 0; t < FPL; ++t) {
                          const int64_t c = lane + 32 * t;
                          if (c < f) acc[t] += (acc_t)wj * (acc_t)feats[rj * f + c];
                        }
                      });
#pragma unroll
  for (int t = 0; t < FPL; ++t) {
    const int64_t c = lane + 32 * t;
    if (c < f) out[row * f + c] = (scalar_t)(total > 0.0f ? acc[t] / (acc_t)total : acc_t(0));
  }
  if (lane == 0) totals[row] = total;
}

// The rows of the points of a 32 that lie within the radius (`found`, the same in every
// lane; lane i holds point i's row `index` and weight `w`, 0 outside the radius), added
// weighted to lane c's sum of feature c (rows of at most 32 features): eight points at a
// time, whose rows' loads are in flight together (one after the other, a 32 with
// twenty neighbours waits for twenty loads in a row). Returns the weights' sum.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ float add_rows(unsigned found, int32_t index, float w, int lane,
                                          const scalar_t* feats, int64_t f, acc_t& acc) {
  float total = 0.0f;
#pragma unroll
  for (int g = 0; g < 32; g += 8) {
    if (((found >> g) & 0xffu) == 0u) continue;  // the same in every lane
    acc_t x[8];
    float wj[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t rj = __shfl_sync(0xffffffffu, index, g + j);
      wj[j] = __shfl_sync(0xffffffffu, w, g + j);
      const bool in = ((found >> (g + j)) & 1u) != 0u;
      x[j] = in && lane < f ? (acc_t)feats[rj * f + lane] : acc_t(0);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      total += wj[j];
      acc += (acc_t)wj[j] * x[j];
    }
  }
  return total;
}

// One warp's part of a dense query's forward: the 32s numbered first, first + share, ...
// of its box. Returns the warp's total weight (in every lane) and lane c's sum of
// feature c in acc.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ float dense_part(const float* qp, const Point4* ref,
                                            const int32_t* start, const GridParams& g,
                                            float radius, float inv_sigma,
                                            const scalar_t* feats, int64_t f, int lane,
                                            int first, int share, acc_t& acc) {
  acc = 0;
  float total = 0.0f;
  for_chunks_team(qp, ref, start, g, radius, inv_sigma, lane, first, share,
                  [&](unsigned found, int32_t index, float w) {
                    total += add_rows(found, index, w, lane, feats, f, acc);
                  });
  return total;
}

// The forward of the queries on the `dense` lists (rows of at most 32 features): as many
// blocks of kDenseTeam warps as the GPU holds at once take each list's queries in turn,
// the largest teams' first, a block holding 8 / t teams of t warps that share a query's
// points 32 at a time (a few tight clusters make a short list of queries with a
// thousand neighbours each, which one warp per query would leave to a few warps of the
// GPU). A team's sums are added across its warps in warp order: each query's sum is
// taken in the same order on every call, whichever block or warps take it.
constexpr int kDenseTeam = 8;

template <typename scalar_t>
__global__ void __launch_bounds__(32 * kDenseTeam)
    radius_dense_fwd_kernel(const float* q, int64_t m, const int32_t* dense,
                            const Point4* ref, const int32_t* start,
                            const GridParams* params, float radius, float inv_sigma,
                            const scalar_t* feats, int64_t f, scalar_t* out,
                            float* totals) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t part[kDenseTeam][32];
  __shared__ float part_total[kDenseTeam];
  const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x & 31u);
  static_assert(kTeamLists == 4, "the counts below are four");
  // Loaded together, not list by list: on most clouds every list is empty.
  const int c0 = dense[0], c1 = dense[1], c2 = dense[2], c3 = dense[3];
  if ((c0 | c1 | c2 | c3) == 0) return;
  const GridParams g = *params;
#pragma unroll 1
  for (int list = kTeamLists - 1; list >= 0; --list) {
    const int32_t* queries = dense + kTeamLists + list * m;
    const int count = list == 3 ? c3 : (list == 2 ? c2 : (list == 1 ? c1 : c0));
    const int size = 1 << list, teams = kDenseTeam >> list;  // the same in the block
    const int first = warp & (size - 1);  // the warp's place in its team
    for (int i0 = (int)blockIdx.x * teams; i0 < count; i0 += (int)gridDim.x * teams) {
      const int i = i0 + (warp >> list);  // the warp's team's query
      int64_t row = -1;
      acc_t acc = 0;
      float total = 0.0f;
      if (i < count) {
        row = queries[i];
        const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
        total = dense_part(qp, ref, start, g, radius, inv_sigma, feats, f, lane, first,
                           size, acc);
      }
      if (size > 1) {
        part[warp][lane] = acc;
        if (lane == 0) part_total[warp] = total;
        __syncthreads();
        if (first == 0 && row >= 0) {
          acc = 0;
          total = 0.0f;
          for (int w = warp; w < warp + size; ++w) {
            acc += part[w][lane];
            total += part_total[w];
          }
        }
        __syncthreads();  // the parts are read before the next queries overwrite them
      }
      if (first == 0 && row >= 0) {
        if (lane < f) out[row * f + lane] = (scalar_t)(total > 0.0f ? acc / (acc_t)total : acc_t(0));
        if (lane == 0) totals[row] = total;
      }
    }
  }
}

// Blocks of radius_dense_fwd_kernel that the GPU holds at once (the list's length is on
// the device), found once per device: the occupancy query costs more than the launch.
template <typename scalar_t>
int dense_blocks(int device) {
  static std::array<std::atomic<int>, 64> known{};
  TORCH_CHECK(device >= 0 && device < 64, "p_query: expected a CUDA device index below 64");
  int blocks = known[device].load();
  if (blocks == 0) {
    int sms = 0, per_sm = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, radius_dense_fwd_kernel<scalar_t>, 32 * kDenseTeam, 0));
    blocks = sms * std::max(per_sm, 1);
    known[device].store(blocks);
  }
  return blocks;
}

// Its adjoint, one warp per query: the same walk, an atomic addition per (neighbour,
// feature), the lanes of a warp adding to one row of consecutive features.
template <typename scalar_t, typename acc_t, int FPL>
__global__ void __launch_bounds__(kThreads)
    radius_warp_bwd_kernel(const scalar_t* grad_out, const float* q, int64_t m,
                           const float* totals, const Point4* ref, const int32_t* start,
                           const GridParams* params, float radius, float inv_sigma,
                           int64_t f, acc_t* grad) {
  const int64_t row = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
  const int lane = (int)(threadIdx.x & 31u);
  if (row >= m) return;
  const float total = totals[row];
  if (!(total > 0.0f)) return;  // the whole warp: no neighbour
  acc_t go[FPL];
#pragma unroll
  for (int t = 0; t < FPL; ++t) {
    const int64_t c = lane + 32 * t;
    go[t] = c < f ? (acc_t)grad_out[row * f + c] / (acc_t)total : acc_t(0);
  }
  const GridParams g = *params;
  const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
  const Runs runs = box_runs(qp, start, g, radius, lane);
  for_neighbours_warp(runs, qp, ref, start, g, radius, inv_sigma, lane,
                      [&](int64_t rj, float wj) {
#pragma unroll
                        for (int t = 0; t < FPL; ++t) {
                          const int64_t c = lane + 32 * t;
                          if (c < f) atomicAdd(grad + rj * f + c, (acc_t)wj * go[t]);
                        }
                      });
}

// Features per lane of the warp kernels: F up to 128 (4 per lane); wider rows take the
// kernels of one thread per (query, feature).
constexpr int kMaxWarpFeatures = 128;

#define EK_DISPATCH_FPL(f, ...)             \
  [&] {                                     \
    if ((f) <= 32) {                        \
      constexpr int FPL = 1;                \
      __VA_ARGS__                           \
    } else if ((f) <= 64) {                 \
      constexpr int FPL = 2;                \
      __VA_ARGS__                           \
    } else {                                \
      constexpr int FPL = 4;                \
      __VA_ARGS__                           \
    }                                       \
  }()

RadiusOut radius_aggregate_fwd_cuda(const at::Tensor& p_query, const at::Tensor& p_ref,
                                    const at::Tensor& feats, double radius, double sigma,
                                    bool warp) {
  check_radius_args(p_query, p_ref, feats, radius, sigma);
  check_queries(p_query, kMaxRadiusQueries,
                "the fused radius kernels list query rows, and step through the lists, "
                "with 32-bit integers");
  const c10::cuda::CUDAGuard guard(p_query.device());
  check_finite(p_query, p_ref, capturing());
  // Cells as wide as the radius: a box query +- radius spans 2 or 3 cells per axis
  // however dense the cloud (chapter 14's clusters).
  const SavedGrid d =
      build_grid(p_ref, /*deterministic=*/true, /*robust=*/true, (float)radius);
  const int64_t m = p_query.size(0), f = feats.size(1);
  at::Tensor out = at::empty({m, f}, feats.options());
  at::Tensor totals = at::empty({m}, p_query.options());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* ref = reinterpret_cast<const Point4*>(d.ref.data_ptr<float>());
  const auto* params = reinterpret_cast<const GridParams*>(d.params.data_ptr<uint8_t>());
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(feats.scalar_type(), "radius_fwd_cuda", [&] {
    if (warp && f <= kMaxWarpFeatures) {
      // Rows of up to 32 features: queries with dense boxes listed for the second kernel,
      // by the size of the team of warps that takes each.
      int32_t* dense = nullptr;
      at::Tensor listed;
      if (f <= 32) {
        // Only the counts need zeros: the lists are read up to them.
        listed = at::empty({kTeamLists * (m + 1)}, p_query.options().dtype(at::kInt));
        listed.narrow(0, 0, kTeamLists).zero_();
        dense = listed.data_ptr<int32_t>();
      }
      EK_DISPATCH_FPL(f, {
        radius_warp_fwd_kernel<scalar_t, FPL><<<blocks_for(m * 32), kThreads, 0, stream>>>(
            p_query.data_ptr<float>(), m, ref, d.start.data_ptr<int32_t>(), params,
            (float)radius, (float)(1.0 / sigma), feats.data_ptr<scalar_t>(), f,
            out.data_ptr<scalar_t>(), totals.data_ptr<float>(), dense);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (dense != nullptr) {
        const int blocks = dense_blocks<scalar_t>(p_query.device().index());
        radius_dense_fwd_kernel<scalar_t><<<blocks, 32 * kDenseTeam, 0, stream>>>(
            p_query.data_ptr<float>(), m, dense, ref, d.start.data_ptr<int32_t>(), params,
            (float)radius, (float)(1.0 / sigma), feats.data_ptr<scalar_t>(), f,
            out.data_ptr<scalar_t>(), totals.data_ptr<float>());
      }
      return;
    }
    radius_fwd_kernel<scalar_t><<<blocks_for(m * f), kThreads, 0, stream>>>(
        p_query.data_ptr<float>(), m, ref, d.start.data_ptr<int32_t>(), params,
        (float)radius, (float)(1.0 / sigma), feats.data_ptr<scalar_t>(), f,
        out.data_ptr<scalar_t>(), totals.data_ptr<float>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, totals, d.ref, d.start, d.params};
}

at::Tensor radius_aggregate_bwd_cuda(const at::Tensor& grad_out, const at::Tensor& p_query,
                                     const at::Tensor& totals, const at::Tensor& grid_ref,
                                     const at::Tensor& grid_start,
                                     const at::Tensor& grid_params, double radius,
                                     double sigma, bool warp) {
  check_radius_backward(grad_out, p_query, totals, grid_ref, grid_start, grid_params);
  at::globalContext().alertNotDeterministic(
      "extkernels_fused::radius_aggregate_bwd (atomic additions of gradient rows)");
  const c10::cuda::CUDAGuard guard(grad_out.device());
  const int64_t m = p_query.size(0), f = grad_out.size(1), n = grid_ref.size(0);
  auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(grad_out.scalar_type(), "radius_bwd_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor acc = at::zeros(
        {n, f}, grad_out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const auto* ref = reinterpret_cast<const Point4*>(grid_ref.data_ptr<float>());
    const auto* params = reinterpret_cast<const GridParams*>(grid_params.data_ptr<uint8_t>());
    if (warp && f <= kMaxWarpFeatures) {
      EK_DISPATCH_FPL(f, {
        radius_warp_bwd_kernel<scalar_t, acc_t, FPL>
            <<<blocks_for(m * 32), kThreads, 0, stream>>>(
                grad_out.data_ptr<scalar_t>(), p_query.data_ptr<float>(), m,
                totals.data_ptr<float>(), ref, grid_start.data_ptr<int32_t>(), params,
                (float)radius, (float)(1.0 / sigma), f, acc.data_ptr<acc_t>());
      });
    } else {
      radius_bwd_kernel<scalar_t, acc_t><<<blocks_for(m * f), kThreads, 0, stream>>>(
          grad_out.data_ptr<scalar_t>(), p_query.data_ptr<float>(), m,
          totals.data_ptr<float>(), ref, grid_start.data_ptr<int32_t>(), params,
          (float)radius, (float)(1.0 / sigma), f, acc.data_ptr<acc_t>());
    }
    grad = acc.scalar_type() == grad_out.scalar_type() ? acc
                                                        : acc.to(grad_out.scalar_type());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(extkernels_fused, CUDA, m) {
  m.impl("knn", &knn_cuda);
  m.impl("knn_out", &knn_out_cuda);
  m.impl("knn_aggregate_fwd", &knn_aggregate_fwd_cuda);
  m.impl("radius_aggregate_fwd", &radius_aggregate_fwd_cuda);
  m.impl("radius_aggregate_bwd", &radius_aggregate_bwd_cuda);
}

}  // namespace extkernels
