// The tree of tree.h on the GPU (chapter 14): its search. The build is in
// tree_build_cuda.cu.
//
// - Search: one warp per query. It first takes the 32 points around the query's place
//   in the Morton order; then the warp tests a node's 32 child boxes at once (a lane
//   each) and ranks the ones nearer than the k-th best so far (by counting when they
//   are few, with a bitonic network of shuffles when many). Inner nodes go on a stack in
//   shared memory, nearest on top; the kept leaves of a node are tested at once,
//   nearest first, their points laid end to end 32 at a time (a leaf holds 12 points on
//   average, so one leaf per step would leave most lanes idle). Each better point
//   enters a list of the k best that the warp holds, element e in lane e % 32 (more
//   than kInsertLimit at once are sorted and merged with it). The softmax and the
//   gather follow in the same kernel.
// - Heavy queries: a query that has not finished after kHeavySteps steps (kEarlySteps
//   in a small cloud; near the centre of a hollow shell, every point of it is nearly as
//   far as the nearest) goes on a list that a second kernel works through with a team
//   of warps per query, so that one warp's long walk does not hold up the kernel.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <climits>

#include "fused.h"
#include "launch.cuh"
#include "launch_fused.cuh"
#include "tree.h"
#include "warp.cuh"

namespace extkernels {
namespace {

constexpr int kWarps = kTreeThreads / 32;

__device__ __forceinline__ NodeBox load_box(const NodeBox* nodes, int64_t i) {
  const float4* v = reinterpret_cast<const float4*>(nodes + i);
  const float4 lo = __ldg(v), hi = __ldg(v + 1);
  return NodeBox{{lo.x, lo.y, lo.z}, 0.0f, {hi.x, hi.y, hi.z}, 0.0f};
}

// Sorts (key, val) ascending across the warp, ties by val: 15 compare-exchange steps.
__device__ __forceinline__ void bitonic_sort(float& key, int32_t& val, int lane) {
#pragma unroll
  for (int size = 2; size <= 32; size <<= 1) {
#pragma unroll
    for (int stride = size / 2; stride > 0; stride >>= 1) {
      const float other = __shfl_xor_sync(kFullWarp, key, stride);
      const int32_t other_val = __shfl_xor_sync(kFullWarp, val, stride);
      const bool ascending = (lane & size) == 0 || size == 32;
      const bool lower = (lane & stride) == 0;
      const bool smaller = other < key || (other == key && other_val < val);
      if (lower == ascending ? smaller : !smaller) {
        key = other;
        val = other_val;
      }
    }
  }
}

// Whether a point or box at squared distance d2 may hold a neighbour, given the k-th best
// kth: nearer, or as near (a tie goes to the lower index, which may be inside), never
// when nothing is there (infinity).
__device__ __forceinline__ bool admit(float d2, float kth) {
  return d2 < kth || (d2 == kth && d2 < INFINITY);
}

// The warp's list of the best S * 32 (squared distance, row), ascending: element e is
// slot e / 32 of lane e % 32.
template <int S>
__device__ __forceinline__ void list_insert(float (&d)[S], int32_t (&id)[S], float c,
                                            int32_t ci, int lane) {
  int pos = 0;  // after the entries that come before it: the order of TopK::push (grid.h)
#pragma unroll
  for (int s = 0; s < S; ++s) pos += __popc(__ballot_sync(kFullWarp, before(d[s], id[s], c, ci)));
#pragma unroll
  for (int s = S - 1; s >= 0; --s) {
    float up = __shfl_up_sync(kFullWarp, d[s], 1);
    int32_t up_id = __shfl_up_sync(kFullWarp, id[s], 1);
    if (s > 0) {  // lane 0 takes the last element of the slot below
      const float last = __shfl_sync(kFullWarp, d[s > 0 ? s - 1 : 0], 31);
      const int32_t last_id = __shfl_sync(kFullWarp, id[s > 0 ? s - 1 : 0], 31);
      if (lane == 0) {
        up = last;
        up_id = last_id;
      }
    }
    const int e = s * 32 + lane;
    if (e > pos) {
      d[s] = up;
      id[s] = up_id;
    } else if (e == pos) {
      d[s] = c;
      id[s] = ci;
    }
  }
}

template <int S, typename T>
__device__ __forceinline__ T list_get(const T (&v)[S], int e) {
  T x = v[0];
#pragma unroll
  for (int s = 1; s < S; ++s) x = e / 32 == s ? v[s] : x;
  return __shfl_sync(kFullWarp, x, e % 32);
}

// A bitonic sequence across the warp sorted ascending, ties by val: 5 steps.
__device__ __forceinline__ void bitonic_merge(float& key, int32_t& val, int lane) {
#pragma unroll
  for (int stride = 16; stride > 0; stride >>= 1) {
    const float other = __shfl_xor_sync(kFullWarp, key, stride);
    const int32_t other_val = __shfl_xor_sync(kFullWarp, val, stride);
    const bool lower = (lane & stride) == 0;
    const bool smaller = other < key || (other == key && other_val < val);
    if (lower == smaller) {
      key = other;
      val = other_val;
    }
  }
}

// Up to this many better points enter a list of 32 one at a time; more are sorted and
// merged with it at once (a query far from every point, whose k-th best falls slowly).
constexpr int kInsertLimit = 6;

// Each lane's point (squared distance pd, row pi; infinity for none) that beats the
// warp's k-th best enters the list: one at a time when few do, else (a list of 32, S = 1)
// sorted and merged with it at once; kth follows the list, never above cap (a bound known
// in advance, see tree_heavy_kernel; infinity otherwise).
template <int S>
__device__ __forceinline__ void take_better(float pd, int32_t pi, float (&d)[S],
                                            int32_t (&id)[S], float& kth, float cap,
                                            int k, int lane) {
  unsigned better = __ballot_sync(kFullWarp, admit(pd, kth));
  if (S == 1 && __popc(better) > kInsertLimit) {
    float c = admit(pd, kth) ? pd : INFINITY;
    int32_t ci = admit(pd, kth) ? pi : -1;
    bitonic_sort(c, ci, lane);
    // The 32 best of both: the list against the candidates in reverse, then sorted.
    const float r = __shfl_sync(kFullWarp, c, 31 - lane);
    const int32_t ri = __shfl_sync(kFullWarp, ci, 31 - lane);
    if (r < d[0] || (r == d[0] && ri < id[0])) {
      d[0] = r;
      id[0] = ri;
    }
    bitonic_merge(d[0], id[0], lane);
    kth = fminf(cap, list_get<S>(d, k - 1));
    return;
  }
  for (; better; better &= better - 1) {
    const int src = __ffs(better) - 1;
    const float c = __shfl_sync(kFullWarp, pd, src);
    const int32_t ci = __shfl_sync(kFullWarp, pi, src);
    if (admit(c, kth)) {
      list_insert<S>(d, id, c, ci, lane);
      kth = fminf(cap, list_get<S>(d, k - 1));
    }
  }
}

// Up to this many kept children are ranked by counting; more by the sorting network.
constexpr int kRankLimit = 8;

// The points of up to 32 leaves (lane i holds the i-th nearest: its index in key, its
// box's distance in d2), 32 points at a time whatever the leaves' sizes: the leaves'
// runs of points are laid end to end and lane t takes point t of each window of 32. A
// leaf whose box is no nearer than the k-th best when its points come up is skipped.
template <int S>
__device__ __forceinline__ void test_leaves(const float* qp, const Point4* ref,
                                            const int32_t* leaf_start, TreeEntry leaf,
                                            int n_leaves, int64_t guess, float (&d)[S],
                                            int32_t (&id)[S], float& kth, float cap,
                                            int k, int lane) {
  int32_t begin = 0, count = 0;
  if (lane < n_leaves) {
    begin = leaf_start[leaf.key];
    count = leaf_start[leaf.key + 1] - begin;
  }
  int end = count;  // where the lane's leaf ends in the windows: an inclusive scan
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int below = __shfl_up_sync(kFullWarp, end, o);
    if (lane >= o) end += below;
  }
  const int first = end - count;
  const int total = __shfl_sync(kFullWarp, end, 31);
  for (int base = 0; base < total; base += 32) {
    const int t = base + lane;
    int j = 0;  // the last leaf starting at or before t
#pragma unroll
    for (int step = 16; step > 0; step /= 2) {
      const int at = __shfl_sync(kFullWarp, first, j + step);
      if (j + step < n_leaves && at <= t) j += step;
    }
    const float box = __shfl_sync(kFullWarp, leaf.d2, j);
    const int32_t s = __shfl_sync(kFullWarp, begin, j) + (t - __shfl_sync(kFullWarp, first, j));
    float pd = INFINITY;
    int32_t pi = -1;
    // (the first guess's points are in the list already)
    if (t < total && admit(box, kth) && (s < guess || s >= guess + kFanout)) {
      const Point4 p = load_point(ref, s);
      pd = dist2(qp[0] - p.x, qp[1] - p.y, qp[2] - p.z);
      pi = p.index;
    }
    take_better<S>(pd, pi, d, id, kth, cap, k, lane);
  }
}

// Steps (stack entries taken) a query's warp takes before it hands the query to
// tree_heavy_kernel. A query on the book's cloud takes about 20; near the centre of a
// hollow shell, where every point of the shell is nearly as far as the nearest, a few
// take hundreds, and one warp's steps, each waiting for memory, make the kernel wait.
// In a cloud of up to kEarlyCloud points a query hands over sooner, after kEarlySteps:
// the shell's search at 10^5 points takes 15 % less time; at 10^6 the earlier hand-over
// sends thousands of queries of the shell and the meshes to the teams: 11 to 42 % slower.
constexpr int kHeavySteps = 128;
constexpr int kEarlySteps = 64;
constexpr int64_t kEarlyCloud = int64_t(1) << 18;
// Warps that share one heavy query, each searching its own part of the tree: 16 take
// the shell's heavy queries in a fifth of the time that 8 take (their stacks and lists
// hold 37 KiB of the 48 KiB of static shared memory a block may have).
constexpr int kTeam = 16;
constexpr int kTeamThreads = 32 * kTeam;
// Rounds of the team kernel's blocks a heavy list may take before its teams halve: a
// team of kTeam warps finishes a query far sooner than one of half as many.
constexpr int kTeamWaves = 2;

// The descent from the stack: nearest box first, skipping every box no nearer than the
// k-th best. Returns false, with entries left on the stack, after `budget` steps.
template <int S>
__device__ __forceinline__ bool descend(const float* qp, const Point4* ref,
                                        const int32_t* leaf_start, const NodeBox* nodes,
                                        const TreeLayout& L, TreeEntry* stack, int& top,
                                        int64_t guess, float (&d)[S], int32_t (&id)[S],
                                        float& kth, float cap, int k, int lane,
                                        int budget) {
  for (int steps = 0; top > 0; ++steps) {
    if (steps == budget) return false;
    const TreeEntry e = stack[--top];
    __syncwarp();  // every lane has read it before any lane pushes over it
    if (!admit(e.d2, kth)) continue;
    const int level = e.key % kMaxLevels;
    const int64_t node = e.key / kMaxLevels;
    TreeEntry leaf{0, INFINITY};  // lane i: the i-th nearest leaf to test, or none
    int n_leaves = 1;
    if (level == 0) {  // a leaf alone (the root of a small tree, or a heavy query's share)
      if (lane == 0) leaf = TreeEntry{(int32_t)node, e.d2};
    } else {
      // The node's children, a lane each: the ones nearer than the k-th best, ranked.
      const int64_t c = node * kFanout + lane;
      float cd = INFINITY;
      if (c < L.count[level - 1]) cd = box_dist2(qp, load_box(nodes, L.offset[level - 1] + c));
      const unsigned kept = __ballot_sync(kFullWarp, admit(cd, kth));
      if (!kept) continue;
      const int n_kept = __popc(kept);
      float key = admit(cd, kth) ? cd : INFINITY;
      int32_t child = (int32_t)c;
      bool mine = admit(cd, kth);
      int rank = 0;
      if (n_kept > kRankLimit) {  // many: a sorting network
        bitonic_sort(key, child, lane);
        mine = lane < n_kept;
        rank = lane;
      } else {  // few: each counts the ones before it
        for (unsigned rest = kept; rest; rest &= rest - 1) {
          const int src = __ffs(rest) - 1;
          const float other = __shfl_sync(kFullWarp, key, src);
          const int32_t other_child = __shfl_sync(kFullWarp, child, src);
          rank += other < key || (other == key && other_child < child);
        }
      }
      if (level > 1) {  // inner nodes wait on the stack, the nearest on top
        if (mine) stack[top + n_kept - 1 - rank] = TreeEntry{entry_key(child, level - 1), key};
        top += n_kept;
        __syncwarp();
        continue;
      }
      // Leaves are tested at once: lane i takes the i-th nearest.
      if (mine) stack[top + rank] = TreeEntry{child, key};
      __syncwarp();
      if (lane < n_kept) leaf = stack[top + lane];
      n_leaves = n_kept;
      __syncwarp();
    }
    test_leaves<S>(qp, ref, leaf_start, leaf, n_leaves, guess, d, id, kth, cap, k, lane);
  }
  return true;
}

// The k best of a warp's list, as distances or softmax weights, and with features the
// weighted sum of their rows.
template <int S, bool SOFTMAX>
__device__ __forceinline__ void finish(const float (&d)[S], const int32_t (&id)[S],
                                       int64_t row, int k, float inv_sigma,
                                       const float* feats, int64_t f, float* out,
                                       float* values, int64_t* idx, int lane) {
  const float nearest = sqrtf(__shfl_sync(kFullWarp, d[0], 0));
  float w[S], total = 0.0f;
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const float dist = sqrtf(d[s]);
    const bool mine = s * 32 + lane < k;
    w[s] = SOFTMAX ? (mine ? __expf((nearest - dist) * inv_sigma) : 0.0f) : dist;
    total += mine ? w[s] : 0.0f;
  }
  if (SOFTMAX) {
    total = warp_sum(total);
#pragma unroll
    for (int s = 0; s < S; ++s) w[s] /= total;
  }
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const int e = s * 32 + lane;
    if (e < k) {
      values[row * k + e] = w[s];
      idx[row * k + e] = id[s];
    }
  }
  if (feats == nullptr) return;
  for (int64_t c0 = 0; c0 < f; c0 += 32) {
    const int64_t c = c0 + lane;
    float acc = 0.0f;
    for (int e = 0; e < k; ++e) {
      const float we = list_get<S>(w, e);
      const int32_t ie = list_get<S>(id, e);
      if (ie >= 0 && c < f) acc += we * __ldg(feats + (int64_t)ie * f + c);
    }
    if (c < f) out[row * f + c] = acc;
  }
}

