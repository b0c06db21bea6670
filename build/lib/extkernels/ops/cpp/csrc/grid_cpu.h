// The grid of a reference cloud built on the host (chapter 9), shared by the CPU kernels
// of the C++ backend and of the fused backend (chapter 11): the box and the spread of
// the points in one pass, then a counting sort of the points by cell.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "grid.h"

namespace extkernels {

struct Sorted {
  GridParams g;
  at::Tensor ref;    // (n, 4) float32 holding n Point4, in cell order
  at::Tensor start;  // (cells + 1,) int32: each cell's first sorted point
};

// The box of the cloud (robust: skipping the most extreme blocks' bounds, as the fused
// backend's CUDA kernels do, robust_bound in grid.h), and the spread of each axis.
inline void box_and_spread_cpu(const float* p, int64_t n, bool robust, float lo[3],
                               float hi[3], float sd[3]) {
  const int blocks = robust ? robust_blocks(n) : 1;
  std::vector<float> lows(3 * blocks, INFINITY), highs(3 * blocks, -INFINITY);
  double sum[3] = {0, 0, 0}, sum2[3] = {0, 0, 0};
  for (int64_t j = 0; j < n; ++j) {
    const int b = robust ? robust_block_of(j, blocks) : 0;
    for (int a = 0; a < 3; ++a) {
      const float x = p[3 * j + a];
      lows[a * blocks + b] = std::min(lows[a * blocks + b], x);
      highs[a * blocks + b] = std::max(highs[a * blocks + b], x);
      sum[a] += x;
      sum2[a] += (double)x * x;
    }
  }
  for (int a = 0; a < 3; ++a) {
    lo[a] = robust_bound(lows.data() + a * blocks, blocks, false);
    hi[a] = robust_bound(highs.data() + a * blocks, blocks, true);
    const double mean = sum[a] / (double)(n > 0 ? n : 1);
    sd[a] = (float)std::sqrt(std::max(0.0, sum2[a] / (double)(n > 0 ? n : 1) - mean * mean));
  }
}

// The grid and the counting sort of the reference cloud by cell: with robust, over the
// robust box; no cell is smaller than min_h (make_grid).
inline Sorted build_grid_cpu(const at::Tensor& p_ref, bool robust = false,
                             float min_h = 0.0f) {
  const int64_t n = p_ref.size(0);
  const float* p = p_ref.data_ptr<float>();
  float lo[3], hi[3], sd[3];
  box_and_spread_cpu(p, n, robust, lo, hi, sd);
  Sorted s;
  s.g = make_grid(lo, hi, sd, n, min_h);
  const int64_t cells = (int64_t)s.g.dims[0] * s.g.dims[1] * s.g.dims[2];
  std::vector<int64_t> key(n);
  s.start = at::zeros({cells + 1}, p_ref.options().dtype(at::kInt));
  int32_t* start = s.start.data_ptr<int32_t>();
  for (int64_t j = 0; j < n; ++j) {
    key[j] = key_of(p + 3 * j, s.g);
    ++start[key[j] + 1];
  }
  for (int64_t c = 0; c < cells; ++c) start[c + 1] += start[c];  // prefix sum
  s.ref = at::empty({n, 4}, p_ref.options());
  auto* ref = reinterpret_cast<Point4*>(s.ref.data_ptr<float>());
  std::vector<int32_t> fill(start, start + cells);
  for (int64_t j = 0; j < n; ++j) {
    ref[fill[key[j]]++] = Point4{p[3 * j], p[3 * j + 1], p[3 * j + 2], (int32_t)j};
  }
  return s;
}

// The search of every query; with inv_sigma > 0 the softmax weights of the neighbours
// (exp(-(d - d_nearest) / sigma), normalised) are written instead of their distances.

}  // namespace extkernels
