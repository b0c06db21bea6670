// The fused backend (chapters 11 and 14): schemas, and the CPU kernels.
//
// The kNN operators search one of two indexes, chosen per call by `index`:
// - "tree" (chapter 14): the wide tree of tree.h over the points in Morton order; on the
//   GPU (tree_search_cuda.cu) one warp per query, with the softmax and the gather in the
//   same kernel; on the CPU tree_cpu.h, the same tree and the same pruning.
// - "grid" (chapter 11): chapter 9's uniform grid; on the GPU (knn_lanes_cuda.cu) a group
//   of `lanes` threads per query; on the CPU the C++ backend's kernels (chapter 9),
//   reached through the dispatcher.
// The radius aggregation walks the grid on both devices (radius.h).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstring>
#include <vector>

#include "checks.h"
#include "fused.h"
#include "grid.h"
#include "grid_cpu.h"
#include "radius.h"
#include "tree.h"
#include "tree_cpu.h"

namespace extkernels {

namespace {

using KnnOut = std::tuple<at::Tensor, at::Tensor>;
using AggregateOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

KnnOut knn_grid_cpu(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("extkernels_cpp::knn", "")
                       .typed<KnnOut(const at::Tensor&, const at::Tensor&, int64_t)>();
  return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), p_query, p_ref, k);
}

// The k nearest of every query by the tree: squared distances and rows, (M, k) each.
KnnOut knn_tree_cpu(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k) {
  const Tree t = build_tree_cpu(p_ref);
  const int64_t m = p_query.size(0);
  at::Tensor d2 = at::empty({m, k}, p_query.options());
  at::Tensor indices = at::empty({m, k}, p_query.options().dtype(at::kLong));
  const float* q = p_query.data_ptr<float>();
  float* d = d2.data_ptr<float>();
  int64_t* idx = indices.data_ptr<int64_t>();
  EK_DISPATCH_KMAX(k, {
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      TopK<KMAX> best;
      for (int64_t row = begin; row < end; ++row) {
        best.init((int)k);
        tree_search_cpu(q + 3 * row, t, best);
        for (int64_t j = 0; j < k; ++j) {
          d[row * k + j] = best.d[j];
          idx[row * k + j] = best.i[j];
        }
      }
    });
  });
  return {d2, indices};
}

KnnOut knn_cpu(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
               int64_t lanes, c10::string_view index) {
  check_lanes(lanes);
  if (check_index(index) == Index::Grid) return knn_grid_cpu(p_query, p_ref, k);
  check_clouds(p_query, p_ref);
  check_k(k, p_ref.size(0));
  check_finite(p_query, p_ref, /*capturing=*/false);
  auto [d2, indices] = knn_tree_cpu(p_query, p_ref, k);
  return {d2.sqrt_(), indices};
}

void knn_out_cpu(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
                 at::Tensor& distances, at::Tensor& indices, int64_t lanes,
                 c10::string_view index) {
  check_clouds(p_query, p_ref);
  check_out(distances, "distances", at::kFloat, "torch.float32", p_query, k);
  check_out(indices, "indices", at::kLong, "torch.int64", p_query, k);
  auto [d, i] = knn_cpu(p_query, p_ref, k, lanes, index);
  distances.copy_(d);
  indices.copy_(i);
}

AggregateOut knn_aggregate_fwd_cpu(const at::Tensor& p_query, const at::Tensor& p_ref,
                                   const at::Tensor& feats, int64_t k, double sigma,
                                   int64_t lanes, c10::string_view index) {
  check_lanes(lanes);
  if (check_index(index) == Index::Grid) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("extkernels_cpp::knn_aggregate_fwd", "")
                         .typed<AggregateOut(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, int64_t, double)>();
    return op.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), p_query, p_ref,
                         feats, k, sigma);
  }
  check_clouds(p_query, p_ref);
  check_feats(feats, p_ref);
  check_k(k, p_ref.size(0));
  check_sigma(sigma);
  check_finite(p_query, p_ref, /*capturing=*/false);
  auto [d2, indices] = knn_tree_cpu(p_query, p_ref, k);
  // softmax(-d / sigma) over the k, shifted by the nearest (as the CUDA kernels do)
  const at::Tensor d = d2.sqrt_();
  at::Tensor weights = at::exp((d.narrow(1, 0, 1) - d) * (1.0 / sigma));
  weights.div_(weights.sum(1, /*keepdim=*/true));
  static auto gather = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("extkernels_cpp::gather", "")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                             const at::Tensor&, bool)>();
  at::Tensor out = gather.redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), weights,
                                     indices, feats, false);
  return {out, weights, indices};
}