template <int S, bool SOFTMAX>
__global__ void __launch_bounds__(kTreeThreads)
    tree_knn_kernel(const float* q, int64_t m, const Point4* ref, int64_t n,
                    const uint64_t* codes, const int32_t* leaf_start,
                    const NodeBox* nodes, const TreeLayout* layout,
                    const TreeParams* params, int k, float inv_sigma, const float* feats,
                    int64_t f, float* out, float* values, int64_t* idx, int32_t* heavy,
                    int32_t* n_heavy) {
  __shared__ TreeEntry stacks[kWarps][kStackSize];
  __shared__ TreeLayout L;
  __shared__ TreeParams P;
  if (threadIdx.x == 0) {
    L = *layout;
    P = *params;
  }
  __syncthreads();
  const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x & 31u);
  const int64_t row = blockIdx.x * (int64_t)kWarps + warp;
  if (row >= m) return;  // the whole warp: one query
  TreeEntry* stack = stacks[warp];
  const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
  float d[S];
  int32_t id[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    d[s] = INFINITY;
    id[s] = -1;
  }
  float kth = INFINITY;
  int top = 0;
  int64_t guess = 0;  // the first guess: points guess .. guess + 31
  if (finite3(qp)) {  // (value checks off) otherwise no neighbour: index -1
    // The kFanout points around the query's place in the Morton order (found by a
    // search in which the 32 lanes split the range 32 ways at each step), so that the
    // descent starts with a k-th distance near the final one.
    const uint64_t qcode = (uint64_t)morton_of(qp, P);
    int64_t lo = 0, hi = n;  // the place lies in lo .. hi
    while (hi - lo > 1) {
      const int64_t step = (hi - lo + 31) / 32;
      const int64_t at = lo + lane * step;
      const bool below = at < hi && codes[at] < qcode;
      const int last = 31 - __clz(__ballot_sync(kFullWarp, below) | 1u);
      const int64_t new_lo = lo + last * step;
      hi = new_lo + step < hi ? new_lo + step : hi;
      lo = new_lo;
    }
    guess = lo - kFanout / 2;
    guess = guess + kFanout > n ? n - kFanout : guess;
    guess = guess < 0 ? 0 : guess;
    const int64_t s = guess + lane;
    float pd = INFINITY;
    int32_t pi = -1;
    if (s < n) {
      const Point4 p = load_point(ref, s);
      pd = dist2(qp[0] - p.x, qp[1] - p.y, qp[2] - p.z);
      pi = p.index;
    }
    take_better<S>(pd, pi, d, id, kth, INFINITY, k, lane);
    if (lane == 0) stack[0] = TreeEntry{entry_key(0, L.levels - 1), 0.0f};
    top = 1;
  }
  __syncwarp();
  if (!descend<S>(qp, ref, leaf_start, nodes, L, stack, top, guess, d, id, kth, INFINITY,
                  k, lane, n <= kEarlyCloud ? kEarlySteps : kHeavySteps)) {
    // Too long for one warp: the query goes on the heavy list, with the k-th distance
    // found so far (parked in its first value), for a team of warps to finish.
    if (lane == 0) {
      heavy[atomicAdd(n_heavy, 1)] = (int32_t)row;
      values[row * k] = kth;
    }
    return;
  }
  finish<S, SOFTMAX>(d, id, row, k, inv_sigma, feats, f, out, values, idx, lane);
}

