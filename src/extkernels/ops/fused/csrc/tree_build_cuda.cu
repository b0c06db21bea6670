// The tree of tree.h on the GPU (chapter 14): its build. The search is in
// tree_search_cuda.cu.
//
// - Build: the cloud's box (partial min/max per block), a Morton code per point, one
//   radix sort of the codes (CUB); then, from the sorted codes, where each leaf (an
//   octree cell of at most 32 points) starts, a running count of the starts, each
//   leaf's box (a warp per leaf) and each node's box, level by level (a warp per node).
//   The number of leaves is known on the device only: the kernels loop over as many as
//   the layout there says, and nothing is read back on the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cub/device/device_radix_sort.cuh>

#include "fused.h"
#include "launch.cuh"
#include "launch_fused.cuh"
#include "tree.h"

namespace extkernels {
namespace {

// The Morton sort (CUB's onesweep radix sort, six passes of 8 bits). CUB tunes it for
// hundreds of millions of keys: on Hopper a block sorts 5,760 of these pairs per pass,
// so that 10^5 points make 18 blocks for 132 multiprocessors and leave most of them idle.
// Up to kSmallSort points, a tile of kSortThreads * kSortItems / 2 pairs fills the GPU.
// (The tiles are set through CUB's dispatch layer, whose form is CUB 3.0's, as in CUDA
// 13.0; another CUB sorts with its own tiles.)
#if CUB_MAJOR_VERSION == 3 && CUB_MINOR_VERSION == 0
#define EK_SMALL_SORT 1
constexpr int64_t kSmallSort = int64_t{1} << 18;
constexpr int kSortThreads = 256;
constexpr int kSortItems = 16;  // per thread, counted in 4-byte words
using SortHub = cub::detail::radix::policy_hub<uint64_t, int32_t, uint32_t>;
struct SmallSortHub {
  struct Policy900
      : cub::ChainedPolicy<900, Policy900, SortHub::Policy800>,
        SortHub::OnesweepSmallKeyTunedPolicy<cub::detail::radix::sm90_small_key_tuning<8, 4, 4>> {
    using OnesweepPolicy = cub::AgentRadixSortOnesweepPolicy<
        kSortThreads, kSortItems, uint64_t, 1, cub::RADIX_RANK_MATCH_EARLY_COUNTS_ANY,
        cub::BLOCK_SCAN_RAKING_MEMOIZE, cub::RADIX_SORT_STORE_DIRECT, 8>;
  };
  using MaxPolicy = Policy900;
};
#endif

// Sorts n codes (3 * kMortonBits bits) with their rows; stable. With temp null, only
// sets bytes, as CUB does.
cudaError_t sort_codes(void* temp, size_t& bytes, const uint64_t* keys_in, uint64_t* keys_out,
                       const int32_t* rows_in, int32_t* rows_out, int64_t n,
                       cudaStream_t stream) {
#ifdef EK_SMALL_SORT
  if (n <= kSmallSort) {
    cub::DoubleBuffer<uint64_t> keys(const_cast<uint64_t*>(keys_in), keys_out);
    cub::DoubleBuffer<int32_t> rows(const_cast<int32_t*>(rows_in), rows_out);
    return cub::DispatchRadixSort<cub::SortOrder::Ascending, uint64_t, int32_t, uint32_t,
                                  cub::detail::identity_decomposer_t, SmallSortHub>::
        Dispatch(temp, bytes, keys, rows, (uint32_t)n, 0, 3 * kMortonBits,
                 /*is_overwrite_okay=*/false, stream);
  }
#endif
  return cub::DeviceRadixSort::SortPairs(temp, bytes, keys_in, keys_out, rows_in, rows_out,
                                         (int)n, 0, 3 * kMortonBits, stream);
}

constexpr int kBoxThreads = kRobustChunk;

// Partial boxes: block b writes lo[3], hi[3] of its stride of the points.
__global__ void __launch_bounds__(kBoxThreads)
    box_kernel(const float* p, int64_t n, float* partial) {
  __shared__ float lo[3][kBoxThreads], hi[3][kBoxThreads];
  float l[3] = {INFINITY, INFINITY, INFINITY}, h[3] = {-INFINITY, -INFINITY, -INFINITY};
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; j < n; j += stride) {
    for (int a = 0; a < 3; ++a) {
      l[a] = fminf(l[a], p[3 * j + a]);
      h[a] = fmaxf(h[a], p[3 * j + a]);
    }
  }
  for (int a = 0; a < 3; ++a) {
    lo[a][threadIdx.x] = l[a];
    hi[a][threadIdx.x] = h[a];
  }
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      for (int a = 0; a < 3; ++a) {
        lo[a][threadIdx.x] = fminf(lo[a][threadIdx.x], lo[a][threadIdx.x + half]);
        hi[a][threadIdx.x] = fmaxf(hi[a][threadIdx.x], hi[a][threadIdx.x + half]);
      }
    }
    __syncthreads();
  }
  if (threadIdx.x < 3) {
    partial[6 * blockIdx.x + threadIdx.x] = lo[threadIdx.x][0];
    partial[6 * blockIdx.x + 3 + threadIdx.x] = hi[threadIdx.x][0];
  }
}

