// The checks of the fused radius search's arguments (radius_search.cpp), on both
// devices. Unlike the projector's operators, either cloud may be empty (no neighbours).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "checks.h"
#include "knn_batched.h"

namespace extkernels {

// A batch's offsets as the kernels read them (on the clouds' device), or no batch
// (clouds == 0: every query takes every row).
struct Batch {
  const int64_t* query = nullptr;
  const int64_t* ref = nullptr;
  int64_t clouds = 0;
};

// float32 (n, 3), contiguous; n may be 0.
inline void check_search_cloud(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat,
                   msg(name, ": expected dtype torch.float32 (the fused backend's radius "
                             "search), got ", t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(1) == 3,
                    msg(name, ": expected shape (n, 3), got ", t.sizes()));
  TORCH_CHECK_VALUE(t.is_contiguous(),
                    msg(name, ": expected a contiguous tensor (call .contiguous() first)"));
}

inline void check_max_neighbours(int64_t max_neighbours) {
  TORCH_CHECK_VALUE(max_neighbours >= 1,
                    msg("max_neighbours: expected an int >= 1, got ", max_neighbours));
}

// The clouds, the radius and the offsets (both or neither); with `values`, the offsets'
// values and the coordinates too, read on the host (a copy of each from the GPU).
inline Batch check_radius_search(const at::Tensor& p_query, const at::Tensor& p_ref,
                                 double radius,
                                 const std::optional<at::Tensor>& query_offsets,
                                 const std::optional<at::Tensor>& ref_offsets,
                                 bool values) {
  check_search_cloud(p_query, "p_query");
  check_search_cloud(p_ref, "p_ref");
  check_same_device(p_query, "p_query", p_ref, "p_ref");
  TORCH_CHECK_VALUE(p_ref.size(0) <= kMaxPoints,
                    msg("p_ref: expected at most ", kMaxPoints,
                        " points (the kernels index cells and points with 32-bit "
                        "integers), got ", p_ref.size(0)));
  TORCH_CHECK_VALUE(std::isfinite(radius) && radius > 0,
                    msg("radius: expected a finite value > 0, got ", radius));
  TORCH_CHECK_VALUE(query_offsets.has_value() == ref_offsets.has_value(),
                    msg(query_offsets.has_value() ? "ref_offsets" : "query_offsets",
                        ": expected offsets too, since ",
                        query_offsets.has_value() ? "query_offsets" : "ref_offsets",
                        " is given"));
  Batch batch;
  if (query_offsets.has_value()) {
    const at::Tensor &qo = *query_offsets, &ro = *ref_offsets;
    check_batch_meta(qo, ro, p_query);
    if (values && value_checks_flag()) {
      // k = 0: a cloud without reference points is allowed (its queries find none)
      check_batch_values(qo.cpu(), ro.cpu(), p_query.size(0), p_ref.size(0), 0);
    }
    batch = Batch{qo.data_ptr<int64_t>(), ro.data_ptr<int64_t>(), qo.size(0) - 1};
  }
  if (values && p_query.numel() > 0 && p_ref.numel() > 0) {
    check_finite(p_query, p_ref, /*capturing=*/false);
  }
  return batch;
}

// The outputs of a search that finds nothing (no query, or no reference point) and the
// padded form's before its walk: CSR (distances (0,), offsets of zeros (M + 1,), rows
// (0,)); padded (distances +inf (M, K), rows -1 (M, K), counts 0 (M,)).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> empty_csr(const at::Tensor& p_query) {
  at::Tensor offsets = at::zeros({p_query.size(0) + 1}, p_query.options().dtype(at::kLong));
  return {at::empty({0}, p_query.options()), offsets, at::empty({0}, offsets.options())};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> unfilled_padded(
    const at::Tensor& p_query, int64_t k) {
  const int64_t m = p_query.size(0);
  at::Tensor indices = at::full({m, k}, -1, p_query.options().dtype(at::kLong));
  return {at::full({m, k}, std::numeric_limits<float>::infinity(), p_query.options()),
          indices, at::zeros({m}, indices.options())};
}

}  // namespace extkernels