// The heavy queries, a team of warps each: the nodes of the highest level with at least
// as many nodes as the team has warps are dealt out to them, every warp searches its
// share with a list of its own, bounded from the start by the k-th distance the first
// kernel had found (taken as an upper bound: every point at most that far is looked at),
// and the team's first warp merges the lists, in warp order, into the k best. A team has
// kTeam warps while the list is short; when the launched blocks would need more than
// kTeamWaves rounds to give each query kTeam warps, the teams halve until they do not. The
// team's size follows from the list's length alone, and the lists never race, so the
// result is the same on every call. The blocks loop over the list, whose length is known
// on the device only.
template <int S, bool SOFTMAX>
__global__ void __launch_bounds__(kTeamThreads)
    tree_heavy_kernel(const float* q, const Point4* ref, const int32_t* leaf_start,
                      const NodeBox* nodes, const TreeLayout* layout, int k,
                      float inv_sigma, const float* feats, int64_t f, float* out,
                      float* values, int64_t* idx, const int32_t* heavy,
                      const int32_t* n_heavy) {
  __shared__ TreeEntry stacks[kTeam][kStackSize];
  __shared__ float lists_d[kTeam][32 * S];
  __shared__ int32_t lists_id[kTeam][32 * S];
  __shared__ TreeLayout L;
  if (threadIdx.x == 0) L = *layout;
  __syncthreads();
  const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x & 31u);
  TreeEntry* stack = stacks[warp];
  const int64_t count = *n_heavy;
  int team = kTeam;
  while (team > 1 && count * team > (int64_t)kTeamWaves * gridDim.x * kTeam) team /= 2;
  const int teams = kTeam / team;  // queries a block takes at once
  const int sub = warp / team, member = warp % team;
  // The level dealt out: the highest with at least `team` nodes (so that the next one up
  // has fewer, and each warp's share is under kFanout), or the leaves.
  int level = 0;
  for (int l = L.levels - 1; l > 0; --l) {
    if (L.count[l] >= team) {
      level = l;
      break;
    }
  }
  for (int64_t first = (int64_t)blockIdx.x * teams; first < count;
       first += (int64_t)gridDim.x * teams) {
    const int64_t h = first + sub;
    const bool active = h < count;  // the whole warp
    const int64_t row = active ? heavy[h] : 0;
    const float qp[3] = {q[3 * row], q[3 * row + 1], q[3 * row + 2]};
    float d[S];
    int32_t id[S];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      d[s] = INFINITY;
      id[s] = -1;
    }
    if (active) {
      const float cap = nextafterf(values[row * k], INFINITY);
      float kth = cap;
      // The warp's share, lane i its i-th node, pushed nearest on top.
      const int64_t node = member + (int64_t)lane * team;
      float key = INFINITY;
      if (node < L.count[level]) {
        key = box_dist2(qp, load_box(nodes, L.offset[level] + node));
        key = key < cap ? key : INFINITY;
      }
      const int n_kept = __popc(__ballot_sync(kFullWarp, key < INFINITY));
      int32_t mine = (int32_t)node;
      bitonic_sort(key, mine, lane);
      if (lane < n_kept) stack[n_kept - 1 - lane] = TreeEntry{entry_key(mine, level), key};
      int top = n_kept;
      __syncwarp();
      descend<S>(qp, ref, leaf_start, nodes, L, stack, top, -2 * kFanout, d, id, kth, cap,
                 k, lane, INT_MAX);
    }
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const bool in = s * 32 + lane < k;
      lists_d[warp][s * 32 + lane] = in ? d[s] : INFINITY;
      lists_id[warp][s * 32 + lane] = in ? id[s] : -1;
    }
    __syncthreads();  // every list written, and every warp done with values[row * k]
    if (active && member == 0) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        d[s] = INFINITY;
        id[s] = -1;
      }
      float kth = INFINITY;
      for (int w = warp; w < warp + team; ++w) {
#pragma unroll
        for (int s = 0; s < S; ++s) {
          take_better<S>(lists_d[w][s * 32 + lane], lists_id[w][s * 32 + lane], d, id, kth,
                         INFINITY, k, lane);
        }
      }
      finish<S, SOFTMAX>(d, id, row, k, inv_sigma, feats, f, out, values, idx, lane);
    }
    __syncthreads();  // the lists are read before the next queries overwrite them
  }
}

}  // namespace

