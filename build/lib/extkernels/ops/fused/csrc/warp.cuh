// A sum across the 32 lanes of a warp, shared by the fused backend's CUDA kernels: a
// butterfly of shuffles, so every lane ends with the result, added in the same order
// on every call.
#pragma once

#include "launch.cuh"

namespace extkernels {
namespace {

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(kFullWarp, v, o);
  return v;
}

}  // namespace
}  // namespace extkernels