// The grid's ring search of grid.h, counting the cells it looks into and the points it
// tests.
template <int KMAX>
void grid_search_counted(const float* q, const Sorted& s, TopK<KMAX>& best, Work& w) {
  const Rings R = rings_of(q, s.g);
  const auto* ref = reinterpret_cast<const Point4*>(s.ref.data_ptr<float>());
  const int32_t* start = s.start.data_ptr<int32_t>();
  auto cells_within = [&](int64_t r) -> int64_t {  // cells of the grid within ring r
    int64_t cells = r < 0 ? 0 : 1;
    for (int a = 0; a < 3 && cells > 0; ++a) {
      const int64_t lo = std::max<int64_t>(R.c[a] - r, 0);
      const int64_t hi = std::min<int64_t>(R.c[a] + r, s.g.dims[a] - 1);
      cells *= hi >= lo ? hi - lo + 1 : 0;
    }
    return cells;
  };
  for (int64_t r = R.first; r <= R.last; ++r) {
    for_ring(R, r, s.g, start, [&](int32_t begin, int32_t end) {
      for (int32_t j = begin; j < end; ++j) {
        const Point4 p = ref[j];
        const float dx = q[0] - p.x, dy = q[1] - p.y, dz = q[2] - p.z;
        best.push(dx * dx + dy * dy + dz * dz, p.index);
      }
      w.points += end - begin;
    });
    w.boxes += cells_within(r) - cells_within(r - 1);
    const float bound = ((float)r * s.g.h + R.inside) * (1.0f - 1e-5f);
    if (best.worst() <= bound * bound) break;
  }
}

// The work of every query's search: (M, 2) int64, the cells (grid) or boxes (tree) it
// looked into and the points it tested. On the CPU: the same walks as the GPU's.
at::Tensor knn_work_cpu(const at::Tensor& p_query, const at::Tensor& p_ref, int64_t k,
                        c10::string_view index) {
  const Index which = check_index(index);
  check_clouds(p_query, p_ref);
  check_k(k, p_ref.size(0));
  check_finite(p_query, p_ref, /*capturing=*/false);
  const int64_t m = p_query.size(0);
  at::Tensor work = at::zeros({m, 2}, p_query.options().dtype(at::kLong));
  int64_t* out = work.data_ptr<int64_t>();
  const float* q = p_query.data_ptr<float>();
  const Tree t = which == Index::Tree ? build_tree_cpu(p_ref) : Tree{};
  const Sorted s = which == Index::Grid ? build_grid_cpu(p_ref) : Sorted{};
  EK_DISPATCH_KMAX(k, {
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      TopK<KMAX> best;
      for (int64_t row = begin; row < end; ++row) {
        best.init((int)k);
        Work w;
        if (which == Index::Tree) {
          tree_search_cpu(q + 3 * row, t, best, &w);
        } else {
          grid_search_counted(q + 3 * row, s, best, w);
        }
        out[2 * row] = w.boxes;
        out[2 * row + 1] = w.points;
      }
    });
  });
  return work;
}

// The grid as the radius operators hand it from forward to backward: sorted points,
// cell starts padded to cell_capacity(n) + 1 entries, the parameters as bytes. Cells
// are at least as wide as the radius, as on the GPU.
SavedGrid build_saved_grid_cpu(const at::Tensor& p_ref, float radius) {
  const int64_t n = p_ref.size(0);
  Sorted s = build_grid_cpu(p_ref, /*robust=*/true, radius);
  SavedGrid d;
  d.ref = s.ref;
  d.start = at::full({cell_capacity(n) + 1}, n, p_ref.options().dtype(at::kInt));
  d.start.narrow(0, 0, s.start.size(0)).copy_(s.start);
  d.params = at::empty({(int64_t)sizeof(GridParams)}, p_ref.options().dtype(at::kByte));
  std::memcpy(d.params.data_ptr<uint8_t>(), &s.g, sizeof(GridParams));
  return d;
}

