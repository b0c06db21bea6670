// The spatial index of the fused backend (chapter 14), shared by its CPU and CUDA
// kernels: a wide bounding-volume hierarchy over the reference points in Morton order.
//
// - The points are sorted by the Morton code of their position in a cube around the
//   cloud (16 bits per axis), so that consecutive points are near each other. The cube
//   spans the cloud's box less its few most extreme points (robust_bound, grid.h): a far
//   outlier takes the code of the nearest face's cell instead of diluting every code.
// - Level 0 cuts the sorted points into leaves: the coarsest cells of the octree of that
//   cube that hold at most kLeafSize points (a run of consecutive points each, found from
//   the codes alone; see leaf_starts). Every level above groups kFanout consecutive
//   nodes of the level below. A node's box bounds its children; nothing else is
//   stored, the tree is implicit in the order.
// - A search descends from the root, nearest box first, and skips every box that lies
//   farther than the k-th best distance so far: empty space, far clusters and outliers
//   cost one box test each, whatever the shape of the cloud. Unlike the grid of chapter
//   9, no cell size has to fit the cloud.
#pragma once

#include <cmath>
#include <cstdint>

#include "grid.h"

namespace extkernels {

// Children per node: one warp's width, so that on the GPU the lanes of a warp test a
// node's children at once.
constexpr int kFanout = 32;
// The most points a leaf holds (at most kFanout, the points of the first guess).
constexpr int kLeafSize = 32;
// Levels of a tree over at most 2^31 points: at most 2^31 leaves, then 2^26, ..., 1.
constexpr int kMaxLevels = 8;
// Bits of each coordinate in the Morton code: 65,536 cells per axis, so that a dense
// part 1/5,000 the cloud's width still has its own cells, and 48 bits for the radix
// sort (six passes; 21 bits, the most a 64-bit code holds, cost eight, 30 bits four but
// lose small dense parts in a wide cloud, chapter 14).
constexpr int kMortonBits = 16;

// How many nodes each level holds and where it starts in the node array, for a given
// number of leaves. The workspace is sized for the most leaves n points can make (n),
// so from shapes; the actual layout is computed on the device.
struct TreeLayout {
  int levels;  // levels 0 (leaves) .. levels - 1 (the root, one node)
  int64_t count[kMaxLevels];
  int64_t offset[kMaxLevels];
  int64_t total;
};

EK_HD TreeLayout tree_layout(int64_t leaves) {
  TreeLayout t;
  int64_t c = leaves < 1 ? 1 : leaves;
  t.levels = 0;
  t.total = 0;
  for (int l = 0; l < kMaxLevels; ++l) {
    t.count[l] = 0;
    t.offset[l] = 0;
  }
  while (t.levels < kMaxLevels) {
    t.count[t.levels] = c;
    t.offset[t.levels] = t.total;
    t.total += c;
    ++t.levels;
    if (c == 1) break;
    c = (c + kFanout - 1) / kFanout;
  }
  return t;
}

// A node's box, 32 bytes (two float4 loads on the GPU): (n_nodes, 8) float32 in memory.
struct alignas(16) NodeBox {
  float lo[3];
  float pad0;
  float hi[3];
  float pad1;
};

// Where the Morton codes are measured: the corner of the cube around the cloud, and
// codes per unit length. A cube, not the box: cells are cubes, so a slab's leaves are
// compact patches, not needles.
struct TreeParams {
  float lo[3];
  float scale;
};

EK_HD TreeParams tree_params(const float lo[3], const float hi[3]) {
  TreeParams t;
  float extent = 0.0f;
  for (int a = 0; a < 3; ++a) {
    t.lo[a] = lo[a] - lo[a] == 0.0f ? lo[a] : 0.0f;  // not finite (checks off): 0
    const float e = hi[a] - lo[a];
    extent = e > extent ? e : extent;
  }
  const float top = (float)((1 << kMortonBits) - 1);
  t.scale = extent > 0.0f && extent < INFINITY ? top / extent : 0.0f;
  return t;
}

// The bits of v (kMortonBits of them) spread to every third bit of a 64-bit word.
EK_HD uint64_t spread_bits(uint32_t v) {
  uint64_t x = v & 0x1fffffu;
  x = (x | x << 32) & 0x1f00000000ffffull;
  x = (x | x << 16) & 0x1f0000ff0000ffull;
  x = (x | x << 8) & 0x100f00f00f00f00full;
  x = (x | x << 4) & 0x10c30c30c30c30c3ull;
  x = (x | x << 2) & 0x1249249249249249ull;
  return x;
}

EK_HD int64_t morton_of(const float* p, const TreeParams& t) {
  const float top = (float)((1 << kMortonBits) - 1);
  uint64_t code = 0;
  for (int a = 0; a < 3; ++a) {
    float c = (p[a] - t.lo[a]) * t.scale;
    c = c > 0.0f ? (c < top ? c : top) : 0.0f;  // NaN (checks off) -> 0
    code |= spread_bits((uint32_t)c) << a;
  }
  return (int64_t)code;
}

// Squared distance, with fused multiply-adds in a fixed order: rounding is monotone, so
// a point never comes out nearer than the box that holds it (see box_dist2), and the
// search never skips a box that holds a better point.
EK_HD float dist2(float dx, float dy, float dz) {
  return fmaf(dz, dz, fmaf(dy, dy, dx * dx));
}

EK_HD float axis_gap(float q, float lo, float hi) {
  const float below = lo - q, above = q - hi;
  return below > 0.0f ? below : (above > 0.0f ? above : 0.0f);
}

// Squared distance from q to the nearest point of a box (0 inside it). Along each axis
// the gap is a difference of the query and a point's coordinate (the box's faces are
// points' coordinates), rounded the same way as the points' own differences.
EK_HD float box_dist2(const float* q, const NodeBox& b) {
  return dist2(axis_gap(q[0], b.lo[0], b.hi[0]), axis_gap(q[1], b.lo[1], b.hi[1]),
               axis_gap(q[2], b.lo[2], b.hi[2]));
}

EK_HD bool finite3(const float* q) {
  return q[0] - q[0] == 0.0f && q[1] - q[1] == 0.0f && q[2] - q[2] == 0.0f;
}

// The box of `count` boxes or points, as a running union.
EK_HD void box_empty(NodeBox& b) {
  for (int a = 0; a < 3; ++a) {
    b.lo[a] = INFINITY;
    b.hi[a] = -INFINITY;
  }
  b.pad0 = b.pad1 = 0.0f;
}

EK_HD void box_add(NodeBox& b, const float* lo, const float* hi) {
  for (int a = 0; a < 3; ++a) {
    b.lo[a] = lo[a] < b.lo[a] ? lo[a] : b.lo[a];
    b.hi[a] = hi[a] > b.hi[a] ? hi[a] : b.hi[a];
  }
}

// Leading 3-bit groups (octree levels) that two codes share: the depth of the deepest
// octree cell holding both (kMortonBits for equal codes).
EK_HD int common_depth(uint64_t a, uint64_t b) {
  const uint64_t x = a ^ b;
  if (x == 0) return kMortonBits;
#if defined(__CUDA_ARCH__)
  const int lead = __clzll((long long)x);
#else
  const int lead = __builtin_clzll(x);
#endif
  return (lead - (64 - 3 * kMortonBits)) / 3;  // the code's top bits are never set
}

// The depth of the leaf that holds sorted point i: 1 + the deepest depth at which
// kLeafSize + 1 consecutive points around i share a cell (those cells hold too many),
// with window[t] = common_depth(code[t], code[t + kLeafSize]) for t + kLeafSize < n
// (an array, or on the GPU a block's slice of it in shared memory).
// Deeper than kMortonBits: points with equal codes, more than kLeafSize of them.
template <typename Window>
EK_HD int leaf_depth(const Window& window, int64_t n, int64_t i) {
  int depth = 0;
  const int64_t first = i >= kLeafSize ? i - kLeafSize : 0;
  for (int64_t t = first; t <= i && t + kLeafSize < n; ++t) {
    depth = window[t] + 1 > depth ? window[t] + 1 : depth;
  }
  return depth;
}

// Whether a leaf starts at sorted point i (codes ascending; run_start, the first point
// with point i's code, is needed only when more than kLeafSize points share it: such a
// run is cut every kLeafSize points). The leaves partition the points: the coarsest cell
// holding at most kLeafSize points is the same for every point in it.
template <typename Window>
EK_HD bool leaf_starts(const uint64_t* code, const Window& window, int64_t n, int64_t i,
                       int64_t run_start) {
  if (i == 0) return true;
  const int depth = leaf_depth(window, n, i);
  const int shared = common_depth(code[i - 1], code[i]);
  if (depth <= kMortonBits) return shared < depth;
  return shared < kMortonBits || (i - run_start) % kLeafSize == 0;
}

// A stack entry of the search: a node (its index within its level, and the level) and
// its box's squared distance from the query.
struct TreeEntry {
  int32_t key;  // node * kMaxLevels + level
  float d2;
};

EK_HD int32_t entry_key(int64_t node, int level) {
  return (int32_t)(node * kMaxLevels + level);
}

// Entries a search's stack can hold: at most kFanout - 1 siblings wait at each level,
// plus the node being expanded.
constexpr int kStackSize = kFanout * (kMaxLevels - 1) + 1;

}  // namespace extkernels
