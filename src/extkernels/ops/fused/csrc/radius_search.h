// The radius search of the fused backend (chapter 16), shared by its CPU kernels
// (radius_search.cpp) and CUDA kernels (radius_search_cuda.cu): every reference point
// within `radius` of a query (inclusive), found by the radius aggregation's walk of the
// grid (radius.h), optionally only among the rows of the query's own cloud.
//
// Each query's neighbours are ordered by (distance, row): the walk visits the grid's
// cells, not the rows, in order, so the order is made after the walk, by insertion into
// a sorted list.
#pragma once

#include <cmath>
#include <cstdint>

#include "grid.h"
#include "knn_batched.h"
#include "radius.h"

namespace extkernels {

// The rows [first, end) of p_ref that a query may take: its cloud's, or every row.
struct Rows {
  int64_t first, end;
};

EK_HD Rows rows_of_query(const int64_t* query_offsets, const int64_t* ref_offsets,
                         int64_t clouds, int64_t row, int64_t n) {
  Rows r{0, n};
  if (clouds > 0) {
    cloud_rows(ref_offsets, cloud_of(query_offsets, clouds, row), n, r.first, r.end);
  }
  return r;
}

// Calls visit(row, distance) for every reference point within radius of q whose row is
// in `rows`.
template <typename Visit>
EK_HD void for_rows_within(const float* q, const Point4* ref, const int32_t* start,
                           const GridParams& g, float radius, Rows rows, Visit&& visit) {
  for_neighbour_pairs(q, ref, start, g, radius, 0.0f,
                      [&](int32_t j, float, float, float, float, float d) {
                        if (j >= rows.first && j < rows.end) visit(j, d);
                      });
}

// (d, j) before (e, k): nearer, or as near and a lower row.
EK_HD bool precedes(float d, int64_t j, float e, int64_t k) {
  return d < e || (d == e && j < k);
}

// (d, j) into the sorted list dist[0 .. used), of room `size`: the list grows by one
// while it has room, else the last entry drops out (if (d, j) precedes it). Returns the
// entries used.
EK_HD int64_t insert_sorted(float* dist, int64_t* rows, int64_t used, int64_t size,
                            float d, int64_t j) {
  int64_t s = used < size ? used : size - 1;
  if (used == size && !precedes(d, j, dist[s], rows[s])) return used;
  while (s > 0 && precedes(d, j, dist[s - 1], rows[s - 1])) {
    dist[s] = dist[s - 1];
    rows[s] = rows[s - 1];
    --s;
  }
  dist[s] = d;
  rows[s] = j;
  return used < size ? used + 1 : used;
}

}  // namespace extkernels