// `warp` chooses a CUDA kernel; the CPU has one walk.
RadiusOut radius_aggregate_fwd_cpu(const at::Tensor& p_query, const at::Tensor& p_ref,
                                   const at::Tensor& feats, double radius, double sigma,
                                   bool /*warp*/) {
  check_radius_args(p_query, p_ref, feats, radius, sigma);
  check_finite(p_query, p_ref, /*capturing=*/false);
  const SavedGrid d = build_saved_grid_cpu(p_ref, (float)radius);
  GridParams g;
  std::memcpy(&g, d.params.data_ptr<uint8_t>(), sizeof(GridParams));
  const int64_t m = p_query.size(0), f = feats.size(1);
  at::Tensor out = at::empty({m, f}, feats.options());
  at::Tensor totals = at::empty({m}, p_query.options());
  const float* q = p_query.data_ptr<float>();
  const auto* ref = reinterpret_cast<const Point4*>(d.ref.data_ptr<float>());
  const int32_t* start = d.start.data_ptr<int32_t>();
  float* tot = totals.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(feats.scalar_type(), "radius_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = feats.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(f);
      for (int64_t row = begin; row < end; ++row) {
        std::fill(acc.begin(), acc.end(), acc_t(0));
        float total = 0.0f;
        for_neighbours(q + 3 * row, ref, start, g, (float)radius, (float)(1.0 / sigma),
                       [&](int32_t j, float w) {
                         total += w;
                         for (int64_t c = 0; c < f; ++c) {
                           acc[c] += (acc_t)w * static_cast<acc_t>(x[j * f + c]);
                         }
                       });
        tot[row] = total;
        for (int64_t c = 0; c < f; ++c) {
          o[row * f + c] = static_cast<scalar_t>(total > 0.0f ? acc[c] / total : acc_t(0));
        }
      }
    });
  });
  return {out, totals, d.ref, d.start, d.params};
}

at::Tensor radius_aggregate_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& p_query,
                                    const at::Tensor& totals, const at::Tensor& grid_ref,
                                    const at::Tensor& grid_start,
                                    const at::Tensor& grid_params, double radius,
                                    double sigma, bool /*warp*/) {
  check_radius_backward(grad_out, p_query, totals, grid_ref, grid_start, grid_params);
  GridParams g;
  std::memcpy(&g, grid_params.data_ptr<uint8_t>(), sizeof(GridParams));
  const int64_t m = p_query.size(0), f = grad_out.size(1), n = grid_ref.size(0);
  const float* q = p_query.data_ptr<float>();
  const auto* ref = reinterpret_cast<const Point4*>(grid_ref.data_ptr<float>());
  const int32_t* start = grid_start.data_ptr<int32_t>();
  const float* tot = totals.data_ptr<float>();
  at::Tensor grad;
  AT_DISPATCH_FLOATING_TYPES_AND_HALF(grad_out.scalar_type(), "radius_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor acc = at::zeros(
        {n, f}, grad_out.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const scalar_t* go = grad_out.data_ptr<scalar_t>();
    acc_t* a = acc.data_ptr<acc_t>();
    for (int64_t row = 0; row < m; ++row) {  // serial: rows of different queries collide
      if (!(tot[row] > 0.0f)) continue;
      const acc_t scale = acc_t(1) / (acc_t)tot[row];
      for_neighbours(q + 3 * row, ref, start, g, (float)radius, (float)(1.0 / sigma),
                     [&](int32_t j, float w) {
                       for (int64_t c = 0; c < f; ++c) {
                         a[j * f + c] += (acc_t)w * scale * static_cast<acc_t>(go[row * f + c]);
                       }
                     });
    }
    grad = acc.scalar_type() == grad_out.scalar_type() ? acc
                                                        : acc.to(grad_out.scalar_type());
  });
  return grad;
}

