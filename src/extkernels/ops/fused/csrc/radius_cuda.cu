// The fused backend's radius aggregation on the GPU (chapter 11), on the grid of
// grid_build_cuda.cu.
//
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
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "checks.h"
#include "fused.h"
#include "grid.h"
#include "launch.cuh"
#include "radius.h"
#include "warp.cuh"

namespace extkernels {
namespace {

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
  m.impl("radius_aggregate_fwd", &radius_aggregate_fwd_cuda);
  m.impl("radius_aggregate_bwd", &radius_aggregate_bwd_cuda);
}

}  // namespace extkernels
