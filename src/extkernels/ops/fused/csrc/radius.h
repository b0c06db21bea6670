// The radius walk of the fused backend (chapter 11), shared by its CPU and CUDA kernels:
// every reference point within `radius` of a query, found among the grid cells that the
// box query +- radius overlaps, with its weight exp(-distance / sigma).
#pragma once

#include <cmath>
#include <cstdint>

#include "grid.h"

namespace extkernels {

// Cells of the box q +- radius along each axis, clamped to the grid.
struct Box {
  int64_t lo[3], hi[3];
};

// The box of a query, clamped to the grid, or false when a coordinate is not finite
// (with the value checks off: the query then has no neighbour). A box beyond the grid
// keeps its edge cells: the points beyond the grid's bounds are kept there (key_of).
EK_HD bool box_of(const float* q, float radius, const GridParams& g, Box& b) {
  for (int a = 0; a < 3; ++a) {
    if (!(q[a] - q[a] == 0.0f)) return false;
    const float top = (float)g.dims[a];
    float c0 = floorf((q[a] - radius - g.lo[a]) * g.inv_h);
    float c1 = floorf((q[a] + radius - g.lo[a]) * g.inv_h);
    c0 = c0 < -1.0f ? -1.0f : (c0 > top ? top : c0);  // no overflow in the casts
    c1 = c1 < -1.0f ? -1.0f : (c1 > top ? top : c1);
    b.lo[a] = clamp_cell((int64_t)c0, g, a);
    b.hi[a] = clamp_cell((int64_t)c1, g, a);
  }
  return true;
}

// Calls visit(row, weight, dx, dy, dz, distance) for every reference point within
// radius of q: row in the caller's cloud, weight exp(-distance / sigma), (dx, dy, dz) =
// q - point. Cells that differ in z only are consecutive in the sorted points, so each
// (x, y) column of the box is one run.
template <typename Visit>
EK_HD void for_neighbour_pairs(const float* q, const Point4* ref, const int32_t* start,
                               const GridParams& g, float radius, float inv_sigma,
                               Visit&& visit) {
  Box b;
  if (!box_of(q, radius, g, b)) return;
  for (int64_t x = b.lo[0]; x <= b.hi[0]; ++x) {
    for (int64_t y = b.lo[1]; y <= b.hi[1]; ++y) {
      const int64_t column = (x * g.dims[1] + y) * g.dims[2];
      const int32_t end = start[column + b.hi[2] + 1];
      for (int32_t j = start[column + b.lo[2]]; j < end; ++j) {
        const Point4 p = load_point(ref, j);
        const float dx = q[0] - p.x, dy = q[1] - p.y, dz = q[2] - p.z;
        const float d = sqrtf(dx * dx + dy * dy + dz * dz);
        if (d <= radius) visit(p.index, expf(-d * inv_sigma), dx, dy, dz, d);
      }
    }
  }
}

// Calls visit(row, weight) for every reference point within radius of q.
template <typename Visit>
EK_HD void for_neighbours(const float* q, const Point4* ref, const int32_t* start,
                          const GridParams& g, float radius, float inv_sigma,
                          Visit&& visit) {
  for_neighbour_pairs(q, ref, start, g, radius, inv_sigma,
                      [&](int32_t j, float w, float, float, float, float) { visit(j, w); });
}

// The positions' gradient of one query's aggregation out = sum_j w_j feats[j] / total,
// w_j = exp(-d_j / sigma) (chapter 6): d loss / d d_j = -(w_j / total / sigma) *
// (<grad_out, feats[j]> - <grad_out, out>), times (q - p_j) / d_j into the query and
// minus that into the point (zero at d_j = 0). `dot(j)` is <grad_out, feats[j]> and
// `pull(j, x, y, z)` takes the point's share.
template <typename Dot, typename Pull>
EK_HD void radius_position_grad(const float* q, const Point4* ref, const int32_t* start,
                                const GridParams& g, float radius, float inv_sigma,
                                float total, float grad_dot_out, float* grad_query,
                                Dot&& dot, Pull&& pull) {
  float gx = 0.0f, gy = 0.0f, gz = 0.0f;
  if (total > 0.0f) {
    const float scale = inv_sigma / total;
    for_neighbour_pairs(q, ref, start, g, radius, inv_sigma,
                        [&](int32_t j, float w, float dx, float dy, float dz, float d) {
                          if (!(d > 0.0f)) return;
                          const float s = -w * scale * (dot(j) - grad_dot_out) / d;
                          gx += s * dx;
                          gy += s * dy;
                          gz += s * dz;
                          pull(j, -s * dx, -s * dy, -s * dz);
                        });
  }
  grad_query[0] = gx;
  grad_query[1] = gy;
  grad_query[2] = gz;
}

}  // namespace extkernels