// The clouds' gradients of the radius aggregation (radius.h's radius_position_grad):
// (grad_query (M, 3), grad_ref (N, 3)) float32; serial, since points of different
// queries collide.
std::tuple<at::Tensor, at::Tensor> radius_positions_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& feats,
    const at::Tensor& p_query, const at::Tensor& totals, const at::Tensor& grid_ref,
    const at::Tensor& grid_start, const at::Tensor& grid_params, double radius,
    double sigma) {
  check_radius_positions_backward(grad_out, out, feats, p_query, totals, grid_ref,
                                  grid_start, grid_params);
  GridParams g;
  std::memcpy(&g, grid_params.data_ptr<uint8_t>(), sizeof(GridParams));
  const int64_t m = p_query.size(0), f = grad_out.size(1), n = grid_ref.size(0);
  at::Tensor grad_query = at::empty({m, 3}, p_query.options());
  at::Tensor grad_ref = at::zeros({n, 3}, p_query.options());
  const float *q = p_query.data_ptr<float>(), *go = grad_out.data_ptr<float>(),
              *o = out.data_ptr<float>(), *x = feats.data_ptr<float>(),
              *tot = totals.data_ptr<float>();
  const auto* ref = reinterpret_cast<const Point4*>(grid_ref.data_ptr<float>());
  float *gq = grad_query.data_ptr<float>(), *gr = grad_ref.data_ptr<float>();
  for (int64_t row = 0; row < m; ++row) {
    const float* g_row = go + row * f;
    float grad_dot_out = 0.0f;
    for (int64_t c = 0; c < f; ++c) grad_dot_out += g_row[c] * o[row * f + c];
    radius_position_grad(
        q + 3 * row, ref, grid_start.data_ptr<int32_t>(), g, (float)radius,
        (float)(1.0 / sigma), tot[row], grad_dot_out, gq + 3 * row,
        [&](int32_t j) {
          float dot = 0.0f;
          for (int64_t c = 0; c < f; ++c) dot += g_row[c] * x[(int64_t)j * f + c];
          return dot;
        },
        [&](int32_t j, float px, float py, float pz) {
          gr[3 * j] += px;
          gr[3 * j + 1] += py;
          gr[3 * j + 2] += pz;
        });
  }
  return {grad_query, grad_ref};
}

}  // namespace

TORCH_LIBRARY(extkernels_fused, m) {
  m.def(
      "knn(Tensor p_query, Tensor p_ref, int k, " EK_SEARCH_DEFAULTS
      ") -> (Tensor, Tensor)");
  m.def(
      "knn_aggregate_fwd(Tensor p_query, Tensor p_ref, Tensor feats, int k, float sigma,"
      " " EK_SEARCH_DEFAULTS ") -> (Tensor, Tensor, Tensor)");
  // The search into given buffers: distances (M, k) float32, indices (M, k) int64.
  m.def(
      "knn_out(Tensor p_query, Tensor p_ref, int k, Tensor(a!) distances,"
      " Tensor(b!) indices, " EK_SEARCH_DEFAULTS ") -> ()");
  m.def("knn_work(Tensor p_query, Tensor p_ref, int k, str index=\"" EK_STR(
      EK_DEFAULT_INDEX) "\") -> Tensor");
  m.def(
      "radius_aggregate_fwd(Tensor p_query, Tensor p_ref, Tensor feats, float radius,"
      " float sigma, bool warp=True) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "radius_aggregate_bwd(Tensor grad_out, Tensor p_query, Tensor totals,"
      " Tensor grid_ref, Tensor grid_start, Tensor grid_params, float radius,"
      " float sigma, bool warp=True) -> Tensor");
  // The clouds' gradients: (grad_query (M, 3), grad_ref (N, 3)).
  m.def(
      "radius_positions_bwd(Tensor grad_out, Tensor out, Tensor feats, Tensor p_query,"
      " Tensor totals, Tensor grid_ref, Tensor grid_start, Tensor grid_params,"
      " float radius, float sigma) -> (Tensor, Tensor)");
  m.def("set_value_checks(bool enabled) -> bool", &set_value_checks);
  // The grid's layout, for the fakes: GridParams' bytes and the cells per point.
  m.def("grid_layout() -> int[]", []() {
    return std::vector<int64_t>{(int64_t)sizeof(GridParams), cell_capacity(1)};
  });
  // The most queries of the kNN operators and of the radius aggregation (fused.h).
  m.def("limits() -> int[]", []() {
    return std::vector<int64_t>{kMaxQueries, kMaxRadiusQueries};
  });
}

TORCH_LIBRARY_IMPL(extkernels_fused, CPU, m) {
  m.impl("knn", &knn_cpu);
  m.impl("knn_out", &knn_out_cpu);
  m.impl("knn_aggregate_fwd", &knn_aggregate_fwd_cpu);
  m.impl("knn_work", &knn_work_cpu);
  m.impl("radius_aggregate_fwd", &radius_aggregate_fwd_cpu);
  m.impl("radius_aggregate_bwd", &radius_aggregate_bwd_cpu);
  m.impl("radius_positions_bwd", &radius_positions_bwd_cpu);
}

}  // namespace extkernels