void knn_tree_cuda(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
                   float inv_sigma, const at::Tensor* feats, at::Tensor* out,
                   at::Tensor& values, at::Tensor& indices) {
  const int64_t m = p_query.size(0), n = p_ref.size(0);
  // The heavy list: the queries the first kernel hands on, and their number (zeroed by
  // the build).
  auto ints = p_query.options().dtype(at::kInt);
  at::Tensor heavy = at::empty({std::max<int64_t>(m, 1)}, ints);
  at::Tensor n_heavy = at::empty({1}, ints);
  const TreeTensors t = build_tree_cuda(p_ref, n_heavy.data_ptr<int32_t>());
  auto stream = c10::cuda::getCurrentCUDAStream();
  const float* x = feats ? feats->data_ptr<float>() : nullptr;
  float* o = out ? out->data_ptr<float>() : nullptr;
  const int64_t f = feats ? feats->size(1) : 0;
  const auto* ref = reinterpret_cast<const Point4*>(t.ref.data_ptr<float>());
  const auto* nodes = reinterpret_cast<const NodeBox*>(t.nodes.data_ptr<float>());
  const int blocks = blocks_for(m, kWarps);
  // The heavy kernel's blocks loop over the list: four per multiprocessor.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  const int team_blocks = 4 * sms;
  const auto* tree_layout = reinterpret_cast<const TreeLayout*>(t.layout.data_ptr<uint8_t>());
#define EK_TREE_LAUNCH(S, SOFTMAX)                                                    \
  do {                                                                                \
  tree_knn_kernel<S, SOFTMAX><<<blocks, kTreeThreads, 0, stream>>>(                  \
      p_query.data_ptr<float>(), m, ref, n,                                           \
      reinterpret_cast<const uint64_t*>(t.codes.data_ptr<int64_t>()),                 \
      t.leaf_start.data_ptr<int32_t>(), nodes, tree_layout,                           \
      reinterpret_cast<const TreeParams*>(t.params.data_ptr<uint8_t>()), (int)k,      \
      inv_sigma, x, f, o, values.data_ptr<float>(), indices.data_ptr<int64_t>(),      \
      heavy.data_ptr<int32_t>(), n_heavy.data_ptr<int32_t>());                        \
  C10_CUDA_KERNEL_LAUNCH_CHECK();                                                     \
  tree_heavy_kernel<S, SOFTMAX><<<team_blocks, kTeamThreads, 0, stream>>>(           \
      p_query.data_ptr<float>(), ref, t.leaf_start.data_ptr<int32_t>(), nodes,        \
      tree_layout, (int)k, inv_sigma, x, f, o, values.data_ptr<float>(),              \
      indices.data_ptr<int64_t>(), heavy.data_ptr<int32_t>(),                         \
      n_heavy.data_ptr<int32_t>());                                                   \
  } while (0)
  if (k <= 32) {
    if (inv_sigma > 0.0f) EK_TREE_LAUNCH(1, true); else EK_TREE_LAUNCH(1, false);
  } else {
    if (inv_sigma > 0.0f) EK_TREE_LAUNCH(2, true); else EK_TREE_LAUNCH(2, false);
  }
#undef EK_TREE_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace extkernels
