// The counting sort of the reference points into the grid's cells, on the device
// (chapter 9), shared by the CUDA kernels of the C++ backend and of the fused backend
// (chapter 11): one thread per point counts its cell, then, after a prefix sum of the
// counts, takes a slot in it; settle_kernel then orders each cell's points by row when
// the result must be the same on every call.
#pragma once

#include <cstdint>

#include "grid.h"

namespace extkernels {
namespace {

__global__ void count_kernel(const float* p, int64_t n, const GridParams* params,
                             int32_t* keys, int32_t* counts) {
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int32_t key = (int32_t)key_of(p + 3 * j, *params);
  keys[j] = key;
  atomicAdd(counts + key + 1, 1);
}

// Each point takes a slot of its cell by counting the cell's count down: no second
// counter to zero.
__global__ void scatter_kernel(const float* p, int64_t n, const int32_t* keys,
                               const int32_t* start, int32_t* counts, Point4* ref) {
  const int64_t j = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int32_t key = keys[j];
  const int32_t at = start[key] + atomicSub(counts + key + 1, 1) - 1;
  ref[at] = Point4{p[3 * j], p[3 * j + 1], p[3 * j + 2], (int32_t)j};
}

// Makes the counting sort deterministic: the atomics of scatter_kernel leave the points
// of a cell in any order; each point's rank among its cell's points by row puts it in
// the same place on every call.
__global__ void settle_kernel(const Point4* unordered, int64_t n, const GridParams* params,
                              const int32_t* start, Point4* ref) {
  const int64_t s = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (s >= n) return;
  const Point4 p = unordered[s];
  const int32_t key = (int32_t)key_of(&p.x, *params);  // its cell, as count_kernel found
  const int32_t begin = start[key], end = start[key + 1];
  int32_t rank = 0;
  for (int32_t t = begin; t < end; ++t) rank += unordered[t].index < p.index;
  ref[begin + rank] = p;
}

}  // namespace
}  // namespace extkernels
