// The uniform grid and the ring search of the C++ backend (chapter 9), shared by the
// CPU kernels (knn.cpp) and the CUDA kernels (knn_cuda.cu): one algorithm, two devices.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define EK_HD __host__ __device__ __forceinline__
#else
#define EK_HD inline
#endif

namespace extkernels {

// Mean reference points per cell the grid aims for.
constexpr float kPointsPerCell = 2.0f;
// The most neighbours a query may ask for (the kept list lives in registers).
constexpr int kMaxK = 64;

// Cells the workspace holds for a cloud of n points: a function of the shape only.
EK_HD int64_t cell_capacity(int64_t n) { return n < 1 ? 1 : 8 * n; }

struct GridParams {
  float lo[3];
  float h;       // cubic cell side
  float inv_h;
  int dims[3];   // cells per axis; dims[0] * dims[1] * dims[2] <= cell_capacity(n)
};

// Blocks of the strided partial sums that the grid's box is reduced from (the CUDA
// moment kernels and the CPU builds use the same split): point j falls in block
// (j mod (blocks * kRobustChunk)) / kRobustChunk.
constexpr int kRobustBlocks = 64;
constexpr int kRobustChunk = 256;

EK_HD int robust_blocks(int64_t n) {
  const int64_t b = (n + kRobustChunk - 1) / kRobustChunk;
  return b < 1 ? 1 : (b > kRobustBlocks ? kRobustBlocks : (int)b);
}

EK_HD int robust_block_of(int64_t j, int blocks) {
  return (int)((j % ((int64_t)blocks * kRobustChunk)) / kRobustChunk);
}

// A bound of the cloud that a few far points do not move: the (skip + 1)-th smallest
// of the blocks' minima (upper: the (skip + 1)-th largest of their maxima), skipping
// one block in sixteen. A lone outlier moves its own block's extreme only, so the grid
// covers the bulk of the cloud, and the points beyond it fall in the edge cells
// (key_of clamps): still found, since the searches clamp to the grid as well.
EK_HD int robust_skip(int blocks) { return blocks / 16; }

// How many blocks' extremes lie further out than block i's (ties: the lower block
// first); block i's is the bound when that is robust_skip(blocks). A CUDA thread per
// block computes its own.
EK_HD int further_out(const float* extremes, int blocks, int i, bool upper) {
  const float v = extremes[i];
  int count = 0;
  for (int j = 0; j < blocks; ++j) {
    const float w = extremes[j];
    count += upper ? (w > v || (w == v && j < i)) : (w < v || (w == v && j < i));
  }
  return count;
}

EK_HD float robust_bound(const float* extremes, int blocks, bool upper) {
  for (int i = 0; i < blocks; ++i) {
    if (further_out(extremes, blocks, i, upper) == robust_skip(blocks)) return extremes[i];
  }
  return upper ? -INFINITY : INFINITY;
}

// The grid over the box lo .. hi of n points whose coordinates have standard deviations
// sd: cubes of side h holding about kPointsPerCell points where the cloud is densest.
// The volume the points fill is taken, per axis, as the smaller of the box's extent and
// sqrt(2 pi) sd (the width of a normal distribution's peak): a box sized by a few
// outliers would put hundreds of points in the central cells. A flat cloud gets one
// layer of cells; the grid never has more than cell_capacity(n) cells (coarser cells
// when it would), and no cell is smaller than min_h (the fused backend's radius walk
// asks for cells as wide as its radius, chapter 14).
EK_HD GridParams make_grid(const float lo[3], const float hi[3], const float sd[3],
                           int64_t n, float min_h = 0.0f) {
  GridParams g;
  float volume = 1.0f, widest = 0.0f;
  int spanned = 0;
  for (int a = 0; a < 3; ++a) {
    g.lo[a] = lo[a];
    const float e = hi[a] - lo[a];
    widest = e > widest ? e : widest;
    if (e > 0.0f) {
      const float peak = 2.5066283f * sd[a];
      volume *= peak > 0.0f && peak < e ? peak : e;
      ++spanned;
    }
  }
  float h = 1.0f;
  if (spanned > 0) {
    float cells = (float)n / kPointsPerCell;
    cells = cells < 1.0f ? 1.0f : cells;
    h = powf(volume / cells, 1.0f / (float)spanned);
    h = h > widest * 1e-6f ? h : widest * 1e-6f;  // float cells stay countable
    h = h > min_h ? h : min_h;
  }
  const double capacity = (double)cell_capacity(n);
  double total = INFINITY;
  for (int attempt = 0; attempt < 64 && total > capacity; ++attempt) {
    if (attempt > 0) h *= 1.25f;  // too many cells for the workspace: coarser
    total = 1.0;
    for (int a = 0; a < 3; ++a) {
      const float d = floorf((hi[a] - lo[a]) / h) + 1.0f;
      g.dims[a] = d >= 1.0f && d < 2e9f ? (int)d : 1;
      total *= (double)g.dims[a];
    }
  }
  if (!(total <= capacity) || !(h > 0.0f && h < INFINITY)) {
    // Only for coordinates that are not finite (with the value checks switched off):
    // one cell, so that nothing is written outside the workspace.
    for (int a = 0; a < 3; ++a) {
      g.lo[a] = 0.0f;
      g.dims[a] = 1;
    }
    h = 1.0f;
  }
  g.h = h;
  g.inv_h = 1.0f / h;
  return g;
}

// Cell of a coordinate along one axis, unclamped (a query may lie outside the box).
EK_HD int64_t cell_of(float x, const GridParams& g, int a) {
  return (int64_t)floorf((x - g.lo[a]) * g.inv_h);
}

EK_HD int64_t clamp_cell(int64_t c, const GridParams& g, int a) {
  return c < 0 ? 0 : (c >= g.dims[a] ? g.dims[a] - 1 : c);
}

// Key of a point inside the grid (its cell clamped to the grid).
EK_HD int64_t key_of(const float* p, const GridParams& g) {
  int64_t key = 0;
  for (int a = 0; a < 3; ++a) key = key * g.dims[a] + clamp_cell(cell_of(p[a], g, a), g, a);
  return key;
}

// A reference point in cell order: its coordinates and its row in the caller's cloud,
// 16 bytes, so that a CUDA thread reads it with one vectorised (float4) load.
struct alignas(16) Point4 {
  float x, y, z;
  int32_t index;
};

EK_HD Point4 load_point(const Point4* points, int64_t j) {
#if defined(__CUDA_ARCH__)
  const float4 v = __ldg(reinterpret_cast<const float4*>(points) + j);
  return Point4{v.x, v.y, v.z, __float_as_int(v.w)};
#else
  return points[j];
#endif
}

// Whether the pair (da, ia) comes before (db, ib): the nearer first, and of two at equal
// distance the lower reference index, on every backend of the book.
EK_HD bool before(float da, int32_t ia, float db, int32_t ib) {
  return da < db || (da == db && (uint32_t)ia < (uint32_t)ib);
}

// The k best (squared distance, index) pairs, sorted by before(), in at most KMAX
// slots. Every loop is unrolled over the compile-time KMAX, so that on a GPU the list
// lives in registers (an array indexed by a run-time value would live in local memory).
template <int KMAX>
struct TopK {
  float d[KMAX];
  int32_t i[KMAX];
  int k;