// The Morton cube from the partial boxes, robust to a few far points as the grid's box
// is (robust_bound, grid.h): a thread per (bound, axis, block), then one writes it.
// A point beyond the cube takes the code of the nearest face's cell, so its leaf's box
// stretches out to it; nothing is lost, and the cube's resolution stays on the bulk.
__global__ void __launch_bounds__(kParamsThreads)
    params_kernel(const float* partial, int blocks, TreeParams* out, int32_t* zero) {
  __shared__ float extremes[6][kRobustBlocks];
  __shared__ float bound[6];  // lo[3], then hi[3]
  const int t = (int)threadIdx.x, b = t % kRobustBlocks, which = t / kRobustBlocks;
  if (b < blocks) extremes[which][b] = partial[6 * b + which];
  __syncthreads();
  if (b < blocks && further_out(extremes[which], blocks, b, which >= 3) == robust_skip(blocks)) {
    bound[which] = extremes[which][b];
  }
  __syncthreads();
  if (t == 0) {
    *out = tree_params(bound, bound + 3);
    if (zero != nullptr) *zero = 0;  // the search's heavy count, without a launch of its own
  }
}

__global__ void morton_kernel(const float* p, int64_t n, const TreeParams* params,
                              uint64_t* codes, int32_t* rows) {
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= n) return;
  codes[j] = (uint64_t)morton_of(p + 3 * j, *params);
  rows[j] = (int32_t)j;
}

__device__ __forceinline__ void warp_box(NodeBox& b) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      b.lo[a] = fminf(b.lo[a], __shfl_xor_sync(kFullWarp, b.lo[a], o));
      b.hi[a] = fmaxf(b.hi[a], __shfl_xor_sync(kFullWarp, b.hi[a], o));
    }
  }
}

// A block's slice of window (leaf_depth, tree.h) in shared memory: window[t], the octree
// depth that sorted points t and t + kLeafSize share, for the block's points and the
// kLeafSize before them.
constexpr int kStartsThreads = 256;

struct BlockWindow {
  const int8_t* slice;
  int64_t first;  // slice[0] is window[first]
  __device__ int operator[](int64_t t) const { return slice[t - first]; }
};

