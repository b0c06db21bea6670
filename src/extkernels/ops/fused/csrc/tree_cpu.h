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

#include "tree.h"

namespace extkernels {

// The tree as the operators hand it around: the sorted points and the node boxes.
struct Tree {
  TreeLayout layout;
  at::Tensor ref;    // (n, 4) float32: n Point4 in Morton order
  at::Tensor nodes;  // (layout.total, 8) float32: NodeBox per node, level by level
};

inline Tree build_tree_cpu(const at::Tensor& p_ref) {
  const int64_t n = p_ref.size(0);
  const float* p = p_ref.data_ptr<float>();
  float lo[3] = {INFINITY, INFINITY, INFINITY}, hi[3] = {-INFINITY, -INFINITY, -INFINITY};
  for (int64_t j = 0; j < n; ++j) {
    for (int a = 0; a < 3; ++a) {
      lo[a] = std::min(lo[a], p[3 * j + a]);
      hi[a] = std::max(hi[a], p[3 * j + a]);
    }
  }
  const TreeParams params = tree_params(lo, hi);
  std::vector<std::pair<int64_t, int32_t>> order(n);
  for (int64_t j = 0; j < n; ++j) order[j] = {morton_of(p + 3 * j, params), (int32_t)j};
  std::sort(order.begin(), order.end());  // by code, then by row: the GPU's order too
  Tree t;
  t.layout = tree_layout(n);
  t.ref = at::empty({n, 4}, p_ref.options());
  t.nodes = at::empty({t.layout.total, 8}, p_ref.options());
  auto* ref = reinterpret_cast<Point4*>(t.ref.data_ptr<float>());
  auto* nodes = reinterpret_cast<NodeBox*>(t.nodes.data_ptr<float>());
  for (int64_t s = 0; s < n; ++s) {
    const float* x = p + 3 * order[s].second;
    ref[s] = Point4{x[0], x[1], x[2], order[s].second};
  }
  for (int64_t leaf = 0; leaf < t.layout.count[0]; ++leaf) {
    NodeBox& b = nodes[leaf];
    box_empty(b);
    for (int64_t s = leaf * kFanout; s < std::min<int64_t>(n, (leaf + 1) * kFanout); ++s) {
      box_add(b, &ref[s].x, &ref[s].x);
    }
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
void tree_search_cpu(const float* q, const Tree& t, int64_t n, TopK<KMAX>& best,
                     Work* work = nullptr) {
  if (!finite3(q)) return;  // (value checks off) no neighbour: index -1
  const TreeLayout& L = t.layout;
  const auto* ref = reinterpret_cast<const Point4*>(t.ref.data_ptr<float>());
  const auto* nodes = reinterpret_cast<const NodeBox*>(t.nodes.data_ptr<float>());
  TreeEntry stack[kStackSize];
  int top = 0;
  stack[top++] = TreeEntry{entry_key(0, L.levels - 1), 0.0f};
  std::pair<float, int64_t> children[kFanout];
  while (top > 0) {
    const TreeEntry e = stack[--top];
    if (!(e.d2 < best.worst())) continue;  // nothing in it can be better
    const int level = e.key % kMaxLevels;
    const int64_t node = e.key / kMaxLevels;
    const int64_t first = node * kFanout;
    if (level == 0) {
      const int64_t end = std::min<int64_t>(n, first + kFanout);
      for (int64_t s = first; s < end; ++s) {
        const Point4 p = ref[s];
        best.push(dist2(q[0] - p.x, q[1] - p.y, q[2] - p.z), p.index);
      }
      if (work) work->points += end - first;
      continue;
    }
    const int64_t end = std::min<int64_t>(L.count[level - 1], first + kFanout);
    const NodeBox* below = nodes + L.offset[level - 1];
    const float kth = best.worst();
    int kept = 0;
    for (int64_t c = first; c < end; ++c) {
      const float d2 = box_dist2(q, below[c]);
      if (d2 < kth) children[kept++] = {d2, c};
    }
    if (work) work->boxes += end - first;
    std::sort(children, children + kept);
    for (int s = kept - 1; s >= 0; --s) {  // the nearest on top
      stack[top++] = TreeEntry{entry_key(children[s].second, level - 1), children[s].first};
    }
  }
}

}  // namespace extkernels