  EK_HD void init(int k_) {
    k = k_;
#pragma unroll
    for (int s = 0; s < KMAX; ++s) {
      d[s] = INFINITY;
      i[s] = -1;
    }
  }
  EK_HD float worst() const {  // the k-th best so far (infinity until k are kept)
    float w = INFINITY;
#pragma unroll
    for (int s = 0; s < KMAX; ++s) w = s == k - 1 ? d[s] : w;
    return w;
  }
  EK_HD int32_t worst_index() const {  // its index (-1, the last of all, until then)
    int32_t w = -1;
#pragma unroll
    for (int s = 0; s < KMAX; ++s) w = s == k - 1 ? i[s] : w;
    return w;
  }
  EK_HD bool full() const { return worst() < INFINITY; }
  EK_HD void push(float dist, int32_t index) {
    if (!before(dist, index, worst(), worst_index())) return;
    bool placed = false;  // insertion from the top: shift later entries up one slot
#pragma unroll
    for (int s = KMAX - 1; s >= 0; --s) {
      if (s < k && !placed) {
        if (s > 0 && before(dist, index, d[s - 1], i[s - 1])) {
          d[s] = d[s - 1];
          i[s] = i[s - 1];
        } else {
          d[s] = dist;
          i[s] = index;
          placed = true;
        }
      }
    }
  }
};

// Rings of cells around the query's (unclamped) cell c: ring r holds the cells at
// Chebyshev distance r. Every point in a ring beyond r lies at least
// r * h + inside away, where inside is the query's distance to its own cell's faces.
struct Rings {
  int64_t c[3];
  int64_t first, last;  // the rings that meet the grid
  float inside;
};

EK_HD Rings rings_of(const float* q, const GridParams& g) {
  Rings R;
  R.first = 0;
  R.last = 0;
  R.inside = INFINITY;
  for (int a = 0; a < 3; ++a) {
    float f = (q[a] - g.lo[a]) * g.inv_h;
    R.c[a] = (int64_t)floorf(f);
    float frac = f - (float)R.c[a];
    float in = (frac < 1.0f - frac ? frac : 1.0f - frac) * g.h;
    R.inside = in < R.inside ? in : R.inside;
    int64_t below = -R.c[a], above = R.c[a] - (g.dims[a] - 1);
    int64_t gap = below > above ? below : above;
    R.first = gap > R.first ? gap : R.first;
    int64_t far_lo = R.c[a], far_hi = (g.dims[a] - 1) - R.c[a];
    far_lo = far_lo < 0 ? -far_lo : far_lo;
    far_hi = far_hi < 0 ? -far_hi : far_hi;
    int64_t far = far_lo > far_hi ? far_lo : far_hi;
    R.last = far > R.last ? far : R.last;
  }
  R.inside = R.inside > 0.0f ? R.inside : 0.0f;
  if (!(q[0] - q[0] == 0.0f && q[1] - q[1] == 0.0f && q[2] - q[2] == 0.0f)) {
    R.first = 0;  // a coordinate that is not finite (value checks off): no ring at
    R.last = -1;  // all, and the query keeps no neighbour (index -1)
  }
  return R;
}

// Calls visit(begin, end) for the run of sorted points of every cell of ring r that
// lies in the grid: cells that differ in z only are consecutive, so each (x, y)
// column of the ring is one or two runs.
template <typename Visit>
EK_HD void for_ring(const Rings& R, int64_t r, const GridParams& g, const int32_t* start,
                    Visit&& visit) {
  const int64_t x0 = R.c[0] - r < 0 ? 0 : R.c[0] - r;
  const int64_t x1 = R.c[0] + r >= g.dims[0] ? g.dims[0] - 1 : R.c[0] + r;
  const int64_t y0 = R.c[1] - r < 0 ? 0 : R.c[1] - r;
  const int64_t y1 = R.c[1] + r >= g.dims[1] ? g.dims[1] - 1 : R.c[1] + r;
  for (int64_t x = x0; x <= x1; ++x) {
    for (int64_t y = y0; y <= y1; ++y) {
      const bool edge = (x == R.c[0] - r || x == R.c[0] + r || y == R.c[1] - r ||
                         y == R.c[1] + r);
      const int64_t column = (x * g.dims[1] + y) * g.dims[2];
      if (edge) {  // the whole column of the ring, clipped to the grid
        int64_t z0 = R.c[2] - r < 0 ? 0 : R.c[2] - r;
        int64_t z1 = R.c[2] + r >= g.dims[2] ? g.dims[2] - 1 : R.c[2] + r;
        if (z0 <= z1) visit(start[column + z0], start[column + z1 + 1]);
      } else {  // inside the ring's footprint: its bottom and top cells only
        int64_t zs[2] = {R.c[2] - r, R.c[2] + r};
        for (int s = 0; s < (r == 0 ? 1 : 2); ++s) {
          int64_t z = zs[s];
          if (z >= 0 && z < g.dims[2]) visit(start[column + z], start[column + z + 1]);
        }
      }
    }
  }
}

// The k nearest of query q among the sorted reference points (in cell order, see
// Point4), by growing rings: exact, because it stops only when no point of a ring not
// yet visited can be nearer than the k-th best so far.
template <int KMAX>
EK_HD void ring_search(const float* q, const Point4* ref, const int32_t* start,
                       const GridParams& g, TopK<KMAX>& best) {
  const Rings R = rings_of(q, g);
  const float qx = q[0], qy = q[1], qz = q[2];
  for (int64_t r = R.first; r <= R.last; ++r) {
    for_ring(R, r, g, start, [&](int32_t begin, int32_t end) {
      for (int32_t j = begin; j < end; ++j) {
        const Point4 p = load_point(ref, j);
        const float dx = qx - p.x, dy = qy - p.y, dz = qz - p.z;
        best.push(dx * dx + dy * dy + dz * dz, p.index);
      }
    });
    // Slightly under the true bound, so that rounding at a cell's face never stops early.
    const float bound = ((float)r * g.h + R.inside) * (1.0f - 1e-5f);
    if (best.worst() <= bound * bound) break;
  }
}

}  // namespace extkernels

// Runs the statements given with KMAX, a compile-time constant, set to the smallest of 8,
// 16, 32 and 64 that holds k: each kernel is compiled once per list size.
#define EK_DISPATCH_KMAX(k, ...)            \
  [&] {                                     \
    if ((k) <= 8) {                         \
      constexpr int KMAX = 8;               \
      __VA_ARGS__                           \
    } else if ((k) <= 16) {                 \
      constexpr int KMAX = 16;              \
      __VA_ARGS__                           \
    } else if ((k) <= 32) {                 \
      constexpr int KMAX = 32;              \
      __VA_ARGS__                           \
    } else {                                \
      constexpr int KMAX = 64;              \
      __VA_ARGS__                           \
    }                                       \
  }()