// Which sorted points start a leaf (leaf_starts of tree.h), and each point moved to its
// place in Morton order.
__global__ void __launch_bounds__(kStartsThreads)
    starts_kernel(const float* p, const int32_t* order, const uint64_t* code, int64_t n,
                  int32_t* flags, Point4* ref) {
  __shared__ int8_t slice[kStartsThreads + kLeafSize];
  const int64_t base = blockIdx.x * (int64_t)kStartsThreads;
  const BlockWindow window{slice, base - kLeafSize};
  for (int s = (int)threadIdx.x; s < kStartsThreads + kLeafSize; s += kStartsThreads) {
    const int64_t t = window.first + s;
    if (t >= 0 && t + kLeafSize < n) {
      slice[s] = (int8_t)common_depth(code[t], code[t + kLeafSize]);
    }
  }
  __syncthreads();
  const int64_t i = base + threadIdx.x;
  if (i >= n) return;
  int64_t run_start = 0;
  if (leaf_depth(window, n, i) > kMortonBits) {  // many equal codes: where they begin
    int64_t lo = 0, hi = i;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (code[mid] < code[i]) lo = mid + 1; else hi = mid;
    }
    run_start = lo;
  }
  flags[i] = leaf_starts(code, window, n, i, run_start) ? 1 : 0;
  const int64_t j = order[i];
  ref[i] = Point4{p[3 * j], p[3 * j + 1], p[3 * j + 2], (int32_t)j};
}

// From the running count of leaf starts: where each leaf begins, and the layout.
__global__ void layout_kernel(const int32_t* flags, const int32_t* ids, int64_t n,
                              int32_t* leaf_start, TreeLayout* layout) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (flags[i]) leaf_start[ids[i] - 1] = (int32_t)i;
  if (i == n - 1) {
    leaf_start[ids[i]] = (int32_t)n;
    *layout = tree_layout(ids[i]);
  }
}

// Warps over the leaves (as many as the layout says): each leaf's box.
__global__ void __launch_bounds__(kTreeThreads)
    leaves_kernel(const Point4* ref, const int32_t* leaf_start, const TreeLayout* layout,
                  NodeBox* leaves) {
  const int lane = (int)(threadIdx.x & 31u);
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  const int64_t count = layout->count[0];
  for (int64_t leaf = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; leaf < count;
       leaf += warps) {
    const int64_t s = leaf_start[leaf] + lane;
    NodeBox b;
    box_empty(b);
    if (s < leaf_start[leaf + 1]) box_add(b, &ref[s].x, &ref[s].x);
    warp_box(b);
    if (lane == 0) leaves[leaf] = b;
  }
}

// Warps over the nodes of level l: the box of each one's (up to) 32 children.
__device__ __forceinline__ void level_boxes(NodeBox* nodes, const TreeLayout* layout, int l,
                                            int64_t warp, int64_t warps, int lane) {
  const NodeBox* below = nodes + layout->offset[l - 1];
  const int64_t n_below = layout->count[l - 1];
  for (int64_t node = warp; node < layout->count[l]; node += warps) {
    const int64_t c = node * kFanout + lane;
    NodeBox b;
    box_empty(b);
    if (c < n_below) box_add(b, below[c].lo, below[c].hi);
    warp_box(b);
    if (lane == 0) nodes[layout->offset[l] + node] = b;
  }
}

__global__ void __launch_bounds__(kTreeThreads)
    level_kernel(NodeBox* nodes, const TreeLayout* layout, int l) {
  if (l >= layout->levels) return;
  level_boxes(nodes, layout, l, (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32,
              (int64_t)gridDim.x * blockDim.x / 32, (int)(threadIdx.x & 31u));
}

// The levels from `first` up to the root in one block, a level after the one below it:
// the top levels hold few nodes (at most kTopNodes in the largest layout), and a launch
// each would cost more than their work.
constexpr int kTopThreads = 1024;
constexpr int64_t kTopNodes = 4 * (kTopThreads / 32);

__global__ void __launch_bounds__(kTopThreads)
    top_kernel(NodeBox* nodes, const TreeLayout* layout, int first) {
  const int levels = layout->levels;  // the same in every thread
  for (int l = first; l < levels; ++l) {
    level_boxes(nodes, layout, l, threadIdx.x / 32, kTopThreads / 32,
                (int)(threadIdx.x & 31u));
    __syncthreads();  // the level's boxes written before the next level reads them
  }
}

}  // namespace

