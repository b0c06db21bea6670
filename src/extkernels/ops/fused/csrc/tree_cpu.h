// The tree of tree.h built and searched on the host (chapter 14): the same layout, the
// same order of the points and the same pruning as the CUDA kernels, one query at a
// time. The CPU kernels of the fused backend run it, and so do the tests on a machine
// without a GPU.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "grid_cpu.h"
#include "tree.h"

namespace extkernels {

// The tree as the operators hand it around: the sorted points, where each leaf's run of
// them starts, and the node boxes.
struct Tree {
  TreeLayout layout;
  at::Tensor ref;         // (n, 4) float32: n Point4 in Morton order
  at::Tensor leaf_start;  // (leaves + 1,) int32: leaf l holds points [start[l], start[l + 1])
  at::Tensor nodes;       // (layout.total, 8) float32: NodeBox per node, level by level
  at::Tensor codes;       // (n,) int64: the sorted Morton codes
  TreeParams params;
};

inline Tree build_tree_cpu(const at::Tensor& p_ref) {
  const int64_t n = p_ref.size(0);
  const float* p = p_ref.data_ptr<float>();
  float lo[3], hi[3], sd[3];
  box_and_spread_cpu(p, n, /*robust=*/true, lo, hi, sd);  // the GPU's Morton cube
  const TreeParams params = tree_params(lo, hi);
  std::vector<std::pair<uint64_t, int32_t>> order(n);
  for (int64_t j = 0; j < n; ++j) {
    order[j] = {(uint64_t)morton_of(p + 3 * j, params), (int32_t)j};
  }
  std::sort(order.begin(), order.end());  // by code, then by row: the GPU's order too
  Tree t;
  t.params = params;
  t.codes = at::empty({n}, p_ref.options().dtype(at::kLong));
  auto* code_out = reinterpret_cast<uint64_t*>(t.codes.data_ptr<int64_t>());
  std::vector<uint64_t> code(n);
  std::vector<int8_t> window(n, 0);
  for (int64_t s = 0; s < n; ++s) code[s] = code_out[s] = order[s].first;
  for (int64_t t = 0; t + kLeafSize < n; ++t) {
    window[t] = (int8_t)common_depth(code[t], code[t + kLeafSize]);
  }
  std::vector<int32_t> starts;
  int64_t run_start = 0;
  for (int64_t s = 0; s < n; ++s) {
    if (s > 0 && code[s] != code[s - 1]) run_start = s;
    if (leaf_starts(code.data(), window.data(), n, s, run_start)) starts.push_back((int32_t)s);
  }
  const int64_t leaves = (int64_t)starts.size();
  starts.push_back((int32_t)n);
  t.layout = tree_layout(leaves);
  t.ref = at::empty({n, 4}, p_ref.options());
  t.leaf_start = at::empty({leaves + 1}, p_ref.options().dtype(at::kInt));
  std::copy(starts.begin(), starts.end(), t.leaf_start.data_ptr<int32_t>());
  t.nodes = at::empty({t.layout.total, 8}, p_ref.options());
  auto* ref = reinterpret_cast<Point4*>(t.ref.data_ptr<float>());
  auto* nodes = reinterpret_cast<NodeBox*>(t.nodes.data_ptr<float>());
  for (int64_t s = 0; s < n; ++s) {
    const float* x = p + 3 * order[s].second;
    ref[s] = Point4{x[0], x[1], x[2], order[s].second};
  }
  for (int64_t leaf = 0; leaf < leaves; ++leaf) {
    NodeBox& b = nodes[leaf];
    box_empty(b);
    for (int64_t s = starts[leaf]; s < starts[leaf + 1]; ++s) box_add(b, &ref[s].x, &ref[s].x);
  }
  for (int l = 1; l < t.layout.levels; ++l) {
    const NodeBox* below = nodes + t.layout.offset[l - 1];
    for (int64_t node = 0; node < t.layout.count[l]; ++node) {
      NodeBox& b = nodes[t.layout.offset[l] + node];
      box_empty(b);
      const int64_t end = std::min<int64_t>(t.layout.count[l - 1], (node + 1) * kFanout);
      for (int64_t c = node * kFanout; c < end; ++c) box_add(b, below[c].lo, below[c].hi);
    }
  }
  return t;
}

// What a search did: boxes tested and points tested (for the work counts of chapter 14).
struct Work {
  int64_t boxes = 0, points = 0;
};

// The k nearest of q (sorted ascending in best), nearest box first.
template <int KMAX>
void tree_search_cpu(const float* q, const Tree& t, TopK<KMAX>& best, Work* work = nullptr) {
  if (!finite3(q)) return;  // (value checks off) no neighbour: index -1
  const TreeLayout& L = t.layout;
  const auto* ref = reinterpret_cast<const Point4*>(t.ref.data_ptr<float>());
  const auto* nodes = reinterpret_cast<const NodeBox*>(t.nodes.data_ptr<float>());
  const int32_t* leaf_start = t.leaf_start.data_ptr<int32_t>();
  TreeEntry stack[kStackSize];
  int top = 0;
  // A first guess: the kFanout points around the query's place in the Morton order,
  // so that the descent starts with a k-th distance near the final one.
  const int64_t n = t.ref.size(0);
  const auto* codes = reinterpret_cast<const uint64_t*>(t.codes.data_ptr<int64_t>());
  const uint64_t qcode = (uint64_t)morton_of(q, t.params);
  const int64_t at = std::lower_bound(codes, codes + n, qcode) - codes;
  const int64_t lo = std::max<int64_t>(0, std::min<int64_t>(at - kFanout / 2, n - kFanout));
  for (int64_t s = lo; s < std::min<int64_t>(n, lo + kFanout); ++s) {
    const Point4 p = ref[s];
    best.push(dist2(q[0] - p.x, q[1] - p.y, q[2] - p.z), p.index);
  }
  const int64_t hi = std::min<int64_t>(n, lo + kFanout);
  if (work) work->points += hi - lo;
  auto test_leaf = [&](int64_t leaf) {  // its points, but the first guess's
    const int64_t begin = leaf_start[leaf], end = leaf_start[leaf + 1];
    for (int64_t s = begin; s < end; ++s) {
      if (s >= lo && s < hi) continue;  // in the first guess already
      const Point4 p = ref[s];
      best.push(dist2(q[0] - p.x, q[1] - p.y, q[2] - p.z), p.index);
    }
    if (work) work->points += end - begin;
  };
  stack[top++] = TreeEntry{entry_key(0, L.levels - 1), 0.0f};
  std::pair<float, int64_t> children[kFanout];
  while (top > 0) {
    const TreeEntry e = stack[--top];
    // Nothing in it can be better (a box as far as the k-th may hold a tie of lower index).
    if (e.d2 > best.worst()) continue;
    const int level = e.key % kMaxLevels;
    const int64_t node = e.key / kMaxLevels;
    const int64_t first = node * kFanout;
    if (level == 0) {  // the root is a leaf
      test_leaf(node);
      continue;
    }
    const int64_t end = std::min<int64_t>(L.count[level - 1], first + kFanout);
    const NodeBox* below = nodes + L.offset[level - 1];
    const float kth = best.worst();
    int kept = 0;
    for (int64_t c = first; c < end; ++c) {
      const float d2 = box_dist2(q, below[c]);
      if (d2 <= kth) children[kept++] = {d2, c};
    }
    if (work) work->boxes += end - first;
    std::sort(children, children + kept);
    if (level == 1) {  // leaves: tested at once, nearest first (as the GPU's warp does)
      for (int s = 0; s < kept; ++s) {
        if (children[s].first <= best.worst()) test_leaf(children[s].second);
      }
      continue;
    }
    for (int s = kept - 1; s >= 0; --s) {  // the nearest on top
      stack[top++] = TreeEntry{entry_key(children[s].second, level - 1), children[s].first};
    }
  }
}

}  // namespace extkernels