TreeTensors build_tree_cuda(const at::Tensor& p_ref, int32_t* zero) {
  const int64_t n = p_ref.size(0);
  const TreeLayout most = tree_layout(n);  // the workspace: as many leaves as points
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = robust_blocks(n);  // the split of robust_bound (grid.h)
  at::Tensor partial = at::empty({6 * blocks}, p_ref.options());
  box_kernel<<<blocks, kBoxThreads, 0, stream>>>(p_ref.data_ptr<float>(), n,
                                                  partial.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TreeTensors t;
  auto bytes = p_ref.options().dtype(at::kByte);
  t.params = at::empty({(int64_t)sizeof(TreeParams)}, bytes);
  t.layout = at::empty({(int64_t)sizeof(TreeLayout)}, bytes);
  auto* tp = reinterpret_cast<TreeParams*>(t.params.data_ptr<uint8_t>());
  auto* layout = reinterpret_cast<TreeLayout*>(t.layout.data_ptr<uint8_t>());
  params_kernel<<<1, kParamsThreads, 0, stream>>>(partial.data_ptr<float>(), blocks, tp,
                                                   zero);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto longs = p_ref.options().dtype(at::kLong);
  auto ints = p_ref.options().dtype(at::kInt);
  at::Tensor codes = at::empty({n}, longs);
  t.codes = at::empty({n}, longs);
  at::Tensor rows = at::empty({n}, ints), order = at::empty({n}, ints);
  auto* keys_in = reinterpret_cast<uint64_t*>(codes.data_ptr<int64_t>());
  auto* keys_out = reinterpret_cast<uint64_t*>(t.codes.data_ptr<int64_t>());
  morton_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(p_ref.data_ptr<float>(), n, tp,
                                                        keys_in, rows.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // A radix sort of the codes' 3 * kMortonBits bits, rows as values; stable, so that
  // equal codes keep their rows' order and the tree is the same on every call.
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(sort_codes(nullptr, temp_bytes, keys_in, keys_out, rows.data_ptr<int32_t>(),
                            order.data_ptr<int32_t>(), n, stream));
  at::Tensor temp = at::empty({(int64_t)temp_bytes}, p_ref.options().dtype(at::kByte));
  C10_CUDA_CHECK(sort_codes(temp.data_ptr(), temp_bytes, keys_in, keys_out,
                            rows.data_ptr<int32_t>(), order.data_ptr<int32_t>(), n, stream));
  t.ref = at::empty({n, 4}, p_ref.options());
  at::Tensor flags = at::empty({n}, ints);
  starts_kernel<<<blocks_for(n, kStartsThreads), kStartsThreads, 0, stream>>>(
      p_ref.data_ptr<float>(), order.data_ptr<int32_t>(), keys_out, n,
      flags.data_ptr<int32_t>(), reinterpret_cast<Point4*>(t.ref.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor ids = at::cumsum(flags, 0, at::kInt);
  t.leaf_start = at::empty({n + 1}, ints);
  layout_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(
      flags.data_ptr<int32_t>(), ids.data_ptr<int32_t>(), n,
      t.leaf_start.data_ptr<int32_t>(), layout);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  t.nodes = at::empty({most.total, 8}, p_ref.options());
  auto* nodes = reinterpret_cast<NodeBox*>(t.nodes.data_ptr<float>());
  // Launched for a typical number of leaves (a ninth of the points); the warps loop
  // over as many as the layout holds.
  const int leaf_blocks = blocks_for(std::max<int64_t>(1, n / 8) * 32, kTreeThreads);
  leaves_kernel<<<leaf_blocks, kTreeThreads, 0, stream>>>(
      reinterpret_cast<const Point4*>(t.ref.data_ptr<float>()),
      t.leaf_start.data_ptr<int32_t>(), layout, nodes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  int l = 1;
  for (; l < most.levels && most.count[l] > kTopNodes; ++l) {
    const int64_t typical = std::max<int64_t>(1, most.count[l] / 8);
    level_kernel<<<blocks_for(typical * 32, kTreeThreads), kTreeThreads, 0, stream>>>(
        nodes, layout, l);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (l < most.levels) {
    top_kernel<<<1, kTopThreads, 0, stream>>>(nodes, layout, l);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return t;
}

}  // namespace extkernels
